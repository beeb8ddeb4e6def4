"""Generation engines behind one interface: ``generate(prompts) -> list[Sample]``
and ``update_weights(state_dict, version)``. HF transformers runs everywhere;
vLLM is a GPU extra and is imported lazily."""

from bapo.rollout.hf import HFRollout

__all__ = ["HFRollout"]
