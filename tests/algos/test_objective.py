"""Objectives (chooser + loss + state) and the advantage entry point the loop calls."""

import pytest
import torch

from bapo.algos import (
    CardState,
    bapo_bounds,
    card_g,
    card_loss,
    card_objective,
    card_sums,
    compute_advantages,
    grpo_advantages,
    policy_loss,
    surrogate_objective,
)

F64 = torch.float64


def _tokens(seed=0, n=60):
    g = torch.Generator().manual_seed(seed)
    ratio = torch.exp(0.4 * torch.randn(n, generator=g, dtype=F64))
    adv = torch.randn(n, generator=g, dtype=F64)
    old = -torch.rand(n, generator=g, dtype=F64)
    return ratio, adv, torch.ones(n, dtype=torch.bool), old


def test_surrogate_objective_is_bounds_plus_policy_loss():
    ratio, adv, mask, old = _tokens()
    obj = surrogate_objective("bapo", rho0=0.5, agg="seq-mean-token-sum", dual_clip=3.0)
    params, stats = obj.choose(ratio, adv, mask, old)
    lo, hi, bstats = bapo_bounds(ratio, adv, mask, old, rho0=0.5)
    assert params == {"ratio_low": lo, "ratio_high": hi}
    assert stats == {"ratio_low": lo, "ratio_high": hi, **bstats}
    assert obj.loss is policy_loss and obj.adaptive and obj.state is None and obj.after_update(stats) == {}
    assert obj.loss_kw["agg"] == "seq-mean-token-sum" and obj.loss_kw["dual_clip"] == 3.0
    fixed = surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.28)
    assert not fixed.adaptive and fixed.choose(ratio, adv, mask, old)[0] == {"ratio_low": 0.8, "ratio_high": 1.28}
    with pytest.raises(ValueError, match="kind"):
        surrogate_objective("card")


def test_card_objective_chooses_g_and_steps_eps():
    ratio, adv, mask, old = _tokens(1)
    state = CardState()
    obj = card_objective(state, entropy_coef=0.01)
    params, stats = obj.choose(ratio, adv, mask, old, reduce_sum=lambda t: 2 * t)  # two equal ranks: same g
    g = card_g(card_sums(ratio, adv, mask, eps=0.2))
    assert params == {"eps": 0.2, "g": pytest.approx(g)}
    assert stats["ratio_low"] == pytest.approx(0.8) and stats["ratio_high"] == pytest.approx(1.2)
    assert obj.loss is card_loss and obj.adaptive and obj.prefix == "card"
    expected = 0.22 if g > 1 else 0.18 if g < 0.5 else 0.2
    assert obj.after_update(stats) == {"eps_next": pytest.approx(expected)}
    assert state.eps == pytest.approx(expected)


def test_compute_advantages_grpo_broadcasts_over_tokens():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=F64)
    adv, returns, stats = compute_advantages("grpo", rewards, [2, 3, 1, 2, 2, 2], group_size=3)
    seq = grpo_advantages(rewards, 3)
    assert returns is None and adv.shape == (6, 3)
    for b, n in enumerate([2, 3, 1, 2, 2, 2]):
        assert adv[b, :n].tolist() == [seq[b].item()] * n and torch.all(adv[b, n:] == 0)
    assert stats["degenerate_groups"] == 1.0  # the second group is all ones


def test_compute_advantages_gae_is_whitened_gae():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)
    lengths = [3, 2, 4, 1]
    values = torch.rand(4, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    adv, returns, stats = compute_advantages("gae", rewards, lengths, group_size=2, values=values, gamma=1.0, lam=0.9)
    mask = torch.arange(4)[None, :] < torch.tensor(lengths)[:, None]
    assert adv[mask].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert adv[mask].std().item() == pytest.approx(1.0, abs=1e-6)
    # returns at the last token: the reward itself (no bootstrap after the end)
    assert [returns[b, n - 1].item() for b, n in enumerate(lengths)] == pytest.approx(rewards.tolist())
    assert "value_mean" in stats and "return_mean" in stats
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", rewards, lengths, group_size=2)
    with pytest.raises(ValueError, match="advantage kind"):
        compute_advantages("rloo", rewards, lengths, group_size=2)
