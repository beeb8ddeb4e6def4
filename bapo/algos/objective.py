"""What the learner optimises, as configuration: a parameter chooser, a loss, an optional state.

The learner holds no RL math; it runs one :class:`Objective` and only decides
*when* each part runs (see ``bapo/learner/learner.py``):

- ``choose(ratio, adv, mask, old_logp, *, reduce_sum=None) -> (params, stats)``
  picks the loss's per-update parameters from per-token scalars (detached);
- ``loss(logp, old_logp, adv, mask, **params, **loss_kw, <entropy, ref_logp,
  normalisers>) -> (loss, stats)``;
- ``adaptive``: ``choose`` reads the current ratios, so with ``scope=mini_batch``
  the learner needs the ratios of the whole update before its first backward
  (a no-grad pre-pass);
- ``state`` (optional): ``after_update(stats) -> stats`` after each applied
  optimizer update, plus ``state_dict`` / ``load_state_dict``.

Every algorithm of the project but one is ``surrogate_objective``: the one clipped
surrogate ``policy_loss``, with the bound choice (BAPO's search, its recipe
variant, or fixed bounds for GRPO / PPO / clip-higher) as the pluggable part.
The card (NOT the paper's method) is ``card_objective``: its own loss
(``card_loss``) and an eps state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bapo.algos.bounds import ADAPTIVE, ReduceSum, _reduce, make_bound_fn
from bapo.algos.card import CardState, card_g, card_loss, card_sums
from bapo.algos.surrogate import policy_loss

ChooseFn = Callable[..., tuple[dict[str, float], dict[str, float]]]
LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass
class Objective:
    choose: ChooseFn
    loss: LossFn
    loss_kw: dict[str, Any]  # fixed keyword arguments of ``loss`` (agg, entropy_coef, dual_clip, kl_*)
    adaptive: bool
    prefix: str = "bapo"  # metric prefix of the chooser's stats
    state: Any = field(default=None)  # CardState or None

    def after_update(self, stats: dict[str, float]) -> dict[str, float]:
        return {} if self.state is None else self.state.after_update(stats)


def surrogate_objective(
    bounds: str,
    *,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    **bound_params: Any,
) -> Objective:
    """The clipped surrogate with ``make_bound_fn(bounds, **bound_params)`` choosing its bounds."""
    bound_fn = make_bound_fn(bounds, **bound_params)

    def choose(ratio, adv, mask, old_logp, *, reduce_sum: ReduceSum | None = None):
        lo, hi, stats = bound_fn(ratio, adv, mask, old_logp, reduce_sum=reduce_sum)
        return {"ratio_low": lo, "ratio_high": hi}, {"ratio_low": lo, "ratio_high": hi, **stats}

    loss_kw = dict(dual_clip=dual_clip, agg=agg, entropy_coef=entropy_coef, kl_coef=kl_coef, kl_estimator=kl_estimator)
    return Objective(choose, policy_loss, loss_kw, adaptive=ADAPTIVE[bounds])


def card_objective(
    state: CardState,
    *,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    entropy_coef: float = 0.01,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> Objective:
    """The card heuristic (NOT the paper's method): g chosen per update at the state's eps."""

    def choose(ratio, adv, mask, old_logp, *, reduce_sum: ReduceSum | None = None):
        eps = state.eps
        g = card_g(_reduce(reduce_sum, card_sums(ratio, adv, mask, eps=eps, dual_clip=dual_clip)))
        eps_neg = eps * (1 + state.widen * g) if g > state.g_high else eps
        stats = {"ratio_low": 1 - eps, "ratio_high": 1 + eps, "eps": eps, "eps_neg": eps_neg, "g": g}
        return {"eps": eps, "g": g}, stats

    loss_kw = dict(
        g_high=state.g_high,
        widen=state.widen,
        dual_clip=dual_clip,
        agg=agg,
        entropy_coef=entropy_coef,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
    )
    return Objective(choose, card_loss, loss_kw, adaptive=True, prefix="card", state=state)
