"""The behaviour policy: whose log-probabilities a sample's ratio divides by (π_old), decided once from the config.

- ``learner.old_logp=rollout``: the log-probs the rollout engine recorded while it sampled. The learner re-scores
  ``learner.logp_check_share`` of each batch's rows at the generating weights, to log the engine's mismatch.
- ``learner.old_logp=recompute``: the learner's own forward at the weights that generated the sample (its numerics,
  not the engine's). The rollout source then keeps the weights of every version a batch within the staleness bound
  may have been made with.
- ``rollout.partial_budget``: responses are generated in segments, a step's weights each, so one response's tokens
  come from several versions: recompute scores each token under its own version's weights, from copies the source
  publishes (live weights would have moved on), and staleness is counted per token too.

:class:`BehaviourPolicy` holds the decision (``rc.behaviour``, made by ``bapo.config.build``); the loop, the
composition and the placement ask it, never the flags.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bapo.samples import RolloutBatch, TokenVersionWeights

Snapshot = Callable[[int], Mapping[str, Any]]  # version -> the weights published at it (the source's snapshot)


@dataclass(frozen=True)
class BehaviourPolicy:
    """π_old of a run: the engine's log-probs or the learner's recompute, per response or per token."""

    recompute: bool  # the learner's forward at the generating weights (else the engine's recorded log-probs)
    partial_budget: int | None  # tokens a response gets per step (None: whole responses, one version each)
    check_share: float  # engine log-probs: the share of each batch's rows re-scored to log their mismatch

    @classmethod
    def of(cls, learner: Any, rollout: Any) -> BehaviourPolicy:
        """From the typed ``learner`` and ``rollout`` groups (``learner.old_logp``, ``learner.logp_check_share``,
        ``rollout.partial_budget``)."""
        return cls(learner.old_logp == "recompute", rollout.partial_budget, learner.logp_check_share)

    @property
    def per_token(self) -> bool:
        """A response's tokens may come from several versions (partial rollouts)."""
        return self.partial_budget is not None

    @property
    def keeps_window(self) -> bool:
        """The source keeps the weights of every version a batch within the staleness bound may need (recompute)."""
        return self.recompute

    @property
    def needs_copies(self) -> bool:
        """The weights a response's later segments are scored under must be copies, not the learner's live ones."""
        return self.per_token and self.recompute

    @property
    def checks(self) -> bool:
        """The engine's log-probs stand, and a share of rows is re-scored to measure their mismatch."""
        return not self.recompute and self.check_share > 0

    def snapshot_dtype(self, engine_dtype: Any) -> Any:
        """The dtype weight snapshots are published in: the learner's own for recompute (its numerics), else the
        engine's."""
        return None if self.recompute else engine_dtype

    def weights(self, batch: RolloutBatch, version: int, snapshot: Snapshot) -> Mapping | TokenVersionWeights | None:
        """What recompute scores ``batch`` under, the learner being at ``version``: the generating version's
        snapshot (None: the learner's own weights, when it is still at it), or per token, each token's version's."""
        if not self.per_token:
            return None if batch.version == version else snapshot(batch.version)
        used = sorted({int(u) for x in batch.samples for u in x.token_versions().unique()})
        return TokenVersionWeights({u: None if u == version else snapshot(u) for u in used})
