"""The off-policy engine: which weights each rollout batch is generated with, and a
producer that generates ahead of the learner without breaking the staleness bound.

Versions and staleness
----------------------
The policy *version* is the learner's optimizer-update counter: 0 before the first
update, +1 at every update (a skipped non-finite update counts too; its weights are
the previous ones). Every sample records the version of the weights that produced
it; a rollout batch never spans a weight update, so one version per sample is exact.
The *staleness* of a sample in an update is ``learner version - sample version``.

Rollout batch ``t`` (t = 1, 2, ...) is consumed by training step ``t``, whose
``U = ppo_epochs x mini_batches_per_rollout`` updates run at learner versions
``(t-1)U ... tU-1``. New weights reach the engine every ``s = train.sync_every``
updates. So a batch generated at version ``v_t`` is used at staleness up to
``tU - 1 - v_t`` and the startup check is ``k = buffer.max_staleness >= U + s - 2``
(experience reuse gives ``U - 1``, a sync every s updates up to ``s - 1`` more).

* ``sync`` (``train.async_rollout=false``): batch t is generated right before step t,
  with the newest synced weights: ``v_t = floor((t-1)U / s) * s``.
* ``admission`` (async, the default enforcement): batch t is generated with the
  *oldest* weights that keep it within k, ``v_t = ceil(max(0, tU - 1 - k) / s) * s``.
  The producer waits until the learner has published ``v_t`` (AReaL's
  max_head_offpolicyness, measured in updates), so no sample is ever thrown away.
  The schedule does not depend on machine speed, so an async run is reproducible and
  resumes exactly, and k is the realised staleness, which is what a staleness study
  varies. At the smallest valid k (``U + s - 2``) it is the sync schedule, so async
  with k = 0 (U = s = 1) is synchronous on-policy training.
* ``drop`` (async): the producer generates with the newest published weights and
  never waits for the learner (only for room: at most ``ahead`` batches queued);
  the buffer drops, and counts, samples that would exceed k. Timing decides what is
  dropped, so drop-mode runs are not bit-reproducible.

Snapshots
---------
The learner publishes its weights at the versions some batch will be generated
with (:meth:`Producer.wants`). A published snapshot must hold *that* version's
weights for as long as a batch may load it, so it is a copy, except in one case
(:meth:`Producer.needs_copy`): in sync mode at a step boundary, when the only batch
that asks for this version is the very next one, made before any further update.
With ``sync_every`` larger than the updates per step, two batches share a version,
and the second is made after more updates: it gets a copy.

Live weights under FSDP are a :class:`~bapo.learner.strategy.StreamedWeights`: nothing is gathered
when they are published, and the engine gathers one parameter at a time as it loads them, on every
rank together (the sync producer runs inline on the learner's thread). A copy is a full snapshot
gathered at publish time on the learner's thread, kept on the CPU: the async producer's thread
loads it later and must run no collective of its own.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

MODES = ("sync", "admission", "drop")


def min_staleness(updates_per_batch: int, sync_every: int) -> int:
    """The smallest ``buffer.max_staleness`` any schedule can keep: reuse plus sync lag."""
    return updates_per_batch - 1 + sync_every - 1


def batch_version(t: int, *, updates_per_batch: int, max_staleness: int, sync_every: int, mode: str) -> int | None:
    """The version that rollout batch ``t`` (1-based) is generated with; None in drop mode (newest)."""
    if t < 1:
        raise ValueError(f"rollout batches are numbered from 1, got {t}")
    u, k, s = updates_per_batch, max_staleness, sync_every
    if k < min_staleness(u, s):
        raise ValueError(f"max_staleness={k} < {min_staleness(u, s)} (updates_per_batch={u}, sync_every={s})")
    if mode == "sync":
        return ((t - 1) * u // s) * s
    if mode == "admission":
        return math.ceil(max(0, t * u - 1 - k) / s) * s
    if mode == "drop":
        return None
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


class Interrupted(Exception):
    """A blocking wait was woken by a stop request (or the producer was stopped while waiting)."""


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


class Producer:
    """Generates rollout batches in order, inline (sync) or on a background thread (async).

    The producer decides *when* batch t may be made and *which* snapshot it gets (from
    :func:`batch_version`); ``maker.make(t, version, weights)`` makes it. It owns the
    weight mailbox and the queue of batches made ahead, and checkpoints both, with the
    maker's state (:meth:`state_dict`).

    ``take`` returns ``maker.gather(batch)``: under torchrun the ranks' shares of a
    batch are gathered there, on the consumer's (learner's) thread, because the
    learner's own collectives run on that thread and collectives of one process group
    must not interleave across threads.

    Every blocking wait wakes on ``interrupt`` (a stop request: :class:`Interrupted`)
    and on a producer error (re-raised).
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
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.maker = maker
        self.mailbox = WeightMailbox()
        self.mode = mode
        self.kw = dict(
            updates_per_batch=updates_per_batch, max_staleness=max_staleness, sync_every=sync_every, mode=mode
        )
        self.ahead = max(1, ahead)
        self.last_batch = last_batch
        self.interrupt = interrupt if interrupt is not None else threading.Event()
        self._cond = self.mailbox.cond
        self._queue: deque = deque()
        self._next = 1  # the next batch to make
        self._consumed = 0  # batches taken
        self._wait_s = 0.0  # producer time spent waiting (for weights or for room), since last asked
        self._stop = threading.Event()
        self._pause = False
        self._busy = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ schedule

    def version_for(self, t: int) -> int | None:
        return batch_version(t, **self.kw)

    def _asking(self, upto: int) -> list[tuple[int, int]]:
        """(batch, version) of the batches not yet consumed whose version is <= ``upto`` (admission/sync).

        Counted from the consumer's side, not the producer's: the answer then depends on
        the learner's progress only, so every rank of a torchrun job agrees on it (and on
        the collective weight gather it triggers) however far its producer has got. Batches
        past ``last_batch`` count too: a finished run may be extended (``resume=auto`` with more
        steps), and its checkpoint must hold what those batches will be made with."""
        if self.mode == "drop":
            return []
        out, t = [], self._consumed + 1
        while (v := self.version_for(t)) <= upto:
            out.append((t, v))
            t += 1
        return out

    def wants(self, version: int) -> bool:
        """Should the learner publish its weights at ``version``? (Some batch will be generated with them.)"""
        if self.mode == "drop":
            return version % self.kw["sync_every"] == 0
        return any(v == version for _, v in self._asking(version)) and not self.mailbox.has(version)

    def needs_copy(self, version: int) -> bool:
        """Must the weights published at ``version`` be a copy (see the module docstring), or may they be live?"""
        if self.mode != "sync" or version != self._consumed * self.kw["updates_per_batch"]:
            return True  # async, or mid-step: more updates come before the batch is made
        return [t for t, v in self._asking(version) if v == version] != [self._consumed + 1]

    def publish(self, version: int, weights: dict) -> None:
        self.mailbox.publish(version, weights)

    def snapshot(self, version: int) -> dict:
        """The published weights of ``version`` (recompute's older policy); KeyError when not held."""
        return self.mailbox.get(version)

    def release(self, version: int, *, keep_window: bool) -> None:
        """Free snapshots that no batch will be made with any more. With ``keep_window`` (recompute) keep
        every version a batch within the staleness bound may have been made with."""
        nxt = self.version_for(self._next)  # past last_batch too: the run may be extended
        floor = max(self.mailbox.versions(), default=0) if nxt is None else nxt
        if keep_window:
            floor = min(floor, version - self.kw["max_staleness"])
        self.mailbox.release_below(floor)

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
                if self._stop.is_set() or self.mailbox.closed:
                    raise Interrupted
                self._cond.wait(0.1)
            version, weights = self.mailbox.newest(self.version_for(t))
        item = self.maker.make(t, version, weights)
        with self._cond:
            self._queue.append(item)
            self._next += 1
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self._done():
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
            raise RuntimeError("the rollout producer failed") from self._error
        if self.interrupt.is_set():
            raise Interrupted
        if self.threaded and (self._thread is None or not self._thread.is_alive()):
            raise RuntimeError("the rollout producer stopped before the run ended")

    def take(self) -> tuple[Any, float]:
        """The next batch (gathered over ranks), and the seconds the consumer waited for it."""
        t0 = time.perf_counter()
        if not self.threaded:
            if self.interrupt.is_set():
                raise Interrupted
            if not self._queue:
                v = self.version_for(self._next)
                if not self.mailbox.has(v):
                    raise RuntimeError(f"sync schedule: batch {self._next} needs version {v}, not published")
                self._produce_one()
            item = self._queue.popleft()
            self._consumed += 1
            return self.maker.gather(item), 0.0
        with self._cond:
            while not self._queue:
                self._check()
                self._cond.wait(0.1)
            item = self._queue.popleft()
            self._consumed += 1
            self._cond.notify_all()
        return self.maker.gather(item), time.perf_counter() - t0

    def try_take(self) -> Any | None:
        """A batch already made, without waiting (drop mode refills); None if there is none."""
        with self._cond:
            if not self._queue:
                return None
            item = self._queue.popleft()
            self._consumed += 1
            self._cond.notify_all()
        return self.maker.gather(item)

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
                raise RuntimeError("the rollout producer failed") from self._error

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
        ``snapshots=False``: the versions held, without their weights (under torchrun every rank holds the same
        full copies, so one rank's file carries them: :func:`bapo.checkpoint.save_run`)."""
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
    """The one backward edge: give the producer the learner's weights if a batch will be generated with them.

    ``learner.weights()`` / ``snapshot()`` may be collectives (FSDP); ``wants`` and ``needs_copy`` give the same
    answer on every rank, so all ranks call them together."""
    v = learner.version
    if producer.wants(v):
        producer.publish(v, learner.snapshot() if producer.needs_copy(v) else learner.weights())
