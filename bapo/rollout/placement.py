"""The placement registry: ``placement.mode`` names where a run's rollout happens, and the class that puts it there.

A placement is named here by a dotted path (``"module:Class"``), imported only when a config chooses it, as the
engines are (:mod:`bapo.engines.registry`). Each class declares

- ``traits`` (:class:`PlacementTraits`), which the composition (:mod:`bapo.build`) and the memory plan
  (:mod:`bapo.plan`) read in place of the mode's name;
- ``config``: its schema, a dataclass that subclasses :class:`PlacementConfig` with the keys only it reads
  (``placement.<key>``; a key of another mode is refused at start-up, naming it);
- ``check(rc, world)``: the combinations it refuses at start-up, each a ConfigError naming a key;
- how it is built: ``cls(rc, cfg, path=..., limit=..., interrupt=...)`` on every rank before the learner is built
  (what must load while the learner loads starts here), then ``rollout(parts)`` gives the batch maker, the engine
  evaluation borrows, the verifier, the data loaders' report and the held-out prompts; ``source(maker, engine,
  interrupt)`` the rollout source ``run()`` takes batches from (the producer of :mod:`bapo.rollout.producer`
  unless the placement brings its own); ``stop()`` ends whatever it started if the build fails.

A new placement, or a new rollout source, is one class (in its own module, or any importable
``package.module:Class``), one line in :data:`PLACEMENTS` and one YAML in ``conf/placement/`` that sets
``placement.mode``; it touches neither the loop nor :mod:`bapo.build` nor :mod:`bapo.config` (docs/extending.md,
"A new placement or rollout source").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from bapo.infra.checks import Schemas, plugin, require, resumable
from bapo.rollout.producer import Producer
from bapo.rollout.schedule import partial_lag
from bapo.rollout.source import RolloutSource

PLACEMENTS: dict[str, str] = {
    "colocated": "bapo.rollout.placement:Colocated",
    "disaggregated": "bapo.rollout.disaggregated:Disaggregated",
}


@dataclass
class PlacementConfig:
    """``placement``: the hardware a run is written for, the memory knobs the stages read from it
    (conf/rollout/vllm.yaml and conf/learner/fsdp.yaml interpolate them; the stages check them again), and where
    rollout runs (``mode``, a name in :data:`PLACEMENTS`). The keys every placement has; a mode's own are in its
    ``config``."""

    name: str = resumable()
    gpus: int = resumable()  # ranks the memory plan assumes without --nproc or $WORLD_SIZE
    gpu_memory_gib: float = resumable()  # memory of one GPU, for the memory plan
    # The knobs a GPU placement sets for the stages; absent (None) where the stage keeps its own default.
    gpu_memory_utilization: float | None = resumable(None)
    tensor_parallel_size: int | None = resumable(None)
    max_tokens_per_micro_batch: int | None = resumable(None)
    activation_checkpointing: bool | None = resumable(None)
    cpu_offload: bool | None = resumable(None)
    mode: str = resumable("colocated")  # where rollout runs: a name in PLACEMENTS
    learner_threads: int | None = resumable(None)  # torch threads of the learner's process (None: torch's default)

    def __post_init__(self) -> None:
        require(
            self.learner_threads is None or self.learner_threads >= 1,
            "placement.learner_threads",
            f"must be null (torch's default) or >= 1, got {self.learner_threads}",
        )
        require(self.gpus >= 1, "placement.gpus", f"must be >= 1, got {self.gpus}")
        require(0 < self.gpu_memory_gib < 1e6, "placement.gpu_memory_gib", f"must be > 0, got {self.gpu_memory_gib}")


@dataclass(frozen=True)
class PlacementTraits:
    """What a placement is, as far as the composition and the memory plan must know.

    - ``in_workers``: rollout runs in processes of its own, not the learner's: the learner's process keeps no
      copy of the model for an engine, and the memory plan counts no engine on the learner's GPUs.
    """

    in_workers: bool = False


class RolloutSide(NamedTuple):
    """A placement's rollout side (``Placement.rollout``): the batch maker, the engine evaluation borrows, the
    verifier, the data loaders' report and the held-out prompts."""

    maker: Any
    engine: Any
    verifier: Any
    report: Any
    heldout: list


@dataclass(frozen=True)
class RolloutParts:
    """What the composition lends a placement to build its rollout side from (closures over the run's stages)."""

    local: Callable[[], RolloutSide]  # the in-process rollout side
    verifier: Callable[[], Any]  # a verifier of the run's reward group (bapo.reward.build_verifier)
    heldout: Callable[[], tuple]  # (held-out prompts, rendered, and the data loaders' report)
    tokenizer: Any


class Placement:
    """A placement's interface (see the module's doc); :class:`Colocated` is the simplest one."""

    traits: ClassVar[PlacementTraits] = PlacementTraits()
    config: ClassVar[type] = PlacementConfig

    def __init__(self, rc: Any, cfg: Any, *, path: str, limit: int, interrupt: threading.Event) -> None:
        self.rc = rc

    @staticmethod
    def check(rc: Any, world: int) -> None:
        """Refuse, as a ConfigError naming a key, a combination this placement cannot run."""

    def rollout(self, parts: RolloutParts) -> RolloutSide:
        """The batch maker, the engine evaluation borrows, the verifier, the data loaders' report and the held-out
        prompts."""
        raise NotImplementedError

    def source(self, maker: Any, engine: Any, interrupt: threading.Event) -> RolloutSource:
        """The rollout source ``run()`` takes batches from: by default this process's producer, which runs ``maker``
        inline (sync) or on its thread (async) on the run's schedule. A placement whose batches come from elsewhere
        (a replay, a service) returns its own :class:`bapo.rollout.source.RolloutSource`."""
        rc = self.rc
        return Producer(
            maker,
            mode=rc.mode,
            updates_per_batch=rc.sizes.updates_per_step,
            max_staleness=rc.buffer.max_staleness,
            sync_every=rc.train.sync_every,
            ahead=max(1, rc.buffer.capacity // rc.sizes.samples_per_step),
            last_batch=None if rc.mode == "drop" else rc.train.steps,  # drop: replacements for dropped batches
            interrupt=interrupt,
            engine=engine,
            lag=partial_lag(rc.rollout.max_new_tokens, rc.behaviour.partial_budget),
            copies=rc.behaviour.needs_copies,
        )

    def stop(self) -> None:
        """End what the constructor started (called when the build fails; the source stops the rest)."""


class Colocated(Placement):
    """Rollout in the learner's process: the producer runs the batch maker with the run's engine inline (sync) or
    on its thread (async)."""

    def rollout(self, parts: RolloutParts) -> RolloutSide:
        return parts.local()


def placement_class(mode: str) -> type[Placement]:
    """The class registered as ``mode``, or that the import path ``package.module:Class`` names, imported now; a
    ConfigError names the choices or what the class lacks."""
    return plugin(mode, PLACEMENTS, "placement.mode", kind="a placement", lacks=_lacks_placement)


def _lacks_placement(cls: Any) -> str | None:
    ok = isinstance(cls, type) and issubclass(cls, Placement) and issubclass(cls.config, PlacementConfig)
    if ok and isinstance(cls.traits, PlacementTraits):
        return None
    return (
        "it needs to subclass bapo.rollout.placement.Placement, with traits and a config that subclasses "
        "PlacementConfig (docs/extending.md, a new placement)"
    )


PLACEMENT_CONFIGS: Mapping[str, type] = Schemas(PLACEMENTS, placement_class)  # placement.mode's schemas
