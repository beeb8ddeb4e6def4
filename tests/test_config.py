"""Every option of every config group composes and validates; bad values fail naming the key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bapo.config import ConfigError, build

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["algo", "model", "data", "rollout", "reward", "buffer", "learner", "logger", "eval"]


def _compose(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name="config", overrides=overrides)


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# Options that need a value only the user can give (a path or a name).
NEEDS = {
    ("data", "jsonl"): ["data.path=x.jsonl"],
    ("data", "hub"): ["data.path=org/name"],
    ("model", "hf"): ["model.name_or_path=org/name"],
}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option, tmp_path):
    cfg = _compose([f"{group}={option}", *NEEDS.get((group, option), [])])
    rc = build(cfg, tmp_path)
    assert rc.sizes.samples_per_step == cfg.train.prompts_per_step * cfg.rollout.n


def test_every_algo_file_carries_every_algo_key():
    from omegaconf import OmegaConf

    from bapo.config import AlgoConfig

    keys = set(OmegaConf.structured(AlgoConfig).keys())
    for option in options("algo"):
        cfg = _compose([f"algo={option}"])
        assert set(cfg.algo.keys()) == keys, option
        assert cfg.algo.name == option


def test_debug_smoke_composes(tmp_path):
    rc = build(_compose(["debug=smoke"]), tmp_path)
    assert rc.train.steps == 3 and rc.logger.wandb is False


def test_qwen7b_selects_gpu_stages(tmp_path):
    rc = build(_compose(["algo=bapo", "model=qwen7b"]), tmp_path)
    assert rc.rollout.engine == "vllm" and rc.learner.kind == "fsdp" and rc.model.dtype == "bfloat16"


def test_model_fallback_defaults_per_model(tmp_path):
    assert build(_compose([]), tmp_path).reward.fallback == "none"
    assert build(_compose(["model=smollm2_135m"]), tmp_path).reward.fallback == "last_number"


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.temperature=-1", "rollout.temperature"),
        ("rollout.n=0", "rollout.n"),
        ("rollout.n=abc", "rollout.n"),
        ("algo.agg=token-sum", "algo.agg"),
        ("algo.bounds=magic", "algo.bounds"),
        ("algo.low_range=[0.9,0.6]", "algo.low_range"),
        ("algo.dual_clip=0.5", "algo.dual_clip"),
        ("reward.fallback=guess", "reward.fallback"),
        ("reward.format_reward=1", "reward.format_reward"),
        ("eval.sets=[nope]", "eval.sets"),
        ("eval.sets_k=0", "eval.sets_k"),
        ("eval.sets_limit=0", "eval.sets_limit"),
        ("reward.overlong_buffer=-1", "reward.overlong_buffer"),
        ("reward.overlong_buffer=100000", "reward.overlong_buffer"),  # must leave room below max_new_tokens
        ("learner.lr=0", "learner.lr"),
        ("buffer.sampling=lifo", "buffer.sampling"),
        ("data.kind=csv", "data.kind"),
        ("model.dtype=int8", "model.dtype"),
        ("learner.mini_batches_per_rollout=3", "learner.mini_batches_per_rollout"),
        ("algo.advantage=rloo", "algo.advantage"),
        ("algo.loss=dpo", "algo.loss"),
        ("algo.kl_estimator=k4", "algo.kl_estimator"),
        ("algo.kl_coef=-0.1", "algo.kl_coef"),
        ("algo.critic.lam=1.5", "algo.critic.lam"),
        ("algo.critic.lr=0", "algo.critic.lr"),
        ("algo.card.eps=0.05", "algo.card.eps"),
        ("monitor.entropy_frac=2", "monitor.entropy_frac"),
        ("monitor.clip_patience=0", "monitor.clip_patience"),
    ],
)
def test_bad_values_name_the_key(override, key, tmp_path):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build(_compose([override]), tmp_path)


def test_reuse_must_fit_the_staleness_bound(tmp_path):
    # 2 epochs x 4 mini-batches = 8 updates on one batch: staleness up to 7
    over = ["learner.ppo_epochs=2", "learner.mini_batches_per_rollout=4"]
    with pytest.raises(ConfigError, match=r"buffer\.max_staleness.*must be >= 7"):
        build(_compose([*over, "buffer.max_staleness=4"]), tmp_path)
    assert build(_compose([*over, "buffer.max_staleness=7"]), tmp_path).sizes.max_reuse_staleness == 7


def test_unknown_key_is_refused():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="rollout.temprature"):
        _compose(["rollout.temprature=0.5"])


def test_missing_mandatory_value_names_key(tmp_path):
    with pytest.raises(ConfigError, match="data.path"):
        build(_compose(["data=jsonl"]), tmp_path)
