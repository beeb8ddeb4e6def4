"""The ``algo`` group's schema: the objective's name, the advantages, the loss's options and its sub-groups.

Defaults live in ``conf/algo/`` (``base/common.yaml`` for every objective, ``base/surrogate.yaml`` for the
clipped surrogate's); these dataclasses hold types and range checks only. Each sub-group with variants
(``algo.bounds.kind``, ``algo.correction.kind``) has one schema per variant, holding only the keys it
reads. Ranges the math also checks (the bound search, the rollout corrections, the eps-feedback
heuristic) are checked once, by the math's own check, and reported under the config key.

Which sub-groups an objective needs is its factory's business (``bapo.algos.objective``): building the
objective is the last check of :func:`algo_config`, so a registered loss and one plugged in from an
import path are validated at startup like the built-in ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from bapo.algos.advantages import ADVANTAGE_KINDS
from bapo.algos.correction import PROXIMAL, check_correction
from bapo.algos.eps_feedback import EpsFeedbackState
from bapo.algos.surrogate import AGG_MODES, IS_WEIGHTS, KL_ESTIMATORS, POSITIVE_WEIGHTS, RATIO_LEVELS, TOKEN_MASKS
from bapo.infra.checks import ConfigError, choice, delegated, require, typed, variant

SCOPES = ("mini_batch", "micro_batch")


@dataclass
class BapoBoundsConfig:
    """``algo/bounds: bapo`` (and ``recipe``): BAPO's search (Algorithm 1) for the clip bounds of each update."""

    kind: str = MISSING
    rho0: float = MISSING
    low_range: list[float] = MISSING
    high_range: list[float] = MISSING
    low_step: float = MISSING
    high_step: float = MISSING
    contribution: str = MISSING  # loss_value (eq. 8) | gradient
    weight: str = MISSING  # behavior_prob (eq. 8) | none
    variant: str = MISSING  # paper | recipe (the authors' verl code)
    scope: str = MISSING  # mini_batch: one search per update | micro_batch

    def __post_init__(self) -> None:
        # The search's ranges are checked by the search's own check when the objective is built.
        choice(self.scope, "algo.bounds.scope", SCOPES)


@dataclass
class FixedBoundsConfig:
    """``algo/bounds: fixed``: the same clip window at every update (PPO-clip, GRPO, clip-higher).

    ``null`` is no bound on that side (CISPO, M2PO and DPPO clip no ratio from above or below)."""

    kind: str = MISSING
    ratio_low: float | None = MISSING
    ratio_high: float | None = MISSING

    def __post_init__(self) -> None:
        # ratio_high = 1 is TOPR's [0, 1] taper of negative sequences
        lo = 0.0 if self.ratio_low is None else self.ratio_low
        hi = float("inf") if self.ratio_high is None else self.ratio_high
        require(
            0 <= lo <= 1 <= hi and lo < hi,
            "algo.bounds",
            f"need 0 <= ratio_low <= 1 <= ratio_high, ratio_low < ratio_high, null for no bound "
            f"(got {self.ratio_low}, {self.ratio_high})",
        )


BOUNDS: dict[str, type] = {"bapo": BapoBoundsConfig, "fixed": FixedBoundsConfig}


@dataclass
class SurrogateConfig:
    """``algo.surrogate``: the clipped surrogate's options (bapo/algos/surrogate.py); PPO's clip by default.

    ``mask_threshold`` is the token mask's parameter (M2PO's tau, DPPO's delta): set exactly when
    ``token_mask`` is not ``none``."""

    ratio_level: str = MISSING  # token | sequence (TOPR) | sequence_mean (GSPO)
    is_weight: str = MISSING  # clip (PPO) | stop_grad (CISPO, TOPR)
    positive_weight: str = MISSING  # ratio | one (TOPR)
    token_mask: str = MISSING  # none | second_moment (M2PO) | divergence (DPPO binary-TV)
    mask_threshold: float | None = MISSING

    def __post_init__(self) -> None:
        choice(self.ratio_level, "algo.surrogate.ratio_level", RATIO_LEVELS)
        choice(self.is_weight, "algo.surrogate.is_weight", IS_WEIGHTS)
        choice(self.positive_weight, "algo.surrogate.positive_weight", POSITIVE_WEIGHTS)
        choice(self.token_mask, "algo.surrogate.token_mask", TOKEN_MASKS)
        require(
            (self.mask_threshold is None) == (self.token_mask == "none"),
            "algo.surrogate.mask_threshold",
            f"set exactly when token_mask is not none (token_mask={self.token_mask}, got {self.mask_threshold})",
        )
        require(
            self.mask_threshold is None or self.mask_threshold > 0,
            "algo.surrogate.mask_threshold",
            f"must be > 0, got {self.mask_threshold}",
        )
        require(
            self.positive_weight == "ratio" or self.is_weight == "stop_grad",
            "algo.surrogate.positive_weight",
            "one needs is_weight=stop_grad (a clipped ratio of 1 has no gradient)",
        )


@dataclass
class NoCorrectionConfig:
    """``algo/correction: none``."""

    kind: str = MISSING


@dataclass
class ISCorrectionConfig:
    """``algo/correction: tis | mis``: truncated or masked IS between the engine's and the learner's log-probs."""

    kind: str = MISSING
    level: str = MISSING  # token | sequence
    cap: float = MISSING

    def __post_init__(self) -> None:
        delegated("algo.correction", check_correction, self.kind, level=self.level, cap=self.cap)


@dataclass
class GeoRejectConfig:
    """``algo/correction: geo_reject``: sequences whose geometric-mean weight leaves [1/cap, cap] are dropped."""

    kind: str = MISSING
    cap: float = MISSING

    def __post_init__(self) -> None:
        delegated("algo.correction", check_correction, self.kind, cap=self.cap)


@dataclass
class DecoupledConfig:
    """``algo/correction: decoupled``: decoupled PPO (AReaL), its proximal policy exact or log-linear."""

    kind: str = MISSING
    proximal: str = MISSING  # exact | loglinear
    cap: float | None = MISSING

    def __post_init__(self) -> None:
        choice(self.proximal, "algo.correction.proximal", PROXIMAL)
        delegated("algo.correction", check_correction, self.kind, cap=self.cap)


CORRECTIONS: dict[str, type] = {
    "none": NoCorrectionConfig,
    "tis": ISCorrectionConfig,
    "mis": ISCorrectionConfig,
    "geo_reject": GeoRejectConfig,
    "decoupled": DecoupledConfig,
}


@dataclass
class CriticConfig:
    """The value model of ``advantage: gae`` (PPO): GAE and the clipped value loss."""

    lr: float = MISSING
    gamma: float = MISSING
    lam: float = MISSING
    vf_clip: float | None = MISSING

    def __post_init__(self) -> None:
        require(self.lr > 0, "algo.critic.lr", f"must be > 0, got {self.lr}")
        require(0 < self.gamma <= 1, "algo.critic.gamma", f"must be in (0, 1], got {self.gamma}")
        require(0 <= self.lam <= 1, "algo.critic.lam", f"must be in [0, 1], got {self.lam}")
        require(self.vf_clip is None or self.vf_clip > 0, "algo.critic.vf_clip", "must be null or > 0")


@dataclass
class EpsFeedbackConfig(EpsFeedbackState):
    """``algo=eps_feedback``: a feedback heuristic on one clip epsilon, kept for comparison (NOT the paper's).

    Its keys are the heuristic's state (the starting ``eps`` and the rule's constants, declared and range-checked
    once, by :class:`bapo.algos.eps_feedback.EpsFeedbackState`) and ``scope``, when the choice of g runs."""

    scope: str = MISSING

    def __post_init__(self) -> None:
        choice(self.scope, "algo.eps_feedback.scope", SCOPES)
        delegated("algo.eps_feedback", super().__post_init__)


@dataclass
class AlgoConfig:
    """The objective: its registered name (or an import path), the advantages, the loss's shared options and
    the sub-groups its factory reads. ``critic`` is set exactly when ``advantage`` is ``gae``."""

    objective: str = MISSING  # a name registered in bapo.algos.objective, or "package.module:factory"
    name: str = MISSING
    advantage: str = MISSING  # grpo | gae
    norm_std: bool = MISSING
    agg: str = MISSING
    dual_clip: float | None = MISSING
    entropy_coef: float = MISSING
    kl_coef: float = MISSING
    kl_estimator: str = MISSING
    filter_groups: bool = MISSING  # DAPO dynamic sampling (judged by correctness), refilled with fresh groups
    overlong_filter: bool = MISSING  # truncated responses carry no loss
    bounds: Any = None  # BapoBoundsConfig | FixedBoundsConfig | None
    correction: Any = None  # one of CORRECTIONS' schemas, or None (= none)
    surrogate: Any = None  # SurrogateConfig | None
    critic: Any = None  # CriticConfig | None
    eps_feedback: Any = None  # EpsFeedbackConfig | None
    # A plugged-in objective's own keys (``+algo.options.k=v`` or its YAML), validated by its factory;
    # the one schema default: the built-in objectives have none and refuse any.
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        choice(self.advantage, "algo.advantage", tuple(ADVANTAGE_KINDS))
        require(self.dual_clip is None or self.dual_clip > 1, "algo.dual_clip", "must be null or > 1")
        choice(self.agg, "algo.agg", AGG_MODES)
        require(self.entropy_coef >= 0, "algo.entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        require(self.kl_coef >= 0, "algo.kl_coef", f"must be >= 0 (0 = no reference model), got {self.kl_coef}")
        choice(self.kl_estimator, "algo.kl_estimator", KL_ESTIMATORS)

    @property
    def scope(self) -> str:
        """When an adaptive bound choice runs: once per update (mini_batch) or per micro-batch."""
        sub = self.bounds if self.bounds is not None else self.eps_feedback
        return getattr(sub, "scope", "mini_batch")


SUBGROUPS = {"surrogate": SurrogateConfig, "critic": CriticConfig, "eps_feedback": EpsFeedbackConfig}


def algo_config(node: Any) -> AlgoConfig:
    """The typed ``algo`` group; its objective is built once here, so the factory's checks run at startup."""
    from bapo.algos.objective import build_objective

    if not isinstance(node, dict):
        raise ConfigError(f"algo: expected a group of keys, got {node!r}")
    tree, node = node, dict(node)
    subs = {k: node.pop(k, None) for k in ("bounds", "correction", *SUBGROUPS)}
    algo = typed("algo", node, AlgoConfig, tree=tree)
    algo.bounds = None if subs["bounds"] is None else variant("algo.bounds", subs["bounds"], "kind", BOUNDS)
    c = subs["correction"]
    algo.correction = None if c is None else variant("algo.correction", c, "kind", CORRECTIONS)
    for key, schema in SUBGROUPS.items():
        setattr(algo, key, None if subs[key] is None else typed(f"algo.{key}", subs[key], schema))
    require(
        (algo.critic is not None) == (algo.advantage == "gae"),
        "algo.critic",
        f"needed exactly when algo.advantage=gae (got algo.advantage={algo.advantage})",
    )
    build_objective(algo)
    return algo
