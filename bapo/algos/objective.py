"""What the learner optimises, as configuration: a parameter chooser, a loss, and flags.

The learner holds no RL math; it runs one :class:`Objective` and only decides
*when* each part runs (see ``bapo/learner/learner.py``):

- ``choose(ratio, adv, mask, old_logp, *, reduce_sum=None) -> (params, stats)``
  picks the loss's per-update parameters from per-token scalars (detached): the
  update's (or micro-batch's) real tokens as 1-D tensors and ``mask`` a float tensor
  of ones over them; ``reduce_sum`` sums a float64 tensor over the data-parallel
  ranks (None on one rank). Its
  stats are already named for the logger: every algorithm reports its clip window
  as ``clip/low``, ``clip/high``, and the positive share of the loss at that window
  as ``clip/rho`` (BAPO.md eq. 8), so they can be compared; a chooser's own
  diagnostics go under its name (``bapo/rho_before``, ``bapo/search_steps``,
  ``eps_feedback/g``).
- ``loss(inputs, **params, **loss_kw) -> (loss, stats)``: ``inputs`` a :class:`bapo.algos.inputs.LossInputs` (the
  micro-batch's tensors and the mini-batch's normalisers), the hyper-parameters keyword-only; :func:`loss_of` makes
  one of a loss with the tensors positional (``policy_loss``).

Flags the learner reads (no hooks reach into it):

- ``adaptive``: ``choose`` reads the current ratios;
- ``scope``: ``mini_batch`` (one choice per update) or ``micro_batch``;
  ``prepass`` = adaptive and mini_batch scope: the learner needs the ratios of the
  whole update before its first backward (a no-grad pre-pass);
- ``stateful``: the objective keeps state across updates; the learner then calls
  ``after_update(stats)`` after each *applied* update with the choice over all of
  the update's tokens, and checkpoints ``state_dict()``.

Every algorithm of the project but one is :func:`surrogate_objective`: the one
clipped surrogate ``policy_loss`` with its bound choice (BAPO's search, its recipe
variant, or fixed bounds for GRPO / PPO / clip-higher) as the pluggable part. The
eps-feedback heuristic (NOT the paper's method; ``eps_feedback.py``) is
:func:`eps_feedback_objective`: its own loss and an eps state.

The seam: :func:`build_objective` turns the typed ``algo`` group into an Objective by the
factory that ``algo.objective`` names, a name registered with :func:`register_objective`
(``surrogate``, ``eps_feedback``) or an import path ``package.module:factory`` to a
function outside the repository. A factory takes the typed group (``bapo.algos.config.
AlgoConfig``, its own keys under ``algo.options``), checks what it reads (a ``ConfigError``
naming the key) and returns an :class:`Objective`; docs/extending.md has a worked example.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bapo.algos.bounds import ADAPTIVE, ReduceSum, _reduce, make_bound_fn, positive_contribution
from bapo.algos.correction import check_correction, correction_weights, loglinear_proximal
from bapo.algos.eps_feedback import EpsFeedbackState, eps_feedback_g, eps_feedback_loss, eps_feedback_sums
from bapo.algos.inputs import loss_of
from bapo.algos.surrogate import MAX_RATIO, check_surrogate_options, policy_loss, second_moment_cutoff
from bapo.infra.checks import ConfigError, delegated, lacks_factory, plugin, require

ChooseFn = Callable[..., tuple[dict[str, float], dict[str, float]]]
LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
SCOPES = ("mini_batch", "micro_batch")
# The loss keywords every objective takes (aggregation and regularisers), by their ``algo`` keys.
SHARED_LOSS_KEYS = ("dual_clip", "agg", "entropy_coef", "kl_coef", "kl_estimator")
# The chooser's stats of the bound search, by their logged names.
BAPO_NAMES = {
    "rho_after": "clip/rho",
    "P": "clip/P",
    "N": "clip/N",
    "rho_before": "bapo/rho_before",
    "steps": "bapo/search_steps",
    "target_met": "bapo/target_met",
    "active": "bapo/search_active",
    "signal": "bapo/signal",
    "target_reached": "bapo/target_reached",
    "rho_moved": "bapo/rho_moved",
    "beyond": "bapo/beyond_bounds",
    "reach": "bapo/reach",
    "pn_ratio_before": "bapo/pn_ratio_before",
    "pn_ratio_after": "bapo/pn_ratio_after",
}


@dataclass
class Objective:
    choose: ChooseFn
    loss: LossFn
    loss_kw: dict[str, Any]  # fixed keyword arguments of ``loss`` (agg, entropy_coef, dual_clip, kl_*)
    # ``loss`` is ``loss(inputs: LossInputs, **params, **loss_kw)`` (bapo.algos.inputs)
    adaptive: bool
    scope: str = "mini_batch"
    state: Any = None  # an object with after_update / state_dict / load_state_dict, or None
    # decoupled PPO's log-linear proximal policy (``proximal_fn``): (logp, behaviour_logp, mask, behaviour_version,
    # proximal_version, current_version) -> (proximal log-probs, token weights); None otherwise
    proximal: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")

    @property
    def prepass(self) -> bool:
        return self.adaptive and self.scope == "mini_batch"

    @property
    def stateful(self) -> bool:
        return self.state is not None

    def after_update(self, stats: dict[str, float]) -> dict[str, float]:
        """Step the state with an applied update's choice (over all of its tokens); returns stats to log."""
        return {} if self.state is None else self.state.after_update(stats)

    def state_dict(self) -> dict:
        return {} if self.state is None else self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.state is not None:
            self.state.load_state_dict(state)


def surrogate_objective(
    bounds: str,
    *,
    scope: str = "mini_batch",
    dual_clip: float | None = None,
    agg: str = "token-mean",
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    ratio_level: str = "token",
    is_weight: str = "clip",
    positive_weight: str = "ratio",
    token_mask: str = "none",
    mask_threshold: float | None = None,
    **bound_params: Any,
) -> Objective:
    """The one surrogate ``policy_loss`` with ``make_bound_fn(bounds, **bound_params)`` choosing its bounds.

    ``ratio_level``, ``is_weight``, ``positive_weight`` and ``token_mask`` are the loss's options
    (``surrogate.py``): BAPO's rivals are configurations of them, not subclasses. ``token_mask=
    second_moment`` (M2PO) makes the chooser adaptive: it also picks the squared log-ratio cutoff over
    the update's tokens, with ``mask_threshold`` as M2PO's tau; ``divergence`` (DPPO) passes
    ``mask_threshold`` (delta) to the loss.
    """
    bound_fn = make_bound_fn(bounds, **bound_params)
    m2 = token_mask == "second_moment"
    if m2 and not (mask_threshold is not None and mask_threshold >= 0):
        raise ValueError(f"token_mask='second_moment' needs mask_threshold (tau) >= 0, got {mask_threshold}")
    probe = torch.zeros(1, 1)  # the option checks need a tensor's dimension only
    delta = mask_threshold if token_mask == "divergence" else None
    check_surrogate_options(probe, ratio_level, is_weight, positive_weight, token_mask, delta, 0.0, dual_clip)

    def choose(ratio, adv, mask, old_logp, *, reduce_sum: ReduceSum | None = None):
        lo, hi, raw = bound_fn(ratio, adv, mask, old_logp, reduce_sum=reduce_sum)
        stats = {"clip/low": 0.0 if lo is None else lo, "clip/high": MAX_RATIO if hi is None else hi}
        stats |= {BAPO_NAMES[k]: v for k, v in raw.items() if bounds == "bapo" or BAPO_NAMES[k].startswith("clip/")}
        params = {"ratio_low": lo, "ratio_high": hi}
        if m2:
            log_ratio = torch.log(ratio.detach().double().clamp(min=1e-300))
            cutoff, m2_stats = second_moment_cutoff(log_ratio, mask, m2_threshold=mask_threshold, reduce_sum=reduce_sum)
            params["m2_cutoff"] = cutoff
            stats |= {f"m2po/{k}": v for k, v in m2_stats.items()} | {"m2po/cutoff": cutoff}
        return params, stats

    loss_kw = dict(dual_clip=dual_clip, agg=agg, entropy_coef=entropy_coef, kl_coef=kl_coef, kl_estimator=kl_estimator)
    loss_kw |= dict(ratio_level=ratio_level, is_weight=is_weight, positive_weight=positive_weight)
    loss_kw |= dict(token_mask=token_mask, mask_threshold=None if m2 else mask_threshold)
    return Objective(choose, loss_of(policy_loss), loss_kw, adaptive=ADAPTIVE[bounds] or m2, scope=scope)


def proximal_fn(cap: float | None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Decoupled PPO with ``proximal=loglinear`` (``correction.py``): the proximal log-probs interpolated by
    version, and the behaviour->proximal weights truncated at ``cap`` (None: untruncated)."""
    check_correction("decoupled", cap=cap)

    def proximal(logp, behaviour_logp, mask, behaviour_version, proximal_version, current_version):
        prox = loglinear_proximal(behaviour_logp, logp, behaviour_version, proximal_version, current_version)
        weight, _ = correction_weights(prox, behaviour_logp, mask, kind="decoupled", cap=cap)
        return prox, weight

    return proximal


def eps_feedback_objective(state: EpsFeedbackState, *, scope: str = "mini_batch", **loss_kw: Any) -> Objective:
    """The eps-feedback heuristic (NOT the paper's method): g chosen per update at the state's eps.

    ``loss_kw``: the keywords every objective's loss shares (:data:`SHARED_LOSS_KEYS`), each one not given at
    :func:`eps_feedback_loss`'s own default; the rule's ``g_high`` and ``widen`` are the state's.
    """
    unknown = sorted(set(loss_kw) - set(SHARED_LOSS_KEYS))
    if unknown:
        raise TypeError(f"eps_feedback_objective: unknown keyword(s) {unknown}; it takes {list(SHARED_LOSS_KEYS)}")
    defaults = {k: inspect.signature(eps_feedback_loss).parameters[k].default for k in SHARED_LOSS_KEYS}
    loss_kw = defaults | loss_kw | {"g_high": state.g_high, "widen": state.widen}
    dual_clip = loss_kw["dual_clip"]

    def choose(ratio, adv, mask, old_logp, *, reduce_sum: ReduceSum | None = None):
        eps = state.eps
        sums = eps_feedback_sums(ratio, adv, mask, eps=eps, dual_clip=dual_clip)
        # rho at the window [1 - eps, 1 + eps], as for every algorithm (eq. 8's measure); one collective for all
        p, n = positive_contribution(ratio, adv, mask, old_logp, ratio_low=1 - eps, ratio_high=1 + eps)
        reduced = _reduce(reduce_sum, torch.cat([sums.double(), torch.stack([p, n]).double().to(sums.device)]))
        g = eps_feedback_g(reduced[:2])
        p_val, n_val = reduced[2:].tolist()
        eps_neg = eps * (1 + state.widen * g) if g > state.g_high else eps
        stats = {
            "clip/low": 1 - eps,
            "clip/high": 1 + eps,
            "clip/rho": p_val / (p_val + n_val) if p_val + n_val > 0 else 1.0,
            "clip/P": p_val,
            "clip/N": n_val,
            "eps_feedback/eps": eps,
            "eps_feedback/eps_neg": eps_neg,
            "eps_feedback/g": g,
        }
        return {"eps": eps, "g": g}, stats

    return Objective(choose, loss_of(eps_feedback_loss), loss_kw, adaptive=True, scope=scope, state=state)


# ----------------------------------------------------------------------------- the registry

ObjectiveFactory = Callable[[Any], Objective]
OBJECTIVES: dict[str, ObjectiveFactory] = {}


def register_objective(name: str) -> Callable[[ObjectiveFactory], ObjectiveFactory]:
    """Register ``factory(algo_cfg) -> Objective`` under ``name``, the value of ``algo.objective`` that picks it."""

    def register(factory: ObjectiveFactory) -> ObjectiveFactory:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered ({OBJECTIVES[name].__qualname__})")
        OBJECTIVES[name] = factory
        return factory

    return register


def objective_factory(name: str) -> ObjectiveFactory:
    """The factory ``algo.objective`` names: a registered name, or ``package.module:function`` imported and checked to
    be a function of one argument (``bapo.infra.checks.plugin``: ``os:system`` is no loss)."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    require(
        ":" in name,
        "algo.objective",
        f"unknown objective {name!r}; choose from {sorted(OBJECTIVES)} or give an import path package.module:factory",
    )
    signature = "build(algo) -> Objective (docs/extending.md, a loss outside the repository)"
    return plugin(name, OBJECTIVES, "algo.objective", kind="a loss factory", lacks=lacks_factory(signature))


def build_objective(algo: Any) -> Objective:
    """The learner's :class:`Objective` from the typed ``algo`` group, by the factory ``algo.objective`` names."""
    obj = objective_factory(algo.objective)(algo)
    require(
        isinstance(obj, Objective),
        "algo.objective",
        f"{algo.objective!r} returned {type(obj).__name__}, not a bapo.algos.Objective",
    )
    return obj


def shared_loss_kw(algo: Any) -> dict[str, Any]:
    """The loss keywords every objective of the ``algo`` group shares (aggregation and regularisers); an
    Objective's ``loss_kw`` holds them, since the learner reads ``entropy_coef`` there too."""
    return {k: getattr(algo, k) for k in SHARED_LOSS_KEYS}


def _no_options(algo: Any) -> None:
    require(not algo.options, "algo.options", f"{algo.objective} reads no options, got {sorted(algo.options)}")


@register_objective("surrogate")
def build_surrogate(algo: Any) -> Objective:
    """The clipped surrogate with the bound choice of ``algo.bounds`` and the options of ``algo.surrogate``;
    decoupled PPO's log-linear proximal policy when ``algo.correction`` asks for it."""
    b, s, c = algo.bounds, algo.surrogate, algo.correction
    require(b is not None, "algo.bounds", "the clipped surrogate needs its bound choice (algo/bounds=bapo|fixed)")
    require(s is not None, "algo.surrogate", "the clipped surrogate needs its options (conf/algo/base/surrogate.yaml)")
    require(
        algo.eps_feedback is None,
        "algo.eps_feedback",
        "is the eps-feedback heuristic's state: set algo.objective=eps_feedback (algo=eps_feedback)",
    )
    _no_options(algo)
    require(
        algo.dual_clip is None or s.is_weight == "clip",
        "algo.dual_clip",
        "applies to algo.surrogate.is_weight=clip only",
    )
    if b.kind == "fixed":
        bound_kw = dict(ratio_low=b.ratio_low, ratio_high=b.ratio_high)
    else:
        bound_kw = dict(low_range=tuple(b.low_range), high_range=tuple(b.high_range), low_step=b.low_step)
        bound_kw |= dict(high_step=b.high_step, rho0=b.rho0, contribution=b.contribution, weight=b.weight)
        bound_kw |= dict(scope=b.scope, variant=b.variant)
    search_kw = {k: v for k, v in bound_kw.items() if k != "scope"}
    delegated("algo.bounds", make_bound_fn, b.kind, **search_kw)  # the search's ranges, under the group's key
    try:
        obj = surrogate_objective(b.kind, **bound_kw, **shared_loss_kw(algo), **vars(s))
    except ValueError as e:
        raise ConfigError(f"algo.surrogate: {e}") from None
    if c is not None and c.kind == "decoupled" and c.proximal == "loglinear":
        obj.proximal = proximal_fn(c.cap)  # decoupled PPO: the proximal policy interpolated at each update
    return obj


@register_objective("eps_feedback")
def build_eps_feedback(algo: Any) -> Objective:
    """The eps-feedback heuristic (NOT the paper's method): its own loss and the eps state of ``algo.eps_feedback``."""
    e = algo.eps_feedback
    require(e is not None, "algo.eps_feedback", "algo.objective=eps_feedback needs its eps state (algo=eps_feedback)")
    require(
        algo.bounds is None and algo.surrogate is None,
        "algo.bounds" if algo.bounds is not None else "algo.surrogate",
        "belongs to the clipped surrogate (algo.objective=surrogate); the eps-feedback heuristic has its own loss",
    )
    require(
        algo.correction is None or algo.correction.kind == "none",
        "algo.correction",
        "the eps-feedback heuristic's loss takes no token weights: use algo/correction=none",
    )
    _no_options(algo)
    state = EpsFeedbackState(**{k: v for k, v in vars(e).items() if k != "scope"})
    return eps_feedback_objective(state, scope=e.scope, **shared_loss_kw(algo))
