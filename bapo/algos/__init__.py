"""The RL math of the project: pure tensor functions, no I/O, no process groups.

- ``advantages``: GRPO group-normalised advantages, group metrics, and
  ``compute_advantages`` (grpo | gae), the loop's one entry point.
- ``value``: the critic side of PPO: outcome token rewards, GAE, whitening, the
  clipped value loss, explained variance.
- ``surrogate``: the one clipped policy-gradient loss, its aggregation modes, the
  entropy / KL-to-reference regularisers, and the log-prob / entropy helpers.
- ``bounds``: the ratio bounds fed to that loss: BAPO's adaptive search or fixed
  bounds, behind ``make_bound_fn``.
- ``eps_feedback``: the eps-feedback heuristic (NOT the paper's method): its own loss and eps state.
- ``correction``: rollout corrections (TIS, MIS, geometric rejection) and decoupled PPO's
  behaviour->proximal weights, between the engine's and the learner's log-probs.
- ``objective``: what the learner runs: a parameter chooser plus a loss, with flags; the registry of
  objectives (``build_objective``, ``register_objective``), the one seam where a new loss plugs in.
- ``config``: the ``algo`` group's schema (typed, range-checked), read by the objectives' factories.
- ``stats``: how loss stats combine over micro-batches, ranks and updates.
"""

from bapo.algos import stats
from bapo.algos.advantages import ADVANTAGE_KINDS, compute_advantages, group_stats, grpo_advantages
from bapo.algos.bounds import (
    BOUND_KINDS,
    bapo_bounds,
    check_bapo_params,
    fixed_bounds,
    make_bound_fn,
    positive_contribution,
)
from bapo.algos.correction import correction_weights, loglinear_proximal
from bapo.algos.eps_feedback import EpsFeedbackState, eps_feedback_g, eps_feedback_loss, eps_feedback_sums
from bapo.algos.inputs import LossInputs, loss_of
from bapo.algos.objective import (
    OBJECTIVES,
    Objective,
    build_objective,
    eps_feedback_objective,
    register_objective,
    surrogate_objective,
)
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
    "LossInputs",
    "loss_of",
    "ADVANTAGE_KINDS",
    "AGG_MODES",
    "BOUND_KINDS",
    "KL_ESTIMATORS",
    "EpsFeedbackState",
    "OBJECTIVES",
    "Objective",
    "build_objective",
    "register_objective",
    "agg_normalisers",
    "aggregate",
    "bapo_bounds",
    "check_bapo_params",
    "eps_feedback_g",
    "eps_feedback_loss",
    "eps_feedback_objective",
    "eps_feedback_sums",
    "compute_advantages",
    "correction_weights",
    "loglinear_proximal",
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
    "stats",
    "surrogate_objective",
    "token_logp",
    "value_loss",
    "whiten",
]
