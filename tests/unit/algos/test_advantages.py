"""GRPO advantages: hand-computed groups, degenerate groups, and properties."""

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.algos import group_stats, grpo_advantages


def test_hand_computed_group():
    # Group 1: rewards [1, 0, 0, 0]; mean = 0.25; deviations [0.75, -0.25, -0.25, -0.25].
    # ddof=1 variance = (0.75^2 + 3 * 0.25^2) / 3 = (0.5625 + 0.1875) / 3 = 0.25 -> std = 0.5.
    # A = deviation / (0.5 + 1e-6) ~ [1.5, -0.5, -0.5, -0.5].
    # Group 2: rewards [2, 2, 2, 2] -> all equal -> exactly 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    adv = grpo_advantages(rewards, 4)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64) / (0.5 + 1e-6)
    torch.testing.assert_close(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4, dtype=torch.float64))
    # norm_std=False keeps the raw deviations.
    raw = grpo_advantages(rewards, 4, norm_std=False)
    torch.testing.assert_close(raw[:4], torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64))


def test_degenerate_group_is_exactly_zero():
    # mean([0.1, 0.1, 0.1]) is not exactly 0.1 in floating point; the advantage must still be 0.
    adv = grpo_advantages(torch.tensor([0.1, 0.1, 0.1]), 3)
    assert torch.equal(adv, torch.zeros(3))
    adv = grpo_advantages(torch.tensor([0.1, 0.1, 0.1]), 3, norm_std=False)
    assert torch.equal(adv, torch.zeros(3))


def test_group_size_one_gives_zeros():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5]), 1)
    assert torch.equal(adv, torch.zeros(3))
    stats = group_stats(torch.tensor([1.0, 0.0, 0.5]), 1)
    assert stats["num_groups"] == 3 and stats["degenerate_groups"] == 3


def test_not_divisible_raises():
    with pytest.raises(ValueError, match="not divisible by group_size"):
        grpo_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        group_stats(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(4), 0)


def test_integer_rewards_and_lists():
    adv = grpo_advantages([1, 0], 2)
    assert adv.is_floating_point()
    # mean 0.5, ddof=1 std = sqrt(0.5) -> A = +-0.5 / (0.70710678 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]) / (0.5**0.5 + 1e-6))


def test_group_stats_counts():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    stats = group_stats(rewards, 3)
    # groups: [1, 1, 0] (signal), [0, 1, 0] (signal), [0, 0, 0] (degenerate)
    assert stats["num_groups"] == 3
    assert stats["degenerate_groups"] == 1
    assert stats["degenerate_frac"] == pytest.approx(1 / 3)
    assert stats["reward_mean"] == pytest.approx(3 / 9)


@settings(max_examples=50, deadline=None)
@given(
    groups=st.integers(2, 6).flatmap(
        lambda size: st.lists(
            st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.5]), min_size=size, max_size=size),
            min_size=1,
            max_size=5,
        )
    ),
    shift=st.floats(-10, 10),
)
def test_matches_statistics_reference(groups, shift):
    size = len(groups[0])
    rewards = torch.tensor([x for g in groups for x in g], dtype=torch.float64)
    adv = grpo_advantages(rewards, size)
    for i, group in enumerate(groups):
        mean, std = statistics.mean(group), statistics.stdev(group)
        expected = [0.0] * size if std == 0 else [(x - mean) / (std + 1e-6) for x in group]
        assert adv[i * size : (i + 1) * size].tolist() == pytest.approx(expected, abs=1e-9)
    # Shifting every reward by a constant changes nothing.
    torch.testing.assert_close(grpo_advantages(rewards + shift, size), adv, atol=1e-6, rtol=1e-6)
