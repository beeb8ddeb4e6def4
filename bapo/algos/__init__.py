"""The RL math of the project: pure tensor functions, no I/O, no process groups.

- ``advantages``: GRPO group-normalised advantages and group metrics.
- ``surrogate``: the one clipped policy-gradient loss, its aggregation modes, and
  the log-prob / entropy helpers the learner needs.
- ``bounds``: the ratio bounds fed to that loss: BAPO's adaptive search or fixed
  bounds, behind ``make_bound_fn``.
"""

from bapo.algos.advantages import group_stats, grpo_advantages
from bapo.algos.bounds import (
    BOUND_KINDS,
    bapo_bounds,
    fixed_bounds,
    make_bound_fn,
    positive_contribution,
)
from bapo.algos.surrogate import (
    AGG_MODES,
    agg_normalisers,
    aggregate,
    entropy_from_logits,
    policy_loss,
    token_logp,
)

__all__ = [
    "AGG_MODES",
    "BOUND_KINDS",
    "agg_normalisers",
    "aggregate",
    "bapo_bounds",
    "entropy_from_logits",
    "fixed_bounds",
    "grpo_advantages",
    "group_stats",
    "make_bound_fn",
    "policy_loss",
    "positive_contribution",
    "token_logp",
]
