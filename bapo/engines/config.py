"""The ``rollout`` group's common schema (conf/rollout/): the keys every engine has.

Each engine's own schema subclasses :class:`RolloutCommon` and lives beside the engine (``HFRollout.config`` in
``bapo/engines/hf.py``, ``VLLMRollout.config`` in ``bapo/engines/vllm.py``); ``rollout.engine`` picks it through
the registry (:data:`bapo.engines.registry.ENGINE_CONFIGS`). Types and range checks only (the defaults live in the
YAML files); a field marked ``resumable`` may change when a run is resumed (memory and speed knobs: the same
samples' distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from bapo.infra.checks import require


@dataclass
class RolloutCommon:
    engine: str = MISSING
    n: int = MISSING
    temperature: float = MISSING
    max_new_tokens: int = MISSING
    # Partial rollouts: tokens each unfinished response gets per step; the rest waits for later steps' weights
    # (bapo.rollout.maker, docs/offpolicy.md). None: every response is generated whole within its step; a budget of
    # max_new_tokens or more never interrupts a response, so it is typed as None (the plain run, metric for metric).
    partial_budget: int | None = MISSING

    def __post_init__(self) -> None:
        require(self.n >= 1, "rollout.n", f"must be >= 1, got {self.n}")
        require(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        require(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")
        b = self.partial_budget
        require(
            b is None or b >= 1,
            "rollout.partial_budget",
            f"must be null (off) or tokens per response per step, >= 1, got {b}",
        )
        if b is not None and b >= self.max_new_tokens:
            self.partial_budget = None  # no response is ever interrupted: the plain run
        if self.partial_budget is not None:  # responses will be interrupted: the engine must continue them
            from bapo.engines.registry import engine_traits

            require(
                engine_traits(self.engine).continues,
                "rollout.partial_budget",
                f"rollout.engine={self.engine} cannot continue a response from its prefix (its traits say "
                f"continues=False), which partial rollouts need: set rollout.partial_budget=null, or use an engine "
                f"that can (hf, vllm, vllm_server)",
            )
