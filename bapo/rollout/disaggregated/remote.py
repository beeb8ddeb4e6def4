"""What the in-process producer drives in a disaggregated run: a batch maker and an engine in the workers.

The producer (:class:`bapo.rollout.producer.Producer`) drives the workers unchanged: this module gives it a batch
maker (:class:`RemoteMaker`) and an engine to lend for evaluation (:class:`RemoteEngine`), both over the learner's
:class:`~bapo.rollout.disaggregated.pool.WorkerPool`, so the schedule, the queue, ``run()`` and the checkpoint
format are the colocated run's.

Determinism. Worker ``i`` of ``N`` is the rollout maker of rank ``i`` of ``N`` (``bapo.rollout.maker``):
every worker draws the same prompts and generates its share with its share's seed, and the shares are
joined in order. So a disaggregated run follows the schedule of the run's ``train.async_rollout`` and
``buffer.enforce`` exactly: in sync or admission mode it is reproducible and resumes exactly, and with one
worker it makes the batches a colocated run makes. Drop mode (free-running) generates with the newest
weights and is not reproducible, as in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bapo.engines.base import RolloutEngine
from bapo.rollout.disaggregated.pool import Worker, WorkerLost, WorkerPool
from bapo.rollout.source import Interrupted
from bapo.samples import Prompt, RolloutBatch, Sample


def merge_shares(parts: list[RolloutBatch]) -> RolloutBatch:
    """The workers' shares of one batch as one batch (:func:`bapo.rollout.maker.join_shares`); one worker's
    share is the batch as it made it."""
    from bapo.rollout.maker import join_shares

    return parts[0] if len(parts) == 1 else join_shares(parts)


def gathered(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every entry of ``weights`` read once, in its own order, on this process's CPU. Under torchrun the
    learner's live weights are a streamed mapping whose reads are collectives: every rank reads them here
    together, and rank 0 keeps the copy it pushes to its workers."""
    return {n: t.detach().cpu() for n, t in weights.items()}


class RemoteMaker:
    """The batch maker of a disaggregated run (:class:`bapo.rollout.producer.BatchMaker`): batch t is made by every
    worker at once, each its share, with the weights of the version the schedule gave; a lost worker is
    replaced and its share made again from its last accepted state.

    Under torchrun only rank 0 holds the pool (``pool`` is None on the others). Every rank calls ``make``
    together in sync mode, so the weights of a new version are read on every rank (their reads are collectives,
    :func:`gathered`); rank 0 makes the batch, and ``gather``, on the learner's thread, broadcasts it. The
    versions are tracked alike on every rank, so that every rank takes the same branch."""

    def __init__(self, pool: WorkerPool | None, world: int = 1):
        self.pool, self.world = pool, world
        count = pool.count if pool is not None else 0
        self.states: list[dict | None] = [None] * count  # each worker's maker state after its last batch
        self.version: int | None = None  # the version of the weights the last batch read (every rank alike)
        self.copy: dict[str, torch.Tensor] | None = None  # rank 0 under torchrun: those weights, gathered
        self.held: int | None = None  # the version worker 0 holds, as every rank knows it (evaluation's)
        self.abandoned = False  # a stop gave a batch up: the workers still owe its replies, and end with the run

    def recover(self, w: Worker) -> None:
        """A replacement's maker state: the one its predecessor had after its last accepted batch."""
        state = self.states[w.index]
        if state is not None:
            self.pool.call(w, ("load_state", state))

    def read(self, weights: Mapping[str, torch.Tensor], version: int) -> Mapping[str, torch.Tensor]:
        """The weights to push for ``version``: as given in one process; under torchrun, read on every rank
        when the version is new, and kept on rank 0."""
        if self.world == 1:
            return weights
        if version != self.version:
            copy = gathered(weights)
            self.copy = copy if self.pool is not None else None
        self.version = version
        return self.copy if self.copy is not None else {}

    def make(self, t: int, version: int, weights: Mapping[str, torch.Tensor]) -> RolloutBatch | tuple:
        weights = self.read(weights, version)
        self.held = version
        pool = self.pool
        if pool is None:
            return ("made on rank 0", t, version)  # gather() brings rank 0's batch

        def start(w: Worker) -> None:
            if w.version != version:
                pool.push_weights(w, weights, version)
            pool._send(w, ("make", t, version))  # noqa: SLF001

        def share(w: Worker, fresh: bool, started: bool) -> tuple[RolloutBatch, dict]:
            if fresh or not started:
                start(w)
            return pool._reply(w, "make")  # noqa: SLF001

        with pool._lock, self._abandon_on_stop():  # noqa: SLF001
            t0 = time.perf_counter()
            pool.take_sync_s()  # from here on: this batch's weight pushes
            started = []
            for i in range(pool.count):  # every share starts before any is waited for
                try:
                    start(pool.workers[i])
                    started.append(True)
                except WorkerLost:
                    started.append(False)  # its retry below replaces it
            parts = []
            for i in range(pool.count):
                batch, state = pool.retrying(i, lambda w, fresh, i=i: share(w, fresh, started[i]), self.recover)
                parts.append(batch)
                self.states[i] = state
            out = merge_shares(parts)
            stats = dict(out.stats)
            stats["time/sync_s"] = pool.take_sync_s() + stats.get("time/sync_s", 0.0)
            stats["rollout/worker_restarts"] = float(pool.restarts)
            stats["time/worker_batch_s"] = time.perf_counter() - t0
            return dataclasses.replace(out, stats=stats)

    @contextlib.contextmanager
    def _abandon_on_stop(self):
        try:
            yield
        except Interrupted:
            self.abandoned = True
            raise

    def gather(self, item: RolloutBatch | tuple) -> RolloutBatch:
        """The batch on every rank (rank 0's, broadcast, under torchrun)."""
        if self.world == 1:
            return item
        from bapo.infra import dist

        return dist.broadcast_object(item if self.pool is not None else None)

    def state_dict(self) -> dict:
        """The rollout maker's state after the last batch made (every worker's prompt stream is at the same
        place; worker 0's is the one a resume gives them all). Before any batch: asked of worker 0. Under
        torchrun rank 0's checkpoint file carries it; the other ranks hold none."""
        if self.pool is None:
            return {}
        if self.states[0] is None:
            with self.pool._lock:  # noqa: SLF001
                self.states[0] = self.pool.retrying(0, lambda w, fresh: self.pool.call(w, ("state",)), self.recover)
        return self.states[0]

    def load_state_dict(self, state: dict) -> None:
        if self.pool is None:
            return
        if self.abandoned:  # after a stop: this side's record only (the busy workers end with the run)
            self.states = [state] * self.pool.count
            return
        if not state:
            raise ValueError(
                "this checkpoint's rollout-maker state is empty: resume it with the world size that wrote it"
            )
        with self.pool._lock:  # noqa: SLF001
            for i in range(self.pool.count):
                self.states[i] = state
                self.pool.retrying(i, lambda w, fresh: self.pool.call(w, ("load_state", state)), self.recover)


class RemoteEngine(RolloutEngine):
    """The engine a disaggregated run lends for evaluation: worker 0's, through its connection (the
    :class:`~bapo.engines.base.RolloutEngine` interface: its sampling defaults, no-op ``sleep`` and ``wake``).
    Loading weights keeps them (the learner does not update during an evaluation), so that a worker lost
    mid-evaluation is replaced and given them again. Under torchrun every rank is one generator
    (``tensor_parallel_size`` = the world): rank 0 asks worker 0, and broadcasts the samples."""

    def __init__(
        self,
        pool: WorkerPool | None,
        maker: RemoteMaker,
        *,
        n: int,
        temperature: float,
        pad_id: int,
        max_new_tokens: int,
        world: int = 1,
    ):
        self.pool, self.maker, self.world = pool, maker, world
        self.tensor_parallel_size = world
        self.n, self.temperature, self.pad_id, self.max_new_tokens = n, temperature, pad_id, max_new_tokens
        self._weights: Mapping[str, torch.Tensor] | None = None

    @property
    def version(self) -> int:  # type: ignore[override]  (worker 0's, as every rank knows it)
        return -1 if self.maker.held is None else self.maker.held

    def _recover(self, w: Worker) -> None:
        self.maker.recover(w)

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        if self.world > 1:
            weights = gathered(weights)  # every rank reads them (collectives); rank 0 pushes them
        self.maker.held = version
        if self.pool is None:
            return time.perf_counter() - t0
        self._weights = weights
        with self.pool._lock:  # noqa: SLF001
            self.pool.retrying(0, lambda w, fresh: self.pool.push_weights(w, weights, version), self._recover)
        return time.perf_counter() - t0

    def _generate(self, prompts: Sequence[Prompt], n: int, temperature: float, seed: int | None) -> list[Sample]:
        samples = None
        if self.pool is not None:
            version = self.version

            def gen(w: Worker, fresh: bool) -> list[Sample]:
                if fresh or w.version != version:
                    if self._weights is None:
                        raise RuntimeError("rollout worker 0 lacks the evaluation's weights and none are held")
                    self.pool.push_weights(w, self._weights, version)
                return self.pool.call(w, ("generate", list(prompts), n, temperature, seed))

            with self.pool._lock:  # noqa: SLF001
                samples = self.pool.retrying(0, gen, self._recover)
        if self.world == 1:
            return samples
        from bapo.infra import dist

        return dist.broadcast_object(samples)


def remote_maker(rc: Any, pool: WorkerPool | None, tokenizer: Any) -> tuple[RemoteMaker, RemoteEngine]:
    """The batch maker and the evaluation engine a disaggregated run's producer drives (``pool``: rank 0's
    workers; None on the other ranks of a torchrun job)."""
    from bapo.engines.base import pad_id_of
    from bapo.infra import dist

    world = dist.world_size()
    maker = RemoteMaker(pool, world)
    r = rc.rollout
    engine = RemoteEngine(
        pool,
        maker,
        n=r.n,
        temperature=r.temperature,
        pad_id=pad_id_of(tokenizer),
        max_new_tokens=r.max_new_tokens,
        world=world,
    )
    return maker, engine
