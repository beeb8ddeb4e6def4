"""The engine registry: ``rollout.engine`` names to engine classes, and the traits each engine declares.

An engine is named here by a dotted path (``"module:Class"``), so its module, and the library behind
it, is imported only when a config chooses it (``import vllm`` happens in a run with ``rollout=vllm``
only). Each class declares its :class:`EngineTraits`, its config schema (``config``: a dataclass that
subclasses :class:`bapo.engines.config.RolloutCommon`, defined in the engine's module) and builds itself
from that typed config (``from_config``). The loop and ``eval.py`` read traits, never engine names.

A new engine is one module with its class and its schema, one YAML in ``conf/rollout/``, one line in
:data:`ENGINES` and a case in ``tests/contracts/test_engine_contract.py``. An engine module imports its
library (vLLM, an HTTP client) inside its methods, not at the top: the config check imports the module
of the chosen engine to read its schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bapo.infra.checks import Schemas, plugin

ENGINES: dict[str, str] = {
    "hf": "bapo.engines.hf:HFRollout",
    "vllm": "bapo.engines.vllm:VLLMRollout",
    "vllm_server": "bapo.engines.vllm_server:VLLMServerRollout",
}

WEIGHT_PATHS = ("in_process", "transport")
GPU_MEMORY = ("model_copy", "vllm_beside", "vllm_own_gpus")  # the memory plan's model of an engine (bapo.plan)


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
    - ``continues``: it continues a response from its prefix (``RolloutEngine._segments``), as partial rollouts
      (``rollout.partial_budget``) need; a budget that would interrupt responses is refused at start-up otherwise.
    - ``runs_in_workers``: it can run in rollout worker processes (``placement.mode=disaggregated``: built there
      from the run's config, on the host, its weights sent over gloo); refused at start-up otherwise.
    - ``gpu_memory``: what the memory plan (``python train.py ... --plan``, :mod:`bapo.plan`) counts for it:
      ``"model_copy"``, a copy of the model and its KV cache on the learner's device; ``"vllm_beside"``, vLLM's
      share of the learner's GPUs (weights, activations, CUDA graphs, KV cache; asleep during updates);
      ``"vllm_own_gpus"``, vLLM on GPUs of its own (``rollout.gpus``), none of the learner's.
    - ``eval_engine``: the engine an evaluation of a run made with this one uses in its place, on the eval ranks'
      own GPUs (an engine on GPUs of its own has none there: the eval's ranks take every GPU); None: this one.
    """

    needs_model_copy: bool
    can_sleep: bool
    behaviour_logprobs: bool
    weights: str
    spans_ranks: bool
    continues: bool = False
    runs_in_workers: bool = False
    gpu_memory: str = "model_copy"
    eval_engine: str | None = None

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_PATHS:
            raise ValueError(f"EngineTraits.weights: must be one of {list(WEIGHT_PATHS)}, got {self.weights!r}")
        if self.gpu_memory not in GPU_MEMORY:
            raise ValueError(f"EngineTraits.gpu_memory: must be one of {list(GPU_MEMORY)}, got {self.gpu_memory!r}")


def engine_class(name: str) -> type:
    """The class registered as ``name``, or that the import path ``package.module:Class`` names (an engine
    outside this repository), imported now; a ConfigError names the choices or what the class lacks."""
    return plugin(name, ENGINES, "rollout.engine", kind="an engine class", lacks=_lacks_engine)


def _lacks_engine(cls: Any) -> str | None:
    lacks = [a for a in ("traits", "config", "from_config") if not hasattr(cls, a)]
    if isinstance(cls, type) and not lacks and isinstance(cls.traits, EngineTraits):
        return None
    return f"it needs {lacks or ['traits = EngineTraits(...)']} (docs/extending.md, a new rollout engine)"


def engine_traits(name: str) -> EngineTraits:
    """The traits the engine registered as ``name`` declares (imports its module, not its library)."""
    return engine_class(name).traits


ENGINE_CONFIGS: Mapping[str, type] = Schemas(ENGINES, engine_class)  # rollout.engine's schemas
