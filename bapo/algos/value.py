"""Critic-side math for PPO: outcome rewards on tokens, GAE, whitening, the clipped value loss.

Not part of BAPO (the paper trains GRPO-style, without a critic); these serve the
``ppo`` baseline and the eps-feedback heuristic's ``advantage: gae`` option. Response tensors are
[B, T] with a right-padded ``mask`` (1 on response tokens); ``values[b, t]`` is the
critic's V(s_t), the value of the state *before* response token t is chosen, i.e.
the position whose logits predict token t.

- Outcome reward: the sequence reward R sits on the last response token, 0 elsewhere.
- GAE (Schulman et al. 2016), per sequence, backwards over its tokens:
      delta_t = r_t + gamma * V_{t+1} - V_t,        V after the last token = 0 (terminal)
      A_t     = delta_t + gamma * lam * A_{t+1},    A after the last token = 0
      returns_t = A_t + V_t
  A truncated response is treated as terminal too (its reward is final), as verl does.
- Whitening: (A - mean) / sqrt(var + 1e-8) over the batch's masked tokens, var with
  ddof = 1 (verl's masked_whiten).
- Clipped value loss (as in verl / PPO2), per token, aggregated with the loss's agg mode:
      V_clip = old_V + clip(V - old_V, -vf_clip, +vf_clip)
      l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)
  ``vf_clip=None`` drops the clipped branch.

Masked positions are removed with ``torch.where`` so NaN/inf there never leak.
"""

from __future__ import annotations

import torch

from bapo.algos.surrogate import aggregate


def response_mask(lengths: torch.Tensor | list[int]) -> torch.Tensor:
    """[B, max(lengths)] bool mask of right-padded responses with the given lengths."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)  # [B]
    width = int(lengths.max().item()) if lengths.numel() else 0
    return torch.arange(width)[None, :] < lengths[:, None]  # [B, T]


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] token rewards: each sequence's reward on its last masked token, 0 elsewhere."""
    m = mask.bool()  # [B, T]
    if rewards.shape != m.shape[:1]:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] for a mask of shape {tuple(m.shape)}")
    pos = torch.arange(m.shape[-1], device=m.device).expand_as(m)  # [B, T]
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=-1)  # [B], -1 for an empty sequence
    out = torch.zeros(m.shape, dtype=rewards.dtype, device=m.device)  # [B, T]
    has = last >= 0  # [B]
    out[has.nonzero().squeeze(-1), last[has]] = rewards[has]
    return out


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and 0 at masked positions; see the module docstring."""
    if not (token_rewards.shape == values.shape == mask.shape):
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and "
            f"mask {tuple(mask.shape)} must share one [B, T] shape"
        )
    m = mask.bool()  # [B, T]
    zero = torch.zeros_like(values)
    v = torch.where(m, values, zero)  # [B, T]
    r = torch.where(m, token_rewards.to(values.dtype), zero)  # [B, T]
    adv = torch.zeros_like(v)  # [B, T]
    next_adv = v.new_zeros(v.shape[0])  # [B]
    next_v = v.new_zeros(v.shape[0])  # [B]
    for t in reversed(range(v.shape[-1])):
        # next_* are 0 past a sequence's last token, so its value and advantage stop there
        delta = r[:, t] + gamma * next_v - v[:, t]  # [B]
        cur = torch.where(m[:, t], delta + gamma * lam * next_adv, torch.zeros_like(delta))  # [B]
        adv[:, t] = cur
        next_adv, next_v = cur, v[:, t]
    return adv, torch.where(m, adv + v, zero)


def whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over masked entries (var with ddof = 1); 0 where masked."""
    m = mask.bool()
    xm = torch.where(m, x, torch.zeros_like(x))
    n = m.sum()
    mean = xm.sum() / n.clamp(min=1)
    var = torch.where(m, (x - mean) ** 2, torch.zeros_like(x)).sum() / (n - 1).clamp(min=1)
    return torch.where(m, (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    vf_clip: float | None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss over [B, T] tokens (module docstring); normalisers as ``aggregate``.

    Stats: value_loss, value_clip_frac (tokens where the clipped branch is the larger
    one, i.e. it carries the gradient), value_mean, return_mean, tokens.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError("values, old_values, returns and mask must share one shape")
    if vf_clip is not None and not vf_clip > 0:
        raise ValueError(f"vf_clip must be > 0 (or None), got {vf_clip}")
    m = mask.bool()  # [B, T]
    zero = torch.zeros_like(values)
    v = torch.where(m, values, zero)  # [B, T]
    old = torch.where(m, old_values.to(v.dtype), zero)  # [B, T]
    ret = torch.where(m, returns.to(v.dtype), zero)  # [B, T]
    unclipped = (v - ret) ** 2  # [B, T]
    if vf_clip is None:
        per_token, clipped_wins = unclipped, torch.zeros_like(m)
    else:
        v_clip = old + (v - old).clamp(-vf_clip, vf_clip)  # [B, T]
        clipped = (v_clip - ret) ** 2  # [B, T]
        per_token, clipped_wins = torch.maximum(unclipped, clipped), clipped > unclipped
    loss = 0.5 * aggregate(per_token, m, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    n = m.sum().clamp(min=1).double()
    with torch.no_grad():
        stats = torch.stack(
            [
                loss.detach().double(),
                (clipped_wins & m).sum().double() / n,
                v.detach().double().sum() / n,
                ret.double().sum() / n,
                m.sum().double(),
            ]
        ).tolist()
    return loss, dict(zip(("value_loss", "value_clip_frac", "value_mean", "return_mean", "tokens"), stats, strict=True))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / (Var(returns) + 1e-5) over masked tokens (population variances).

    1 is a perfect critic, 0 no better than a constant, negative worse. The 1e-5 (as in
    verl) keeps it finite when the returns do not vary; 0 when there is no token.
    """
    m = mask.bool()
    ret, v = returns[m].double(), values[m].double()  # [n], [n]
    if ret.numel() == 0:
        return 0.0
    return float(1.0 - (ret - v).var(unbiased=False) / (ret.var(unbiased=False) + 1e-5))
