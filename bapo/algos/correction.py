"""Rollout corrections: per-token weights between the engine's behaviour log-probs and the learner's own.

The rollout engine (vLLM, or the HF sampler in another dtype) and the learner compute log-probs
with different kernels, so even at the same weights pi_engine != pi_learner. With
``learner.old_logp=recompute`` both are known for every sampled token: ``behaviour_logp``
(the engine's, mu) and ``old_logp`` (the learner's at the generating version, pi). The
correction reweights (or drops) the surrogate's tokens by w = pi / mu, a detached weight
multiplying each token's surrogate (``policy_loss(token_weight=...)``). With
lw_t = old_logp_t - behaviour_logp_t:

- ``tis`` (truncated IS; Yao et al.'s "off-policy RL" fix, verl / slime / TRL):
  token: w_t = min(e^{lw_t}, C); sequence: w_t = min(e^{sum_t lw_t}, C) for all of a sequence's tokens.
- ``mis`` (masked IS): the weight is kept below the cap and the token (sequence) dropped above it:
  w = e^{lw} if e^{lw} <= C else 0, at token or sequence level.
- ``geo_reject`` (geometric-mean sequence rejection, verl's ``geo`` level): a sequence whose
  geometric-mean weight g = e^{mean_t lw_t} lies outside [1 / C, C] is dropped (w = 0), the others kept
  with w = 1 (rejection only, no reweighting).
- ``decoupled`` (AReaL's decoupled PPO, arXiv 2505.24298): the clip is taken against a proximal policy
  (the learner at the version before the step's first update), and the tokens are weighted by the
  behaviour->proximal ratio w = e^{prox - behav}, truncated at C when a cap is set (AReaL's
  ``behav_imp_weight_cap``). The proximal log-probs are a forward pass at the step's start, or, with
  ``proximal=loglinear``, interpolated between behaviour and current log-probs by version (no forward):
  prox = behav + alpha (logp - behav), alpha = (v_prox - v_behav) / (v_now - v_behav) (alpha = 1 when
  v_now = v_behav: then all three policies are one).

Dropped tokens (w = 0) stay in the loss's normalisers, like a clipped token, so a rejection does not
rescale the rest of the batch (verl removes them from the normaliser instead).

The mismatch itself, |lw_t| per sampled token, is measured by :func:`logp_mismatch`: with recompute on every
token, otherwise (``learner.logp_check_share``) on a sampled share of a batch's rows, whose log-probs the
learner computes only to compare them.

Metrics (``correction_stats``) over a batch's tokens: the weights' mean and max, the share truncated
(TIS, capped decoupled) or dropped (MIS, rejection), the effective sample size
ESS = (sum w)^2 / (N sum w^2) (a share of N; 1 when all weights are equal) and the k3 estimate of
KL(mu || pi) = E_mu[e^{lw} - lw - 1] (>= 0), from the raw weights before any truncation.
"""

from __future__ import annotations

import torch

from bapo.algos.surrogate import LOG_RATIO_CLAMP

KINDS = ("none", "tis", "mis", "geo_reject", "decoupled")
MISMATCH_THRESHOLD = 0.1  # nats: logp_mismatch's frac counts the tokens whose |lw| is above it
LEVELS = ("token", "sequence")
PROXIMAL = ("exact", "loglinear")


def check_correction(kind: str, *, level: str = "token", cap: float | None = None) -> None:
    """ValueError naming the parameter when a correction's parameters are unknown or out of range."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if kind in ("tis", "mis") and not (cap is not None and cap >= 1.0):
        raise ValueError(f"cap must be >= 1 for {kind}, got {cap}")
    if kind == "geo_reject" and not (cap is not None and cap > 1.0):
        raise ValueError(f"cap must be > 1 for geo_reject (sequences outside [1/cap, cap] are dropped), got {cap}")
    if kind == "decoupled" and cap is not None and not cap >= 1.0:
        raise ValueError(f"cap must be null or >= 1 for decoupled, got {cap}")


@torch.no_grad()
def logp_mismatch(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, *, threshold: float = MISMATCH_THRESHOLD
) -> dict[str, float]:
    """The engine-vs-learner mismatch d_t = |logp_t - behaviour_logp_t| over the tokens of 1-D ``logp`` (the
    learner's, pi) and ``behaviour_logp`` (the engine's, mu), in float32: mean, max, the share of tokens with
    d_t > ``threshold`` (``frac``) and the token count (``tokens``); zeros for no token."""
    d = (logp.float() - behaviour_logp.float()).abs()  # [N]
    if not d.numel():
        return {"mean": 0.0, "max": 0.0, "frac": 0.0, "tokens": 0.0}
    over = float((d > threshold).float().mean())
    return {"mean": float(d.mean()), "max": float(d.max()), "frac": over, "tokens": float(d.numel())}


def correction_weights(
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str,
    level: str = "token",
    cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached per-token weights [B, T] (0 where masked or dropped) and their ``correction_stats``.

    ``old_logp``: the learner's log-probs (pi: at the generating version, or the proximal policy's for
    ``decoupled``); ``behaviour_logp``: the engine's (mu). ``level`` applies to ``tis`` and ``mis``.
    """
    check_correction(kind, level=level, cap=cap)
    m = mask.bool()  # [B, T]
    zero = torch.zeros_like(old_logp, dtype=torch.float64)
    lw = torch.where(m, old_logp.detach().double() - behaviour_logp.detach().double(), zero)  # [B, T]
    raw = lw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [B, T] the untruncated token weights
    if kind == "none":
        w, cut = torch.where(m, torch.ones_like(raw), zero), torch.zeros_like(m)
    elif kind == "geo_reject":
        g = (lw.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).exp()  # [B, 1] geometric mean
        cut = m & ((g > cap) | (g < 1.0 / cap)).expand_as(m)
        w = torch.where(m & ~cut, torch.ones_like(raw), zero)
    else:
        rho = raw
        if level == "sequence" and kind in ("tis", "mis"):
            seq = lw.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [B, 1]
            rho = torch.where(m, seq.expand_as(raw), zero)
        over = m & (rho > cap) if cap is not None else torch.zeros_like(m)
        if kind == "mis":
            w, cut = torch.where(m & ~over, rho, zero), over
        else:  # tis, decoupled: truncate at the cap
            w, cut = torch.where(m, rho.clamp(max=cap) if cap is not None else rho, zero), over
    return w.to(old_logp.dtype), correction_stats(w, raw, lw, m, cut)


@torch.no_grad()
def correction_stats(w, raw, lw, m, cut) -> dict[str, float]:
    """weight_mean, weight_max, cut_frac (truncated or dropped tokens), ess, kl_k3 (module docstring)."""
    n = m.sum().double().clamp(min=1)
    wm = torch.where(m, w.double(), torch.zeros_like(raw))  # [B, T]
    sq = wm.pow(2).sum()
    k3 = torch.where(m, torch.expm1(lw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - lw, torch.zeros_like(raw))
    values = torch.stack(
        [
            wm.sum() / n,
            wm.amax() if m.any() else torch.zeros((), dtype=torch.float64),
            torch.where(m, raw, torch.zeros_like(raw)).sum() / n,
            cut.sum().double() / n,
            torch.where(sq > 0, wm.sum().pow(2) / (n * sq), torch.ones_like(sq)),
            k3.sum() / n,
        ]
    ).tolist()
    return dict(zip(("weight_mean", "weight_max", "raw_weight_mean", "cut_frac", "ess", "kl_k3"), values, strict=True))


def loglinear_proximal(
    behaviour_logp: torch.Tensor,
    logp: torch.Tensor,
    behaviour_version: torch.Tensor,
    proximal_version: torch.Tensor,
    current_version: int,
) -> torch.Tensor:
    """Decoupled PPO's proximal log-probs without a forward pass: behav + alpha (logp - behav), detached.

    ``behaviour_version`` / ``proximal_version``: [B] or broadcastable to ``logp``; alpha = (v_prox -
    v_behav) / (v_now - v_behav), 1 when v_now = v_behav (module docstring)."""
    vb = behaviour_version.to(device=logp.device, dtype=torch.float64)
    vp = proximal_version.to(device=logp.device, dtype=torch.float64)
    span = float(current_version) - vb
    alpha = torch.where(span > 0, (vp - vb) / span.clamp(min=1e-12), torch.ones_like(span))
    if alpha.dim() == 1 and logp.dim() == 2:
        alpha = alpha[:, None]
    alpha = alpha.clamp(0.0, 1.0).to(logp.dtype)
    behaviour_logp = behaviour_logp.to(logp.dtype)
    return (behaviour_logp + alpha * (logp.detach() - behaviour_logp)).detach()
