"""The clipped surrogate: hand-computed cases, a PPO-clip reference, accumulation, properties."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.algos import AGG_MODES, agg_normalisers, aggregate, entropy_from_logits, policy_loss, token_logp
from tests.helpers.algos import assert_accumulation_matches, random_batch

F64 = torch.float64

# Six tokens, c_low = 0.8, c_high = 1.2, dual clip c = 3:
#   t  ratio  A    s = min(rA, clip(r)A)                         dual clip
#   1  1.5   +1    min(1.5, 1.2) * 1 = 1.2   (clipped high)
#   2  0.5   +1    min(0.5, 1.2) * 1 = 0.5   (positive below c_low: not clipped)
#   3  0.5   -1    -max(0.5, 0.8)    = -0.8  (clipped low)
#   4  1.5   -1    -max(1.5, 0.8)    = -1.5
#   5  4.0   -1    -max(4.0, 0.8)    = -4.0   -> max(-4.0, 3 * -1) = -3.0 (dual clipped)
#   6  1.0   +2    2 * 1.0           = 2.0
HAND_RATIO = [1.5, 0.5, 0.5, 1.5, 4.0, 1.0]
HAND_ADV = [1.0, 1.0, -1.0, -1.0, -1.0, 2.0]


def _hand_inputs(layout):
    """Put the six tokens into ``layout`` ([B, T] list of token indices or None = padding)."""
    old = torch.full((len(layout), len(layout[0])), -1.3, dtype=F64)
    logp = torch.full_like(old, float("nan"))  # garbage at padding
    adv = torch.full_like(old, float("inf"))
    mask = torch.zeros_like(old, dtype=torch.bool)
    for b, row in enumerate(layout):
        for t, tok in enumerate(row):
            if tok is not None:
                logp[b, t] = old[b, t] + math.log(HAND_RATIO[tok])
                adv[b, t] = HAND_ADV[tok]
                mask[b, t] = True
    return logp.requires_grad_(), old, adv, mask


def test_hand_computed_token_mean_with_dual_clip():
    logp, old, adv, mask = _hand_inputs([[0, 1, 2, 3, 4, 5, None]])
    loss, stats = policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.2, dual_clip=3.0)
    # sum s = 1.2 + 0.5 - 0.8 - 1.5 - 3.0 + 2.0 = -1.6 over 6 tokens -> loss = 1.6 / 6
    assert loss.item() == pytest.approx(1.6 / 6)
    loss.backward()
    # d loss / d logp_t = -A r / 6 for tokens with a gradient, 0 for clipped ones (t1, t3, t5).
    expected = [0.0, -0.5 / 6, 0.0, 1.5 / 6, 0.0, -2.0 / 6, 0.0]
    assert logp.grad[0].tolist() == pytest.approx(expected)
    assert stats["clip_frac_high"] == pytest.approx(1 / 3)  # t1 of positives t1, t2, t6
    assert stats["clip_frac_low"] == pytest.approx(1 / 3)  # t3 of negatives t3, t4, t5
    assert stats["dual_clip_frac"] == pytest.approx(1 / 3)  # t5 of the negatives
    assert stats["clip_frac"] == pytest.approx(3 / 6)  # t1, t3, t5 of all six
    assert stats["pos_token_frac"] == pytest.approx(0.5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 4.0 + 1.0) / 6)
    assert stats["ratio_max"] == pytest.approx(4.0)
    log_r = [math.log(r) for r in HAND_RATIO]
    assert stats["approx_kl"] == pytest.approx(sum(0.5 * x * x for x in log_r) / 6)
    # Without the dual clip t5 counts -4.0: sum = -2.6 -> loss = 2.6 / 6.
    loss, stats = policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.2)
    assert loss.item() == pytest.approx(2.6 / 6)
    assert stats["dual_clip_frac"] == 0.0 and stats["clip_frac"] == pytest.approx(2 / 6)


@pytest.mark.parametrize(
    "agg, expected",
    [
        # seq 1 = t1, t2: sum 1.2 + 0.5 = 1.7; seq 2 = t3..t6: -0.8 - 1.5 - 3.0 + 2.0 = -3.3; seq 3 empty.
        ("token-mean", 1.6 / 6),  # -(1.7 - 3.3) / 6 tokens
        ("seq-mean-token-sum", 0.8),  # -(1.7 - 3.3) / 2 sequences (the empty one does not count)
        ("seq-mean-token-mean", -0.0125),  # -(1.7 / 2 + -3.3 / 4) / 2 = -(0.85 - 0.825) / 2
        ("seq-mean-token-sum-norm", 0.2),  # -(1.7 - 3.3) / (2 sequences * T = 4)
    ],
)
def test_hand_computed_aggregation(agg, expected):
    layout = [[0, 1, None, None], [2, 3, 4, 5], [None] * 4]
    logp, old, adv, mask = _hand_inputs(layout)
    loss, _ = policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.2, dual_clip=3.0, agg=agg)
    assert loss.item() == pytest.approx(expected)


def ppo_clip_reference(logp, old_logp, adv, mask, lo, hi, agg):
    """Five-line PPO-clip, with plain python loops for the aggregation."""
    ratio = torch.exp(logp - old_logp)
    s = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    rows = [[s[b, t] for t in range(s.shape[1]) if mask[b, t]] for b in range(s.shape[0])]
    rows = [row for row in rows if row]
    tokens = [x for row in rows for x in row]
    return -{
        "token-mean": sum(tokens) / len(tokens),
        "seq-mean-token-sum": sum(sum(row) for row in rows) / len(rows),
        "seq-mean-token-mean": sum(sum(row) / len(row) for row in rows) / len(rows),
        "seq-mean-token-sum-norm": sum(tokens) / (len(rows) * s.shape[1]),
    }[agg]


_random_batch = functools.partial(random_batch, b=5, t=7, spread=0.4)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("seed", range(4))
def test_matches_ppo_clip_reference(agg, seed):
    logp, old, adv, mask = _random_batch(seed)
    logp_ref = logp.clone().requires_grad_()
    logp = logp.clone().requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.28, agg=agg)
    ref = ppo_clip_reference(logp_ref, old, adv, mask, 0.8, 1.28, agg)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logp.grad, logp_ref.grad)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_accumulation_equals_mini_batch(agg):
    logp, old, adv, mask = _random_batch(11, b=8, t=6, spread=0.6)
    mask[3] = False  # an empty sequence inside a micro-batch
    entropy = torch.rand(8, 6, dtype=F64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    norms = agg_normalisers([mask[:3], mask[3:6], mask[6:]])
    assert norms == agg_normalisers(mask)
    parts = (slice(0, 3), slice(3, 6), slice(6, 8))
    # entropy requires a gradient: the micro-batches' accumulated one must be the mini-batch's too
    assert_accumulation_matches(
        policy_loss, logp, old, adv, mask, parts, norms=norms, per_token={"entropy": entropy},
        ratio_low=0.8, ratio_high=1.2, dual_clip=3.0, agg=agg, entropy_coef=0.01,
    )  # fmt: skip


def test_entropy_bonus_and_stat():
    logp, old, adv, mask = _random_batch(3)
    entropy = torch.rand(logp.shape, dtype=F64)
    base, _ = policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.2)
    loss, stats = policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.2, entropy=entropy, entropy_coef=0.1)
    mean_entropy = entropy[mask].mean()
    torch.testing.assert_close(loss, base - 0.1 * mean_entropy)
    assert stats["entropy"] == pytest.approx(mean_entropy.item())
    assert stats["pg_loss"] == pytest.approx(base.item())


def test_argument_validation():
    logp, old, adv, mask = _random_batch(0)
    with pytest.raises(ValueError, match="agg"):
        policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.2, agg="mean")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.2, dual_clip=1.0)
    with pytest.raises(ValueError, match="ratio_low"):
        policy_loss(logp, old, adv, mask, ratio_low=1.3, ratio_high=1.2)
    with pytest.raises(ValueError, match="adv"):
        policy_loss(logp, old, adv[:, :3], mask, ratio_low=0.8, ratio_high=1.2)


def test_empty_mask_gives_zero_loss():
    logp, old, adv, mask = _random_batch(0)
    logp.requires_grad_()
    for agg in AGG_MODES:
        loss, stats = policy_loss(logp, old, adv, torch.zeros_like(mask), ratio_low=0.8, ratio_high=1.2, agg=agg)
        assert loss.item() == 0.0 and stats["tokens"] == 0.0
        assert all(math.isfinite(v) for v in stats.values())


def test_logit_helpers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g, dtype=F64) * 3
    ids = torch.randint(0, 11, (3, 4), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logp(logits, ids), expected)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    # Uniform logits: entropy log V. Huge and -inf logits stay finite.
    assert entropy_from_logits(torch.zeros(5)).item() == pytest.approx(math.log(5))
    extreme = torch.tensor([1e4, -1e4, float("-inf"), 0.0])
    assert entropy_from_logits(extreme).item() == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(token_logp(extreme, torch.tensor(1)))
    # Half precision is computed in float32.
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32
    assert token_logp(logits.bfloat16(), ids).dtype == torch.float32


# ---------------------------------------------------------------- properties

batch_seeds = st.integers(0, 10_000)


@settings(max_examples=200, deadline=None)
@given(seed=batch_seeds, agg=st.sampled_from(AGG_MODES), dual=st.sampled_from([None, 3.0]))
def test_on_policy_means_no_clipping(seed, agg, dual):
    _, old, adv, mask = _random_batch(seed)
    loss, stats = policy_loss(old.clone(), old, adv, mask, ratio_low=0.8, ratio_high=1.2, dual_clip=dual, agg=agg)
    # r = 1 everywhere: s_t = A_t, nothing clipped.
    torch.testing.assert_close(loss, -aggregate(adv, mask, agg=agg))
    assert stats["clip_frac"] == 0.0 and stats["ratio_max"] == 1.0 and stats["approx_kl"] == 0.0


garbage = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0])


@settings(max_examples=200, deadline=None)
@given(seed=batch_seeds, agg=st.sampled_from(AGG_MODES), junk=st.lists(garbage, min_size=4, max_size=4))
def test_masked_positions_change_nothing(seed, agg, junk):
    logp, old, adv, mask = _random_batch(seed, spread=1.0)
    entropy = torch.rand(logp.shape, dtype=F64)
    kwargs = {"ratio_low": 0.7, "ratio_high": 1.3, "dual_clip": 2.5, "agg": agg, "entropy_coef": 0.05}
    clean = logp.clone().requires_grad_()
    loss, stats = policy_loss(clean, old, adv, mask, entropy=entropy, **kwargs)
    loss.backward()

    dirty = [x.clone() for x in (logp, old, adv, entropy)]
    for x, value in zip(dirty, junk, strict=True):
        x[~mask] = value
    dirty[0].requires_grad_()
    loss2, stats2 = policy_loss(dirty[0], dirty[1], dirty[2], mask, entropy=dirty[3], **kwargs)
    loss2.backward()
    assert loss2.item() == loss.item()
    assert stats2 == stats
    assert torch.equal(dirty[0].grad, clean.grad)
    assert torch.all(dirty[0].grad[~mask] == 0)


@settings(max_examples=200, deadline=None)
@given(
    seed=batch_seeds,
    agg=st.sampled_from(AGG_MODES),
    dual=st.sampled_from([None, 3.0]),
    dtype=st.sampled_from([torch.float32, F64]),
)
def test_extreme_log_ratios_stay_finite(seed, agg, dual, dtype):
    logp, old, adv, mask = _random_batch(seed, dtype=dtype)
    signs = torch.where(torch.rand(logp.shape, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)
    logp = (old + 50.0 * signs.to(dtype)).requires_grad_()  # log-ratios of +-50
    loss, stats = policy_loss(logp, old, adv, mask, ratio_low=0.8, ratio_high=1.2, dual_clip=dual, agg=agg)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in stats.values())


@settings(max_examples=150, deadline=None)
@given(
    seed=batch_seeds,
    agg=st.sampled_from(AGG_MODES),
    cuts=st.lists(st.integers(1, 7), min_size=0, max_size=4, unique=True),
    dual=st.sampled_from([None, 3.0]),
)
def test_any_micro_batch_split_equals_the_mini_batch(seed, agg, cuts, dual):
    """Gradient accumulation with mini-batch normalisers: any split into micro-batches gives the
    mini-batch's loss and gradient, for every agg mode, with the entropy and KL terms included."""
    logp, old, adv, mask = _random_batch(seed, b=8, t=6, spread=0.7)
    g = torch.Generator().manual_seed(seed + 1)
    entropy = torch.rand(8, 6, dtype=F64, generator=g)
    ref = old + 0.3 * torch.randn(8, 6, dtype=F64, generator=g)
    bounds = [0, *sorted(cuts), 8]
    parts = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert_accumulation_matches(
        policy_loss, logp, old, adv, mask, parts, norms=agg_normalisers([mask[p] for p in parts]),
        per_token={"entropy": entropy, "ref_logp": ref},
        ratio_low=0.8, ratio_high=1.2, dual_clip=dual, agg=agg, entropy_coef=0.01, kl_coef=0.05,
    )  # fmt: skip
