"""``placement.mode=disaggregated``: its schema (:class:`DisaggregatedConfig`) and its placement
(:class:`Disaggregated`), which starts the worker pool before the learner is built and hands the producer the
pool's remote maker (the package's docstring tells the whole).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from bapo.infra.checks import require, resumable
from bapo.rollout.disaggregated.pool import WorkerPool, WorkerSpec
from bapo.rollout.disaggregated.remote import remote_maker
from bapo.rollout.placement import Placement, PlacementConfig, PlacementTraits, RolloutParts


@dataclass
class DisaggregatedConfig(PlacementConfig):
    """``placement`` of ``mode=disaggregated``: the keys of the worker processes, beside every placement's."""

    workers: int = resumable(1)  # rollout worker processes, each making its share of every batch
    host: str = resumable("127.0.0.1")  # where the learner listens for its workers
    port: int = resumable(0)  # 0: any free port
    worker_threads: int = resumable(1)  # torch threads of each worker
    worker_timeout_s: float = resumable(900.0)  # a worker silent this long (no reply, no heartbeat) is replaced
    worker_start_timeout_s: float = resumable(300.0)  # to connect and load its model
    worker_restarts: int = resumable(3)  # failures in a row on one request before the run stops

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.workers >= 1, "placement.workers", f"must be >= 1 (worker processes), got {self.workers}")
        require(
            0 <= self.port <= 65535, "placement.port", f"must be 0 (any free port) or a port number, got {self.port}"
        )
        require(self.worker_threads >= 1, "placement.worker_threads", f"must be >= 1, got {self.worker_threads}")
        require(self.worker_timeout_s > 0, "placement.worker_timeout_s", f"must be > 0, got {self.worker_timeout_s}")
        require(
            self.worker_start_timeout_s > 0,
            "placement.worker_start_timeout_s",
            f"must be > 0, got {self.worker_start_timeout_s}",
        )
        require(self.worker_restarts >= 0, "placement.worker_restarts", f"must be >= 0, got {self.worker_restarts}")


class Disaggregated(Placement):
    """Rollout in ``placement.workers`` processes of its own (the package's doc): rank 0 spawns them before the learner
    is built, so they load their models meanwhile; the producer drives their :class:`RemoteMaker`, and evaluation
    borrows worker 0's engine. The held-out set and the verifier stay in the learner's process."""

    traits = PlacementTraits(in_workers=True)
    config = DisaggregatedConfig

    @staticmethod
    def check(rc: Any, world: int) -> None:
        from bapo.engines.registry import engine_traits

        require(
            engine_traits(rc.rollout.engine).runs_in_workers,
            "rollout.engine",
            f"{rc.rollout.engine} cannot run in rollout worker processes (placement.mode=disaggregated; its traits "
            "say runs_in_workers=False, hf's do); for vLLM in processes of its own use rollout=vllm_server",
        )
        require(
            not rc.behaviour.per_token or rc.placement.workers == 1,
            "placement.workers",
            f"rollout.partial_budget keeps its pool of unfinished responses in one worker; got {rc.placement.workers}",
        )
        require(
            rc.train.prompts_per_step >= rc.placement.workers,
            "placement.workers",
            f"{rc.placement.workers} workers for {rc.train.prompts_per_step} prompts a step: each needs at least one",
        )

    def __init__(self, rc: Any, cfg: Any, *, path: str, limit: int, interrupt: threading.Event) -> None:
        from bapo.infra import dist

        super().__init__(rc, cfg, path=path, limit=limit, interrupt=interrupt)
        self.pool = start_pool(rc, cfg, path=path, limit=limit, interrupt=interrupt) if dist.is_main() else None

    def rollout(self, parts: RolloutParts) -> tuple:
        if self.pool is not None:
            self.pool.wait()
        maker, engine = remote_maker(self.rc, self.pool, parts.tokenizer)
        heldout, report = parts.heldout()
        return maker, engine, parts.verifier(), report, heldout

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.stop()


def start_pool(rc: Any, cfg: Any, *, path: str, limit: int, interrupt: threading.Event) -> WorkerPool:
    """The ``placement.workers`` workers of ``rc``, spawned; :meth:`WorkerPool.wait` readies them."""
    from omegaconf import OmegaConf

    if cfg is None:
        raise ValueError("placement.mode=disaggregated: the workers need the run's composed config (cfg)")
    p = rc.placement
    spec = WorkerSpec(
        config=OmegaConf.to_container(cfg, resolve=True),
        path=path,
        limit=limit,
        run_dir=str(rc.run_dir),
        threads=p.worker_threads,
    )
    pool = WorkerPool(
        spec,
        count=p.workers,
        host=p.host,
        port=p.port,
        timeout_s=p.worker_timeout_s,
        start_timeout_s=p.worker_start_timeout_s,
        restarts=p.worker_restarts,
        interrupt=interrupt,
    )
    pool.spawn()
    return pool
