"""BAPO's rivals as options of the one surrogate: CISPO, M2PO, TOPR, DPPO (binary TV) and GSPO.

For each: a hand-computed case (arithmetic in comments), an independent reference written here from the
paper's formula and compared on random float64 inputs to 1e-9 (loss and gradient), and the properties
(on-policy input gives the on-policy form, masked tokens change nothing, any micro-batch split sums to
the mini-batch loss, finite for |log-ratio| up to 50).
"""

import math
import threading

import pytest
import torch

from bapo.algos import agg_normalisers, policy_loss
from bapo.algos.objective import surrogate_objective
from bapo.algos.surrogate import second_moment_cutoff

F64 = torch.float64
TAU, DELTA = 0.04, 0.2

# name -> (policy_loss keyword arguments, agg). M2PO's cutoff is chosen by the objective (see _loss).
ALGOS = {
    "cispo": dict(ratio_low=0.0, ratio_high=1.28, is_weight="stop_grad"),
    "m2po": dict(ratio_low=0.0, ratio_high=1e9, token_mask="second_moment"),
    "topr": dict(
        ratio_low=0.0,
        ratio_high=1.0,
        ratio_level="sequence",
        is_weight="stop_grad",
        positive_weight="one",
        agg="seq-mean-token-sum",
    ),
    "dppo": dict(ratio_low=0.0, ratio_high=1e9, token_mask="divergence", mask_threshold=DELTA),
    "gspo": dict(ratio_low=1 - 3e-4, ratio_high=1 + 4e-4, ratio_level="sequence_mean", agg="seq-mean-token-mean"),
}


def _loss(name, logp, old, adv, mask, **norms):
    """The project's loss for ``name`` (M2PO's cutoff chosen over these tokens, as its objective does)."""
    kw = dict(ALGOS[name]) | norms
    if name == "m2po" and "m2_cutoff" not in kw:
        kw["m2_cutoff"], _ = second_moment_cutoff((logp - old).detach(), mask, m2_threshold=TAU)
    return policy_loss(logp, old, adv, mask, **kw)


def _random(B=5, T=7, scale=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05  # behaviour log-probs in (-3.05, -0.05)
    logp = (old + scale * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-6)
    seq_adv = torch.randn(B, 1, generator=g, dtype=F64)
    adv = seq_adv.expand(B, T).clone()  # GRPO: one advantage per sequence
    return logp.requires_grad_(), old, adv, mask


# ----------------------------------------------------------------------------- references from the papers


def ref_cispo(logp, old, adv, mask, lo=0.0, hi=1.28):
    # MiniMax-M1 eq. 4: J = 1/sum|o| sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_it log pi(o_it)
    terms = []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t]:
                r = math.exp((logp[b, t] - old[b, t]).item())
                terms.append(min(max(r, lo), hi) * float(adv[b, t]) * logp[b, t])
    return -sum(terms) / len(terms)


def ref_m2po(logp, old, adv, mask, tau=TAU):
    # M2PO: drop the token with the largest (log r)^2 while the mean of (log r)^2 over the rest exceeds tau;
    # J = 1/sum|o| sum_{kept} r A (no clip; the normaliser counts every token)
    toks = [(b, t) for b in range(logp.shape[0]) for t in range(logp.shape[1]) if mask[b, t]]
    sq = {k: (logp[k] - old[k]).item() ** 2 for k in toks}
    kept = sorted(toks, key=lambda k: sq[k])
    while kept and sum(sq[k] for k in kept) / len(kept) > tau:
        kept.pop()
    return -sum(torch.exp(logp[k] - old[k]) * adv[k] for k in kept) / len(toks)


def ref_topr(logp, old, adv, mask):
    # TOPR eq. (tapered): grad J = sum_{A>=0} A grad log pi(y) + sum_{A<0} [pi(y)/mu(y)]_0^1 A grad log pi(y),
    # averaged over sequences; log pi(y) = sum_t log pi_t and the weight is not differentiated.
    rows = []
    for b in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[b, t]]
        a = float(adv[b, idx[0]])
        seq_ratio = math.exp(min(20.0, max(-20.0, sum((logp[b, t] - old[b, t]).item() for t in idx))))
        w = 1.0 if a > 0 else min(max(seq_ratio, 0.0), 1.0)
        rows.append(w * a * sum(logp[b, t] for t in idx))
    return -sum(rows) / len(rows)


def ref_dppo(logp, old, adv, mask, delta=DELTA):
    # DPPO binary TV: mask a token when |pi - mu| > delta and the ratio moves the way A pushes; else r A.
    terms, n = [], 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            n += 1
            p, q, a = math.exp(logp[b, t].item()), math.exp(float(old[b, t])), float(adv[b, t])
            away = (a > 0 and p > q) or (a < 0 and p < q)
            if not (away and abs(p - q) > delta):
                terms.append(torch.exp(logp[b, t] - old[b, t]) * a)
    return -sum(terms) / n


def ref_gspo(logp, old, adv, mask, lo=1 - 3e-4, hi=1 + 4e-4):
    # GSPO eq. 5-7: s_i = exp(1/|y_i| sum_t log r_it); J = 1/G sum_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i)
    rows = []
    for b in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[b, t]]
        s = torch.exp(sum(logp[b, t] - old[b, t] for t in idx) / len(idx))
        a = float(adv[b, idx[0]])
        rows.append(torch.minimum(s * a, s.clamp(lo, hi) * a))
    return -sum(rows) / len(rows)


REFS = {"cispo": ref_cispo, "m2po": ref_m2po, "topr": ref_topr, "dppo": ref_dppo, "gspo": ref_gspo}
# The reference's loss value equals ours except where ours writes sg(w) A pi / sg(pi) for sg(w) A log pi
# (same gradient; the value is then the weighted advantage, comparable with the other losses).
SAME_VALUE = {"m2po", "dppo", "gspo"}


@pytest.mark.parametrize("name", sorted(ALGOS))
@pytest.mark.parametrize("seed", range(4))
def test_matches_the_papers_formula_on_random_inputs(name, seed):
    logp, old, adv, mask = _random(seed=seed, scale=0.3 if name == "m2po" else 0.6)
    ours, _ = _loss(name, logp, old, adv, mask)
    (g_ours,) = torch.autograd.grad(ours, logp)
    ref = REFS[name](logp, old, adv, mask)
    (g_ref,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=1e-9)
    if name in SAME_VALUE:
        assert ours.item() == pytest.approx(ref.item(), abs=1e-9)


# ----------------------------------------------------------------------------- hand-computed cases


def _tokens(ratios, advs, old=-1.0):
    """One row of tokens with the given ratios and advantages (behaviour log-prob ``old`` each)."""
    o = torch.full((1, len(ratios)), old, dtype=F64)
    logp = (o + torch.tensor([ratios], dtype=F64).log()).requires_grad_()
    return logp, o, torch.tensor([advs], dtype=F64), torch.ones(1, len(ratios), dtype=torch.bool)


def test_cispo_by_hand():
    # r = [2.0, 0.5, 1.0], A = [+1, -1, +2], window [0, 1.28]:
    #   weights sg(clip(r)) = [1.28, 0.5, 1.0] -> values w A = [1.28, -0.5, 2.0], sum 2.78 -> loss -2.78 / 3
    #   d loss / d logp_t = -w_t A_t / 3 = [-1.28/3, 0.5/3, -2/3]: the clipped token t1 keeps a gradient
    logp, old, adv, mask = _tokens([2.0, 0.5, 1.0], [1.0, -1.0, 2.0])
    loss, st = _loss("cispo", logp, old, adv, mask)
    assert loss.item() == pytest.approx(-2.78 / 3)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.28 / 3, 0.5 / 3, -2 / 3])
    assert st["clip_frac"] == pytest.approx(1 / 3) and st["clip_frac_pos"] == pytest.approx(1 / 2)


def test_m2po_by_hand():
    # log r = [0.1, -0.1, 0.5, 0.0]: (log r)^2 = [0.01, 0.01, 0.25, 0]; mean 0.0675 > tau = 0.04.
    # Dropping the largest (0.25) leaves mean 0.02/3 ~ 0.0067 <= 0.04: token 3 is masked, cutoff in [0.01, 0.25).
    # loss = -(e^0.1 * 1 + e^-0.1 * (-1) + 1 * 2) / 4 (token 3 dropped, still counted in N = 4)
    ratios = [math.exp(0.1), math.exp(-0.1), math.exp(0.5), 1.0]
    logp, old, adv, mask = _tokens(ratios, [1.0, -1.0, 1.0, 2.0])
    cutoff, st = second_moment_cutoff((logp - old).detach(), mask, m2_threshold=TAU)
    assert 0.01 <= cutoff < 0.25
    assert st["m2_before"] == pytest.approx(0.27 / 4) and st["m2_after"] == pytest.approx(0.02 / 3)
    assert st["mask_frac"] == pytest.approx(1 / 4)
    loss, lst = _loss("m2po", logp, old, adv, mask, m2_cutoff=cutoff)
    assert loss.item() == pytest.approx(-(math.exp(0.1) - math.exp(-0.1) + 2) / 4)
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0 and lst["mask_frac"] == pytest.approx(1 / 4)


def test_topr_by_hand():
    # Two sequences, seq-mean-token-sum:
    #   seq 0: A = +1, r_t = [2, 2] -> weight 1 (positive: ratio ignored); value 1 * 1 per token, sum 2
    #   seq 1: A = -1, r_t = [0.5, 0.8] -> seq ratio 0.4 in [0, 1]: weight 0.4; value -0.4 per token, sum -0.8
    #   loss = -(2 - 0.8) / 2 = -0.6; d/d logp = -w A / 2: seq 0 -> -0.5 each, seq 1 -> +0.2 each
    old = torch.full((2, 2), -1.0, dtype=F64)
    logp = (old + torch.tensor([[2.0, 2.0], [0.5, 0.8]], dtype=F64).log()).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    loss, _ = _loss("topr", logp, old, adv, torch.ones(2, 2, dtype=torch.bool))
    assert loss.item() == pytest.approx(-0.6)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.5, -0.5, 0.2, 0.2])


def test_dppo_by_hand():
    # delta = 0.2; (mu, pi, A): masked when |pi - mu| > 0.2 and pi moves the way A pushes
    #   (0.6, 0.9, +1) up by 0.3 with A > 0 -> masked      (0.6, 0.3, +1) down: kept, r = 0.5
    #   (0.6, 0.3, -1) down by 0.3 with A < 0 -> masked    (0.6, 0.7, +1) up by 0.1 < 0.2: kept, r = 7/6
    #   loss = -(0.5 * 1 + 7/6 * 1) / 4
    mu = torch.tensor([[0.6, 0.6, 0.6, 0.6]], dtype=F64)
    pi = torch.tensor([[0.9, 0.3, 0.3, 0.7]], dtype=F64)
    logp = pi.log().requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=F64)
    loss, st = _loss("dppo", logp, mu.log(), adv, torch.ones(1, 4, dtype=torch.bool))
    assert loss.item() == pytest.approx(-(0.5 + 7 / 6) / 4)
    assert st["mask_frac"] == pytest.approx(2 / 4)
    assert st["clip_frac_pos"] == pytest.approx(1 / 3) and st["clip_frac_neg"] == pytest.approx(1.0)


def test_gspo_by_hand():
    # seq 0: log r = [0.0002, 0.0004] -> s = e^0.0003 ~ 1.0003 inside [0.9997, 1.0004], A = +1: value s
    # seq 1: log r = [0.001, 0.001] -> s = e^0.001 > 1.0004, A = +1: clipped, value 1.0004, no gradient
    # loss = -(e^0.0003 + 1.0004) / 2; d/d logp seq 0 = -s * (1/2 tokens) / 2 sequences
    old = torch.full((2, 2), -1.0, dtype=F64)
    logp = (old + torch.tensor([[0.0002, 0.0004], [0.001, 0.001]], dtype=F64)).requires_grad_()
    adv = torch.ones(2, 2, dtype=F64)
    loss, st = _loss("gspo", logp, old, adv, torch.ones(2, 2, dtype=torch.bool))
    assert loss.item() == pytest.approx(-(math.exp(0.0003) + 1.0004) / 2, abs=1e-12)
    loss.backward()
    s = math.exp(0.0003)
    assert logp.grad.flatten().tolist() == pytest.approx([-s / 4, -s / 4, 0.0, 0.0], abs=1e-12)
    assert st["clip_frac_high"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- properties


def _on_policy_form(name, logp, adv, mask):
    """What each loss reduces to at r = 1: REINFORCE, -agg(A) in value, -A grad logp / normaliser in gradient."""
    m = mask.to(F64)
    if name == "topr":  # seq-mean-token-sum
        n_seq = mask.any(1).sum()
        return -(adv * m).sum() / n_seq, -(adv * m) / n_seq
    if name == "gspo":  # seq-mean-token-mean
        n_seq, lengths = mask.any(1).sum(), m.sum(1, keepdim=True).clamp(min=1)
        return -(adv * m / lengths).sum() / n_seq, -(adv * m / lengths) / n_seq
    return -(adv * m).sum() / m.sum(), -(adv * m) / m.sum()


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_on_policy_input_gives_reinforce(name):
    logp, _, adv, mask = _random(seed=3)
    loss, st = _loss(name, logp, logp.detach().clone(), adv, mask)
    value, grad = _on_policy_form(name, logp, adv, mask)
    assert loss.item() == pytest.approx(value.item(), abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, grad, rtol=0, atol=1e-12)
    assert st["clip_frac"] == 0.0 and st["mask_frac"] == 0.0


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_masked_tokens_have_no_effect(name):
    logp, old, adv, mask = _random(seed=5, scale=0.3)
    loss, st = _loss(name, logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    junk_logp = torch.where(mask, logp.detach(), torch.tensor(float("nan"), dtype=F64)).requires_grad_()
    junk_old = torch.where(mask, old, torch.tensor(float("inf"), dtype=F64))
    junk_adv = torch.where(mask, adv, torch.tensor(-1e30, dtype=F64))
    loss2, st2 = _loss(name, junk_logp, junk_old, junk_adv, mask)
    (grad2,) = torch.autograd.grad(loss2, junk_logp)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(grad2, torch.where(mask, grad, torch.zeros_like(grad)), rtol=0, atol=1e-12)
    assert st2["pg_loss"] == pytest.approx(st["pg_loss"], abs=1e-12)


@pytest.mark.parametrize("name", sorted(ALGOS))
@pytest.mark.parametrize("cuts", [[2], [1, 3], [4]])
def test_micro_batch_split_sums_to_the_mini_batch_loss(name, cuts):
    logp, old, adv, mask = _random(B=5, seed=7, scale=0.3)
    extra = {}
    if name == "m2po":  # the objective chooses one cutoff per update, over all of its tokens
        extra["m2_cutoff"], _ = second_moment_cutoff((logp - old).detach(), mask, m2_threshold=TAU)
    whole, _ = _loss(name, logp, old, adv, mask, **extra)
    bounds = [0, *cuts, 5]
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    norms = agg_normalisers([mask[p] for p in parts])
    total = sum(_loss(name, logp[p], old[p], adv[p], mask[p], **extra, **norms)[0] for p in parts)
    assert total.item() == pytest.approx(whole.item(), abs=1e-12)
    (g_whole,) = torch.autograd.grad(whole, logp)
    (g_parts,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(g_parts, g_whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(ALGOS))
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_finite_for_extreme_log_ratios(name, dtype):
    g = torch.Generator().manual_seed(11)
    old = torch.full((4, 6), -0.5, dtype=dtype)
    log_r = (torch.rand(4, 6, generator=g, dtype=dtype) * 100 - 50).to(dtype)  # |log r| up to 50
    log_r[0, :] = 50.0
    log_r[1, :] = -50.0
    logp = (old + log_r).requires_grad_()
    adv = torch.tensor([[1.0], [-1.0], [2.0], [-0.5]], dtype=dtype).expand(4, 6).clone()
    mask = torch.ones(4, 6, dtype=torch.bool)
    loss, st = _loss(name, logp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in st.values()), st


# ----------------------------------------------------------------------------- M2PO's chooser


@pytest.mark.parametrize("seed", range(5))
def test_second_moment_cutoff_matches_greedy_removal(seed):
    g = torch.Generator().manual_seed(seed)
    log_r = torch.randn(200, generator=g, dtype=F64) * 0.3
    mask = torch.rand(200, generator=g) < 0.8
    cutoff, st = second_moment_cutoff(log_r, mask, m2_threshold=TAU)
    x = sorted(float(v) ** 2 for v, k in zip(log_r, mask, strict=True) if k)
    while x and sum(x) / len(x) > TAU:  # the paper's procedure: drop the largest until the mean is <= tau
        x.pop()
    kept = [float(v) ** 2 for v, k in zip(log_r, mask, strict=True) if k and float(v) ** 2 <= cutoff]
    assert sorted(kept) == x
    assert st["m2_after"] == pytest.approx(sum(x) / len(x)) and st["m2_after"] <= TAU


def test_second_moment_cutoff_is_the_same_on_every_rank():
    # Two "ranks" (threads) hold halves of the tokens; reduce_sum is an all-reduce through a barrier,
    # so each probe sums both halves, and both ranks must pick the cutoff of the whole batch.
    g = torch.Generator().manual_seed(3)
    log_r = torch.randn(2, 50, generator=g, dtype=F64) * 0.4
    mask = torch.ones(2, 50, dtype=torch.bool)
    whole, _ = second_moment_cutoff(log_r, mask, m2_threshold=TAU)
    barrier, slots, picks = threading.Barrier(2), [None, None], [None, None]

    def rank(i):
        def all_reduce(t):
            slots[i] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read before the next probe overwrites a slot
            return total

        picks[i], _ = second_moment_cutoff(log_r[i], mask[i], m2_threshold=TAU, reduce_sum=all_reduce)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert picks[0] == picks[1] == pytest.approx(whole, abs=1e-12)
    assert whole < 20.0**2  # something was masked: the test exercises the bisection


def test_m2po_objective_chooses_over_the_whole_update():
    obj = surrogate_objective("fixed", ratio_low=0.0, ratio_high=1e9, token_mask="second_moment", mask_threshold=TAU)
    assert obj.adaptive and obj.prepass
    ratio = torch.exp(torch.tensor([0.1, -0.1, 0.5, 0.0], dtype=F64))
    params, st = obj.choose(ratio, torch.ones(4), torch.ones(4), torch.zeros(4))
    assert 0.01 <= params["m2_cutoff"] < 0.25 and st["m2po/mask_frac"] == pytest.approx(0.25)
    assert {"clip/low", "clip/high", "clip/rho"} <= set(st)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(positive_weight="one"), "positive_weight"),
        (dict(token_mask="divergence"), "mask_threshold"),
        (dict(ratio_level="segment"), "ratio_level"),
        (dict(is_weight="stop_grad", dual_clip=3.0), "dual_clip"),
        (dict(token_mask="second_moment"), "mask_threshold"),
    ],
)
def test_bad_option_combinations_fail_at_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2, **kw)


def test_merged_stats_derive_the_positive_share_and_the_ess():
    # two micro-batches: ratios [1, 3] (A = +1, -1) and [1] (A = +1); token means merge by tokens, then
    #   ess = mean(r)^2 / mean(r^2) = (5/3)^2 / (11/3) = 25/33, pos_share = |1 + 1| / (|1 + 1| + |-3|) = 2/5
    from bapo.algos import stats

    old = torch.zeros(1, 2, dtype=F64)
    a = policy_loss(
        torch.tensor([[0.0, math.log(3.0)]], dtype=F64),
        old,
        torch.tensor([[1.0, -1.0]], dtype=F64),
        torch.ones(1, 2, dtype=torch.bool),
        ratio_low=0.0,
        ratio_high=1e9,
    )[1]
    b = policy_loss(
        torch.zeros(1, 1, dtype=F64),
        torch.zeros(1, 1, dtype=F64),
        torch.ones(1, 1, dtype=F64),
        torch.ones(1, 1, dtype=torch.bool),
        ratio_low=0.0,
        ratio_high=1e9,
    )[1]
    merged = stats.merge([a, b])
    assert merged["ess"] == pytest.approx(25 / 33) and merged["pos_share"] == pytest.approx(2 / 5)
