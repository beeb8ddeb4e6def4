"""The in-process rollout source: a producer that makes rollout batches inline (sync) or on a background
thread (async), ahead of the learner without breaking the staleness bound.

:class:`Producer` is one implementation of :class:`bapo.rollout.source.RolloutSource`. Which weights each
batch gets, which versions the learner publishes, and which may be live rather than copies, is the pure
schedule of :mod:`bapo.rollout.schedule`; this module adds what running it takes: the weight mailbox, the queue of
batches made ahead, the thread, pause/resume, and checkpoint state.

Live weights under FSDP are a :class:`~bapo.learner.weights.StreamedWeights`: nothing is gathered
when they are published, and the engine gathers one parameter at a time as it loads them, on every
rank together (the sync producer runs inline on the learner's thread). A copy is a full snapshot
gathered at publish time on the learner's thread, kept on the CPU: the async producer's thread
loads it later and must run no collective of its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from bapo.infra import dist, stop
from bapo.infra.checks import RunFailed, UserError
from bapo.rollout.schedule import MODES, Schedule, batch_version, min_staleness
from bapo.rollout.source import Interrupted, RolloutSource

# the schedule's names, and the interrupt every source raises, as this module's users import them
__all__ = ["MODES", "Interrupted", "Producer", "batch_version", "min_staleness", "offer_weights"]


class WeightMailbox:
    """Weight snapshots by version, published by the learner and loaded by the producer.

    One condition variable guards the snapshots and the producer's queue, so that a
    publish wakes a producer waiting for weights. Used only through :class:`Producer`.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._snaps: dict[int, dict] = {}
        self.closed = False

    def publish(self, version: int, weights: dict) -> None:
        with self.cond:
            self._snaps[version] = weights
            self.cond.notify_all()

    def get(self, version: int) -> dict:
        """The snapshot of ``version``; a KeyError names what is held instead."""
        with self.cond:
            if version not in self._snaps:
                raise KeyError(f"no weight snapshot of version {version} (held: {sorted(self._snaps)})")
            return self._snaps[version]

    def ready(self, version: int | None) -> bool:
        """Is the snapshot a batch asks for (None: any, the newest) published? Call with ``cond`` held."""
        return bool(self._snaps) if version is None else version in self._snaps

    def newest(self, version: int | None) -> tuple[int, dict]:
        """(version, snapshot): ``version``'s, or the newest for None. Call with ``cond`` held, once ready."""
        v = max(self._snaps) if version is None else version
        return v, self._snaps[v]

    def has(self, version: int) -> bool:
        with self.cond:
            return version in self._snaps

    def release_below(self, version: int) -> None:
        with self.cond:
            for v in [v for v in self._snaps if v < version]:
                del self._snaps[v]

    def versions(self) -> list[int]:
        with self.cond:
            return sorted(self._snaps)

    def snapshots(self, exclude: int | None = None) -> dict[int, dict]:
        """The stored copies (for a checkpoint): not ``exclude``'s, and not live weights (a streamed mapping of the
        learner's current weights, which a resume republishes from the model)."""
        with self.cond:
            return {v: s for v, s in self._snaps.items() if v != exclude and isinstance(s, dict)}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class BatchMaker(Protocol):
    """What the producer runs: make batch t with a version's weights, and carry its own state (the data cursor)."""

    def make(self, t: int, version: int, weights: dict) -> Any: ...

    def gather(self, item: Any) -> Any: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Producer(RolloutSource):
    """Generates rollout batches in order, inline (sync) or on a background thread (async): the in-process
    :class:`~bapo.rollout.source.RolloutSource`.

    The producer decides *when* batch t may be made and *which* snapshot it gets (from
    its :class:`~bapo.rollout.schedule.Schedule`); ``maker.make(t, version, weights)`` makes it. It owns the
    weight mailbox and the queue of batches made ahead, and checkpoints both, with the
    maker's state (:meth:`state_dict`). ``engine`` is the engine the maker generates with, which
    :meth:`borrow` lends for evaluation and :meth:`before_updates` puts to sleep.

    ``take`` returns ``maker.gather(batch)``: under torchrun the ranks' shares of a
    batch are gathered there, on the consumer's (learner's) thread, because the
    learner's own collectives run on that thread and collectives of one process group
    must not interleave across threads.

    Every blocking wait wakes on ``interrupt`` (a stop request: :class:`Interrupted`)
    and on a producer error (re-raised).

    ``lag`` and ``copies``: partial rollouts' share of the schedule (:class:`~bapo.rollout.schedule.Schedule`).
    """

    def __init__(
        self,
        maker: BatchMaker,
        *,
        mode: str,
        updates_per_batch: int,
        max_staleness: int,
        sync_every: int,
        ahead: int = 1,
        last_batch: int | None = None,
        interrupt: threading.Event | None = None,
        engine: Any = None,
        lag: int = 0,
        copies: bool = False,
    ):
        self.schedule = Schedule(mode, updates_per_batch, max_staleness, sync_every, lag, copies)
        self.maker = maker
        self.engine = engine
        self.mailbox = WeightMailbox()
        self.mode = mode
        self.ahead = max(1, ahead)
        self.last_batch = last_batch
        self.interrupt = interrupt if interrupt is not None else threading.Event()
        self._cond = self.mailbox.cond
        self._queue: deque = deque()
        self._next = 1  # the next batch to make
        self._consumed = 0  # batches taken
        self._taken: list = []  # batches taken since the last release (this step's): requeue() puts them back
        self._wait_s = 0.0  # producer time spent waiting (for weights or for room), since last asked
        self._stop = threading.Event()
        self._pause = False
        self._busy = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ schedule

    def version_for(self, t: int) -> int | None:
        return self.schedule.version_for(t)

    def wants(self, version: int) -> bool:
        """Should the learner publish its weights at ``version``? (Some batch will be made with them, and they
        are not held yet.)"""
        return self.schedule.wants(version, self._consumed) and not (self.mode != "drop" and self.mailbox.has(version))

    def needs_copy(self, version: int) -> bool:
        """Must the weights published at ``version`` be a copy (:meth:`bapo.rollout.schedule.Schedule.needs_copy`)?"""
        return self.schedule.needs_copy(version, self._consumed)

    def publish(self, version: int, weights: dict) -> None:
        self.mailbox.publish(version, weights)

    def offer_weights(self, learner: Any) -> None:
        """Publish the learner's weights if a batch will be generated with them: live, or a copy.

        ``learner.weights()`` / ``snapshot()`` may be collectives (FSDP); ``wants`` and ``needs_copy`` give the
        same answer on every rank, so all ranks call them together."""
        v = learner.version
        if self.wants(v):
            self.publish(v, learner.snapshot() if self.needs_copy(v) else learner.weights())

    def snapshot(self, version: int) -> dict:
        """The published weights of ``version`` (recompute's older policy); KeyError when not held."""
        return self.mailbox.get(version)

    def release(self, version: int, *, keep_window: bool) -> None:
        """Free snapshots that no batch will be made with any more (past ``last_batch`` too: the run may be
        extended). The step's batches are the learner's from here on (:meth:`requeue` no longer returns them)."""
        self._taken.clear()
        newest = max(self.mailbox.versions(), default=0)
        self.mailbox.release_below(
            self.schedule.release_floor(self._next, version, newest_held=newest, keep_window=keep_window)
        )

    # ------------------------------------------------------------------ running

    @property
    def threaded(self) -> bool:
        return self.mode != "sync"

    def start(self) -> None:
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="bapo-producer", daemon=True)
            self._thread.start()

    def _done(self) -> bool:
        return self.last_batch is not None and self._next > self.last_batch

    def _ready(self) -> bool:
        """May the next batch be made now? (Called with the lock held.)"""
        if self._pause or len(self._queue) >= self.ahead_limit():
            return False
        return self.mailbox.ready(self.version_for(self._next))

    def _produce_one(self) -> None:
        t = self._next
        with self._cond:
            while not self.mailbox.ready(self.version_for(t)):
                if self._stop.is_set() or self.mailbox.closed or stop.requested():
                    raise Interrupted
                self._cond.wait(0.1)
            version, weights = self.mailbox.newest(self.version_for(t))
        before = self.maker.state_dict()
        try:
            item = self.maker.make(t, version, weights)
        except stop.Interrupted:  # a stop gave the batch up: its prompts are drawn again by a resumed run
            self.maker.load_state_dict(before)
            raise
        with self._cond:
            self._queue.append(item)
            self._next += 1
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self._done() and not stop.requested():
                with self._cond:
                    t0 = time.perf_counter()
                    while not self._stop.is_set() and not self.mailbox.closed and not self._ready():
                        self._cond.wait(0.1)
                    self._wait_s += time.perf_counter() - t0
                    if self._stop.is_set() or self.mailbox.closed:
                        break
                    self._busy = True
                try:
                    self._produce_one()
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        except Interrupted:
            pass
        except BaseException as e:  # surfaced to the learner in take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def ahead_limit(self) -> int:
        """Batches the producer may hold unconsumed. Admission bounds itself through the schedule."""
        return self.ahead if self.mode == "drop" else 1 << 30

    def _check(self) -> None:
        """Raise what a waiting consumer must not sleep through. Called with the lock held."""
        if self._error is not None:
            self._raise_error()
        if self.threaded and (self._thread is None or not self._thread.is_alive()):
            raise RuntimeError("the rollout producer stopped before the run ended")

    def _raise_error(self) -> None:
        """The producer's error, raised on the learner's thread: as itself when the entry point reports it in one
        line (``bapo.entry.cli``: bad input, or a run that failed, such as a rollout worker lost too often), else
        wrapped, so that a bug's traceback also shows where the learner noticed it."""
        if isinstance(self._error, UserError | RunFailed):
            raise self._error
        raise RuntimeError("the rollout producer failed") from self._error

    def _stopping(self) -> bool:
        return self.interrupt.is_set() or stop.requested()

    def take(self) -> tuple[Any, float]:
        """The next batch (gathered over ranks), and the seconds the consumer waited for it.

        A stop request gives up the batch being made (sync) or the wait (async) and raises :class:`Interrupted`;
        under torchrun every rank agrees on that first (:func:`bapo.infra.stop.agree`), so that all give up
        together, and a batch already made stays queued (the checkpoint keeps it)."""
        t0 = time.perf_counter()
        if not self.threaded:
            aborted = False
            if not self._queue and not self._stopping():
                v = self.version_for(self._next)
                if not self.mailbox.has(v):
                    raise RuntimeError(f"sync schedule: batch {self._next} needs version {v}, not published")
                try:
                    self._produce_one()
                except Interrupted:
                    aborted = True
            if stop.agree(aborted or self._stopping()):
                raise Interrupted
            return self.maker.gather(self._pop()), 0.0
        with self._cond:
            while not self._queue and not self._stopping():
                self._check()
                self._cond.wait(0.1)
        if stop.agree(self._stopping()):
            raise Interrupted
        with self._cond:
            while not self._queue:  # the wait above ended with a batch (no rank is stopping): defensive
                self._check()
                self._cond.wait(0.1)
            item = self._pop()
        return self.maker.gather(item), time.perf_counter() - t0

    def _pop(self) -> Any:
        """Take the next queued batch (the caller holds the lock, or is the only thread)."""
        item = self._queue.popleft()
        self._consumed += 1
        self._taken.append(item)
        self._cond.notify_all() if self.threaded else None
        return item

    def try_take(self) -> Any | None:
        """A batch already made, without waiting (drop mode refills); None if there is none."""
        with self._cond:
            if not self._queue:
                return None
            item = self._pop()
        return self.maker.gather(item)

    def requeue(self) -> None:
        """Put the batches taken since the last :meth:`release` back at the head of the queue, in order: a step
        stopped before its first update gives them back, and the checkpoint holds them as made."""
        with self._cond:
            for item in reversed(self._taken):
                self._queue.appendleft(item)
            self._consumed -= len(self._taken)
            self._taken.clear()
            self._cond.notify_all()

    def before_updates(self) -> None:
        """The learner is about to update: the engine may free its accelerator memory (a no-op where it has
        none); it wakes itself to load or generate."""
        if self.engine is not None:
            self.engine.sleep()

    @contextlib.contextmanager
    def borrow(self, learner: Any) -> Iterator[Any]:
        """The engine, quiesced and holding the learner's current weights, for an evaluation."""
        if self.engine is None:
            raise RuntimeError("this producer was built without its engine: it has none to lend")
        with self.paused():
            # Async producers may stand at different batches: all ranks load (a streamed gather) if any is behind.
            if any(v != learner.version for v in dist.all_gather_object(self.engine.version)):
                self.engine.load_weights(learner.weights(), learner.version)
            yield self.engine

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Quiesce the thread between two batches for the block (checkpoints; evaluation borrows the engine)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def pause(self) -> None:
        """Block until the producer is between batches, and keep it there until :meth:`resume`."""
        if not self.threaded:
            return
        with self._cond:
            self._pause = True
            while self._busy and self._error is None:
                self._cond.wait(0.1)
            if self._error is not None:
                self._raise_error()

    def resume(self) -> None:
        with self._cond:
            self._pause = False
            self._cond.notify_all()

    def take_wait_s(self) -> float:
        with self._cond:
            w, self._wait_s = self._wait_s, 0.0
        return w

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self) -> None:
        self._stop.set()
        self.mailbox.close()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, live: int | None = None, snapshots: bool = True) -> dict:
        """Batches made ahead, the maker's state (data cursor) and the snapshots still needed. Pause first.

        ``live``: a version whose snapshot is the learner's current weights (restored from the model, not stored).
        ``snapshots=False``: the versions held, without their weights (under torchrun a version's copy is the same
        on every rank that holds it, so one rank's file carries it: :func:`bapo.checkpoint.save_run`)."""
        with self._cond:
            pending = list(self._queue)
        held = self.mailbox.snapshots(exclude=live)
        return {
            "consumed": self._consumed,
            "pending": pending,
            "snapshots": held if snapshots else {},
            "snapshot_versions": sorted(held),
            "maker": self.maker.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._consumed = int(state["consumed"])
        self._queue = deque(state["pending"])
        self._next = self._consumed + 1 + len(self._queue)
        for v, snap in state["snapshots"].items():
            self.mailbox.publish(int(v), snap)
        self.maker.load_state_dict(state["maker"])


def offer_weights(producer: Producer, learner: Any) -> None:
    """``producer.offer_weights(learner)``: the one backward edge, as a function."""
    producer.offer_weights(learner)
