"""The GPU model configs, the qwen7b alias, the paper's 7B experiment, random-arch models.

Nothing downloads: architectures come from model.arch (config.json fields) with random weights,
and parameter counts are taken on the meta device against the published figures.
"""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bapo.config import build
from bapo.modeling import arch_config, load_model

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
# config name -> (hub name, parameters of the published checkpoint)
GPU_MODELS = {
    "qwen2.5_0.5b": ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768),
    "qwen2.5_1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", 1_543_714_304),
    "qwen2.5_7b": ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512),
    "qwen2.5_math_7b": ("Qwen/Qwen2.5-Math-7B", 7_615_616_512),
    "r1_distill_qwen_7b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 7_615_616_512),
    "r1_distill_qwen_32b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 32_763_876_352),
}
PROMPT_BUDGET = 1024  # tokens left for the prompt inside the model's context
SHRINK = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _compose(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name="config", overrides=overrides)


def _experiment(name: str) -> str:
    """`experiment=x` once config.yaml lists an experiment slot, `+experiment=x` until then."""
    listed = "experiment" in OmegaConf.load(CONF / "config.yaml").get("defaults", [{}]).__str__()
    return f"{'' if listed else '+'}experiment={name}"


@pytest.mark.parametrize("name", sorted(GPU_MODELS))
def test_gpu_model_composes_with_gpu_stages(name):
    cfg = _compose([f"model={name}"])
    hub, _ = GPU_MODELS[name]
    m = cfg.model
    assert m.name_or_path == hub and m.init == "pretrained" and m.dtype == "bfloat16"
    assert cfg.rollout.engine == "vllm" and cfg.learner.kind == "fsdp"
    assert cfg.rollout.max_new_tokens == m.max_new_tokens
    assert 0.3 <= cfg.rollout.gpu_memory_utilization <= 0.9
    assert 8 % cfg.rollout.tensor_parallel_size == 0  # tensor-parallel groups tile an 8-GPU node
    # a packed micro-batch holds at least one whole sequence (packing never splits one)
    assert cfg.learner.max_tokens_per_micro_batch >= PROMPT_BUDGET + m.max_new_tokens
    # prompt + response must fit the model's context (Qwen2.5-Math-7B has only 4096 positions)
    assert PROMPT_BUDGET + m.max_new_tokens <= m.arch.max_position_embeddings
    assert m.arch.model_type == "qwen2" and m.arch.eos_token_id < m.arch.vocab_size


@pytest.mark.parametrize("name", sorted(GPU_MODELS))
def test_gpu_model_validates(name, tmp_path):
    rc = build(_compose([f"model={name}"]), tmp_path)
    assert rc.model.arch["hidden_size"] > 0 and rc.learner.kind == "fsdp"


def test_command_line_stages_win_over_the_model_defaults():
    cfg = _compose(["model=qwen2.5_0.5b", "rollout=hf", "learner=single"])
    assert cfg.rollout.engine == "hf" and cfg.learner.kind == "single"
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_qwen7b_is_an_alias_of_qwen2_5_7b():
    alias, target = _compose(["model=qwen7b"]), _compose(["model=qwen2.5_7b"])
    assert alias.rollout.engine == "vllm" and alias.learner.kind == "fsdp"
    assert OmegaConf.to_container(alias) == OmegaConf.to_container(target)


def test_paper_7b_experiment():
    cfg = _compose([_experiment("paper_7b")])
    assert cfg.model.name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    assert cfg.learner.lr == 2e-6 and cfg.rollout.temperature == 0.6
    assert cfg.model.max_new_tokens == cfg.rollout.max_new_tokens == 8192
    a, b = cfg.algo, cfg.algo.bounds
    assert a.name == "bapo" and b.kind == "bapo" and a.advantage == "grpo" and a.kl_coef == 0.0
    # BAPO's defaults, untouched (../shared/BAPO.md)
    assert (b.rho0, list(b.low_range), list(b.high_range), b.low_step, b.high_step) == (
        0.4,
        [0.6, 0.9],
        [1.2, 3.0],
        0.02,
        0.05,
    )
    assert (b.contribution, b.weight, b.variant, b.scope) == ("loss_value", "behavior_prob", "paper", "mini_batch")
    assert cfg.rollout.engine == "vllm" and cfg.learner.kind == "fsdp"


def test_paper_7b_sizes(tmp_path):
    rc = build(_compose([_experiment("paper_7b")]), tmp_path)
    assert rc.sizes.samples_per_step == 256 * 16 and rc.sizes.updates_per_step == 4
    assert rc.sizes.max_reuse_staleness == 3 <= rc.buffer.max_staleness


@pytest.mark.parametrize("name", sorted(GPU_MODELS))
def test_arch_matches_the_published_parameter_count(name):
    arch = OmegaConf.to_container(_compose([f"model={name}"]).model.arch)
    model = load_model("", init="random", arch=arch, dtype="bfloat16", device="meta")
    assert sum(p.numel() for p in model.parameters()) == GPU_MODELS[name][1]


@pytest.mark.parametrize("name", ["qwen2.5_1.5b", "r1_distill_qwen_7b"])  # tied and untied embeddings
def test_random_arch_builds_a_shrunk_qwen2_offline(name):
    arch = OmegaConf.to_container(_compose([f"model={name}"]).model.arch) | SHRINK | {"vocab_size": 256}
    arch |= {"bos_token_id": 254, "eos_token_id": 255}
    torch.manual_seed(0)
    model = load_model("", init="random", arch=arch, dtype="float32", device="cpu")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == arch["tie_word_embeddings"]
    assert model.config.rope_parameters["rope_theta"] == arch["rope_theta"]
    ids = torch.randint(0, 256, (2, 12))
    logits = model(input_ids=ids).logits  # [2, 12, 256]
    assert logits.shape == (2, 12, 256) and torch.isfinite(logits).all()
    torch.manual_seed(0)
    again = load_model("", init="random", arch=arch, dtype="float32", device="cpu")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)  # seeded: reproducible


def test_random_init_errors_name_the_key():
    with pytest.raises(ValueError, match="model.arch"):
        load_model("", init="random", arch=None)
    with pytest.raises(ValueError, match="model.init"):
        load_model("", init="zeros")
    with pytest.raises(ValueError, match="model_type"):
        arch_config({"hidden_size": 8})
