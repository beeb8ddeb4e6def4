"""The model's shape for the memory plan, and what it costs per token.

Activation bytes per token are those of a transformers Qwen2 / Llama decoder layer with a flash or sdpa
kernel (no [L, L] score matrix), counted from what autograd saves (compute dtype ``b`` bytes, RMSNorm in
fp32, ``q``/``kv`` the query and key-value widths):

    one layer, all saved:  2 (4H + 4 + bH) + 2bH + b (2q + 2kv) + 4 heads + 4bI
    one layer, checkpointed:  bH (its input)
    one layer's backward temporaries:  2bI + 4H
    the head (final norm, LM head input):  (4H + 4 + bH) + bH

``tests/e2e/test_plan.py`` checks them against peaks measured on CPU (a tiny Qwen2 in fp32). vLLM's own
activations are estimated from its profiling run (``max_num_batched_tokens`` 16384, ``max_num_seqs`` 1024:
vLLM 0.32's offline defaults on 70 GB+ GPUs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_BATCHED_TOKENS, VLLM_MAX_SEQS = 16384, 1024
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of an architecture (config.json fields and parameter counts)."""

    model_type: str
    params: int
    root_params: int  # outside the decoder layers: embeddings, final norm, an untied LM head
    layer_params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def model_shape(config) -> ModelShape:
    """The shape of a transformers config, its parameters counted on the meta device (nothing allocated)."""
    return _shape(config.to_json_string(use_diff=False))


@functools.lru_cache(maxsize=64)
def _shape(config_json: str) -> ModelShape:
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bapo.learner.fsdp import decoder_layers

    fields = json.loads(config_json)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_layers(model)
    total = sum(p.numel() for p in model.parameters())  # tied parameters once
    per_layer = sum(p.numel() for p in layers[0].parameters())
    heads = config.num_attention_heads
    return ModelShape(
        model_type=config.model_type,
        params=total,
        root_params=total - len(layers) * per_layer,
        layer_params=per_layer,
        layers=len(layers),
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
    )


def layer_activations_per_token(s: ModelShape, b: int) -> int:
    """Bytes autograd saves per token in one decoder layer (module docstring), compute dtype of ``b`` bytes."""
    H, I = s.hidden, s.intermediate
    norms = 2 * (4 * H + 4 + b * H)  # RMSNorm in fp32: its fp32 input, 1 / rms, the normalised output
    inputs = 2 * b * H  # the q/k/v and gate/up projections' shared inputs
    attention = b * (2 * s.q_dim + 2 * s.kv_dim) + 4 * s.heads  # q, k, v, output, log-sum-exp (fp32)
    mlp = 4 * b * I  # gate output, its SiLU, up output, the down projection's input
    return norms + inputs + attention + mlp


def checkpoint_per_token(s: ModelShape, b: int) -> int:
    """Bytes per token a checkpointed decoder layer keeps: its input."""
    return b * s.hidden


def layer_backward_per_token(s: ModelShape, b: int) -> int:
    """Bytes per token of one layer's backward temporaries (the MLP's intermediate gradients, the norm's fp32)."""
    return 2 * b * s.intermediate + 4 * s.hidden


def head_activations_per_token(s: ModelShape, b: int) -> int:
    """Bytes per token the final norm and the LM head keep for the backward."""
    return (4 * s.hidden + 4 + b * s.hidden) + b * s.hidden


def kv_per_token(s: ModelShape, b: int, tp: int) -> int:
    """KV-cache bytes per token on one GPU of a tensor-parallel group (key-value heads split, or replicated)."""
    return 2 * s.layers * max(1, s.kv_heads // tp) * s.head_dim * b


def vllm_activations(s: ModelShape, b: int, tp: int) -> int:
    """vLLM's profiled activation peak: a forward of ``VLLM_BATCHED_TOKENS`` tokens (one layer's transients:
    gate/up output, SiLU, q/k/v, attention output), or sampling ``VLLM_MAX_SEQS`` rows of fp32 logits
    (logits, probabilities, log-probs), whichever is larger."""
    forward = VLLM_BATCHED_TOKENS * (3 * s.intermediate + 3 * s.hidden) * b // tp
    sampler = VLLM_MAX_SEQS * s.vocab * 4 * 3
    return max(forward, sampler)


def model_config(model) -> Any:
    """The transformers config of the typed ``model`` group: ``model.arch``, else the local checkpoint's."""
    from bapo.infra.checks import ConfigError
    from bapo.infra.paths import resolve_path
    from bapo.modeling import arch_config

    if model.arch:
        return arch_config(model.arch)
    path = Path(resolve_path(model.name_or_path))
    if (path / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    raise ConfigError(
        f"model.arch: the memory plan needs the model's config.json fields (model.arch, or a local "
        f"model.name_or_path); got model.name_or_path={model.name_or_path} and no model.arch"
    )
