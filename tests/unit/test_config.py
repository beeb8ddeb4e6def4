"""Every option of every config group composes and validates; each variant holds only the keys it reads;
bad values and bad combinations fail at startup naming the key."""

import dataclasses
import re
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from bapo.config import ConfigError, build, check_combinations
from bapo.infra.paths import HELDOUT
from tests.helpers.config import compose

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = [
    "algo",
    "algo/bounds",
    "model",
    "data",
    "rollout",
    "reward",
    "buffer",
    "learner",
    "logger",
    "eval",
    "placement",
]


def options(group):
    """The options train.py composes (the `eval` group's others are eval.py's sets: unit/eval/test_evaluate.py)."""
    return [HELDOUT] if group == "eval" else sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# Options that need a value only the user can give (a path or a name).
NEEDS = {
    ("data", "jsonl"): ["data.path=x.jsonl"],
    ("data", "hub"): ["data.path=org/name"],
    ("model", "hf"): ["model.name_or_path=org/name"],
}


def leaves(node, prefix=""):
    """The leaf keys of a plain nested dict (a list is one leaf)."""
    if not isinstance(node, dict):
        return {prefix}
    return {k for key, v in node.items() for k in leaves(v, f"{prefix}.{key}" if prefix else key)}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option, tmp_path):
    cfg = compose(f"{group}={option}", *NEEDS.get((group, option), []))
    rc = build(cfg, tmp_path)
    assert rc.sizes.samples_per_step == cfg.train.prompts_per_step * cfg.rollout.n


def test_default_config_stays_small():
    plain = OmegaConf.to_container(compose(), resolve=False)
    # placement: 3 keys, the memory plan's hardware; algo.objective and the 5 surrogate options BAPO reads too;
    # rollout.partial_budget (partial rollouts, null by default); placement.learner_threads (torch threads of the
    # run's process; placement=disaggregated adds its own keys, placement.workers among them, only where it is picked);
    # learner.logp_check_share (the engine-vs-learner log-prob check on a share of rows); launcher: 4 keys (how a
    # plain `python train.py` starts the node's ranks, and what it chose); checkpoint.every_minutes and
    # launcher.grace_s (a stop that keeps its work: time-based checkpoints, the launcher's grace)
    assert len(leaves(plain)) <= 117, sorted(leaves(plain))  # reward.kind: the reward seam


@pytest.mark.parametrize(
    "option,absent",
    [
        ("algo=bapo", ["algo.bounds.ratio_low", "algo.bounds.ratio_high", "algo.critic", "algo.eps_feedback"]),
        ("algo=grpo", ["algo.bounds.rho0", "algo.bounds.scope", "algo.bounds.low_range", "algo.critic"]),
        ("algo=clip_higher", ["algo.bounds.rho0", "algo.critic", "algo.eps_feedback"]),
        ("algo=ppo", ["algo.bounds.rho0", "algo.eps_feedback"]),
        ("algo=eps_feedback", ["algo.bounds"]),
        ("rollout=hf", ["rollout.gpu_memory_utilization", "rollout.tensor_parallel_size", "rollout.top_p"]),
        ("rollout=vllm", ["rollout.batch_size", "rollout.decode", "rollout.top_p"]),
        ("data=arith", ["data.path", "data.eval_path", "data.split", "data.problem_key", "data.answer_format"]),
        ("data=jsonl", ["data.arith", "data.split", "data.subset"]),
        ("learner=single", ["learner.mixed_precision", "learner.cpu_offload", "learner.activation_checkpointing"]),
        ("learner=fsdp", ["learner.device"]),
        ("logger=default", ["logger.wandb"]),
    ],
)
def test_a_variant_holds_only_the_keys_it_reads(option, absent):
    plain = OmegaConf.to_container(compose(option, *NEEDS.get(tuple(option.split("=")), [])), resolve=False)
    keys = leaves(plain)
    for key in absent:
        assert not any(k == key or k.startswith(key + ".") for k in keys), (option, key)


@pytest.mark.parametrize(
    "override",
    ["algo.ratio_low=0.7", "algo.bounds.ratio_low=0.7", "rollout.top_p=0.9", "rollout.gpu_memory_utilization=0.5"],
)
def test_a_key_of_another_variant_fails_at_startup_naming_it(override):
    with pytest.raises(ConfigCompositionException, match=re.escape(override.split("=")[0])):
        compose(override)


def test_debug_smoke_composes(tmp_path):
    rc = build(compose("debug=smoke"), tmp_path)
    assert rc.train.steps == 3 and rc.logger.mode == "disabled"


def test_gpu_models_pick_their_placement(tmp_path):
    rc = build(compose("algo=bapo", "model=qwen7b"), tmp_path)
    assert rc.rollout.engine == "vllm" and rc.learner.kind == "fsdp" and rc.model.dtype == "bfloat16"
    assert rc.learner.activation_checkpointing and rc.learner.max_tokens_per_micro_batch == 16384
    big = build(compose("model=r1_distill_qwen_32b"), tmp_path)
    assert big.learner.cpu_offload and big.rollout.tensor_parallel_size == 4
    # the placement is its own group: the same model without it runs on the default stages
    rc = build(compose("model=qwen7b", "placement=local"), tmp_path)
    assert rc.rollout.engine == "hf" and rc.learner.kind == "single" and rc.model.name_or_path.startswith("Qwen/")


def test_model_fallback_defaults_per_model(tmp_path):
    assert build(compose(), tmp_path).reward.fallback == "none"
    assert build(compose("model=smollm2_135m"), tmp_path).reward.fallback == "last_number"


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.temperature=-1", "rollout.temperature"),
        ("rollout.n=0", "rollout.n"),
        ("rollout.n=abc", "rollout.n"),
        ("rollout.decode=beam", "rollout.decode"),
        ("algo.agg=token-sum", "algo.agg"),
        ("algo.bounds.kind=magic", "algo.bounds.kind"),
        ("algo.bounds.low_range=[0.9,0.6]", "algo.bounds"),
        ("algo.bounds.rho0=1.5", "algo.bounds"),
        ("algo.bounds.low_step=0", "algo.bounds"),
        ("algo.bounds.scope=token", "algo.bounds.scope"),
        ("algo.dual_clip=0.5", "algo.dual_clip"),
        ("reward.fallback=guess", "reward.fallback"),
        ("reward.format_reward=1", "reward.format_reward"),
        ("eval.sets=[nope]", "eval.sets"),
        ("eval.sets_k=0", "eval.sets_k"),
        ("eval.sets_limit=0", "eval.sets_limit"),
        ("reward.overlong_buffer=-1", "reward.overlong_buffer"),
        ("reward.overlong_buffer=100000", "reward.overlong_buffer"),  # must leave room below max_new_tokens
        ("learner.lr=0", "learner.lr"),
        ("learner.device=foo", "learner.device"),
        ("learner.device=cuda", "learner.device"),  # a CPU build: no CUDA device
        ("buffer.sampling=lifo", "buffer.sampling"),
        ("data.kind=csv", "data.kind"),
        ("data.max_prompt_tokens=0", "data.max_prompt_tokens"),
        ("model.dtype=int8", "model.dtype"),
        ("learner.mini_batches_per_rollout=3", "learner.mini_batches_per_rollout"),
        ("algo.advantage=rloo", "algo.advantage"),
        ("algo.advantage=gae", "algo.critic"),  # gae needs a critic: algo=ppo
        ("algo.kl_estimator=k4", "algo.kl_estimator"),
        ("algo.kl_coef=-0.1", "algo.kl_coef"),
        ("seed=abc", "seed"),
        ("overwrite=maybe", "overwrite"),
        ("monitor.entropy_frac=2", "monitor.entropy_frac"),
        ("monitor.clip_patience=0", "monitor.clip_patience"),
        ("checkpoint.every_minutes=-1", "checkpoint.every_minutes"),
        ("launcher.grace_s=0", "launcher.grace_s"),
    ],
)
def test_bad_values_name_the_key(override, key, tmp_path):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + r"\b"):
        build(compose(override), tmp_path)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["algo=ppo", "algo.critic.lam=1.5"], "algo.critic.lam"),
        (["algo=ppo", "algo.critic.lr=0"], "algo.critic.lr"),
        (["algo=eps_feedback", "algo.eps_feedback.eps=0.05"], "algo.eps_feedback"),
        (["algo=eps_feedback", "algo.eps_feedback.scope=token"], "algo.eps_feedback.scope"),
        (["rollout=vllm", "rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization"),
        (["learner=fsdp", "learner.mixed_precision=fp8"], "learner.mixed_precision"),
        (["data=jsonl"], "data.path"),
        # the rivals' surrogate options (tests/unit/test_config_surrogate.py)
        (["algo=cispo", "algo.surrogate.mask_threshold=0.1"], "algo.surrogate.mask_threshold"),
        (["algo=dppo", "algo.surrogate.mask_threshold=null"], "algo.surrogate.mask_threshold"),
        (["algo=dppo", "algo.surrogate.mask_threshold=-1"], "algo.surrogate.mask_threshold"),
        (["algo=gspo", "algo.surrogate.ratio_level=segment"], "algo.surrogate.ratio_level"),
        (["algo=gspo", "algo.surrogate.positive_weight=one"], "algo.surrogate.positive_weight"),
        (["algo=cispo", "algo.dual_clip=3.0"], "algo.dual_clip"),
        (["algo=topr", "algo.bounds.ratio_low=1.5"], "algo.bounds"),
    ],
)
def test_bad_values_of_a_variant_name_the_key(overrides, key, tmp_path):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + r"\b"):
        build(compose(*overrides), tmp_path)


def test_each_range_is_checked_once_by_the_math_it_guards(tmp_path, monkeypatch):
    """The bound search's ranges live in bapo.algos.bounds; the config reports them under its keys."""
    from bapo.algos import bounds

    calls = []
    monkeypatch.setattr(bounds, "check_bapo_params", lambda p: calls.append(p))
    build(compose("algo.bounds.rho0=7"), tmp_path)  # out of range, but the (disabled) math check is the only one
    assert calls and calls[0]["rho0"] == 7


def test_reuse_must_fit_the_staleness_bound(tmp_path):
    # 2 epochs x 4 mini-batches = 8 updates on one batch: staleness up to 7
    over = ["learner.ppo_epochs=2", "learner.mini_batches_per_rollout=4"]
    with pytest.raises(ConfigError, match=r"buffer\.max_staleness.*must be >= 7"):
        build(compose(*over, "buffer.max_staleness=4"), tmp_path)
    assert build(compose(*over, "buffer.max_staleness=7"), tmp_path).sizes.max_reuse_staleness == 7


@pytest.mark.parametrize(
    "overrides,world,key",
    [
        (["rollout.n=1"], 1, "rollout.n"),  # GRPO's group of one: every advantage is 0
        (["train.async_rollout=true", "reward.num_workers=0"], 1, "reward.num_workers"),
        ([], 2, "learner.kind"),  # torchrun with a single-process learner
        (["learner=fsdp", "train.async_rollout=true", "buffer.enforce=drop"], 2, "buffer.enforce"),
        (["learner=fsdp", "train.prompts_per_step=1", "learner.mini_batches_per_rollout=1"], 2, "train.prompts"),
        (["learner=fsdp", "algo=ppo"], 1, "algo.advantage"),
    ],
)
def test_combinations_no_stage_supports_are_refused(overrides, world, key, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match="^" + re.escape(key)):
        build(compose(*overrides), tmp_path)


def test_n_equal_1_is_fine_with_a_critic(tmp_path):
    assert build(compose("algo=ppo", "rollout.n=1"), tmp_path).rollout.n == 1


def test_check_combinations_takes_the_world_size(tmp_path):
    rc = build(compose("learner=fsdp"), tmp_path)
    check_combinations(rc, world=2)
    with pytest.raises(ConfigError, match="learner.mini_batches_per_rollout"):
        check_combinations(dataclasses.replace(rc, sizes=dataclasses.replace(rc.sizes, mini_batch_size=1)), world=2)


def test_unknown_key_is_refused():
    with pytest.raises(ConfigCompositionException, match="rollout.temprature"):
        compose("rollout.temprature=0.5")
