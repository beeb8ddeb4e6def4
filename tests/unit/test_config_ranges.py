"""No config key takes NaN or an infinity, and a response length that leaves no room for the prompt names the key
to set, with the value the run that wrote an export used."""

from pathlib import Path

import pytest

from bapo.config import ConfigError, prompt_limit
from tests.helpers.config import run_config
from tests.helpers.exports import export_with_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["learner.lr=inf"], "learner.lr"),  # before: passed 'lr > 0' and diverged after the model load
        (["learner.lr=nan"], "learner.lr"),
        (["learner.eps=inf"], "learner.eps"),
        (["learner.grad_clip=inf"], "learner.grad_clip"),
        (["learner.weight_decay=inf"], "learner.weight_decay"),
        (["learner.betas=[0.9,nan]"], "learner.betas[1]"),
        (["rollout.temperature=inf"], "rollout.temperature"),
        (["eval.temperature=inf"], "eval.temperature"),
        (["reward.timeout_s=inf"], "reward.timeout_s"),
        (["algo.entropy_coef=inf"], "algo.entropy_coef"),
        (["algo.kl_coef=inf"], "algo.kl_coef"),
        (["algo.dual_clip=inf"], "algo.dual_clip"),
        (["algo.bounds.rho0=nan"], "algo.bounds.rho0"),
        (["algo.bounds.high_range=[1.2,inf]"], "algo.bounds.high_range[1]"),
        (["algo=ppo", "algo.critic.lr=inf"], "algo.critic.lr"),
        (["algo=grpo", "algo.bounds.ratio_high=inf"], "algo.bounds.ratio_high"),
        (["algo=eps_feedback", "algo.eps_feedback.eps_max=inf"], "algo.eps_feedback.eps_max"),
        (["rollout=vllm", "rollout.gpu_memory_utilization=nan"], "rollout.gpu_memory_utilization"),
    ],
)
def test_nan_and_infinity_are_refused_naming_the_key(overrides, key, tmp_path):
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.").replace("[", r"\[") + ": must be a finite"):
        run_config(*overrides, run_dir=tmp_path)


def test_prompt_limit_without_an_export_config_says_which_key_to_set():
    with pytest.raises(ConfigError) as info:
        prompt_limit(1024, 512, 256)
    assert str(info.value) == (
        "rollout.max_new_tokens: 512 (model.max_new_tokens) leaves no room for a prompt in the model's context "
        "of 256 tokens: set model.max_new_tokens below 256, leaving room for the prompt"
    )
    assert prompt_limit(1024, 48, 256) == 208 and prompt_limit(100, 48, 256) == 100 and prompt_limit(9, 5, None) == 9


def test_prompt_limit_names_the_value_the_exporting_run_used(tmp_path):
    export = export_with_config(tmp_path, 48)
    with pytest.raises(ConfigError, match=r"set model\.max_new_tokens=48 \(what the run that wrote .*export used\)$"):
        prompt_limit(1024, 512, 256, model_dir=export)
    export = export_with_config(tmp_path / "b", "${model.max_new_tokens}")  # an unresolved interpolation
    with pytest.raises(ConfigError, match=r"model\.max_new_tokens=48 "):
        prompt_limit(1024, 512, 256, model_dir=export)


@pytest.mark.parametrize("value", ["0", "-1", "5"])
def test_kv_overcommit_is_a_share_of_the_cache(value, tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.kv_overcommit: must be in \(0, 4\] .*got "):
        run_config("rollout=vllm_server", f"rollout.kv_overcommit={value}", run_dir=tmp_path)
