"""KL to the reference model: the k1/k2/k3 estimators and the KL term of the loss."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.algos import AGG_MODES, agg_normalisers, aggregate, kl_estimate, policy_loss
from tests.helpers.algos import assert_accumulation_matches

F64 = torch.float64


def test_estimators_hand_computed():
    # pi = 0.5, pi_ref = 0.25: x = log(pi_ref / pi) = -log 2 = -0.693147
    #   k1 = -x = 0.693147
    #   k2 = 0.5 * x^2 = 0.5 * 0.480453 = 0.240227
    #   k3 = exp(x) - x - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp, ref = torch.tensor([math.log(0.5)], dtype=F64), torch.tensor([math.log(0.25)], dtype=F64)
    ln2 = math.log(2)
    assert kl_estimate(logp, ref, kl_estimator="k1").item() == pytest.approx(ln2)
    assert kl_estimate(logp, ref, kl_estimator="k2").item() == pytest.approx(0.5 * ln2**2)
    assert kl_estimate(logp, ref, kl_estimator="k3").item() == pytest.approx(0.5 + ln2 - 1)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, kl_estimator="k4")


def test_k1_and_k3_are_unbiased_k2_is_not():
    # Expectation over tokens sampled from pi, computed exactly as a sum over the vocabulary.
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(11, generator=g, dtype=F64), -1)
    ref = torch.log_softmax(torch.randn(11, generator=g, dtype=F64), -1)
    p = logp.exp()
    kl = (p * (logp - ref)).sum()
    assert (p * kl_estimate(logp, ref, kl_estimator="k1")).sum().item() == pytest.approx(kl.item())
    assert (p * kl_estimate(logp, ref, kl_estimator="k3")).sum().item() == pytest.approx(kl.item())
    assert (p * kl_estimate(logp, ref, kl_estimator="k2")).sum().item() != pytest.approx(kl.item())


@settings(max_examples=200, deadline=None)
@given(x=st.floats(-50, 50), est=st.sampled_from(["k1", "k2", "k3"]))
def test_estimators_finite_and_k2_k3_nonnegative(x, est):
    logp = torch.tensor([0.0], dtype=F64, requires_grad=True)
    value = kl_estimate(logp, torch.tensor([x], dtype=F64), kl_estimator=est)
    value.backward()
    assert math.isfinite(value.item()) and math.isfinite(logp.grad.item())
    if est != "k1":
        assert value.item() >= 0.0


def _batch(seed, b=5, t=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = old + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    ref = old + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, t).clone()
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    return logp, old, ref, adv, torch.arange(t)[None, :] < lengths[:, None]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_term_is_added_with_the_agg_mode(agg, est):
    logp, old, ref, adv, mask = _batch(1)
    kw = dict(ratio_low=0.8, ratio_high=1.2, agg=agg)
    base, _ = policy_loss(logp, old, adv, mask, **kw)
    loss, stats = policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1, kl_estimator=est, **kw)
    kl = kl_estimate(logp, ref, kl_estimator=est)
    torch.testing.assert_close(loss, base + 0.1 * aggregate(kl, mask, agg=agg))
    assert stats["kl_ref"] == pytest.approx(kl[mask].mean().item())
    # kl_coef = 0 with a reference only logs kl_ref; kl_coef > 0 without one is refused
    loss0, stats0 = policy_loss(logp, old, adv, mask, ref_logp=ref, kl_estimator=est, **kw)
    torch.testing.assert_close(loss0, base)
    assert stats0["kl_ref"] == stats["kl_ref"]
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, kl_coef=0.1, **kw)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_kl_term_micro_batch_split_invariant(agg):
    logp, old, ref, adv, mask = _batch(4, b=8)
    parts = (slice(0, 3), slice(3, 4), slice(4, 8))
    assert_accumulation_matches(
        policy_loss, logp, old, adv, mask, parts, norms=agg_normalisers(mask), per_token={"ref_logp": ref},
        ratio_low=0.8, ratio_high=1.2, agg=agg, kl_coef=0.05, kl_estimator="k3",
    )  # fmt: skip


def test_kl_masked_positions_change_nothing():
    logp, old, ref, adv, mask = _batch(2)
    kw = dict(ratio_low=0.8, ratio_high=1.2, kl_coef=0.1)
    base, st = policy_loss(logp, old, adv, mask, ref_logp=ref, **kw)
    dirty_ref = ref.masked_fill(~mask, float("nan"))
    dirty_logp = logp.masked_fill(~mask, float("inf"))
    loss, st2 = policy_loss(dirty_logp, old, adv, mask, ref_logp=dirty_ref, **kw)
    assert loss.item() == base.item() and st2 == st
