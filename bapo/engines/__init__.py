"""Generation engines behind one interface (:class:`~bapo.engines.base.RolloutEngine`):
``generate(prompts) -> list[Sample]``, ``load_weights(weights, version)``, ``sleep``/``wake``.

The engines are registered by name in :mod:`bapo.engines.registry` (dotted paths, imported when
chosen), each with its traits; :func:`build_rollout` is the one builder, used by training and by
``eval.py``. HF transformers runs everywhere; vLLM is an optional extra (``VLLMRollout`` raises a
ConfigError with an install hint when vLLM is missing).
"""

from __future__ import annotations

from bapo.engines.base import EngineContext, RolloutEngine, make_sample, pad_id_of, stop_ids_of
from bapo.engines.hf import HFRollout
from bapo.engines.registry import ENGINES, EngineTraits, engine_class, engine_traits

__all__ = [
    "ENGINES",
    "EngineContext",
    "EngineTraits",
    "HFRollout",
    "RolloutEngine",
    "VLLMRollout",
    "build_rollout",
    "check_engine",
    "engine_class",
    "engine_traits",
    "make_sample",
    "pad_id_of",
    "stop_ids_of",
]


def build_rollout(cfg, **context) -> RolloutEngine:
    """The engine ``cfg.engine`` names (:data:`~bapo.engines.registry.ENGINES`), built by its ``from_config``
    from the typed rollout config ``cfg`` and an :class:`~bapo.engines.base.EngineContext` of the keyword
    arguments (``path``, ``tokenizer``, ``model``, ``dtype``, ``seed``, ``max_model_len``, ``logprobs``,
    ``top_p``; see there).
    """
    return engine_class(cfg.engine).from_config(cfg, EngineContext(**context))


def check_engine(cfg) -> None:
    """What the engine ``cfg.engine`` needs of this machine (vLLM installed, ...), checked before anything is loaded:
    one ConfigError, not a failure after minutes of model loading."""
    engine_class(cfg.engine).preflight(cfg)


def __getattr__(name: str):
    if name == "VLLMRollout":  # importing bapo.engines.vllm sets vLLM's env defaults; only on use
        from bapo.engines.vllm import VLLMRollout

        return VLLMRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
