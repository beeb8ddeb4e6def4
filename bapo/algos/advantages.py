"""Advantages: GRPO group-normalised (BAPO.md, "GRPO advantages"), or GAE from a critic.

``compute_advantages(kind, ...)`` is the one entry point the loop calls; ``kind`` is
``algo.advantage``: ``grpo`` or ``gae`` (PPO; the critic math is in ``value.py``).
Both return per-token advantages [B, T] over right-padded responses.

GRPO: every prompt is sampled ``group_size`` times; the rewards arrive flat, group after
group (``[num_prompts * group_size]``). Each response's advantage is its reward
minus its group's mean, divided by the group's unbiased standard deviation
(ddof = 1, as verl does) plus ``eps``:

    A_i = (R_i - mean(R_group)) / (std(R_group) + eps)

A group whose rewards are all equal carries no learning signal and gets exactly 0
(not a float residue of ``R - mean``). A group of one response has no spread at all
(its ddof = 1 std is undefined), so ``group_size == 1`` also gives zeros. The
advantage is per sequence; ``compute_advantages`` broadcasts it over the sequence's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bapo.algos.value import gae_advantages, outcome_token_rewards, response_mask, whiten


def _grouped(rewards: torch.Tensor | list[float], group_size: int) -> torch.Tensor:
    """Return ``rewards`` as a float tensor of shape [num_groups, group_size]."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"len(rewards) = {rewards.numel()} is not divisible by group_size = {group_size}; "
            "rewards must hold whole groups, one after another"
        )
    return rewards.view(-1, group_size)  # [G, K]


def _degenerate(grouped: torch.Tensor) -> torch.Tensor:
    """[G] bool: True for groups whose rewards are all equal (no signal)."""
    return (grouped == grouped[:, :1]).all(dim=1)


def grpo_advantages(
    rewards: torch.Tensor | list[float],
    group_size: int,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised advantages, one per response: [num_prompts * group_size].

    ``norm_std=False`` drops the division by the group std (Dr. GRPO style).
    Degenerate groups (all rewards equal, or ``group_size == 1``) get exactly 0.
    """
    grouped = _grouped(rewards, group_size)  # [G, K]
    if group_size == 1:
        return torch.zeros_like(grouped).view(-1)
    adv = grouped - grouped.mean(dim=1, keepdim=True)  # [G, K]
    if norm_std:
        adv = adv / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    adv = torch.where(_degenerate(grouped).unsqueeze(1), torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def group_stats(rewards: torch.Tensor | list[float], group_size: int) -> dict[str, float]:
    """Metrics about the groups: how many there are and how many carry no signal.

    Returns python floats: ``num_groups``, ``degenerate_groups`` (all rewards equal),
    ``degenerate_frac``, ``reward_mean`` and ``reward_std_in_group`` (the mean over
    groups of the ddof = 1 std; 0 when ``group_size == 1``).
    """
    grouped = _grouped(rewards, group_size)  # [G, K]
    num_groups = grouped.shape[0]
    degenerate = int(_degenerate(grouped).sum().item()) if num_groups else 0
    if group_size > 1 and num_groups:
        std_in_group = grouped.std(dim=1, unbiased=True).mean().item()
    else:
        std_in_group = 0.0
    return {
        "num_groups": float(num_groups),
        "degenerate_groups": float(degenerate),
        "degenerate_frac": degenerate / num_groups if num_groups else 0.0,
        "reward_mean": grouped.mean().item() if num_groups else 0.0,
        "reward_std_in_group": std_in_group,
    }


def _grpo_tokens(rewards, mask, *, values, group_size, norm_std, gamma, lam):
    adv = grpo_advantages(rewards, group_size, norm_std=norm_std)  # [B]
    return torch.where(mask, adv[:, None], torch.zeros((), dtype=adv.dtype)), None  # [B, T]


def _gae_tokens(rewards, mask, *, values, group_size, norm_std, gamma, lam):
    if values is None:
        raise ValueError("advantage 'gae' needs the critic's values (the learner gives them when it has a critic)")
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} must be [B, T] = {tuple(mask.shape)}")
    values = values.to(rewards.dtype)
    adv, returns = gae_advantages(outcome_token_rewards(rewards, mask), values, mask, gamma=gamma, lam=lam)
    return whiten(adv, mask), returns


ADVANTAGE_KINDS = {"grpo": _grpo_tokens, "gae": _gae_tokens}


def compute_advantages(
    kind: str,
    rewards: torch.Tensor | Sequence[float],
    lengths: torch.Tensor | Sequence[int],
    *,
    group_size: int,
    norm_std: bool = True,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Per-token advantages of one rollout batch: (adv [B, T], returns [B, T] or None, stats).

    ``rewards`` [B] are outcome rewards, group after group; ``lengths`` [B] the response
    lengths, T = max(lengths). ``grpo``: the group-normalised advantage broadcast over each
    response's tokens (``norm_std`` as ``grpo_advantages``). ``gae``: the reward on the last
    token, GAE(``gamma``, ``lam``) on the critic's ``values`` [B, T], whitened over the
    batch's tokens; ``returns`` are the critic's targets. 0 at padding. Stats:
    ``group_stats`` plus, for gae, value_mean and return_mean.
    """
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"advantage kind must be one of {tuple(ADVANTAGE_KINDS)}, got {kind!r}")
    rewards = torch.as_tensor(rewards)
    rewards = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    mask = response_mask(lengths)  # [B, T]
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards {tuple(rewards.shape)} and lengths ({mask.shape[0]}) differ")
    adv, returns = ADVANTAGE_KINDS[kind](
        rewards, mask, values=values, group_size=group_size, norm_std=norm_std, gamma=gamma, lam=lam
    )
    stats = group_stats(rewards, group_size)
    if returns is not None:
        n = mask.sum().clamp(min=1)
        stats["value_mean"] = float(torch.where(mask, values, 0.0).sum() / n)
        stats["return_mean"] = float(torch.where(mask, returns, 0.0).sum() / n)
    return adv, returns, stats
