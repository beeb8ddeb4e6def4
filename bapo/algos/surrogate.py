"""The one policy-gradient surrogate, its loss aggregation, and logit helpers.

Every algorithm of the project (GRPO / PPO-clip, PPO with a critic, clip-higher,
BAPO and its recipe variant, and BAPO's rivals CISPO, M2PO, TOPR, DPPO and GSPO)
uses this one loss, configured by orthogonal options; the bounds come from
``bounds.py``. The one exception is the eps-feedback heuristic, which is not the
paper's method and has its own loss (``eps_feedback.py``). Per response token t
(BAPO.md, "Notation"), with the default options (PPO's clipped surrogate):

    r_t = exp(logp_t - old_logp_t)
    s_t = min(r_t * A_t, clip(r_t, ratio_low, ratio_high) * A_t)
        = A_t * min(r_t, ratio_high)                  if A_t > 0
        = A_t * max(r_t, ratio_low)                   if A_t < 0
    dual clip c (optional, c > 1), A_t < 0 only:  s_t = max(s_t, c * A_t)
    loss = -aggregate(w_t * s_t)  [- entropy_coef * aggregate(entropy_t)]  [+ kl_coef * aggregate(kl_t)]

``w_t`` is an optional detached per-token weight (``token_weight``: a rollout
correction or decoupled PPO's behaviour->proximal weight, ``correction.py``), 1 by default.

The options, each independent of the others (``sg`` = stop-gradient):

- ``ratio_level``: ``token`` (r_t as above); ``sequence``: every token of sequence i
  uses r_i = exp(sum_t (logp_t - old_logp_t)) = pi(y_i) / pi_old(y_i) (TOPR);
  ``sequence_mean``: r_i = exp(mean_t (logp_t - old_logp_t)), the length-normalised
  (geometric-mean) ratio of GSPO. The ratio carries the gradient.
- ``is_weight``: ``clip`` (PPO's min above); ``stop_grad``: s_t = sg(clip(r, ratio_low,
  ratio_high)) * A_t * pi_t / sg(pi_t), i.e. the value is the truncated weight times A
  and the gradient is that weight times A * grad logp_t, so no token's gradient is
  dropped (CISPO; TOPR's tapered weights).
- ``positive_weight``: ``ratio`` or ``one``: A > 0 tokens take weight 1 whatever their
  ratio (TOPR's positive term; needs ``is_weight=stop_grad``).
- ``token_mask``: tokens removed from the loss (their s_t is 0, they still count in the
  normalisers, as a clipped token does): ``second_moment`` drops tokens whose squared
  token log-ratio exceeds ``m2_cutoff`` (M2PO; the cutoff is chosen over the whole
  update by ``second_moment_cutoff``); ``divergence`` drops tokens whose binary total
  variation |pi_t - pi_old_t| exceeds ``mask_threshold`` while the update moves them
  further in the direction their advantage pushes (A > 0 and r > 1, or A < 0 and
  r < 1): DPPO's binary-TV trust region.

The KL term (GRPO's optional penalty; BAPO has none) is an estimate of
KL(pi || pi_ref) per sampled token, from the current and the frozen reference
model's log-probs (Schulman's estimators, with x_t = ref_logp_t - logp_t):

    k1 = -x_t                     unbiased, high variance, can be negative
    k2 = 0.5 * x_t^2              biased, low variance
    k3 = exp(x_t) - x_t - 1       unbiased, low variance, >= 0 (verl's low_var_kl)

Implementation notes (none of them changes the math for ordinary inputs):
- The log-ratio (token or sequence) is clamped to [-20, 20] before ``exp`` (as verl
  does), so an extreme log-ratio gives a large but finite ratio (at most e^20 ~ 4.9e8)
  instead of inf. Tokens beyond the clamp get no gradient; they are clipped anyway
  unless they are negative tokens with r > e^20 and no dual clip.
- Masked positions are removed with ``torch.where`` (never by multiplying with the
  mask), so NaN or inf there cannot leak into the loss, the gradients or the stats.
- Stats are detached python floats over this call's own masked tokens.
- k3's exponent is clamped to [-20, 20] like the ratio (verl clamps it too; we do
  not clamp the result), so it stays finite for any log-ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0
# The widest ratio the loss can see (the clamp's), logged as clip/high when there is no upper bound.
MAX_RATIO = math.exp(LOG_RATIO_CLAMP)


def open_bounds(ratio_low: float | None, ratio_high: float | None) -> tuple[float, float]:
    """The ratio bounds with ``None`` (no bound on that side) as 0 and inf: a ratio is never below 0."""
    return (0.0 if ratio_low is None else ratio_low), (math.inf if ratio_high is None else ratio_high)


def _count(mask: torch.Tensor) -> tuple[int, int, int]:
    """(tokens, sequences with at least one token, T) of one [B, T] (or 1-D) mask."""
    m = mask.bool()
    seqs = m.any(dim=-1) if m.dim() > 1 else m.any().reshape(1)  # [B]
    return int(m.sum().item()), int(seqs.sum().item()), m.shape[-1]


def agg_normalisers(masks: torch.Tensor | Sequence[torch.Tensor]) -> dict[str, int]:
    """Mini-batch totals to pass to ``policy_loss`` / ``aggregate`` when accumulating.

    ``masks`` is one [B, T] mask or the list of the mini-batch's micro-batch masks.
    Returns ``num_tokens`` (response tokens), ``num_seqs`` (sequences that hold at
    least one response token) and ``max_len`` (the widest T). For Dr. GRPO's
    constant normaliser, override ``max_len`` with the generation length. Counts
    are local; a data-parallel caller sums them across ranks itself if it wants a
    global normaliser.
    """
    if isinstance(masks, torch.Tensor):
        masks = [masks]
    counts = [_count(m) for m in masks]
    return {
        "num_tokens": sum(c[0] for c in counts),
        "num_seqs": sum(c[1] for c in counts),
        "max_len": max((c[2] for c in counts), default=0),
    }


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: float | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` [B, T] over ``mask`` to a scalar (verl's modes).

    - token-mean: sum(v * mask) / num_tokens
    - seq-mean-token-sum: sum over sequences of (sum_t v) / num_seqs
    - seq-mean-token-mean: sum over sequences of (mean_t v) / num_seqs
    - seq-mean-token-sum-norm: sum(v * mask) / (num_seqs * max_len)   (Dr. GRPO)

    Normalisers default to this call's own counts: masked tokens, sequences with at
    least one masked token (empty sequences never count), and T. Passing the
    mini-batch totals makes the sum over micro-batches equal the mini-batch loss.
    A zero normaliser (an empty batch) is treated as 1, so the result is 0.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    m = mask.bool()
    v = torch.where(m, values, torch.zeros_like(values))  # [B, T]
    if agg == "token-mean":
        denom = m.sum() if num_tokens is None else num_tokens
        return v.sum() / _nonzero(denom, v)
    if v.dim() != 2:
        raise ValueError(f"agg={agg!r} needs [B, T] inputs, got shape {tuple(v.shape)}")
    if num_seqs is None:
        num_seqs = m.any(dim=-1).sum()
    if agg == "seq-mean-token-sum":
        return v.sum() / _nonzero(num_seqs, v)
    if agg == "seq-mean-token-mean":
        seq_len = m.sum(dim=-1).clamp(min=1)  # [B]
        return (v.sum(dim=-1) / seq_len).sum() / _nonzero(num_seqs, v)
    max_len = v.shape[-1] if max_len is None else max_len
    return v.sum() / _nonzero(num_seqs * max_len, v)


def _nonzero(denom: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    denom = torch.as_tensor(denom, dtype=like.dtype, device=like.device)
    return torch.where(denom > 0, denom, torch.ones_like(denom))


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio_low: float | None,
    ratio_high: float | None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: float | None = None,
    ratio_level: str = "token",
    is_weight: str = "clip",
    positive_weight: str = "ratio",
    token_mask: str = "none",
    mask_threshold: float | None = None,
    m2_cutoff: float | None = None,
    token_weight: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The surrogate loss over [B, T] tokens with explicit ratio bounds (module docstring).

    ``ratio_low``/``ratio_high`` are ratio bounds (0.8 / 1.2), not epsilons; ``None`` is no bound on that side.
    ``dual_clip`` (c > 1) caps the loss of each negative-advantage token at -c * A.
    ``num_tokens``/``num_seqs``/``max_len``: mini-batch normalisers, see ``aggregate``.
    ``ratio_level``, ``is_weight``, ``positive_weight``, ``token_mask`` (with
    ``mask_threshold`` for ``divergence``, ``m2_cutoff`` for ``second_moment``): the
    options of the module docstring. ``token_weight`` [B, T]: a detached weight per token.
    ``entropy`` [B, T] with ``entropy_coef != 0`` subtracts an entropy bonus
    aggregated the same way. ``ref_logp`` [B, T] (the frozen reference model's
    log-probs) adds ``kl_coef`` x the aggregated ``kl_estimator`` (k1, k2, k3).

    Stats (floats): pg_loss, clip_frac_high (A>0 tokens with r > ratio_high, over
    A>0 tokens), clip_frac_low (A<0 tokens with r < ratio_low, over A<0 tokens),
    dual_clip_frac (A<0 tokens with r > c, over A<0 tokens), clip_frac (tokens the
    surrogate clipped, truncated or masked, over all tokens), mask_frac (tokens the
    token mask dropped), ratio_mean, ratio_max, approx_kl (mean of 0.5 *
    log_ratio^2, on the clamped token log-ratio), pos_token_frac, pos_contrib /
    neg_contrib (token means of |w s_t| over A>0 / A<0 tokens: ``stats.derived`` turns
    them into pos_share, the loss's positive share), ratio_sq_mean (``stats.derived``: the
    ratios' effective sample size ess), the clip fractions by advantage
    sign and behaviour-probability bucket (``BUCKETS``), tokens, pos_tokens,
    neg_tokens and the bucket counts (the denominators: ``bapo.algos.stats`` merges
    calls by them), entropy when given, kl_ref (token mean of the KL estimate) when
    ``ref_logp`` is given.
    """
    ratio_low, ratio_high = open_bounds(ratio_low, ratio_high)
    _check_loss_args(logp, old_logp, adv, mask, ratio_low, ratio_high, dual_clip)
    check_surrogate_options(
        logp, ratio_level, is_weight, positive_weight, token_mask, mask_threshold, m2_cutoff, dual_clip
    )
    m = mask.bool()  # [B, T]
    zero = torch.zeros_like(logp)
    diff = torch.where(m, logp - old_logp, zero)  # [B, T] token log-ratio, 0 where masked
    token_log_ratio = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    log_ratio = _level_log_ratio(diff, m, ratio_level)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    adv = torch.where(m, adv, torch.zeros_like(adv)).to(ratio.dtype)  # [B, T]
    pos, neg = adv > 0, adv < 0  # [B, T]

    if is_weight == "clip":
        neg_ratio = ratio.clamp(min=ratio_low)  # [B, T] max(r, c_low)
        if dual_clip is not None:
            # For A < 0: max(A * max(r, c_low), c * A) = A * min(max(r, c_low), c).
            neg_ratio = neg_ratio.clamp(max=dual_clip)
        surrogate = adv * torch.where(pos, ratio.clamp(max=ratio_high), neg_ratio)  # [B, T]
    else:
        w = ratio.detach().clamp(ratio_low, ratio_high)  # [B, T] the truncated, detached IS weight
        if positive_weight == "one":
            w = torch.where(pos, torch.ones_like(w), w)
        safe_logp = torch.where(m, logp, zero)
        surrogate = adv * w * torch.exp(safe_logp - safe_logp.detach())  # [B, T] value w A, gradient w A grad logp
    dropped = _token_mask(token_mask, logp, old_logp, token_log_ratio, m, pos, neg, mask_threshold, m2_cutoff)
    surrogate = torch.where(dropped, zero, surrogate)
    if token_weight is not None:
        if token_weight.shape != logp.shape:
            raise ValueError(f"token_weight has shape {tuple(token_weight.shape)}, logp has {tuple(logp.shape)}")
        surrogate = surrogate * torch.where(m, token_weight.detach().to(surrogate.dtype), zero)
    norms = {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len}
    pg_loss = -aggregate(surrogate, m, **norms)
    loss, reg_stats = regularised(pg_loss, logp, m, norms, entropy, entropy_coef, ref_logp, kl_coef, kl_estimator)
    cut = _cut_tokens(ratio, m, pos, neg, ratio_low, ratio_high, dual_clip, is_weight, positive_weight) | dropped
    stats = _loss_stats(
        pg_loss,
        ratio,
        token_log_ratio,
        old_logp,
        m,
        pos,
        neg,
        ratio_low,
        ratio_high,
        dual_clip,
        entropy,
        surrogate,
        cut,
    )
    return loss, stats | reg_stats | {"mask_frac": _frac_of(dropped, m)}


RATIO_LEVELS = ("token", "sequence", "sequence_mean")
IS_WEIGHTS = ("clip", "stop_grad")
POSITIVE_WEIGHTS = ("ratio", "one")
TOKEN_MASKS = ("none", "second_moment", "divergence")
# Behaviour-probability buckets of the clip diagnostics: the paper's low-probability positive tokens are "low".
BUCKETS = (("low", 0.0, 0.2), ("mid", 0.2, 0.8), ("high", 0.8, 1.0 + 1e-9))


def check_surrogate_options(
    logp, ratio_level, is_weight, positive_weight, token_mask, mask_threshold, m2_cutoff, dual_clip
) -> None:
    """ValueError naming the option when the loss's options are unknown or do not go together."""
    for name, value, allowed in (
        ("ratio_level", ratio_level, RATIO_LEVELS),
        ("is_weight", is_weight, IS_WEIGHTS),
        ("positive_weight", positive_weight, POSITIVE_WEIGHTS),
        ("token_mask", token_mask, TOKEN_MASKS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if ratio_level != "token" and logp.dim() != 2:
        raise ValueError(f"ratio_level={ratio_level!r} needs [B, T] inputs, got shape {tuple(logp.shape)}")
    if positive_weight == "one" and is_weight != "stop_grad":
        raise ValueError("positive_weight='one' needs is_weight='stop_grad' (a clipped ratio of 1 has no gradient)")
    if dual_clip is not None and is_weight != "clip":
        raise ValueError("dual_clip applies to is_weight='clip' only")
    if token_mask == "divergence" and not (mask_threshold is not None and mask_threshold > 0):
        raise ValueError(f"token_mask='divergence' needs mask_threshold > 0, got {mask_threshold}")
    if token_mask == "second_moment" and m2_cutoff is None:
        raise ValueError("token_mask='second_moment' needs m2_cutoff (from second_moment_cutoff)")


def _level_log_ratio(diff: torch.Tensor, m: torch.Tensor, ratio_level: str) -> torch.Tensor:
    """The clamped log-ratio each token uses [B, T]: its own, or its sequence's (sum or mean) broadcast."""
    if ratio_level == "token":
        return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq = diff.sum(dim=-1, keepdim=True)  # [B, 1]
    if ratio_level == "sequence_mean":
        seq = seq / m.sum(dim=-1, keepdim=True).clamp(min=1)
    seq = seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(m, seq.expand_as(diff), torch.zeros_like(diff))


def _token_mask(token_mask, logp, old_logp, token_log_ratio, m, pos, neg, mask_threshold, m2_cutoff):
    """[B, T] bool: tokens the token mask removes from the loss (all False for ``none``)."""
    if token_mask == "none":
        return torch.zeros_like(m)
    with torch.no_grad():
        if token_mask == "second_moment":
            return m & (token_log_ratio.pow(2) > m2_cutoff)
        zero = torch.zeros_like(logp)
        p = torch.where(m, logp.detach(), zero).exp()  # [B, T]
        p_old = torch.where(m, old_logp.to(logp.dtype), zero).exp()  # [B, T]
        away = (pos & (token_log_ratio > 0)) | (neg & (token_log_ratio < 0))  # moving the way A pushes
        return m & away & ((p - p_old).abs() > mask_threshold)


@torch.no_grad()
def _cut_tokens(ratio, m, pos, neg, ratio_low, ratio_high, dual_clip, is_weight, positive_weight):
    """[B, T] bool: tokens whose ratio the surrogate clipped (no gradient) or truncated (weight at a bound)."""
    if is_weight == "clip":
        cut = (pos & (ratio > ratio_high)) | (neg & (ratio < ratio_low))
        if dual_clip is not None:
            cut = cut | (neg & (ratio > dual_clip))
        return cut & m
    out = (ratio > ratio_high) | (ratio < ratio_low)
    if positive_weight == "one":
        out = out & ~pos
    return out & m


def second_moment_cutoff(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, m2_threshold: float, reduce_sum=None, iters: int = 64
) -> tuple[float, dict[str, float]]:
    """M2PO (arXiv 2510.01161): the largest squared log-ratio c such that the tokens with (log r)^2 <= c
    have a second moment (mean of (log r)^2) <= ``m2_threshold``; tokens above c are masked.

    Dropping the tokens with the largest (log r)^2 one at a time until the mean of the rest is <= tau keeps
    exactly {x <= c}: the mean of the k smallest values grows with k. c is found by bisection on
    [0, 20^2] (the log-ratio clamp), where each probe needs only a sum and a count, so
    ``reduce_sum`` (one collective per probe) makes every data-parallel rank pick the same c.
    Ties at c are kept or masked together. Stats: m2_before, m2_after, mask_frac (over all tokens).
    """
    m = mask.bool().reshape(-1)
    x = torch.where(m, log_ratio.detach().reshape(-1).double(), torch.zeros_like(m, dtype=torch.float64))
    x = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).pow(2)  # [n]

    def sums(c: float) -> tuple[float, float]:
        keep = m & (x <= c)
        t = torch.stack([torch.where(keep, x, torch.zeros_like(x)).sum(), keep.double().sum()])
        r = reduce_sum(t) if reduce_sum is not None else None
        return tuple((t if r is None else r).tolist())

    total, n = sums(LOG_RATIO_CLAMP**2)
    m2_before = total / n if n > 0 else 0.0
    if m2_before <= m2_threshold:
        return LOG_RATIO_CLAMP**2, {"m2_before": m2_before, "m2_after": m2_before, "mask_frac": 0.0}
    lo, hi = 0.0, LOG_RATIO_CLAMP**2  # mean{x <= lo} <= tau < mean{x <= hi}
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        s, k = sums(mid)
        if k == 0 or s / k <= m2_threshold:
            lo = mid
        else:
            hi = mid
    s, k = sums(lo)
    return lo, {"m2_before": m2_before, "m2_after": s / k if k > 0 else 0.0, "mask_frac": 1.0 - k / n}


def _frac_of(sel: torch.Tensor, m: torch.Tensor) -> float:
    return float((sel & m).sum()) / max(int(m.sum()), 1)


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """r = exp(logp - old_logp), with the log-ratio clamped as in ``policy_loss``."""
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, *, kl_estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate [...] of KL(pi || pi_ref) at sampled tokens (k1, k2 or k3; module docstring)."""
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    x = ref_logp - logp  # [...] log(pi_ref / pi)
    if kl_estimator == "k1":
        return -x
    if kl_estimator == "k2":
        return 0.5 * x.pow(2)
    x = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(x) - x  # = exp(x) - x - 1, without the cancellation that can dip below 0


def regularised(
    pg_loss: torch.Tensor,
    logp: torch.Tensor,
    m: torch.Tensor,
    norms: dict,
    entropy: torch.Tensor | None,
    entropy_coef: float,
    ref_logp: torch.Tensor | None,
    kl_coef: float,
    kl_estimator: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """pg_loss - entropy_coef * agg(entropy) + kl_coef * agg(kl); shared by every loss of the project.

    Returns the loss and {"kl_ref": token mean of the KL estimate} when ``ref_logp`` is given.
    """
    loss = pg_loss
    if entropy is not None and entropy_coef != 0.0:
        loss = loss - entropy_coef * aggregate(entropy, m, **norms)
    if ref_logp is None:
        if kl_coef != 0.0:
            raise ValueError(f"kl_coef={kl_coef} needs ref_logp (the reference model's log-probs)")
        return loss, {}
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp has shape {tuple(ref_logp.shape)}, logp has {tuple(logp.shape)}")
    zero = torch.zeros_like(logp)
    kl = kl_estimate(
        torch.where(m, logp, zero), torch.where(m, ref_logp.to(logp.dtype), zero), kl_estimator=kl_estimator
    )
    if kl_coef != 0.0:
        loss = loss + kl_coef * aggregate(kl, m, **norms)
    kl_mean = torch.where(m, kl.detach(), zero).double().sum() / m.sum().clamp(min=1)
    return loss, {"kl_ref": float(kl_mean)}


def _check_loss_args(logp, old_logp, adv, mask, ratio_low, ratio_high, dual_clip) -> None:
    shape = logp.shape
    for name, t in (("old_logp", old_logp), ("adv", adv), ("mask", mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(shape)}")
    if not 0.0 <= ratio_low <= ratio_high:
        raise ValueError(f"need 0 <= ratio_low <= ratio_high, got ratio_low={ratio_low}, ratio_high={ratio_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")


@torch.no_grad()
def _loss_stats(
    pg_loss, ratio, log_ratio, old_logp, m, pos, neg, ratio_low, ratio_high, dual_clip, entropy, surrogate, cut
):
    """Detached metrics of one policy_loss call; one device sync for all of them."""
    pos, neg = pos & m, neg & m  # [B, T]
    high = pos & (ratio > ratio_high)  # [B, T] positive tokens above c_high
    low = neg & (ratio < ratio_low)  # [B, T] negative tokens below c_low
    dual = neg & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(m)
    n_tok, n_pos, n_neg = m.sum(), pos.sum(), neg.sum()

    def frac(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        return num.double() / den.clamp(min=1).double()

    masked_ratio = torch.where(m, ratio, torch.zeros_like(ratio))  # [B, T]
    contrib = surrogate.detach().abs().double()  # [B, T] 0 where masked
    values = {
        "pg_loss": pg_loss.detach().double(),
        "clip_frac_high": frac(high.sum(), n_pos),
        "clip_frac_low": frac(low.sum(), n_neg),
        "dual_clip_frac": frac(dual.sum(), n_neg),
        "clip_frac": frac(cut.sum(), n_tok),
        "clip_frac_pos": frac((cut & pos).sum(), n_pos),
        "clip_frac_neg": frac((cut & neg).sum(), n_neg),
        "ratio_mean": frac(masked_ratio.double().sum(), n_tok),
        "ratio_max": masked_ratio.amax().double() if m.numel() else n_tok.double(),  # 0 when empty
        "ratio_sq_mean": frac(masked_ratio.double().pow(2).sum(), n_tok),
        "approx_kl": frac(0.5 * log_ratio.double().pow(2).sum(), n_tok),  # log_ratio is 0 where masked
        "pos_token_frac": frac(n_pos, n_tok),
        "pos_contrib": frac(torch.where(pos, contrib, torch.zeros_like(contrib)).sum(), n_tok),
        "neg_contrib": frac(torch.where(neg, contrib, torch.zeros_like(contrib)).sum(), n_tok),
        "tokens": n_tok.double(),
        "pos_tokens": n_pos.double(),
        "neg_tokens": n_neg.double(),
    }
    # Clip fractions by advantage sign and behaviour probability pi_old = exp(logp - log_ratio): which tokens
    # lose (or have truncated) their gradient, e.g. BAPO's low-probability positive tokens.
    p_old = torch.where(m, old_logp.detach().to(ratio.dtype), torch.zeros_like(ratio)).exp()  # [B, T]
    for name, lo, hi in BUCKETS:
        in_bucket = (p_old >= lo) & (p_old < hi)  # [B, T]
        for sign, side in (("pos", pos), ("neg", neg)):
            sel = side & in_bucket
            values[f"{sign}_{name}_tokens"] = sel.sum().double()
            values[f"clip_frac_{sign}_{name}"] = frac((cut & sel).sum(), sel.sum())
    if entropy is not None:
        ent = torch.where(m, entropy.detach(), torch.zeros_like(entropy))  # [B, T]
        values["entropy"] = frac(ent.double().sum(), n_tok)
    flat = torch.stack([v.to(device=ratio.device, dtype=torch.float64) for v in values.values()]).tolist()
    return dict(zip(values.keys(), flat, strict=True))


def _float_logits(logits: torch.Tensor) -> torch.Tensor:
    # Half-precision log-softmax over a large vocabulary loses digits; upcast those.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def token_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``ids`` [...] under ``logits`` [..., V]: log_softmax gathered.

    Divide the logits by the sampling temperature before calling, so that the result
    matches the behaviour log-probabilities of the sampler.
    """
    logits = _float_logits(logits)
    picked = logits.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [...] of softmax(``logits`` [..., V]), via a logsumexp-based log-softmax.

    -inf logits (banned tokens) contribute exactly 0 rather than 0 * -inf = NaN.
    """
    logits = _float_logits(logits)
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # [..., V]
    probs = log_probs.exp()  # [..., V]
    plogp = torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs))  # [..., V]
    return -plogp.sum(dim=-1)
