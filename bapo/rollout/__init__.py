"""Generation engines behind one interface (:class:`~bapo.rollout.base.RolloutEngine`):
``generate(prompts) -> list[Sample]``, ``load_weights(weights, version)``, ``sleep``/``wake``.

The engines are registered by name in :mod:`bapo.rollout.registry` (dotted paths, imported when
chosen), each with its traits; :func:`build_rollout` is the one builder, used by training and by
``eval.py``. HF transformers runs everywhere; vLLM is an optional extra (``VLLMRollout`` raises a
ConfigError with an install hint when vLLM is missing).
"""

from __future__ import annotations

from bapo.rollout.base import EngineBase, RolloutEngine, make_sample, pad_id_of, stop_ids_of
from bapo.rollout.hf import HFRollout
from bapo.rollout.registry import ENGINES, EngineTraits, engine_class, engine_traits

__all__ = [
    "ENGINES",
    "EngineBase",
    "EngineTraits",
    "HFRollout",
    "RolloutEngine",
    "VLLMRollout",
    "build_rollout",
    "engine_class",
    "engine_traits",
    "make_sample",
    "pad_id_of",
    "stop_ids_of",
]


def build_rollout(
    cfg,
    *,
    path: str,
    tokenizer,
    model=None,
    dtype: str = "float32",
    seed: int = 0,
    logprobs: bool = True,
    top_p: float = 1.0,
    max_model_len: int | None = None,
) -> RolloutEngine:
    """The engine ``cfg.engine`` names (:data:`~bapo.rollout.registry.ENGINES`), built by its ``from_config``
    from the typed rollout config ``cfg``.

    ``model``: the engine's own copy of the weights, for an engine whose traits say it needs one (loaded
    from ``path`` in ``dtype`` when None); the others load ``path`` themselves and seed their sampler with
    ``seed``. ``logprobs=False`` (evaluation) allows ``top_p < 1``; training engines record the log-probs
    the learner needs and sample the full distribution. ``max_model_len``: the longest prompt + response
    the engine must hold, which sizes a KV cache (None: the model's whole context).
    """
    return engine_class(cfg.engine).from_config(
        cfg,
        path=path,
        tokenizer=tokenizer,
        model=model,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        logprobs=logprobs,
        top_p=top_p,
    )


def __getattr__(name: str):
    if name == "VLLMRollout":  # importing bapo.rollout.vllm sets vLLM's env defaults; only on use
        from bapo.rollout.vllm import VLLMRollout

        return VLLMRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
