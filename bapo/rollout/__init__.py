"""Generation engines behind one interface (:class:`~bapo.rollout.base.RolloutEngine`):
``generate(prompts) -> list[Sample]``, ``load_weights(weights, version)``, ``sleep``/``wake``.

:func:`build_rollout` is the one builder, used by training and by ``eval.py``. HF
transformers runs everywhere; vLLM is an optional extra and is imported lazily
(``VLLMRollout`` raises a ConfigError with an install hint when vLLM is missing).
"""

from __future__ import annotations

from bapo.config import ConfigError
from bapo.rollout.base import EngineBase, RolloutEngine, make_sample, pad_id_of, stop_ids_of
from bapo.rollout.hf import HFRollout

__all__ = [
    "EngineBase",
    "HFRollout",
    "RolloutEngine",
    "VLLMRollout",
    "build_rollout",
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
    """The engine ``cfg.engine`` names, configured from the typed rollout config ``cfg``.

    ``cfg`` needs ``engine`` ("hf" | "vllm"), ``n``, ``temperature`` and ``max_new_tokens``;
    for hf ``batch_size`` (and ``decode``, "lean" | "generate", where the config has it), for
    vllm ``gpu_memory_utilization``, ``tensor_parallel_size``, ``enable_sleep_mode`` and
    ``enforce_eager``. The hf engine samples with ``model`` (its own copy of the weights;
    loaded from ``path`` in ``dtype`` when None); vLLM loads ``path`` itself and seeds its
    engine with ``seed``. ``logprobs=False`` (evaluation) allows ``top_p < 1``; training
    engines record the log-probs the learner needs and sample the full distribution.
    ``max_model_len`` (vLLM): the longest prompt + response the engine must hold, which sizes its KV cache
    (None: the model's whole context).
    """
    if cfg.engine == "vllm":
        from bapo.rollout.vllm import VLLMRollout  # lazy: vllm is an optional extra

        return VLLMRollout(
            path,
            tokenizer,
            n=cfg.n,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_sleep_mode=cfg.enable_sleep_mode,
            enforce_eager=cfg.enforce_eager,
            sleep_level=cfg.sleep_level,
            dtype=dtype,
            seed=seed,
            top_p=top_p,
            logprobs=logprobs,
            max_model_len=max_model_len,
        )
    if cfg.engine == "hf":
        if model is None:
            from bapo.modeling import load_model, pick_device

            model = load_model(path, dtype=dtype, device=pick_device("auto"))
        decode = getattr(cfg, "decode", None)  # rollout.decode: until every config has it, the engine's default
        return HFRollout(
            model,
            tokenizer,
            n=cfg.n,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            top_p=top_p,
            logprobs=logprobs,
            **({} if decode is None else {"decode": decode}),
        )
    raise ConfigError(f"rollout.engine: must be one of ['hf', 'vllm'], got {cfg.engine!r}")


def __getattr__(name: str):
    if name == "VLLMRollout":  # importing bapo.rollout.vllm sets vLLM's env defaults; only on use
        from bapo.rollout.vllm import VLLMRollout

        return VLLMRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
