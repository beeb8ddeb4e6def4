"""The staleness schedule: which weights each rollout batch is generated with, as pure functions.

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
  never waits for the learner (only for room); the buffer drops, and counts, samples
  that would exceed k. Timing decides what is dropped, so drop-mode runs are not
  bit-reproducible.

Snapshots
---------
The learner publishes its weights at the versions some batch will be generated with
(:meth:`Schedule.wants`). A published snapshot must hold *that* version's weights for as
long as a batch may load it, so it is a copy, except in one case (:meth:`Schedule.needs_copy`):
in sync mode at a step boundary, when the only batch that asks for this version is the very
next one, made before any further update. With ``sync_every`` larger than the updates per
step, two batches share a version, and the second is made after more updates: it gets a copy.

Partial rollouts
----------------
With ``rollout.partial_budget`` a response is generated over up to ``lag + 1`` consecutive batches
(``bapo.rollout.maker``): a token generated for batch t may first be trained on with batch t + lag.
:class:`Schedule` with ``lag`` keeps the bound for every token: admission uses
``k - lag * U`` in place of k (a token is then at most k stale at its last use), and the startup check
becomes ``k >= U + s - 2 + lag * U``. ``copies`` publishes every version as a copy, because recompute
re-scores a token with its own version's weights steps after that version served a batch.

Everything here is counted from the consumer's side (``consumed``: batches the learner has
taken), never the producer's: the answers then depend on the learner's progress only, so every
rank of a torchrun job agrees on them (and on the collective weight gather they trigger),
however far its producer has got.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("sync", "admission", "drop")


def min_staleness(updates_per_batch: int, sync_every: int) -> int:
    """The smallest ``buffer.max_staleness`` any schedule can keep: reuse plus sync lag."""
    return updates_per_batch - 1 + sync_every - 1


def check_schedule(mode: str, updates_per_batch: int, max_staleness: int, sync_every: int, lag: int = 0) -> None:
    """A ValueError unless ``mode`` is one of :data:`MODES` and k = ``max_staleness`` >= :func:`min_staleness`
    (``lag``: the partial-rollout lag already taken out of k, named in the message)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    u, k, s = updates_per_batch, max_staleness, sync_every
    if k < min_staleness(u, s):
        why = f", partial-rollout lag={lag} batches" if lag else ""
        raise ValueError(f"max_staleness={k} < {min_staleness(u, s)} (updates_per_batch={u}, sync_every={s}{why})")


def partial_lag(max_new_tokens: int, partial_budget: int | None) -> int:
    """Batches a token may wait for its response's last segment: S - 1 with S = ceil(max_new_tokens / budget)
    segments at most per response (0 without partial rollouts; ``bapo.rollout.maker`` proves the bound)."""
    return 0 if partial_budget is None else -(-max_new_tokens // partial_budget) - 1


def batch_version(t: int, *, updates_per_batch: int, max_staleness: int, sync_every: int, mode: str) -> int | None:
    """The version that rollout batch ``t`` (1-based) is generated with; None in drop mode (newest)."""
    if t < 1:
        raise ValueError(f"rollout batches are numbered from 1, got {t}")
    check_schedule(mode, updates_per_batch, max_staleness, sync_every)
    u, k, s = updates_per_batch, max_staleness, sync_every
    if mode == "sync":
        return ((t - 1) * u // s) * s
    if mode == "admission":
        return math.ceil(max(0, t * u - 1 - k) / s) * s
    return None  # drop


@dataclass(frozen=True)
class Schedule:
    """One run's schedule: ``mode`` and U (updates per batch), k (max staleness), s (sync every)."""

    mode: str
    updates_per_batch: int
    max_staleness: int
    sync_every: int
    lag: int = 0  # batches a token may wait for its response's last segment (partial rollouts)
    copies: bool = False  # publish every version as a copy (partial rollouts with recompute)

    def __post_init__(self) -> None:
        check_schedule(self.mode, self.updates_per_batch, self.batch_staleness, self.sync_every, self.lag)

    @property
    def batch_staleness(self) -> int:
        """The staleness a batch may reach at its own step: k, less what partial rollouts' lag adds later."""
        return self.max_staleness - self.lag * self.updates_per_batch

    def version_for(self, t: int) -> int | None:
        """The version batch ``t`` is made with (:func:`batch_version`)."""
        return batch_version(
            t,
            updates_per_batch=self.updates_per_batch,
            max_staleness=self.batch_staleness,
            sync_every=self.sync_every,
            mode=self.mode,
        )

    def asking(self, consumed: int, upto: int) -> list[tuple[int, int]]:
        """(batch, version) of the batches after the first ``consumed`` whose version is <= ``upto`` (none in
        drop mode). Batches past the run's last count too: a finished run may be extended (``resume=auto``
        with more steps), and its checkpoint must hold what those batches will be made with."""
        if self.mode == "drop":
            return []
        out, t = [], consumed + 1
        while (v := self.version_for(t)) <= upto:
            out.append((t, v))
            t += 1
        return out

    def wants(self, version: int, consumed: int) -> bool:
        """Will some batch not yet consumed be made with ``version``'s weights? (Drop: every synced version.)"""
        if self.mode == "drop":
            return version % self.sync_every == 0
        return any(v == version for _, v in self.asking(consumed, version))

    def needs_copy(self, version: int, consumed: int) -> bool:
        """Must the weights published at ``version`` be a copy, or may they be the learner's live ones?"""
        if self.copies or self.mode != "sync" or version != consumed * self.updates_per_batch:
            return True  # async, or mid-step: more updates come before the batch is made
        return [t for t, v in self.asking(consumed, version) if v == version] != [consumed + 1]

    def release_floor(self, next_batch: int, version: int, *, newest_held: int, keep_window: bool) -> int:
        """The oldest snapshot version still needed once the learner is at ``version`` and ``next_batch`` is the
        next batch to make: that batch's (drop mode: the newest held). With ``keep_window`` (recompute) also
        every version a batch within the staleness bound may have been made with."""
        nxt = self.version_for(next_batch)
        floor = newest_held if nxt is None else nxt
        return min(floor, version - self.max_staleness) if keep_window else floor
