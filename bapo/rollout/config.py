"""The ``rollout`` group's schema (conf/rollout/), one per engine picked by ``rollout.engine``.

Types and range checks only (the defaults live in the YAML files); a field marked ``resumable`` may change
when a run is resumed (memory and speed knobs: the same samples' distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from bapo.checks import choice, require, resumable

DECODERS = ("lean", "generate")  # the HF engine's sampling loops (bapo/rollout/decode.py)
SLEEP_LEVELS = (1, 2)  # vLLM's sleep levels


@dataclass
class RolloutCommon:
    engine: str = MISSING
    n: int = MISSING
    temperature: float = MISSING
    max_new_tokens: int = MISSING

    def __post_init__(self) -> None:
        require(self.n >= 1, "rollout.n", f"must be >= 1, got {self.n}")
        require(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        require(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")


@dataclass
class HFRolloutConfig(RolloutCommon):
    """``rollout=hf``: transformers on the learner's device."""

    batch_size: int = resumable()
    decode: str = MISSING  # lean: the project's sampling loop | generate: HF generate (the fallback)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.batch_size > 0, "rollout.batch_size", "must be > 0")
        choice(self.decode, "rollout.decode", DECODERS)


@dataclass
class VLLMRolloutConfig(RolloutCommon):
    """``rollout=vllm``: vLLM's offline engine, colocated with the learner."""

    gpu_memory_utilization: float = resumable()
    tensor_parallel_size: int = resumable()
    enable_sleep_mode: bool = resumable()  # free weights + KV cache during learner updates (GPU, sync mode)
    sleep_level: int = resumable()  # 1: weights offloaded to host memory while asleep | 2: discarded, reloaded at sync
    enforce_eager: bool = resumable()  # no torch.compile / CUDA graphs

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
        choice(self.sleep_level, "rollout.sleep_level", SLEEP_LEVELS)
        require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")


ROLLOUT: dict[str, type] = {"hf": HFRolloutConfig, "vllm": VLLMRolloutConfig}
