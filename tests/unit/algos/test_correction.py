"""Rollout corrections (TIS, MIS, geometric rejection) and decoupled PPO's weights and proximal policy.

Hand-computed cases (arithmetic in comments), a reference written here from each formula compared on
random float64 inputs to 1e-9, and the properties: equal log-probs give weight 1 everywhere, masked
positions change nothing, finite for |log-ratio| up to 50, and token weights split over micro-batches.
"""

import math

import pytest
import torch

from bapo.algos import agg_normalisers, policy_loss
from bapo.algos.correction import check_correction, correction_weights, loglinear_proximal
from bapo.algos.objective import proximal_fn

F64 = torch.float64
KINDS = [
    ("tis", "token", 2.0),
    ("tis", "sequence", 2.0),
    ("mis", "token", 2.0),
    ("mis", "sequence", 2.0),
    ("geo_reject", "token", 1.3),
    ("decoupled", "token", None),
    ("decoupled", "token", 3.0),
]


def _random(B=6, T=5, scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    behaviour = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = behaviour + scale * torch.randn(B, T, generator=g, dtype=F64)
    return old, behaviour, mask


def reference(old, behaviour, mask, kind, level, cap):
    """Each correction's weights, token by token, from its formula (0 at masked positions)."""
    w = torch.zeros_like(old)
    for b in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if mask[b, t]]
        lw = [float(old[b, t] - behaviour[b, t]) for t in idx]
        for j, t in enumerate(idx):
            rho = math.exp(sum(lw)) if level == "sequence" else math.exp(lw[j])
            if kind == "tis" or kind == "decoupled":
                w[b, t] = rho if cap is None else min(rho, cap)
            elif kind == "mis":
                w[b, t] = rho if rho <= cap else 0.0
            else:  # geo_reject
                g = math.exp(sum(lw) / len(lw))
                w[b, t] = 1.0 if 1 / cap <= g <= cap else 0.0
    return w


@pytest.mark.parametrize("kind,level,cap", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_weights_match_the_formula_on_random_inputs(kind, level, cap, seed):
    old, behaviour, mask = _random(seed=seed)
    w, st = correction_weights(old, behaviour, mask, kind=kind, level=level, cap=cap)
    ref = reference(old, behaviour, mask, kind, level, cap)
    torch.testing.assert_close(w, ref, rtol=0, atol=1e-9)
    n = int(mask.sum())
    wm = ref[mask]
    assert st["weight_mean"] == pytest.approx(float(wm.sum()) / n, abs=1e-9)
    assert st["ess"] == pytest.approx(float(wm.sum()) ** 2 / (n * float((wm**2).sum())), abs=1e-9)
    lw = (old - behaviour)[mask]
    assert st["kl_k3"] == pytest.approx(float((lw.exp() - lw - 1).mean()), abs=1e-9)


def test_hand_computed_tis_mis_and_rejection():
    # One sequence of three tokens, log(pi/mu) = [ln 3, ln 0.5, 0]: token weights [3, 0.5, 1], product 1.5,
    # geometric mean 1.5^(1/3) ~ 1.1447.
    behaviour = torch.zeros(1, 3, dtype=F64)
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, st = correction_weights(old, behaviour, mask, kind="tis", cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 1.0])  # 3 truncated to the cap 2
    assert st["cut_frac"] == pytest.approx(1 / 3) and st["weight_max"] == pytest.approx(2.0)
    # ESS = (2 + 0.5 + 1)^2 / (3 * (4 + 0.25 + 1)) = 12.25 / 15.75
    assert st["ess"] == pytest.approx(12.25 / 15.75)
    # k3 = mean(e^x - x - 1) = ((3 - ln3 - 1) + (0.5 - ln0.5 - 1) + 0) / 3
    assert st["kl_k3"] == pytest.approx(((2 - math.log(3)) + (-0.5 - math.log(0.5))) / 3)
    w, _ = correction_weights(old, behaviour, mask, kind="tis", level="sequence", cap=2.0)
    assert w[0].tolist() == pytest.approx([1.5, 1.5, 1.5])  # the product 1.5 is under the cap
    w, st = correction_weights(old, behaviour, mask, kind="mis", cap=2.0)
    assert w[0].tolist() == pytest.approx([0.0, 0.5, 1.0]) and st["cut_frac"] == pytest.approx(1 / 3)  # 3 > 2: out
    w, _ = correction_weights(old, behaviour, mask, kind="mis", level="sequence", cap=1.4)
    assert w[0].tolist() == [0.0, 0.0, 0.0]  # 1.5 > 1.4: the whole sequence goes
    w, _ = correction_weights(old, behaviour, mask, kind="geo_reject", cap=1.2)
    assert w[0].tolist() == [1.0, 1.0, 1.0]  # 1.1447 in [1/1.2, 1.2]: kept, unweighted
    w, st = correction_weights(old, behaviour, mask, kind="geo_reject", cap=1.1)
    assert w[0].tolist() == [0.0, 0.0, 0.0] and st["cut_frac"] == 1.0  # 1.1447 > 1.1: rejected


@pytest.mark.parametrize("kind,level,cap", KINDS)
def test_equal_log_probs_give_weight_one(kind, level, cap):
    _, behaviour, mask = _random(seed=4)
    w, st = correction_weights(behaviour.clone(), behaviour, mask, kind=kind, level=level, cap=cap)
    assert torch.equal(w, mask.to(F64))
    assert st["ess"] == 1.0 and st["kl_k3"] == 0.0 and st["cut_frac"] == 0.0 and st["weight_mean"] == 1.0


@pytest.mark.parametrize("kind,level,cap", KINDS)
def test_masked_positions_change_nothing(kind, level, cap):
    old, behaviour, mask = _random(seed=5)
    w, st = correction_weights(old, behaviour, mask, kind=kind, level=level, cap=cap)
    nan = torch.tensor(float("nan"), dtype=F64)
    w2, st2 = correction_weights(
        torch.where(mask, old, nan), torch.where(mask, behaviour, -nan), mask, kind=kind, level=level, cap=cap
    )
    assert torch.equal(w, w2) and st == st2
    assert torch.all(w[~mask] == 0)


@pytest.mark.parametrize("kind,level,cap", KINDS)
def test_finite_for_extreme_log_ratios(kind, level, cap):
    old, behaviour, mask = _random(seed=6)
    old = behaviour + torch.where(torch.rand(old.shape) < 0.5, 50.0, -50.0).to(F64)
    w, st = correction_weights(old, behaviour, mask, kind=kind, level=level, cap=cap)
    assert torch.isfinite(w).all() and all(math.isfinite(v) for v in st.values()), st


def test_token_weights_split_over_micro_batches():
    # The weights are per token, so any split of the rows with mini-batch normalisers sums to the whole.
    g = torch.Generator().manual_seed(1)
    old, behaviour, mask = _random(seed=7)
    w, _ = correction_weights(old, behaviour, mask, kind="tis", cap=2.0)
    logp = (old + 0.1 * torch.randn(old.shape, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(old.shape[0], 1, generator=g, dtype=F64).expand_as(old).clone()
    kw = dict(ratio_low=0.8, ratio_high=1.2)
    whole, _ = policy_loss(logp, old, adv, mask, token_weight=w, **kw)
    parts = [slice(0, 2), slice(2, 6)]
    norms = agg_normalisers([mask[p] for p in parts])
    total = sum(policy_loss(logp[p], old[p], adv[p], mask[p], token_weight=w[p], **kw, **norms)[0] for p in parts)
    assert total.item() == pytest.approx(whole.item(), abs=1e-12)
    # and the weight multiplies each token's surrogate: all weights 2 doubles the loss
    double, _ = policy_loss(logp, old, adv, mask, token_weight=2 * mask.to(F64), **kw)
    plain, _ = policy_loss(logp, old, adv, mask, **kw)
    assert double.item() == pytest.approx(2 * plain.item(), abs=1e-12)


def test_loglinear_proximal_interpolates_by_version():
    # behaviour at version 2, proximal 5, current 8: alpha = (5 - 2) / (8 - 2) = 0.5
    behaviour = torch.tensor([[-1.0, -2.0]], dtype=F64)
    logp = torch.tensor([[-0.5, -3.0]], dtype=F64, requires_grad=True)
    prox = loglinear_proximal(behaviour, logp, torch.tensor([2]), torch.tensor([5]), 8)
    assert prox.tolist() == [[-0.75, -2.5]] and not prox.requires_grad
    # current == behaviour version: all three policies are one, alpha = 1 (prox = current)
    same = loglinear_proximal(behaviour, logp, torch.tensor([8]), torch.tensor([8]), 8)
    assert same.tolist() == logp.detach().tolist()
    # proximal == behaviour (the batch is from the step's own version): prox = behaviour, weight 1
    fresh = loglinear_proximal(behaviour, logp, torch.tensor([5]), torch.tensor([5]), 8)
    assert fresh.tolist() == behaviour.tolist()
    # decoupled weight e^{prox - behav} = e^{0.25}, e^{-0.5}, truncated at 1.1
    prox_w, w = proximal_fn(1.1)(
        logp, behaviour, torch.ones(1, 2, dtype=torch.bool), torch.tensor([2]), torch.tensor([5]), 8
    )
    assert w.tolist()[0] == pytest.approx([1.1, math.exp(-0.5)])


@pytest.mark.parametrize(
    "kind,kw,match",
    [
        ("tis", dict(cap=0.5), "cap"),
        ("mis", dict(cap=None), "cap"),
        ("geo_reject", dict(cap=1.0), "cap"),
        ("decoupled", dict(cap=0.9), "cap"),
        ("tis", dict(cap=2.0, level="group"), "level"),
        ("ois", dict(cap=2.0), "kind"),
    ],
)
def test_bad_parameters_fail_naming_them(kind, kw, match):
    with pytest.raises(ValueError, match=match):
        check_correction(kind, **kw)
