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

* ``sync`` (``train.async=false``): batch t is generated right before step t, with
  the newest synced weights: ``v_t = floor((t-1)U / s) * s``.
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
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

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


class WeightMailbox:
    """Weight snapshots by version, published by the learner and taken by the producer.

    A snapshot is either a copy (``clone=True``: the learner will go on updating) or
    the live ``state_dict`` (only safe when the learner does not update before the
    producer has loaded it: the sync schedule at a step boundary).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._snaps: dict[int, dict] = {}
        self._live: set[int] = set()
        self.closed = False

    def publish(self, version: int, weights: dict, *, clone: bool) -> None:
        snap = {k: v.detach().clone() for k, v in weights.items()} if clone else weights
        with self._cond:
            self._snaps[version] = snap
            if not clone:
                self._live.add(version)
            self._cond.notify_all()

    def wait(self, version: int | None, stop: threading.Event | None = None) -> tuple[int, dict]:
        """The snapshot of ``version`` (None: the newest), blocking until it is published."""
        with self._cond:
            while True:
                if self.closed or (stop is not None and stop.is_set()):
                    raise Interrupted
                if version is None and self._snaps:
                    v = max(self._snaps)
                    return v, self._snaps[v]
                if version is not None and version in self._snaps:
                    return version, self._snaps[version]
                self._cond.wait(0.1)

    def has(self, version: int) -> bool:
        with self._cond:
            return version in self._snaps

    def release_below(self, version: int) -> None:
        with self._cond:
            for v in [v for v in self._snaps if v < version]:
                del self._snaps[v]
                self._live.discard(v)

    def versions(self) -> list[int]:
        with self._cond:
            return sorted(self._snaps)

    def state_dict(self, live_ok: int | None = None) -> dict[int, dict]:
        """Copied snapshots for a checkpoint (a live one is the current model: restored from it)."""
        with self._cond:
            return {v: s for v, s in self._snaps.items() if v not in self._live or v != live_ok}

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Interrupted(Exception):
    """The producer was asked to stop while waiting."""


class Producer:
    """Generates rollout batches in order, inline (sync) or on a background thread (async).

    ``make_batch(t, version, weights)`` generates batch t with the given snapshot and
    returns anything (the loop's rollout batch). The producer only decides *when*
    batch t may be made and *which* snapshot it gets, from :func:`batch_version`.

    :meth:`pause` quiesces the thread between two batches (for checkpoints and for
    evaluation, which borrows the engine); while paused, the producer's state is just
    ``next_batch`` plus whatever ``make_batch`` keeps (the data cursor) and the batches
    in the queue.
    """

    def __init__(
        self,
        make_batch: Callable[[int, int, dict], Any],
        mailbox: WeightMailbox,
        *,
        mode: str,
        updates_per_batch: int,
        max_staleness: int,
        sync_every: int,
        ahead: int = 1,
        first_batch: int = 1,
        last_batch: int | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.make_batch = make_batch
        self.mailbox = mailbox
        self.mode = mode
        self.kw = dict(
            updates_per_batch=updates_per_batch, max_staleness=max_staleness, sync_every=sync_every, mode=mode
        )
        self.ahead = max(1, ahead)
        self.next_batch = first_batch
        self.last_batch = last_batch
        self.queue: deque = deque()
        self.consumed = first_batch - 1
        self.wait_s = 0.0  # producer time spent waiting (for weights or for room), since last taken
        self._cond = mailbox._cond  # one lock: a publish wakes a producer waiting for weights
        self._stop = threading.Event()
        self._pause = False
        self._busy = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ schedule

    def version_for(self, t: int) -> int | None:
        return batch_version(t, **self.kw)

    def needed_versions(self, upto: int) -> set[int]:
        """Versions <= ``upto`` that batches not yet consumed ask for (admission/sync).

        Counted from the consumer's side, not the producer's: the answer then depends on
        the learner's progress only, so every rank of a torchrun job agrees on it (and on
        the collective weight gather it triggers) however far its producer has got."""
        if self.mode == "drop":
            return set()
        out, t = set(), self.consumed + 1
        while (self.last_batch is None or t <= self.last_batch) and (v := self.version_for(t)) <= upto:
            out.add(v)
            t += 1
        return out

    def wants(self, version: int) -> bool:
        """Should the learner publish its weights at ``version``? (Some batch will be generated with them.)"""
        if self.mode == "drop":
            return version % self.kw["sync_every"] == 0
        return version in self.needed_versions(version)

    def release_floor(self, version: int, *, keep_window: bool) -> int:
        """Snapshots below this version are needed by no one: the producer's next batch asks for the floor
        or newer; with ``keep_window`` (recompute) the consumer may still ask for any version within k."""
        if self.last_batch is not None and self.next_batch > self.last_batch:
            floor = version
        else:
            nxt = self.version_for(self.next_batch)
            floor = max(self.mailbox.versions(), default=0) if nxt is None else nxt
        if keep_window:
            floor = min(floor, version - self.kw["max_staleness"])
        return floor

    # ------------------------------------------------------------------ running

    @property
    def threaded(self) -> bool:
        return self.mode != "sync"

    def start(self) -> None:
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="bapo-producer", daemon=True)
            self._thread.start()

    def _done(self) -> bool:
        return self.last_batch is not None and self.next_batch > self.last_batch

    def _ready(self) -> bool:
        """May the next batch be made now? (Called with the lock held.)"""
        if self._pause or len(self.queue) >= self.ahead_limit():
            return False
        v = self.version_for(self.next_batch)
        return bool(self.mailbox._snaps) if v is None else v in self.mailbox._snaps

    def _produce_one(self) -> None:
        t = self.next_batch
        version, weights = self.mailbox.wait(self.version_for(t), self._stop)
        item = self.make_batch(t, version, weights)
        with self._cond:
            self.queue.append(item)
            self.next_batch += 1
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self._done():
                with self._cond:
                    t0 = time.perf_counter()
                    while not self._stop.is_set() and not self.mailbox.closed and not self._ready():
                        self._cond.wait(0.1)
                    self.wait_s += time.perf_counter() - t0
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

    def take(self) -> tuple[Any, float]:
        """The next batch, and the seconds the consumer waited for it."""
        t0 = time.perf_counter()
        if not self.threaded:
            if not self.queue:
                v = self.version_for(self.next_batch)
                if not self.mailbox.has(v):
                    raise RuntimeError(f"sync schedule: batch {self.next_batch} needs version {v}, not published")
                self._produce_one()
            item = self.queue.popleft()
            self.consumed += 1
            return item, 0.0
        with self._cond:
            while not self.queue:
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("the rollout producer stopped before the run ended")
                self._cond.wait(0.1)
            item = self.queue.popleft()
            self.consumed += 1
            self._cond.notify_all()
        return item, time.perf_counter() - t0

    def try_take(self) -> Any | None:
        with self._cond:
            if not self.queue:
                return None
            self.consumed += 1
            self._cond.notify_all()
            return self.queue.popleft()

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
            w, self.wait_s = self.wait_s, 0.0
        return w

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
