"""The eps-feedback heuristic, for comparison only: it is NOT BAPO and NOT the paper's method.

It has its own loss shape (``max`` for non-positive tokens), so it does not go
through the clipped surrogate of ``surrogate.py``. Per response token t, with one
state epsilon ``eps`` (0.2 at the start) and r_t = exp(logp_t - old_logp_t):

    A_t > 0:   s_t = min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)         (the usual PPO term)
    A_t <= 0:  s_t = max(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)         (max, not min: the heuristic's rule)
    g = |sum of the A <= 0 terms| / (|sum of the A > 0 terms| + 1e-8)
    if g > g_high (1): the A <= 0 terms are recomputed with eps_neg = eps * (1 + widen * g), widen = 0.5
    loss = -aggregate(s_t) - entropy_coef * aggregate(entropy_t)           (token mean, entropy_coef 0.01)

and after each optimizer update, from that update's g:

    eps = min(grow * eps, eps_max)     if g > g_high      (1.1, 0.5, 1)
    eps = max(shrink * eps, eps_min)   if g < g_low       (0.9, 0.1, 0.5)

What the rule does: for A <= 0, max(r A, clip(r) A) = A * min(r, 1 + eps), so a
non-positive token keeps its gradient while r < 1 + eps and loses it above; the
lower bound 1 - eps plays no part anywhere. ``clip_frac_low`` is still reported
with the project's definition (A < 0 and r < 1 - eps) so that the metric reads the
same for every algorithm, but under the eps-feedback heuristic those tokens are *not* clipped; the
non-positive tokens that really lose their gradient are ``neg_clip_frac``.

Project choices: g is computed from detached terms, once per optimizer update over
all of its tokens (the learner passes it in as ``g``; without it, ``eps_feedback_loss``
computes g from its own tokens); the optional dual clip (off by default) applies
to the A < 0 terms, g included; the log-ratio is clamped to [-20, 20] as in the
surrogate; the entropy and KL terms are the project's shared regularisers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from bapo.algos.surrogate import LOG_RATIO_CLAMP, aggregate, regularised

G_EPS = 1e-8


@dataclass
class EpsFeedbackState:
    """The eps-feedback heuristic's one piece of state (eps) and the constants of its rule (module docstring).

    These fields are also the keys of the ``algo.eps_feedback`` group (``bapo.algos.config.EpsFeedbackConfig``
    extends this class), so they have no defaults here: the values above are conf/algo/eps_feedback.yaml's."""

    eps: float
    eps_min: float
    eps_max: float
    grow: float
    shrink: float
    g_high: float
    g_low: float
    widen: float

    def __post_init__(self) -> None:
        if not 0 < self.eps_min <= self.eps <= self.eps_max:
            raise ValueError(f"need 0 < eps_min <= eps <= eps_max, got {self.eps_min}, {self.eps}, {self.eps_max}")
        if not (self.grow >= 1 and 0 < self.shrink <= 1 and 0 <= self.g_low <= self.g_high and self.widen >= 0):
            raise ValueError("need grow >= 1, 0 < shrink <= 1, 0 <= g_low <= g_high, widen >= 0")

    def after_update(self, stats: dict[str, float]) -> dict[str, float]:
        """Apply the eps rule with the update's g (``eps_feedback/g``); returns {"eps_feedback/eps_next": eps}."""
        g = stats["eps_feedback/g"]
        if g > self.g_high:
            self.eps = min(self.grow * self.eps, self.eps_max)
        elif g < self.g_low:
            self.eps = max(self.shrink * self.eps, self.eps_min)
        return {"eps_feedback/eps_next": self.eps}

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        for k, v in state.items():
            setattr(self, k, float(v))


def _terms(ratio, adv, pos, eps_pos, eps_neg, dual_clip):
    """[B, T] eps-feedback terms: min(...) for A > 0 at eps_pos, max(...) for A <= 0 at eps_neg."""
    pos_terms = torch.minimum(ratio * adv, ratio.clamp(1 - eps_pos, 1 + eps_pos) * adv)
    neg_terms = torch.maximum(ratio * adv, ratio.clamp(max(1 - eps_neg, 0.0), 1 + eps_neg) * adv)
    if dual_clip is not None:
        neg_terms = torch.maximum(neg_terms, dual_clip * adv)  # only binds for A < 0
    return torch.where(pos, pos_terms, neg_terms)


def _ratio(logp, old_logp, m):
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(m, logp - old_logp, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    return log_ratio, torch.exp(log_ratio)


def eps_feedback_sums(
    ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *, eps: float, dual_clip: float | None = None
) -> torch.Tensor:
    """float64 [2]: (sum of the A > 0 terms, sum of the A <= 0 terms) at ``eps``, detached.

    Sums, so that micro-batches and data-parallel ranks can add them before ``eps_feedback_g``.
    """
    with torch.no_grad():
        m = mask.bool()
        r = torch.where(m, ratio.detach(), torch.ones_like(ratio)).double().clamp(max=math.exp(LOG_RATIO_CLAMP))
        a = torch.where(m, adv.detach(), torch.zeros_like(adv)).double()
        pos = (a > 0) & m
        s = torch.where(m, _terms(r, a, pos, eps, eps, dual_clip), torch.zeros_like(a))
        return torch.stack([torch.where(pos, s, 0.0).sum(), torch.where(pos, 0.0, s).sum()])


def eps_feedback_g(sums: torch.Tensor) -> float:
    """g = |negative-term sum| / (|positive-term sum| + 1e-8), from ``eps_feedback_sums``."""
    pos_sum, neg_sum = sums.double().tolist()
    return abs(neg_sum) / (abs(pos_sum) + G_EPS)


def eps_feedback_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float,
    g: float | None = None,
    g_high: float = 1.0,
    widen: float = 0.5,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.01,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The eps-feedback heuristic's loss over [B, T] tokens (module docstring). NOT the paper's method.

    ``g``: the update's g (from ``eps_feedback_sums`` over all of its tokens); None computes it
    from this call's tokens. Stats: pg_loss, g, eps, eps_neg, clip_frac_high (A > 0,
    r > 1 + eps), clip_frac_low (A < 0, r < 1 - eps; not clipped by this heuristic),
    neg_clip_frac (A < 0 tokens with r > 1 + eps_neg: they get no gradient),
    clip_frac, ratio_mean, ratio_max, approx_kl, pos_token_frac, tokens, entropy, kl_ref.
    """
    if not all(t.shape == logp.shape for t in (old_logp, adv, mask)):
        raise ValueError("logp, old_logp, adv and mask must share one shape")
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    m = mask.bool()  # [B, T]
    log_ratio, ratio = _ratio(logp, old_logp, m)  # [B, T], [B, T]
    adv = torch.where(m, adv, torch.zeros_like(adv)).to(ratio.dtype)  # [B, T]
    pos = (adv > 0) & m  # [B, T]
    if g is None:
        g = eps_feedback_g(eps_feedback_sums(ratio, adv, m, eps=eps, dual_clip=dual_clip))
    eps_neg = eps * (1 + widen * g) if g > g_high else eps
    terms = _terms(ratio, adv, pos, eps, eps_neg, dual_clip)  # [B, T]
    norms = {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len}
    pg_loss = -aggregate(terms, m, **norms)
    loss, reg = regularised(pg_loss, logp, m, norms, entropy, entropy_coef, ref_logp, kl_coef, kl_estimator)
    stats = _eps_feedback_stats(pg_loss, ratio, log_ratio, m, pos, adv, eps, eps_neg, dual_clip, entropy)
    return loss, stats | reg | {"g": float(g), "eps": float(eps), "eps_neg": float(eps_neg)}


@torch.no_grad()
def _eps_feedback_stats(pg_loss, ratio, log_ratio, m, pos, adv, eps, eps_neg, dual_clip, entropy):
    neg = (adv < 0) & m
    high = pos & (ratio > 1 + eps)  # positive tokens without gradient
    neg_clip = neg & (ratio > 1 + eps_neg)  # negative tokens without gradient
    dual = neg & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(m)
    n_tok, n_pos, n_neg = m.sum().double(), pos.sum().double(), neg.sum().double()
    masked_ratio = torch.where(m, ratio, torch.zeros_like(ratio)).double()  # [B, T]
    values = {
        "pg_loss": pg_loss.detach().double(),
        "clip_frac_high": high.sum() / n_pos.clamp(min=1),
        "clip_frac_low": (neg & (ratio < 1 - eps)).sum() / n_neg.clamp(min=1),
        "neg_clip_frac": neg_clip.sum() / n_neg.clamp(min=1),
        "dual_clip_frac": dual.sum() / n_neg.clamp(min=1),
        "clip_frac": (high | neg_clip | dual).sum() / n_tok.clamp(min=1),
        "ratio_mean": masked_ratio.sum() / n_tok.clamp(min=1),
        "ratio_max": masked_ratio.amax() if m.numel() else n_tok,
        "approx_kl": 0.5 * log_ratio.double().pow(2).sum() / n_tok.clamp(min=1),
        "pos_token_frac": n_pos / n_tok.clamp(min=1),
        "tokens": n_tok,
        "pos_tokens": n_pos,
        "neg_tokens": n_neg,
    }
    if entropy is not None:
        values["entropy"] = torch.where(m, entropy.detach(), torch.zeros_like(entropy)).double().sum() / n_tok.clamp(
            min=1
        )
    flat = torch.stack([v.to(device=ratio.device, dtype=torch.float64) for v in values.values()]).tolist()
    return dict(zip(values.keys(), flat, strict=True))
