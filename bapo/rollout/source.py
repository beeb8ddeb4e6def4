"""What the training loop needs from whoever makes its rollout batches: the :class:`RolloutSource` interface.

The loop (``bapo.loop.run``) drives a source with a few verbs: ``start`` it, ``take`` the next batch
(``try_take`` what is already made, in drop mode), ``offer_weights`` after every update (the one edge that
runs backwards), tell it ``before_updates`` (an engine on this device may free its memory), ``release``
weight snapshots no batch will use, ``borrow`` its engine for an evaluation, pause it for a checkpoint and
carry its state in one, ``stop`` it. It never sees where batches are made: inline, on a thread
(:class:`bapo.rollout.producer.Producer`), or in other processes. A new placement is a new class with these
methods, returned by its placement's ``source`` (``bapo.rollout.placement``); ``run`` does not change.

Which weights each batch is made with is the staleness schedule (:mod:`bapo.rollout.schedule`), which every
source follows, so that the bound ``buffer.max_staleness`` holds whatever the placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from bapo.infra.stop import Interrupted  # a blocking wait woken by a stop request (or by the source's stop)
from bapo.samples import RolloutBatch

__all__ = ["Interrupted", "RolloutSource"]


@runtime_checkable
class RolloutSource(Protocol):
    """A supplier of rollout batches, in order, each generated with the weights the schedule names.

    Every blocking call wakes on the run's stop request and raises :class:`Interrupted`; a failure where the
    batches are made is raised from ``take`` (a RuntimeError whose cause is the failure). Under torchrun every
    rank calls every method together (``take`` may gather the ranks' shares, ``offer_weights`` and ``borrow``
    may read streamed weights, whose reads are collectives).

    A new source subclasses it: the methods with a body here (``try_take``, ``before_updates``, ``release``,
    ``take_wait_s``, ``requeue``) are no-ops it may keep; the others it implements.
    """

    def start(self) -> None:
        """Begin making batches (after the first ``offer_weights`` and any ``load_state_dict``)."""
        ...

    def take(self) -> tuple[RolloutBatch, float]:
        """The next batch, whole on every rank, and the seconds the caller waited for it."""
        ...

    def try_take(self) -> RolloutBatch | None:
        """A batch already made, without waiting (drop mode refills the step); None when there is none."""
        return None

    def offer_weights(self, learner: Any) -> None:
        """The learner is at ``learner.version``: take its weights (``learner.weights()`` live, or
        ``learner.snapshot()`` a copy) if some batch will be made with them."""
        ...

    def before_updates(self) -> None:  # noqa: B027 - a no-op by default: most sources share no device
        """The learner is about to update: an engine that shares its device may free memory until its next use."""

    def release(self, version: int, *, keep_window: bool) -> None:
        """The learner is at ``version``: drop weight snapshots no batch will be made with. ``keep_window``
        (recompute): keep every version a batch within the staleness bound may have been made with."""

    def snapshot(self, version: int) -> Mapping[str, torch.Tensor]:
        """The weights published at ``version`` (recompute's behaviour policy); KeyError when not held."""
        ...

    def borrow(self, learner: Any) -> AbstractContextManager[Any]:
        """``with source.borrow(learner) as engine:`` a rollout engine holding the learner's current weights,
        for evaluation; no batch is made meanwhile."""
        ...

    def paused(self) -> AbstractContextManager[None]:
        """No batch is being made inside the block, so that ``state_dict`` is consistent (checkpoints)."""
        ...

    def take_wait_s(self) -> float:
        """Seconds the batch makers waited (for weights or for room) since the last call."""
        return 0.0

    def requeue(self) -> None:  # noqa: B027 - a no-op by default: a source that keeps no queue gives nothing back
        """A step stopped before its first update gives back the batches it took since the last ``release``: they
        are made again, or kept (the checkpoint holds them as made ahead)."""

    def state_dict(self, live: int | None = None, snapshots: bool = True) -> dict:
        """What a resume needs: batches made ahead, the data cursor, the snapshots still needed (without their
        weights when ``snapshots`` is False; ``live``: the version whose weights are the learner's own)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def stop(self) -> None:
        """Stop making batches and free what the source holds (called on every exit)."""
        ...
