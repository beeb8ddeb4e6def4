"""The eps-feedback heuristic (NOT the paper's method): hand-computed loss, its eps rule, properties."""

import functools
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from bapo.algos import (
    AGG_MODES,
    agg_normalisers,
    aggregate,
    eps_feedback_g,
    eps_feedback_loss,
    eps_feedback_sums,
)
from tests.helpers.algos import RULE, assert_accumulation_matches, eps_state, random_batch

ROOT = Path(__file__).resolve().parents[3]
F64 = torch.float64


def test_the_rule_here_is_the_shipped_one():
    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "algo" / "eps_feedback.yaml").eps_feedback)
    assert {k: v for k, v in node.items() if k != "scope"} == RULE


# eps = 0.2, five tokens:
#   t  ratio  A    term at eps = 0.2
#   1  1.5   +1    min(1.5, clip 1.2) * 1        = 1.2       (no gradient: r > 1.2)
#   2  0.5   +1    min(0.5, clip 0.8)            = 0.5
#   3  0.5   -1    max(-0.5, -0.8)               = -0.5      (max, the eps-feedback heuristic's rule)
#   4  1.5   -1    max(-1.5, -1.2)               = -1.2
#   5  1.0   -2    max(-2.0, -2.0)               = -2.0
# positive sum 1.7, negative sum -3.7 -> g = 3.7 / 1.7 = 2.176470588 > 1
# eps_neg = 0.2 * (1 + 0.5 * g) = 0.417647059; negative terms again at [0.582353, 1.417647]:
#   t3: max(-0.5, -0.582353) = -0.5;  t4: max(-1.5, -1.417647) = -1.417647 (no gradient);  t5: -2.0
# loss = -(1.2 + 0.5 - 0.5 - 1.417647 - 2.0) / 5 = 2.217647 / 5 = 0.443529
RATIO = [1.5, 0.5, 0.5, 1.5, 1.0]
ADV = [1.0, 1.0, -1.0, -1.0, -2.0]
G_HAND = 3.7 / 1.7
EPS_NEG = 0.2 * (1 + 0.5 * G_HAND)


def _inputs(ratios=RATIO, advs=ADV):
    old = torch.full((1, len(ratios)), -1.0, dtype=F64)
    logp = (old + torch.tensor([ratios], dtype=F64).log()).requires_grad_()
    return logp, old, torch.tensor([advs], dtype=F64), torch.ones_like(old, dtype=torch.bool)


def test_hand_computed_eps_feedback_loss():
    logp, old, adv, mask = _inputs()
    loss, stats = eps_feedback_loss(logp, old, adv, mask, eps=0.2, entropy_coef=0.0)
    assert stats["g"] == pytest.approx(G_HAND)
    assert stats["eps_neg"] == pytest.approx(EPS_NEG)
    assert loss.item() == pytest.approx((1.7 - 0.5 - (1 + EPS_NEG) - 2.0) / -5)
    loss.backward()
    # d loss / d logp_t = -A r / 5 where the term keeps its gradient (t2, t3, t5)
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5 / 5, 0.5 / 5, 0.0, 2.0 / 5])
    assert stats["clip_frac_high"] == pytest.approx(1 / 2)  # t1 of t1, t2
    assert stats["neg_clip_frac"] == pytest.approx(1 / 3)  # t4 of t3, t4, t5
    assert stats["clip_frac_low"] == pytest.approx(1 / 3)  # t3: r < 0.8 (reported, not clipped)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["pos_token_frac"] == pytest.approx(2 / 5)
    # the entropy bonus: entropy 1 everywhere, coefficient 0.01 -> 0.01 lower
    loss_e, stats_e = eps_feedback_loss(logp, old, adv, mask, eps=0.2, entropy=torch.ones_like(old))
    assert loss_e.item() == pytest.approx(loss.item() - 0.01) and stats_e["entropy"] == 1.0


def test_no_recompute_when_g_at_most_one():
    # t1 r = 1.5, A = +2 -> 2 * 1.2 = 2.4; t2 r = 1.5, A = -1 -> max(-1.5, -1.2) = -1.2; g = 0.5
    logp, old, adv, mask = _inputs([1.5, 1.5], [2.0, -1.0])
    loss, stats = eps_feedback_loss(logp, old, adv, mask, eps=0.2, entropy_coef=0.0)
    assert stats["g"] == pytest.approx(0.5) and stats["eps_neg"] == 0.2
    assert loss.item() == pytest.approx(-(2.4 - 1.2) / 2)


def test_given_g_overrides_the_local_one():
    logp, old, adv, mask = _inputs()
    # g = 0.9 given (say, from the whole update): no recompute, t4 stays at -1.2
    loss, stats = eps_feedback_loss(logp, old, adv, mask, eps=0.2, g=0.9, entropy_coef=0.0)
    assert stats["eps_neg"] == 0.2 and loss.item() == pytest.approx(-(1.7 - 3.7) / 5)


def test_sums_and_g():
    _, _, adv, mask = _inputs()
    sums = eps_feedback_sums(torch.tensor([RATIO], dtype=F64), adv, mask, eps=0.2)
    assert sums.tolist() == pytest.approx([1.7, -3.7])
    assert eps_feedback_g(sums) == pytest.approx(G_HAND)
    assert eps_feedback_g(torch.zeros(2)) == 0.0  # nothing to compare: 0 / (0 + 1e-8)


def test_eps_rule():
    state = eps_state()
    assert state.eps == 0.2
    # g > 1: eps * 1.1; 0.5 <= g <= 1: unchanged; g < 0.5: eps * 0.9
    nxt = "eps_feedback/eps_next"
    assert state.after_update({"eps_feedback/g": 2.0}) == {nxt: pytest.approx(0.22)}
    assert state.after_update({"eps_feedback/g": 1.0})[nxt] == pytest.approx(0.22)
    assert state.after_update({"eps_feedback/g": 0.5})[nxt] == pytest.approx(0.22)
    assert state.after_update({"eps_feedback/g": 0.49})[nxt] == pytest.approx(0.198)
    for _ in range(20):
        state.after_update({"eps_feedback/g": 5.0})
    assert state.eps == 0.5  # capped
    for _ in range(30):
        state.after_update({"eps_feedback/g": 0.0})
    assert state.eps == 0.1  # floored
    saved = state.state_dict()
    other = eps_state()
    other.load_state_dict(saved)
    assert other == state
    with pytest.raises(ValueError):
        eps_state(eps=0.6)


def eps_feedback_reference(ratio, adv, eps, g_high=1.0, widen=0.5):
    """The eps-feedback heuristic, token by token in python: A * min(r, 1 + eps_side) is what min/max reduce to."""
    pos = sum(a * min(r, 1 + eps) for r, a in zip(ratio, adv, strict=True) if a > 0)
    neg = sum(a * min(r, 1 + eps) for r, a in zip(ratio, adv, strict=True) if a <= 0)
    g = abs(neg) / (abs(pos) + 1e-8)
    eps_neg = eps * (1 + widen * g) if g > g_high else eps
    neg = sum(a * min(r, 1 + eps_neg) for r, a in zip(ratio, adv, strict=True) if a <= 0)
    return -(pos + neg) / len(ratio), g


_random = functools.partial(random_batch, b=4, t=6, spread=0.5)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), eps=st.floats(0.1, 0.5), spread=st.floats(0.05, 1.5))
def test_matches_token_by_token_reference(seed, eps, spread):
    logp, old, adv, mask = _random(seed, spread=spread)
    loss, stats = eps_feedback_loss(logp, old, adv, mask, eps=eps, entropy_coef=0.0)
    ratio = (logp - old).exp()[mask].tolist()
    expected, g = eps_feedback_reference(ratio, adv[mask].tolist(), eps)
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert stats["g"] == pytest.approx(g, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), agg=st.sampled_from(AGG_MODES))
def test_on_policy_is_plain_policy_gradient(seed, agg):
    _, old, adv, mask = _random(seed)
    loss, stats = eps_feedback_loss(old.clone(), old, adv, mask, eps=0.2, entropy_coef=0.0, agg=agg)
    torch.testing.assert_close(loss, -aggregate(adv, mask, agg=agg))
    assert stats["clip_frac"] == 0.0


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_split_invariant_given_the_update_g(agg):
    logp, old, adv, mask = _random(7, b=8, spread=0.8)
    mask[2] = False
    entropy = torch.rand(8, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    g = eps_feedback_g(eps_feedback_sums((logp - old).exp(), adv, mask, eps=0.2))
    parts = (slice(0, 3), slice(3, 5), slice(5, 8))
    assert_accumulation_matches(
        eps_feedback_loss, logp, old, adv, mask, parts, norms=agg_normalisers(mask), per_token={"entropy": entropy},
        eps=0.2, g=g, agg=agg, entropy_coef=0.01,
    )  # fmt: skip


garbage = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30])


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), junk=st.lists(garbage, min_size=3, max_size=3))
def test_masked_positions_change_nothing(seed, junk):
    logp, old, adv, mask = _random(seed)
    base, st_base = eps_feedback_loss(logp, old, adv, mask, eps=0.2)
    dirty = [x.masked_fill(~mask, j) for x, j in zip((logp, old, adv), junk, strict=True)]
    loss, st_dirty = eps_feedback_loss(*dirty, mask, eps=0.2)
    assert loss.item() == base.item() and st_dirty == st_base


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float32, F64]))
def test_extreme_log_ratios_stay_finite(seed, dtype):
    logp, old, adv, mask = _random(seed, dtype=dtype)
    signs = torch.where(torch.rand(logp.shape, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)
    logp = (old + 50.0 * signs.to(dtype)).requires_grad_()
    loss, stats = eps_feedback_loss(logp, old, adv, mask, eps=0.2, entropy=torch.ones_like(old))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in stats.values())
