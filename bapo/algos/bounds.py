"""Ratio bounds for the clipped surrogate: BAPO's adaptive search, or fixed bounds.

The bound choice is the one pluggable part of the loss. PPO-clip / GRPO
(0.8, 1.2) and clip-higher (0.8, 1.28) are ``make_bound_fn("fixed", ...)``; BAPO
is ``make_bound_fn("bapo", ...)``. Both return ``(c_low, c_high, stats)`` and log
the positive contribution rho, so every algorithm can be compared on it.

Positive contribution (BAPO.md, eq. 8), with w_t = exp(old_logp_t) or 1:

    loss_value:  P = sum_{A>0} w |A| min(r, c_high)        N = sum_{A<0} w |A| max(r, c_low)
    gradient:    P = sum_{A>0, r<=c_high} w r |A|          N = sum_{A<0, r>=c_low} w r |A|
    rho = P / (P + N)     (rho = 1 when P + N = 0)

How the search is evaluated: P depends only on c_high and N only on c_low, so P is
computed for every c_high candidate and N for every c_low candidate in one pass
(one sort of the ratios, prefix and suffix sums, and a ``searchsorted`` of the
candidates), then gathered along the search path; the first candidate that meets
the target wins. Sums are taken in float64; ``reduce_sum`` is called once, on the
stacked candidate sums, so every data-parallel rank picks the same bounds.

Paper variant (Algorithm 1), exactly as written: bounds reset to (a_minus, a_plus)
at every call; while rho < rho0 and c_low + delta_low <= b_minus: raise c_high by
delta_high if that stays <= b_plus, else raise c_low by delta_low. Bounds are
integer step counts, c = a + k * delta, with a 1e-9 tolerance on both the range
check and the rho comparison. A consequence of the loop guard: if ``low_range``
holds no whole ``low_step``, the loop never runs, so c_high is not raised either.

Recipe variant (the authors' verl code), as we read it: the target is the ratio
P / N >= rho0 (P / N is +inf when N = 0, so the target counts as met, even with
P = 0), w_t = 1 whatever ``weight`` says, ``low_range``/``high_range`` are
(start, max). Starting at (start_low, start_high), it raises c_low one step at a
time, clamping the last step to the max (c = min(start + k * step, max)), and
stops as soon as the target is met; if c_low reaches its max unmet, it raises
c_high the same way. It stops at the first met candidate or with both at their
max. Departures from the authors' code: we count integer steps (their float loop
can add a near-zero extra step when drift leaves c a hair below the max), we
compare with the 1e-9 tolerance, and we omit their eps = 1e-8 in P / (N + eps).
``contribution`` applies to the recipe too (its code is ``loss_value``).

Stats (python floats): rho_before (at the starting bounds), rho_after (at the
chosen bounds), steps, target_met, P and N at the chosen bounds; the recipe adds
pn_ratio_before / pn_ratio_after (P / N, may be inf). rho is always the share
P / (P + N), also for the recipe, so it means the same thing for every algorithm.

What the search could do and did, as token counts over the advantage-carrying tokens (A != 0):
``beyond`` is the share outside the chosen bounds (A > 0 with r > c_high, A < 0 with r < c_low),
``reach`` the share that any pair of bounds in the search's ranges treats differently (A > 0 with
r > the lowest c_high, A < 0 with r < the highest c_low): the tokens whose terms the search can
move at all, so it bounds how far rho can move. Only where the search engaged (``active``), the
stats also hold ``target_reached`` (= target_met) and ``rho_moved`` (rho_after - rho_before): an
update that needed no search has neither, so a mean over updates is a mean over engaged ones.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from bapo.algos.surrogate import open_bounds

ReduceSum = Callable[[torch.Tensor], torch.Tensor | None]
BoundFn = Callable[..., tuple[float, float, dict[str, float]]]

CONTRIBUTIONS = ("loss_value", "gradient")
WEIGHTS = ("behavior_prob", "none")
VARIANTS = ("paper", "recipe")
BOUND_KINDS = ("bapo", "fixed")
TOL = 1e-9


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _token_scalars(ratio, adv, mask, old_logp, weight: str, *, sides: bool = False):
    """Flatten to float64 [n] and split into (r, v = w * |A|) of positive / negative tokens
    (``sides``: then also the boolean [n] masks of the positive and the negative tokens).

    Tokens that do not belong to a side get r = 0 and v = 0, so they add nothing;
    ``torch.where`` keeps NaN/inf at masked positions out of every sum.
    """
    shape = ratio.shape
    for name, t in (("adv", adv), ("mask", mask), ("old_logp", old_logp)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, ratio has {tuple(shape)}")
    m = mask.detach().reshape(-1).bool()  # [n]
    zero = torch.zeros(m.shape, dtype=torch.float64, device=m.device)  # [n]
    r = torch.where(m, ratio.detach().reshape(-1).double(), zero)  # [n]
    a = torch.where(m, adv.detach().reshape(-1).double(), zero)  # [n]
    if weight == "behavior_prob":
        w = torch.where(m, old_logp.detach().reshape(-1).double(), zero).exp()  # [n]
    else:
        w = torch.ones_like(r)
    v = w * a.abs()  # [n]
    pos, neg = a > 0, a < 0  # [n]
    r_pos, v_pos = torch.where(pos, r, zero), torch.where(pos, v, zero)  # [n], [n]
    r_neg, v_neg = torch.where(neg, r, zero), torch.where(neg, v, zero)  # [n], [n]
    if sides:
        return (r_pos, v_pos), (r_neg, v_neg), (pos, neg)
    return (r_pos, v_pos), (r_neg, v_neg)


def positive_contribution(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    *,
    ratio_low: float | None,
    ratio_high: float | None,
    contribution: str = "loss_value",
    weight: str = "behavior_prob",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, N) of eq. 8 at one pair of bounds (``None``: no bound), as float64 0-dim tensors (local, no reduce)."""
    ratio_low, ratio_high = open_bounds(ratio_low, ratio_high)
    _check_choice("contribution", contribution, CONTRIBUTIONS)
    _check_choice("weight", weight, WEIGHTS)
    (r_pos, v_pos), (r_neg, v_neg) = _token_scalars(ratio, adv, mask, old_logp, weight)
    if contribution == "loss_value":
        return (v_pos * r_pos.clamp(max=ratio_high)).sum(), (v_neg * r_neg.clamp(min=ratio_low)).sum()
    p = torch.where(r_pos <= ratio_high, v_pos * r_pos, torch.zeros_like(r_pos)).sum()
    n = torch.where(r_neg >= ratio_low, v_neg * r_neg, torch.zeros_like(r_neg)).sum()
    return p, n


def _sums_at(r: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, side: str, contribution: str):
    """P (side="pos", bounds = c_high candidates) or N (side="neg", c_low) for each bound [K].

    One sort plus prefix/suffix sums (no subtraction, so no cancellation):
    ``below`` = number of tokens with r < c; a token with r == c gives the same
    value on either side of the split (min(r, c) = max(r, c) = r).
    """
    r, order = torch.sort(r)  # [n]
    v = v[order]  # [n]
    vr = v * r  # [n]
    zero = r.new_zeros(1)
    prefix_v, prefix_vr = torch.cat([zero, v.cumsum(0)]), torch.cat([zero, vr.cumsum(0)])  # [n + 1]
    suffix_v = torch.cat([v.flip(0).cumsum(0).flip(0), zero])  # [n + 1]
    suffix_vr = torch.cat([vr.flip(0).cumsum(0).flip(0), zero])  # [n + 1]
    below = torch.searchsorted(r, bounds, right=False)  # [K] tokens with r < c
    if side == "pos" and contribution == "loss_value":
        return prefix_vr[below] + bounds * suffix_v[below]  # r below c count r, the rest count c
    if side == "pos":
        return prefix_vr[torch.searchsorted(r, bounds, right=True)]  # tokens with r <= c_high
    if contribution == "loss_value":
        return bounds * prefix_v[below] + suffix_vr[below]  # r below c count c, the rest count r
    return suffix_vr[below]  # tokens with r >= c_low


def _counts_beyond(r_pos, r_neg, pos, neg, highs: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    """Token counts [Kh + Kl + 1] (float64): A > 0 tokens with r > each c_high, A < 0 tokens with r < each
    c_low, and the advantage-carrying tokens in all."""
    r_pos, r_neg = torch.sort(r_pos[pos])[0], torch.sort(r_neg[neg])[0]  # [n_pos], [n_neg]
    above = r_pos.numel() - torch.searchsorted(r_pos, highs, right=True)  # [Kh] r > c_high
    below = torch.searchsorted(r_neg, lows, right=False)  # [Kl] r < c_low
    total = torch.tensor([r_pos.numel() + r_neg.numel()], device=highs.device)
    return torch.cat([above, below, total]).to(torch.float64)


def _reduce(reduce_sum: ReduceSum | None, sums: torch.Tensor) -> torch.Tensor:
    """Apply the caller's cross-rank sum; an in-place collective may return None."""
    if reduce_sum is None:
        return sums
    out = reduce_sum(sums)
    return sums if out is None else out


def _rho(p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    total = p + n
    return torch.where(total > 0, p / torch.where(total > 0, total, torch.ones_like(total)), torch.ones_like(total))


def _pn_ratio(p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.where(n > 0, p / torch.where(n > 0, n, torch.ones_like(n)), torch.full_like(n, math.inf))


def _check_search_args(rho0, low_range, high_range, low_step, high_step, contribution, weight, variant) -> None:
    _check_choice("variant", variant, VARIANTS)
    _check_choice("contribution", contribution, CONTRIBUTIONS)
    _check_choice("weight", weight, WEIGHTS)
    for name, step in (("low_step", low_step), ("high_step", high_step)):
        if not (math.isfinite(step) and step > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {step}")
    for name, rng in (("low_range", low_range), ("high_range", high_range)):
        if len(rng) != 2 or not all(math.isfinite(x) for x in rng) or rng[0] > rng[1]:
            raise ValueError(f"{name} must be an ordered pair (lo, hi) with lo <= hi, got {rng}")
    if not 0 < low_range[0] or not low_range[1] <= 1.0 <= high_range[0]:
        raise ValueError(f"need 0 < low_range <= 1 <= high_range, got low_range={low_range}, high_range={high_range}")
    if not (math.isfinite(rho0) and rho0 >= 0) or (variant == "paper" and rho0 > 1):
        raise ValueError(f"rho0 must be in [0, 1] (paper) or >= 0 (recipe P/N target), got {rho0}")


def _candidates(lo: float, hi: float, step: float, variant: str) -> list[float]:
    """Candidate bounds c_k = lo + k * step for k = 0..K (the recipe clamps the last to hi)."""
    if variant == "paper":  # the largest k with lo + k * step <= hi (+ tol)
        k_max = math.floor((hi - lo + TOL) / step)
    else:  # steps of min(c + step, hi) until c reaches hi
        k_max = math.ceil((hi - lo - TOL) / step) if hi - lo > TOL else 0
    return [min(round(lo + k * step, 12), hi) for k in range(k_max + 1)]


def _search_path(n_high: int, n_low: int, variant: str) -> tuple[list[int], list[int]]:
    """(k_high, k_low) along the search, in order; n_* = number of candidates of each bound."""
    kh_max, kl_max = n_high - 1, n_low - 1
    if variant == "paper":
        if kl_max == 0:  # Algorithm 1's guard (c_low + delta_low <= b_minus) fails at once
            return [0], [0]
        return list(range(kh_max + 1)) + [kh_max] * kl_max, [0] * (kh_max + 1) + list(range(1, kl_max + 1))
    return [0] * (kl_max + 1) + list(range(1, kh_max + 1)), list(range(kl_max + 1)) + [kl_max] * kh_max


def bapo_bounds(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    *,
    rho0: float = 0.4,
    low_range: tuple[float, float] = (0.6, 0.9),
    high_range: tuple[float, float] = (1.2, 3.0),
    low_step: float = 0.02,
    high_step: float = 0.05,
    contribution: str = "loss_value",
    weight: str = "behavior_prob",
    variant: str = "paper",
    reduce_sum: ReduceSum | None = None,
) -> tuple[float, float, dict[str, float]]:
    """BAPO's adaptive bounds (c_low, c_high, stats); see the module docstring.

    Tensors share one shape (1-D or [B, T]); ``ratio`` is the current importance
    ratio. ``reduce_sum`` (e.g. an all-reduce SUM wrapper) is called exactly once,
    on a float64 tensor [n_high + n_low] of the candidates' local P then N sums.
    """
    _check_search_args(rho0, low_range, high_range, low_step, high_step, contribution, weight, variant)
    if variant == "recipe":
        weight = "none"
    with torch.no_grad():
        (r_pos, v_pos), (r_neg, v_neg), (pos, neg) = _token_scalars(ratio, adv, mask, old_logp, weight, sides=True)
        highs = _candidates(*high_range, high_step, variant)
        lows = _candidates(*low_range, low_step, variant)
        highs_t = torch.tensor(highs, dtype=torch.float64, device=r_pos.device)  # [Kh]
        lows_t = torch.tensor(lows, dtype=torch.float64, device=r_pos.device)  # [Kl]
        sums = torch.cat(
            [
                _sums_at(r_pos, v_pos, highs_t, "pos", contribution),
                _sums_at(r_neg, v_neg, lows_t, "neg", contribution),
                _counts_beyond(r_pos, r_neg, pos, neg, highs_t, lows_t),
            ]
        )  # [2 (Kh + Kl) + 1]
        sums = _reduce(reduce_sum, sums).to(torch.float64)
        nh, nl = len(highs), len(lows)
        p_cand, n_cand = sums[:nh], sums[nh : nh + nl]  # [Kh], [Kl]
        above, below, n_adv = sums[nh + nl : 2 * nh + nl], sums[2 * nh + nl : -1], sums[-1]  # [Kh], [Kl], []

        kh, kl = _search_path(len(highs), len(lows), variant)
        p = p_cand[torch.tensor(kh, device=sums.device)]  # [L]
        n = n_cand[torch.tensor(kl, device=sums.device)]  # [L]
        rho = _rho(p, n)  # [L]
        score = rho if variant == "paper" else _pn_ratio(p, n)  # [L]
        met = score >= rho0 - TOL  # [L]
        # The first candidate that meets the target; the path's end if none does.
        chosen = torch.where(met.any(), met.int().argmax(), torch.tensor(len(kh) - 1, device=met.device))
        picked = [chosen.double(), met[chosen].double(), rho[0], rho[chosen], p[chosen], n[chosen]]
        khc, klc = torch.tensor(kh, device=sums.device)[chosen], torch.tensor(kl, device=sums.device)[chosen]
        share = [above[khc] + below[klc], above[0] + below[-1]]  # beyond the chosen bounds; within reach
        share = [torch.where(n_adv > 0, x / n_adv.clamp(min=1), torch.zeros_like(n_adv)) for x in share]
        picked = torch.stack(picked + [score[0], score[chosen], p[0] + n[0]] + share)
        out = picked.tolist()
        step, target_met, rho_before, rho_after, p_after, n_after, score_before, score_after, mass = out[:9]
        beyond, reach = out[9:]

    step = int(step)
    stats = {
        "rho_before": rho_before,
        "rho_after": rho_after,
        "steps": float(step),
        "target_met": target_met,
        "active": float(step > 0),  # rho before the search was below the target: the bounds moved
        "signal": float(mass > 0),  # some token carried an advantage (else rho = 1 by convention: nothing to search)
        "P": p_after,
        "N": n_after,
        "beyond": beyond,
        "reach": reach,
    }
    if step > 0:  # the search engaged: did it reach its target, and how far did it move rho
        stats["target_reached"], stats["rho_moved"] = target_met, rho_after - rho_before
    if variant == "recipe":
        stats["pn_ratio_before"], stats["pn_ratio_after"] = score_before, score_after
    return lows[kl[step]], highs[kh[step]], stats


def fixed_bounds(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    *,
    ratio_low: float | None,
    ratio_high: float | None,
    reduce_sum: ReduceSum | None = None,
    contribution: str = "loss_value",
    weight: str = "behavior_prob",
) -> tuple[float | None, float | None, dict[str, float]]:
    """Fixed bounds (PPO-clip, GRPO, clip-higher; ``None``: no bound on that side, returned as it is), with rho
    logged at those bounds.

    ``reduce_sum`` is called once, on the stacked [P, N]. Stats: rho_before ==
    rho_after, steps = 0, P, N (no target, hence no ``target_met``).
    """
    _check_fixed_args(ratio_low, ratio_high)
    with torch.no_grad():
        p, n = positive_contribution(
            ratio,
            adv,
            mask,
            old_logp,
            ratio_low=ratio_low,
            ratio_high=ratio_high,
            contribution=contribution,
            weight=weight,
        )
        p, n = _reduce(reduce_sum, torch.stack([p, n])).to(torch.float64)
        rho, p_val, n_val = torch.stack([_rho(p, n), p, n]).tolist()
    stats = {"rho_before": rho, "rho_after": rho, "steps": 0.0, "P": p_val, "N": n_val}
    lo, hi = (None if b is None else float(b) for b in (ratio_low, ratio_high))
    return lo, hi, stats


def _check_fixed_args(ratio_low: float | None, ratio_high: float | None) -> None:
    """Bounds are finite numbers with 0 <= ratio_low <= ratio_high, or None (no bound; "no clip" is null)."""
    lo, hi = open_bounds(ratio_low, ratio_high)
    if not (0.0 <= lo <= hi and (ratio_high is None or math.isfinite(ratio_high))):
        raise ValueError(f"need 0 <= ratio_low <= ratio_high, got ratio_low={ratio_low}, ratio_high={ratio_high}")


def check_bapo_params(params: dict[str, Any]) -> None:
    """Check the search's keyword arguments (ValueError naming the parameter); the config's one range check."""
    signature = inspect.signature(bapo_bounds).parameters
    defaults = {k: p.default for k, p in signature.items() if p.kind is p.KEYWORD_ONLY and k != "reduce_sum"}
    _check_search_args(**{**defaults, **params})


def _check_fixed_params(params: dict[str, Any]) -> None:
    missing = sorted({"ratio_low", "ratio_high"} - set(params))
    if missing:
        raise ValueError(f"bound kind 'fixed' needs {missing}")
    _check_fixed_args(params["ratio_low"], params["ratio_high"])
    _check_choice("contribution", params.get("contribution", "loss_value"), CONTRIBUTIONS)
    _check_choice("weight", params.get("weight", "behavior_prob"), WEIGHTS)


def _bound_kind(kind: str) -> tuple[Callable, Callable[[dict[str, Any]], None]]:
    """(bound function, check of its configured keyword arguments) of ``kind``, looked up when called."""
    return {"bapo": (bapo_bounds, check_bapo_params), "fixed": (fixed_bounds, _check_fixed_params)}[kind]


# kind -> whether the bounds depend on the current ratios (then scope=mini_batch needs a pre-pass)
ADAPTIVE = {"bapo": True, "fixed": False}


def make_bound_fn(kind: str, **params: Any) -> BoundFn:
    """A bound chooser ``(ratio, adv, mask, old_logp, reduce_sum=None) -> (c_low, c_high, stats)``.

    ``kind="bapo"`` takes ``bapo_bounds``' keyword arguments, ``kind="fixed"`` takes
    ``fixed_bounds``' (``ratio_low`` and ``ratio_high`` required). Names and values
    are checked here, so a bad configuration fails at startup.
    """
    _check_choice("kind", kind, BOUND_KINDS)
    fn, check = _bound_kind(kind)
    signature = inspect.signature(fn).parameters
    allowed = {k for k, p in signature.items() if p.kind is p.KEYWORD_ONLY and k != "reduce_sum"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for bound kind {kind!r}; allowed: {sorted(allowed)}")
    check(params)

    def bound_fn(ratio, adv, mask, old_logp, reduce_sum: ReduceSum | None = None):
        return fn(ratio, adv, mask, old_logp, reduce_sum=reduce_sum, **params)

    return bound_fn
