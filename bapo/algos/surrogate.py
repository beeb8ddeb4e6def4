"""The clipped policy-gradient surrogate, its loss aggregation, and logit helpers.

Every algorithm of the project (GRPO / PPO-clip, PPO with a critic, clip-higher,
BAPO and its recipe variant) uses this one loss; they differ only in the ratio
bounds they pass (see ``bounds.py``). The one exception is the eps-feedback heuristic,
which is not the paper's method and has its own loss (``eps_feedback.py``). Per
response token t (BAPO.md, "Notation"):

    r_t = exp(logp_t - old_logp_t)
    s_t = min(r_t * A_t, clip(r_t, ratio_low, ratio_high) * A_t)
        = A_t * min(r_t, ratio_high)                  if A_t > 0
        = A_t * max(r_t, ratio_low)                   if A_t < 0
    dual clip c (optional, c > 1), A_t < 0 only:  s_t = max(s_t, c * A_t)
    loss = -aggregate(s_t)  [- entropy_coef * aggregate(entropy_t)]  [+ kl_coef * aggregate(kl_t)]

The KL term (GRPO's optional penalty; BAPO has none) is an estimate of
KL(pi || pi_ref) per sampled token, from the current and the frozen reference
model's log-probs (Schulman's estimators, with x_t = ref_logp_t - logp_t):

    k1 = -x_t                     unbiased, high variance, can be negative
    k2 = 0.5 * x_t^2              biased, low variance
    k3 = exp(x_t) - x_t - 1       unbiased, low variance, >= 0 (verl's low_var_kl)

Implementation notes (none of them changes the math for ordinary inputs):
- The log-ratio is clamped to [-20, 20] before ``exp`` (as verl does), so an extreme
  log-ratio gives a large but finite ratio (at most e^20 ~ 4.9e8) instead of inf.
  Tokens beyond the clamp get no gradient; they are clipped anyway unless they are
  negative tokens with r > e^20 and no dual clip.
- Masked positions are removed with ``torch.where`` (never by multiplying with the
  mask), so NaN or inf there cannot leak into the loss, the gradients or the stats.
- Stats are detached python floats over this call's own masked tokens.
- k3's exponent is clamped to [-20, 20] like the ratio (verl clamps it too; we do
  not clamp the result), so it stays finite for any log-ratio.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0


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
    ratio_low: float,
    ratio_high: float,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-surrogate loss over [B, T] tokens with explicit ratio bounds.

    ``ratio_low``/``ratio_high`` are ratio bounds (0.8 / 1.2), not epsilons.
    ``dual_clip`` (c > 1) caps the loss of each negative-advantage token at -c * A.
    ``num_tokens``/``num_seqs``/``max_len``: mini-batch normalisers, see ``aggregate``.
    ``entropy`` [B, T] with ``entropy_coef != 0`` subtracts an entropy bonus
    aggregated the same way. ``ref_logp`` [B, T] (the frozen reference model's
    log-probs) adds ``kl_coef`` x the aggregated ``kl_estimator`` (k1, k2, k3).

    Stats (floats): pg_loss, clip_frac_high (A>0 tokens with r > ratio_high, over
    A>0 tokens), clip_frac_low (A<0 tokens with r < ratio_low, over A<0 tokens),
    dual_clip_frac (A<0 tokens with r > c, over A<0 tokens), clip_frac (tokens left
    without gradient by any of the three clips, over all tokens), ratio_mean,
    ratio_max, approx_kl (mean of 0.5 * log_ratio^2, on the clamped log-ratio),
    pos_token_frac, tokens, pos_tokens, neg_tokens (the counts behind the fractions:
    ``bapo.algos.stats`` merges calls by them), entropy when given, kl_ref (token mean of the KL
    estimate) when ``ref_logp`` is given.
    """
    _check_loss_args(logp, old_logp, adv, mask, ratio_low, ratio_high, dual_clip)
    m = mask.bool()  # [B, T]
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(m, logp - old_logp, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    adv = torch.where(m, adv, torch.zeros_like(adv)).to(ratio.dtype)  # [B, T]
    pos, neg = adv > 0, adv < 0  # [B, T]

    neg_ratio = ratio.clamp(min=ratio_low)  # [B, T] max(r, c_low)
    if dual_clip is not None:
        # For A < 0: max(A * max(r, c_low), c * A) = A * min(max(r, c_low), c).
        neg_ratio = neg_ratio.clamp(max=dual_clip)
    surrogate = adv * torch.where(pos, ratio.clamp(max=ratio_high), neg_ratio)  # [B, T]
    norms = {"agg": agg, "num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len}
    pg_loss = -aggregate(surrogate, m, **norms)
    loss, reg_stats = regularised(pg_loss, logp, m, norms, entropy, entropy_coef, ref_logp, kl_coef, kl_estimator)
    stats = _loss_stats(pg_loss, ratio, log_ratio, m, pos, neg, ratio_low, ratio_high, dual_clip, entropy)
    return loss, stats | reg_stats


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
def _loss_stats(pg_loss, ratio, log_ratio, m, pos, neg, ratio_low, ratio_high, dual_clip, entropy):
    """Detached metrics of one policy_loss call; one device sync for all of them."""
    pos, neg = pos & m, neg & m  # [B, T]
    high = pos & (ratio > ratio_high)  # [B, T] positive tokens clipped at c_high
    low = neg & (ratio < ratio_low)  # [B, T] negative tokens clipped at c_low
    dual = neg & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(m)
    n_tok, n_pos, n_neg = m.sum(), pos.sum(), neg.sum()

    def frac(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        return num.double() / den.clamp(min=1).double()

    masked_ratio = torch.where(m, ratio, torch.zeros_like(ratio))  # [B, T]
    values = {
        "pg_loss": pg_loss.detach().double(),
        "clip_frac_high": frac(high.sum(), n_pos),
        "clip_frac_low": frac(low.sum(), n_neg),
        "dual_clip_frac": frac(dual.sum(), n_neg),
        "clip_frac": frac((high | low | dual).sum(), n_tok),
        "ratio_mean": frac(masked_ratio.double().sum(), n_tok),
        "ratio_max": masked_ratio.amax().double() if m.numel() else n_tok.double(),  # 0 when empty
        "approx_kl": frac(0.5 * log_ratio.double().pow(2).sum(), n_tok),  # log_ratio is 0 where masked
        "pos_token_frac": frac(n_pos, n_tok),
        "tokens": n_tok.double(),
        "pos_tokens": n_pos.double(),
        "neg_tokens": n_neg.double(),
    }
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
