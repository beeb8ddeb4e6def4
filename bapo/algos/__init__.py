"""The RL math of the project: pure tensor functions, no I/O, no process groups.

- ``advantages``: GRPO group-normalised advantages, group metrics, and
  ``compute_advantages`` (grpo | gae), the loop's one entry point.
- ``value``: the critic side of PPO: outcome token rewards, GAE, whitening, the
  clipped value loss, explained variance.
- ``surrogate``: the one clipped policy-gradient loss, its aggregation modes, the
  entropy / KL-to-reference regularisers, and the log-prob / entropy helpers.
- ``bounds``: the ratio bounds fed to that loss: BAPO's adaptive search or fixed
  bounds, behind ``make_bound_fn``.
- ``card``: the card heuristic (NOT the paper's method): its own loss and eps state.
- ``objective``: what the learner runs: a parameter chooser plus a loss (plus state).
"""

from bapo.algos.advantages import ADVANTAGE_KINDS, compute_advantages, group_stats, grpo_advantages
from bapo.algos.bounds import (
    BOUND_KINDS,
    bapo_bounds,
    fixed_bounds,
    make_bound_fn,
    positive_contribution,
)
from bapo.algos.card import CardState, card_g, card_loss, card_sums
from bapo.algos.objective import Objective, card_objective, surrogate_objective
from bapo.algos.surrogate import (
    AGG_MODES,
    KL_ESTIMATORS,
    agg_normalisers,
    aggregate,
    entropy_from_logits,
    importance_ratio,
    kl_estimate,
    policy_loss,
    token_logp,
)
from bapo.algos.value import (
    explained_variance,
    gae_advantages,
    outcome_token_rewards,
    response_mask,
    value_loss,
    whiten,
)

__all__ = [
    "ADVANTAGE_KINDS",
    "AGG_MODES",
    "BOUND_KINDS",
    "KL_ESTIMATORS",
    "CardState",
    "Objective",
    "agg_normalisers",
    "aggregate",
    "bapo_bounds",
    "card_g",
    "card_loss",
    "card_objective",
    "card_sums",
    "compute_advantages",
    "entropy_from_logits",
    "importance_ratio",
    "explained_variance",
    "fixed_bounds",
    "gae_advantages",
    "grpo_advantages",
    "group_stats",
    "kl_estimate",
    "make_bound_fn",
    "outcome_token_rewards",
    "policy_loss",
    "positive_contribution",
    "response_mask",
    "surrogate_objective",
    "token_logp",
    "value_loss",
    "whiten",
]
