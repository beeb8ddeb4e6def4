"""Critic-side math: outcome rewards, GAE, whitening, the clipped value loss, explained variance."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.algos import (
    AGG_MODES,
    agg_normalisers,
    explained_variance,
    gae_advantages,
    outcome_token_rewards,
    response_mask,
    value_loss,
    whiten,
)

F64 = torch.float64


def test_response_mask_and_outcome_rewards():
    mask = response_mask([3, 1, 0, 2])
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
    r = outcome_token_rewards(torch.tensor([1.0, 0.5, 7.0, -1.0], dtype=F64), mask)
    # each reward on its sequence's last token; the empty sequence gets nothing
    assert r.tolist() == [[0, 0, 1.0], [0.5, 0, 0], [0, 0, 0], [0, -1.0, 0]]


def test_gae_hand_computed():
    # One sequence, V = [0.5, 0.6, 0.8], reward 1 on the last token, gamma = 1, lam = 0.5:
    #   t2: delta = 1 + 0 - 0.8 = 0.2                A2 = 0.2
    #   t1: delta = 0 + 0.8 - 0.6 = 0.2              A1 = 0.2 + 0.5 * 0.2 = 0.3
    #   t0: delta = 0 + 0.6 - 0.5 = 0.1              A0 = 0.1 + 0.5 * 0.3 = 0.25
    #   returns = A + V = [0.75, 0.9, 1.0]
    values = torch.tensor([[0.5, 0.6, 0.8]], dtype=F64)
    mask = torch.ones_like(values, dtype=torch.bool)
    rewards = outcome_token_rewards(torch.tensor([1.0], dtype=F64), mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    assert adv.tolist() == [pytest.approx([0.25, 0.3, 0.2])]
    assert ret.tolist() == [pytest.approx([0.75, 0.9, 1.0])]


def test_gae_hand_computed_discounted_with_padding():
    # Second row has 2 tokens (then padding holding garbage), V = [0.2, 0.4], reward 0, gamma = 0.9, lam = 1:
    #   t1: delta = 0 + 0 - 0.4 = -0.4                         A1 = -0.4
    #   t0: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16                 A0 = 0.16 + 0.9 * 1 * (-0.4) = -0.2
    #   returns = A + V = [0.0, 0.0]: with lam = 1, the discounted Monte-Carlo return of reward 0
    # First row, 3 tokens, V = 0, reward 1: A = returns = [0.81, 0.9, 1.0] (gamma^k).
    values = torch.tensor([[0.0, 0.0, 0.0], [0.2, 0.4, float("nan")]], dtype=F64)
    mask = response_mask([3, 2])
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0], dtype=F64), mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    assert adv[1].tolist() == pytest.approx([-0.2, -0.4, 0.0])
    assert ret[1].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)
    assert adv[0].tolist() == pytest.approx([0.81, 0.9, 1.0])


def direct_gae(rewards, values, gamma, lam):
    """Backward recursion over one sequence, in plain python."""
    adv, nxt_a, nxt_v = [0.0] * len(values), 0.0, 0.0
    for t in reversed(range(len(values))):
        delta = rewards[t] + gamma * nxt_v - values[t]
        nxt_a = delta + gamma * lam * nxt_a
        adv[t], nxt_v = nxt_a, values[t]
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
)
def test_gae_equals_direct_recursion(lengths, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    mask = response_mask(lengths)
    values = torch.randn(mask.shape, generator=g, dtype=F64)
    rewards = torch.randn(mask.shape, generator=g, dtype=F64)  # dense rewards: the recursion is general
    garbage_v = values.masked_fill(~mask, float("nan"))
    garbage_r = rewards.masked_fill(~mask, float("inf"))
    adv, ret = gae_advantages(garbage_r, garbage_v, mask, gamma=gamma, lam=lam)
    for b, n in enumerate(lengths):
        exp_adv, exp_ret = direct_gae(rewards[b, :n].tolist(), values[b, :n].tolist(), gamma, lam)
        assert adv[b, :n].tolist() == pytest.approx(exp_adv, abs=1e-9)
        assert ret[b, :n].tolist() == pytest.approx(exp_ret, abs=1e-9)
        assert torch.all(adv[b, n:] == 0) and torch.all(ret[b, n:] == 0)


def test_whiten_hand_computed():
    # masked entries [1, 2, 3]: mean 2, ddof-1 variance ((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1]
    x = torch.tensor([[1.0, 2.0], [3.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    out = whiten(x, mask)
    assert out[mask].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-7)
    assert out[1, 1].item() == 0.0


# Three tokens, vf_clip = 0.2 (values, old values, returns):
#   t0: V 0.9, old 0.5, R 1.0: (0.9 - 1)^2 = 0.01;  V_clip = 0.5 + 0.2 = 0.7: (0.7 - 1)^2 = 0.09 -> 0.09 (clipped wins)
#   t1: V 0.0, old 0.5, R 1.0: (0 - 1)^2 = 1.0;     V_clip = 0.3: (0.3 - 1)^2 = 0.49         -> 1.0
#   t2: V 0.6, old 0.5, R 0.5: (0.6 - 0.5)^2 = 0.01; V_clip = 0.6 (inside the range)        -> 0.01
#   loss = 0.5 * (0.09 + 1.0 + 0.01) / 3 = 0.18333...; clip fraction 1 / 3
#   d loss / dV = (V - R) / 3 where the unclipped branch counts: [0, -1/3, 0.1/3]
V_HAND, OLD_HAND, RET_HAND = [0.9, 0.0, 0.6], [0.5, 0.5, 0.5], [1.0, 1.0, 0.5]


def test_value_loss_hand_computed():
    v = torch.tensor([V_HAND], dtype=F64, requires_grad=True)
    old, ret = torch.tensor([OLD_HAND], dtype=F64), torch.tensor([RET_HAND], dtype=F64)
    mask = torch.ones_like(old, dtype=torch.bool)
    loss, stats = value_loss(v, old, ret, mask, vf_clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 1.1 / 3)
    assert stats["value_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, -1 / 3, 0.1 / 3])
    # unclipped: 0.5 * (0.01 + 1.0 + 0.01) / 3
    loss, stats = value_loss(v, old, ret, mask, vf_clip=None)
    assert loss.item() == pytest.approx(0.5 * 1.02 / 3) and stats["value_clip_frac"] == 0.0


def _value_batch(seed, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, generator=g, dtype=F64)
    v = old + 0.5 * torch.randn(b, t, generator=g, dtype=F64)
    ret = torch.randn(b, t, generator=g, dtype=F64)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = t
    return v, old, ret, torch.arange(t)[None, :] < lengths[:, None]


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_micro_batch_split_invariant(agg):
    v, old, ret, mask = _value_batch(3, b=7)
    full_v = v.clone().requires_grad_()
    full, _ = value_loss(full_v, old, ret, mask, vf_clip=0.3, agg=agg)
    full.backward()
    norms = agg_normalisers(mask)
    micro_v, total = v.clone().requires_grad_(), 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 7)):
        loss, _ = value_loss(micro_v[rows], old[rows], ret[rows], mask[rows], vf_clip=0.3, agg=agg, **norms)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(micro_v.grad, full_v.grad)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), junk=st.sampled_from([float("nan"), float("inf"), 1e30]))
def test_value_loss_masked_positions_change_nothing(seed, junk):
    v, old, ret, mask = _value_batch(seed)
    base, st_base = value_loss(v, old, ret, mask, vf_clip=0.2)
    dirty = [x.masked_fill(~mask, junk) for x in (v, old, ret)]
    loss, st_dirty = value_loss(*dirty, mask, vf_clip=0.2)
    assert loss.item() == base.item() and st_dirty == st_base


def test_explained_variance():
    ret = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=F64)
    mask = torch.tensor([True, True, True, False])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    # predicting the mean (1.0) explains nothing: Var(ret - 1) = Var(ret)
    assert explained_variance(torch.ones(4, dtype=F64), ret, mask) == pytest.approx(0.0, abs=1e-4)
    # values 1 + 2 (ret - 1) overshoot: residual ret - values = -(ret - 1), the same variance as ret: 0
    assert explained_variance(1 + 2 * (ret - 1), ret, mask) == pytest.approx(0.0, abs=1e-4)
    assert explained_variance(ret, ret, torch.zeros(4, dtype=torch.bool)) == 0.0
    assert math.isfinite(explained_variance(torch.zeros(3), torch.ones(3), torch.ones(3, dtype=torch.bool)))
