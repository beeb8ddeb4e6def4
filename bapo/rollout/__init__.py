"""Generation engines behind one interface: ``generate(prompts) -> list[Sample]``
and ``update_weights(state_dict, version)``. HF transformers runs everywhere;
vLLM is an optional extra and is imported lazily (``VLLMRollout`` raises a
ConfigError with an install hint when vLLM is missing)."""

from bapo.rollout.hf import HFRollout

__all__ = ["HFRollout", "VLLMRollout"]


def __getattr__(name: str):
    if name == "VLLMRollout":  # importing bapo.rollout.vllm sets vLLM's env defaults; only on use
        from bapo.rollout.vllm import VLLMRollout

        return VLLMRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
