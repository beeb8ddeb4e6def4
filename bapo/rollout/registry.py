"""The engine registry: ``rollout.engine`` names to engine classes, and the traits each engine declares.

An engine is named here by a dotted path (``"module:Class"``), so its module, and the library behind
it, is imported only when a config chooses it (``import vllm`` happens in a run with ``rollout=vllm``
only). Each class declares its :class:`EngineTraits` and builds itself from its typed rollout config
(``from_config``). The loop and ``eval.py`` read traits, never engine names.

A new engine is one module with its class, one YAML in ``conf/rollout/``, one line in :data:`ENGINES`
and a case in ``tests/rollout/test_engine_contract.py``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from bapo.checks import ConfigError

ENGINES: dict[str, str] = {
    "hf": "bapo.rollout.hf:HFRollout",
    "vllm": "bapo.rollout.vllm:VLLMRollout",
}

WEIGHT_PATHS = ("in_process", "transport")


@dataclass(frozen=True)
class EngineTraits:
    """What an engine is, as far as the loop and evaluation must know.

    - ``needs_model_copy``: it samples with a model built in this process (``EngineContext.model``,
      a copy of the learner's weights); otherwise it loads the checkpoint at ``path`` itself, and a
      sharded learner may then start from the meta device (nothing to copy it into).
    - ``can_sleep``: ``sleep()`` may free accelerator memory between updates (only with no request in
      flight), and ``wake()`` restores it; otherwise both are no-ops.
    - ``behaviour_logprobs``: a training engine's samples carry the log-prob of each sampled token under
      softmax(logits / T), which the learner can use as the behaviour policy's.
    - ``weights``: ``"in_process"``: ``load_weights`` reads the learner's tensors in this process;
      ``"transport"``: they travel to the engine (a file, a socket) and arrive later.
    - ``spans_ranks``: one engine may span several torchrun ranks (``tensor_parallel_size``), which must
      then submit the same prompts with the same seeds.
    """

    needs_model_copy: bool
    can_sleep: bool
    behaviour_logprobs: bool
    weights: str
    spans_ranks: bool

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_PATHS:
            raise ValueError(f"EngineTraits.weights: must be one of {list(WEIGHT_PATHS)}, got {self.weights!r}")


def engine_class(name: str) -> type:
    """The class registered as ``name``, imported now (a ConfigError names the choices)."""
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine: must be one of {sorted(ENGINES)}, got {name!r}")
    module, _, attr = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def engine_traits(name: str) -> EngineTraits:
    """The traits the engine registered as ``name`` declares (imports its module, not its library)."""
    return engine_class(name).traits
