"""How one loss call's stats combine over micro-batches, data-parallel ranks and updates.

A loss call reports means over its *own* tokens (``clip_frac_high`` over its A > 0
tokens, ``ratio_mean`` over all its tokens, ``ratio_max`` its maximum). An update
runs many calls (micro-batches, ranks), so each mean is turned back into a sum by
its own denominator, the sums are added (and maxima maxed) across calls and ranks,
and divided once at the end. A fraction then means what its name says over the
whole update: ``clip_frac_high`` is clipped positive tokens over *positive* tokens,
not over all tokens, and ``ratio_max`` is the largest ratio, not a mean of maxima.

Pure functions of dicts of floats; the learner supplies the cross-rank sum and max.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# stat -> the count it is a mean over (stats not listed are means over "tokens")
DENOMINATOR = {
    "clip_frac_high": "pos_tokens",
    "clip_frac_low": "neg_tokens",
    "dual_clip_frac": "neg_tokens",
    "neg_clip_frac": "neg_tokens",
    "clip_frac_pos": "pos_tokens",
    "clip_frac_neg": "neg_tokens",
}
# The clip fractions by sign and behaviour-probability bucket (surrogate.BUCKETS), each over its own count.
BUCKET_COUNTS = tuple(f"{sign}_{b}_tokens" for sign in ("pos", "neg") for b in ("low", "mid", "high"))
DENOMINATOR |= {f"clip_frac_{c.removesuffix('_tokens')}": c for c in BUCKET_COUNTS}
# Counts every loss call reports so that the means above can be re-weighted.
COUNTS = ("tokens", "pos_tokens", "neg_tokens", *BUCKET_COUNTS)
# Summed as they are: a micro-batch's share of the update's loss (mini-batch normalisers), and the counts.
ADDITIVE = ("pg_loss", "loss", *COUNTS)
MAXIMA = ("ratio_max",)


def _weight(key: str) -> str | None:
    if key in ADDITIVE or key in MAXIMA:
        return None
    return DENOMINATOR.get(key, "tokens")


def to_sums(stats: dict[str, float]) -> dict[str, float]:
    """One call's stats as additive sums (means times their denominators); maxima pass through."""
    out = {}
    for k, v in stats.items():
        w = _weight(k)
        out[k] = float(v) * float(stats.get(w, 0.0)) if w is not None else float(v)
    return out


def add_sums(total: dict[str, float], sums: dict[str, float]) -> dict[str, float]:
    """``total`` plus one call's sums (maxima maxed); a new dict."""
    out = dict(total)
    for k, v in sums.items():
        if k in MAXIMA:
            out[k] = max(out.get(k, -float("inf")), v)
        else:
            out[k] = out.get(k, 0.0) + v
    return out


def reduce_sums(
    sums: dict[str, float],
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None,
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None,
) -> dict[str, float]:
    """Sums and maxima over data-parallel ranks (one collective each); identity without collectives.

    Every rank must hold the same keys (they run the same loss)."""
    keys = sorted(sums)
    add = [k for k in keys if k not in MAXIMA]
    mx = [k for k in keys if k in MAXIMA]
    out = dict(sums)
    if reduce_sum is not None and add:
        t = torch.tensor([sums[k] for k in add], dtype=torch.float64)
        r = reduce_sum(t)
        out.update(zip(add, (t if r is None else r).tolist(), strict=True))
    if reduce_max is not None and mx:
        t = torch.tensor([sums[k] for k in mx], dtype=torch.float64)
        r = reduce_max(t)
        out.update(zip(mx, (t if r is None else r).tolist(), strict=True))
    return out


def from_sums(sums: dict[str, float]) -> dict[str, float]:
    """Means again, each over its own denominator summed over every call (0 when it is 0)."""
    out = {}
    for k, v in sums.items():
        w = _weight(k)
        if w is None:
            out[k] = v
        else:
            den = sums.get(w, 0.0)
            out[k] = v / den if den > 0 else 0.0
    return out | derived(out)


def derived(means: dict[str, float]) -> dict[str, float]:
    """Ratios of merged means, computed once after merging (a ratio of means is not a mean):

    - pos_share = pos_contrib / (pos_contrib + neg_contrib): the positive share of the loss's
      actual contribution sum |w s_t| (BAPO's rho, measured on what the loss used; 1 when both are 0);
    - ess = ratio_mean^2 / ratio_sq_mean = (sum r)^2 / (N sum r^2): the effective sample size of the
      loss's importance ratios pi / pi_old over its N tokens, as a share of N (1 when every ratio is equal).
    """
    out = {}
    if "pos_contrib" in means and "neg_contrib" in means:
        tot = means["pos_contrib"] + means["neg_contrib"]
        out["pos_share"] = means["pos_contrib"] / tot if tot > 0 else 1.0
    if "ratio_mean" in means and "ratio_sq_mean" in means:
        sq = means["ratio_sq_mean"]
        out["ess"] = means["ratio_mean"] ** 2 / sq if sq > 0 else 1.0
    return out


def merge(stats: Iterable[dict[str, float]]) -> dict[str, float]:
    """The stats of several calls as if computed over all of their tokens at once (no collectives)."""
    total: dict[str, float] = {}
    for st in stats:
        total = add_sums(total, to_sums(st))
    return from_sums(total)
