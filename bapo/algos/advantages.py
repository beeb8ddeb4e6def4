"""GRPO group-normalised advantages (BAPO.md, "GRPO advantages").

Every prompt is sampled ``group_size`` times; the rewards arrive flat, group after
group (``[num_prompts * group_size]``). Each response's advantage is its reward
minus its group's mean, divided by the group's unbiased standard deviation
(ddof = 1, as verl does) plus ``eps``:

    A_i = (R_i - mean(R_group)) / (std(R_group) + eps)

A group whose rewards are all equal carries no learning signal and gets exactly 0
(not a float residue of ``R - mean``). A group of one response has no spread at all
(its ddof = 1 std is undefined), so ``group_size == 1`` also gives zeros. The
advantage is per sequence; the learner broadcasts it over the sequence's tokens.
"""

from __future__ import annotations

import torch


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
