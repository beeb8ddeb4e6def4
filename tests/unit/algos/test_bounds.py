"""BAPO bound search: hand-walked cases, naive loop references, and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.algos import bapo_bounds, fixed_bounds, make_bound_fn, positive_contribution
from bapo.algos import bounds as bounds_mod

F64 = torch.float64
# The authors' example script: c_low 0.8 -> 0.95 by 0.05, c_high 1.2 -> 2.0 by 0.1 (their target: 0.5).
RECIPE = {
    "variant": "recipe",
    "low_range": (0.8, 0.95),
    "low_step": 0.05,
    "high_range": (1.2, 2.0),
    "high_step": 0.1,
}


def _tokens(ratios, advs, probs=None):
    """1-D inputs from python lists; old_logp = log(prob) (1 when not given)."""
    ratio = torch.tensor(ratios, dtype=F64)
    adv = torch.tensor(advs, dtype=F64)
    probs = [1.0] * len(ratios) if probs is None else probs
    return ratio, adv, torch.ones_like(ratio, dtype=torch.bool), torch.tensor(probs, dtype=F64).log()


# ---------------------------------------------------------------- hand-walked cases


def test_paper_hand_walk_raises_c_high_three_steps():
    # One positive token r = 2, A = +1; two negatives r = 1, A = -1; w = 1.
    # P = min(2, c_high), N = 2 * max(1, c_low) = 2 for every c_low <= 0.9.
    #   c_high = 1.20: rho = 1.20 / 3.20 = 0.3750 < 0.4
    #   c_high = 1.25: rho = 1.25 / 3.25 = 0.3846 < 0.4
    #   c_high = 1.30: rho = 1.30 / 3.30 = 0.3939 < 0.4
    #   c_high = 1.35: rho = 1.35 / 3.35 = 0.4030 >= 0.4  -> stop after 3 steps, c_low untouched
    ratio, adv, mask, old_logp = _tokens([2.0, 1.0, 1.0], [1.0, -1.0, -1.0])
    c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp, weight="none")
    assert (c_low, c_high) == (0.6, pytest.approx(1.35))
    assert stats["steps"] == 3 and stats["target_met"] == 1.0 and stats["active"] == 1.0 and stats["signal"] == 1.0
    assert stats["rho_before"] == pytest.approx(1.2 / 3.2)
    assert stats["rho_after"] == pytest.approx(1.35 / 3.35)
    assert (stats["P"], stats["N"]) == (pytest.approx(1.35), pytest.approx(2.0))


def test_paper_behavior_prob_weight_changes_the_walk():
    # Same tokens, but the positive token had behaviour prob 0.5: P = 0.5 * min(2, c_high) <= 1,
    # N = 2. rho <= 1 / 3 < 0.4 at every c_high, and the c_low phase cannot raise rho, so the search
    # runs to the end: 36 c_high steps (1.2 -> 3.0) + 15 c_low steps (0.6 -> 0.9) = 51.
    ratio, adv, mask, old_logp = _tokens([2.0, 1.0, 1.0], [1.0, -1.0, -1.0], probs=[0.5, 1.0, 1.0])
    c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp)
    assert (c_low, c_high) == (pytest.approx(0.9), pytest.approx(3.0))
    assert stats["steps"] == 51 and stats["target_met"] == 0.0
    assert stats["rho_after"] == pytest.approx(1.0 / 3.0)


def test_loss_value_c_low_phase_never_raises_rho():
    # Positive r = 1 (P = 1 for every c_high >= 1.2); two negatives r = 0.5: N = 2 * c_low.
    #   start: rho = 1 / (1 + 1.2) = 0.4545 < 0.5; the c_high phase leaves it there (36 steps);
    #   the c_low phase only grows N: at c_low = 0.9, rho = 1 / (1 + 1.8) = 0.357 (15 more steps).
    ratio, adv, mask, old_logp = _tokens([1.0, 0.5, 0.5], [1.0, -1.0, -1.0])
    c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp, rho0=0.5)
    assert (c_low, c_high, stats["steps"]) == (pytest.approx(0.9), pytest.approx(3.0), 51)
    assert stats["rho_before"] == pytest.approx(1 / 2.2)
    assert stats["rho_after"] == pytest.approx(1 / 2.8)
    rhos = []
    for k in range(16):
        p, n = positive_contribution(ratio, adv, mask, old_logp, ratio_low=0.6 + 0.02 * k, ratio_high=3.0)
        rhos.append((p / (p + n)).item())
    assert all(later <= earlier for earlier, later in zip(rhos, rhos[1:], strict=False))


def test_gradient_contribution_c_low_phase_raises_rho():
    # Positive r = 0.2, A = +1: P = 0.2 (r <= c_high always). Negatives r = 0.63 and 0.7, A = -1:
    # N counts r for r >= c_low.
    #   c_low = 0.60, 0.62: N = 0.63 + 0.70 = 1.33, rho = 0.2 / 1.53 = 0.131 < 0.2
    #   c_low = 0.64:       N = 0.70,               rho = 0.2 / 0.90 = 0.222 >= 0.2
    # Steps: 36 (c_high to its cap) + 2 (c_low 0.60 -> 0.64) = 38.
    ratio, adv, mask, old_logp = _tokens([0.2, 0.63, 0.7], [1.0, -1.0, -1.0])
    c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp, rho0=0.2, contribution="gradient")
    assert (c_low, c_high, stats["steps"]) == (pytest.approx(0.64), pytest.approx(3.0), 38)
    assert stats["rho_before"] == pytest.approx(0.2 / 1.53)
    assert stats["rho_after"] == pytest.approx(0.2 / 0.9)


def test_recipe_hand_walk():
    # Recipe: target P/N >= 0.55, w = 1, c_low first (0.8 -> 0.95 by 0.05), then c_high (1.2 -> 2.0 by 0.1).
    # Positive r = 3, A = +1: P = min(3, c_high). Three negatives r = 0.5, A = -1: N = 3 * c_low.
    #   c_low 0.80, 0.85, 0.90, 0.95 at c_high 1.2: P/N = 1.2 / 2.4, ..., 1.2 / 2.85 = 0.42 < 0.55
    #   c_high 1.3, 1.4, 1.5: 1.5 / 2.85 = 0.526 < 0.55;  c_high 1.6: 1.6 / 2.85 = 0.561 >= 0.55
    # Steps: 3 (c_low) + 4 (c_high) = 7. behaviour probs are ignored (w = 1).
    ratio, adv, mask, old_logp = _tokens([3.0, 0.5, 0.5, 0.5], [1.0, -1.0, -1.0, -1.0], [0.1, 0.9, 0.9, 0.9])
    c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp, **RECIPE, rho0=0.55)
    assert (c_low, c_high, stats["steps"]) == (pytest.approx(0.95), pytest.approx(1.6), 7)
    assert stats["pn_ratio_before"] == pytest.approx(0.5)
    assert stats["pn_ratio_after"] == pytest.approx(1.6 / 2.85)
    assert stats["rho_after"] == pytest.approx(1.6 / (1.6 + 2.85))
    # Target 0.5 is met at the start: P/N = 1.2 / 2.4 = 0.5.
    assert bapo_bounds(ratio, adv, mask, old_logp, **RECIPE, rho0=0.5)[:2] == (0.8, 1.2)


def test_recipe_n_zero_counts_as_met():
    # No negative token: P/N = inf >= target; no token at all: P = N = 0, also met (rho = 1).
    ratio, adv, mask, old_logp = _tokens([5.0, 0.5], [1.0, 2.0])
    c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp, **RECIPE, rho0=0.5)
    assert (c_low, c_high, stats["steps"]) == (0.8, 1.2, 0)
    assert stats["pn_ratio_after"] == math.inf and stats["rho_after"] == 1.0 and stats["signal"] == 1.0
    _, _, stats = bapo_bounds(ratio, adv, torch.zeros_like(mask), old_logp, **RECIPE, rho0=0.5)
    assert stats["steps"] == 0 and stats["target_met"] == 1.0 and stats["rho_before"] == 1.0
    assert stats["active"] == 0.0 and stats["signal"] == 0.0  # no token: nothing to search


def test_paper_no_low_step_means_no_search():
    # Algorithm 1's guard is on c_low: with no whole low_step in low_range the loop never runs.
    ratio, adv, mask, old_logp = _tokens([2.0, 1.0, 1.0], [1.0, -1.0, -1.0])
    c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp, weight="none", low_range=(0.6, 0.61))
    assert (c_low, c_high, stats["steps"]) == (0.6, 1.2, 0)


# ---------------------------------------------------------------- naive loop references


def _naive_sums(tokens, c_low, c_high, contribution):
    p = n = 0.0
    for r, a, w in tokens:
        if a > 0 and contribution == "loss_value":
            p += w * a * min(r, c_high)
        elif a > 0 and r <= c_high:
            p += w * a * r
        elif a < 0 and contribution == "loss_value":
            n += w * -a * max(r, c_low)
        elif a < 0 and r >= c_low:
            n += w * -a * r
    return p, n


def naive_paper(tokens, rho0, low_range, high_range, low_step, high_step, contribution):
    """Algorithm 1 as a while loop; bounds from integer step counts."""

    def rho(kl, kh):
        p, n = _naive_sums(tokens, low_range[0] + kl * low_step, high_range[0] + kh * high_step, contribution)
        return 1.0 if p + n == 0 else p / (p + n)

    kl = kh = 0
    while rho(kl, kh) < rho0 - 1e-9 and low_range[0] + (kl + 1) * low_step <= low_range[1] + 1e-9:
        if high_range[0] + (kh + 1) * high_step <= high_range[1] + 1e-9:
            kh += 1
        else:
            kl += 1
    return low_range[0] + kl * low_step, high_range[0] + kh * high_step, kl + kh


def naive_recipe(tokens, target, low_range, high_range, low_step, high_step, contribution):
    """The recipe's two loops (c_low, then c_high), clamped to the max, on the P/N ratio."""

    def unmet(c_low, c_high):
        p, n = _naive_sums(tokens, c_low, c_high, contribution)
        return n > 0 and p / n < target - 1e-9

    c_low, c_high, steps = low_range[0], high_range[0], 0
    while unmet(c_low, c_high) and c_low < low_range[1] - 1e-9:
        c_low, steps = min(low_range[0] + (steps + 1) * low_step, low_range[1]), steps + 1
    k = 0
    while unmet(c_low, c_high) and c_high < high_range[1] - 1e-9:
        k += 1
        c_high, steps = min(high_range[0] + k * high_step, high_range[1]), steps + 1
    return c_low, c_high, steps


def _random_tokens(seed, n=40, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    ratio = torch.exp(torch.randn(n, generator=g, dtype=F64) * spread)
    adv = torch.randn(n, generator=g, dtype=F64)
    old_logp = -torch.rand(n, generator=g, dtype=F64) * 2
    mask = torch.rand(n, generator=g) < 0.8
    rho0 = 0.1 + 0.8 * torch.rand(1, generator=g).item()
    return ratio, adv, mask, old_logp, rho0


def _as_list(ratio, adv, mask, old_logp, weight):
    w = old_logp.exp() if weight == "behavior_prob" else torch.ones_like(old_logp)
    return [(r, a, x) for r, a, x, m in zip(ratio.tolist(), adv.tolist(), w.tolist(), mask.tolist(), strict=True) if m]


@pytest.mark.parametrize("contribution", ["loss_value", "gradient"])
@pytest.mark.parametrize("weight", ["behavior_prob", "none"])
def test_paper_matches_naive_loop(contribution, weight):
    hp = {"low_range": (0.6, 0.9), "high_range": (1.2, 3.0), "low_step": 0.02, "high_step": 0.05}
    seen_steps = set()
    for seed in range(60):
        ratio, adv, mask, old_logp, rho0 = _random_tokens(seed, spread=0.2 + 0.02 * seed)
        got = bapo_bounds(ratio, adv, mask, old_logp, rho0=rho0, contribution=contribution, weight=weight, **hp)
        tokens = _as_list(ratio, adv, mask, old_logp, weight)
        c_low, c_high, steps = naive_paper(tokens, rho0, contribution=contribution, **hp)
        assert got[:2] == (pytest.approx(c_low, abs=1e-12), pytest.approx(c_high, abs=1e-12)), seed
        assert got[2]["steps"] == steps, seed
        p, n = _naive_sums(tokens, c_low, c_high, contribution)
        assert (got[2]["P"], got[2]["N"]) == (pytest.approx(p), pytest.approx(n))
        seen_steps.add(steps)
    assert len(seen_steps) > 5  # the random cases stop at many different points


@pytest.mark.parametrize("contribution", ["loss_value", "gradient"])
@pytest.mark.parametrize("weight", ["behavior_prob", "none"])
def test_recipe_matches_naive_loop(contribution, weight):
    hp = {k: v for k, v in RECIPE.items() if k != "variant"}
    seen_steps = set()
    for seed in range(60):
        ratio, adv, mask, old_logp, _ = _random_tokens(seed, spread=0.1 + 0.02 * seed)
        target = 0.3 + 1.2 * (seed % 10) / 10
        got = bapo_bounds(ratio, adv, mask, old_logp, **RECIPE, rho0=target, contribution=contribution, weight=weight)
        tokens = _as_list(ratio, adv, mask, old_logp, "none")  # the recipe always uses w = 1
        c_low, c_high, steps = naive_recipe(tokens, target, contribution=contribution, **hp)
        assert got[:2] == (pytest.approx(c_low, abs=1e-12), pytest.approx(c_high, abs=1e-12)), seed
        assert got[2]["steps"] == steps, seed
        seen_steps.add(steps)
    assert len(seen_steps) > 3


# ---------------------------------------------------------------- what the search reached


def test_mechanism_stats_by_hand():
    # The first hand walk: r = [2, 1, 1], A = [+1, -1, -1], chosen [0.6, 1.35]. Three tokens carry an advantage.
    #   beyond: the positive r = 2 > 1.35; no negative r < 0.6            -> 1 / 3
    #   reach:  the positive r = 2 > 1.2 (the lowest c_high); no negative r < 0.9 (the highest c_low) -> 1 / 3
    #   the search engaged and reached 0.4: rho moved 1.35 / 3.35 - 1.2 / 3.2
    ratio, adv, mask, old_logp = _tokens([2.0, 1.0, 1.0], [1.0, -1.0, -1.0])
    _, _, stats = bapo_bounds(ratio, adv, mask, old_logp, weight="none")
    assert stats["beyond"] == pytest.approx(1 / 3) and stats["reach"] == pytest.approx(1 / 3)
    assert stats["target_reached"] == 1.0
    assert stats["rho_moved"] == pytest.approx(1.35 / 3.35 - 1.2 / 3.2)
    # With the positive token's behaviour prob 0.5 the search runs to its corner [0.9, 3.0] unmet: r = 2 is
    # inside it (beyond 0), rho went from 0.6 / 2.6 to 1 / 3.
    _, _, stats = bapo_bounds(ratio, adv, mask, torch.tensor([0.5, 1.0, 1.0], dtype=F64).log())
    assert stats["beyond"] == 0.0 and stats["reach"] == pytest.approx(1 / 3)
    assert stats["target_reached"] == 0.0 and stats["rho_moved"] == pytest.approx(1 / 3 - 0.6 / 2.6)
    # A negative token below every c_low (r = 0.5 < 0.6) is beyond the bounds and within reach; A = 0 counts nowhere.
    ratio, adv, mask, old_logp = _tokens([1.0, 0.5, 1.0, 3.0], [1.0, -1.0, -1.0, 0.0])
    _, _, stats = bapo_bounds(ratio, adv, mask, old_logp, weight="none", rho0=0.35)
    assert stats["steps"] == 0 and "target_reached" not in stats and "rho_moved" not in stats  # rho 1/2.6 >= 0.35
    assert stats["beyond"] == pytest.approx(1 / 3) and stats["reach"] == pytest.approx(1 / 3)
    _, _, stats = bapo_bounds(ratio, adv, torch.zeros_like(mask), old_logp)  # no token at all
    assert (stats["beyond"], stats["reach"]) == (0.0, 0.0)


@pytest.mark.parametrize("variant", ["paper", "recipe"])
def test_mechanism_stats_match_a_token_count(variant):
    """beyond / reach against a plain count over the tokens at the returned bounds; the same on two ranks."""
    hp = {"rho0": 0.45} if variant == "paper" else {**RECIPE, "rho0": 0.9}
    lowest_high, highest_low = (1.2, 0.9) if variant == "paper" else (1.2, 0.95)
    engaged = 0
    for seed in range(40):
        ratio, adv, mask, old_logp, _ = _random_tokens(seed, spread=0.1 + 0.03 * seed)
        c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp, **hp)
        toks = [(r, a) for r, a, m in zip(ratio.tolist(), adv.tolist(), mask.tolist(), strict=True) if m and a != 0]
        beyond = sum((a > 0 and r > c_high) or (a < 0 and r < c_low) for r, a in toks) / len(toks)
        reach = sum((a > 0 and r > lowest_high) or (a < 0 and r < highest_low) for r, a in toks) / len(toks)
        assert stats["beyond"] == pytest.approx(beyond, abs=1e-12) and stats["reach"] == pytest.approx(reach), seed
        assert stats["beyond"] <= stats["reach"] + 1e-12 or stats["steps"] == 0
        if stats["steps"] > 0:
            engaged += 1
            assert stats["target_reached"] == stats["target_met"]
            assert stats["rho_moved"] == pytest.approx(stats["rho_after"] - stats["rho_before"])
        two = bapo_bounds(ratio, adv, mask, old_logp, **hp, reduce_sum=lambda t: 2 * t)[2]
        assert (two["beyond"], two["reach"]) == (pytest.approx(stats["beyond"]), pytest.approx(stats["reach"]))
    assert 0 < engaged < 40  # the cases cover searches that engaged and ones that did not


# ---------------------------------------------------------------- reduce_sum, fixed bounds, factory


def test_reduce_sum_called_exactly_once():
    ratio, adv, mask, old_logp, _ = _random_tokens(0)
    calls = []

    def reduce_sum(t):
        calls.append(t.shape)
        return t

    for kwargs in ({}, RECIPE, {"contribution": "gradient", "rho0": 0.9}):
        calls.clear()
        bapo_bounds(ratio, adv, mask, old_logp, reduce_sum=reduce_sum, **kwargs)
        assert len(calls) == 1
    calls.clear()
    fixed_bounds(ratio, adv, mask, old_logp, ratio_low=0.8, ratio_high=1.2, reduce_sum=reduce_sum)
    assert calls == [torch.Size([2])]


def test_in_place_reduce_sum_returning_none():
    ratio, adv, mask, old_logp, _ = _random_tokens(1)
    doubled = [torch.cat([x, x]) for x in (ratio, adv, mask, old_logp)]

    def all_reduce_in_place(t):  # like torch.distributed.all_reduce: mutates, returns None
        t.mul_(2)

    got = bapo_bounds(ratio, adv, mask, old_logp, rho0=0.6, reduce_sum=all_reduce_in_place)
    expected = bapo_bounds(*doubled, rho0=0.6)
    assert got[:2] == expected[:2] and got[2] == pytest.approx(expected[2])


def test_fixed_bounds_logs_rho():
    ratio, adv, mask, old_logp = _tokens([1.5, 0.5, 0.7], [1.0, -2.0, -1.0], [0.5, 1.0, 0.25])
    # P = 0.5 * 1 * min(1.5, 1.2) = 0.6; N = 1 * 2 * max(0.5, 0.8) + 0.25 * 1 * max(0.7, 0.8) = 1.8
    c_low, c_high, stats = fixed_bounds(ratio, adv, mask, old_logp, ratio_low=0.8, ratio_high=1.2)
    assert (c_low, c_high) == (0.8, 1.2)
    assert stats == pytest.approx({"rho_before": 0.25, "rho_after": 0.25, "steps": 0.0, "P": 0.6, "N": 1.8})


def test_make_bound_fn():
    ratio, adv, mask, old_logp, _ = _random_tokens(2)
    clip_higher = make_bound_fn("fixed", ratio_low=0.8, ratio_high=1.28)
    assert clip_higher(ratio, adv, mask, old_logp)[:2] == (0.8, 1.28)
    bapo = make_bound_fn("bapo", rho0=0.7, contribution="gradient")
    expected = bapo_bounds(ratio, adv, mask, old_logp, rho0=0.7, contribution="gradient")
    assert bapo(ratio, adv, mask, old_logp, reduce_sum=lambda t: t) == expected
    with pytest.raises(ValueError, match=r"'bapo', 'fixed'"):
        make_bound_fn("ppo")
    with pytest.raises(ValueError, match="rho_0"):
        make_bound_fn("bapo", rho_0=0.4)
    with pytest.raises(ValueError, match="high_step"):
        make_bound_fn("bapo", high_step=0.0)
    with pytest.raises(ValueError, match="ratio_high"):
        make_bound_fn("fixed", ratio_low=0.8)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"low_range": (0.9, 0.6)}, "low_range"),
        ({"high_range": (3.0, 1.2)}, "high_range"),
        ({"low_step": 0.0}, "low_step"),
        ({"high_step": -0.1}, "high_step"),
        ({"variant": "verl"}, "variant"),
        ({"contribution": "grad"}, "contribution"),
        ({"weight": "prob"}, "weight"),
        ({"rho0": 1.5}, "rho0"),
    ],
)
def test_argument_validation(kwargs, name):
    ratio, adv, mask, old_logp, _ = _random_tokens(0)
    with pytest.raises(ValueError, match=name):
        bapo_bounds(ratio, adv, mask, old_logp, **kwargs)


def test_float32_and_2d_inputs_match_float64_1d():
    ratio, adv, mask, old_logp, rho0 = _random_tokens(5, n=48)
    flat = bapo_bounds(ratio, adv, mask, old_logp, rho0=rho0)
    shaped = bapo_bounds(*(x.view(6, 8) for x in (ratio, adv, mask, old_logp)), rho0=rho0)
    single = bapo_bounds(ratio.float(), adv.float(), mask, old_logp.float(), rho0=rho0)
    assert flat == shaped
    assert single[:2] == flat[:2] and single[2]["steps"] == flat[2]["steps"]
    assert isinstance(flat[0], float) and isinstance(flat[1], float)


# ---------------------------------------------------------------- properties

seeds = st.integers(0, 10_000)
variants = st.sampled_from([{}, RECIPE, {"contribution": "gradient"}, {"weight": "none"}])


@settings(max_examples=200, deadline=None)
@given(seed=seeds, scale=st.floats(1e-3, 1e3), extra=variants)
def test_scaling_advantages_keeps_bounds(seed, scale, extra):
    ratio, adv, mask, old_logp, rho0 = _random_tokens(seed)
    kwargs = {"rho0": rho0, **extra}
    base = bapo_bounds(ratio, adv, mask, old_logp, **kwargs)
    scaled = bapo_bounds(ratio, adv * scale, mask, old_logp, **kwargs)
    assert scaled[:2] == base[:2]
    assert scaled[2]["rho_after"] == pytest.approx(base[2]["rho_after"])


@settings(max_examples=200, deadline=None)
@given(seed=seeds, extra=variants, spread=st.floats(0.05, 3.0))
def test_bounds_in_range_and_target_met_or_exhausted(seed, extra, spread):
    ratio, adv, mask, old_logp, rho0 = _random_tokens(seed, spread=spread)
    kwargs = {"rho0": rho0, **extra}
    c_low, c_high, stats = bapo_bounds(ratio, adv, mask, old_logp, **kwargs)
    low_range, high_range = kwargs.get("low_range", (0.6, 0.9)), kwargs.get("high_range", (1.2, 3.0))
    assert low_range[0] <= c_low <= low_range[1] + 1e-12
    assert high_range[0] <= c_high <= high_range[1] + 1e-12
    score = stats["pn_ratio_after"] if kwargs.get("variant") == "recipe" else stats["rho_after"]
    exhausted = c_low == pytest.approx(low_range[1]) and c_high == pytest.approx(high_range[1])
    assert score >= kwargs["rho0"] - 1e-9 or exhausted
    assert stats["target_met"] == float(score >= kwargs["rho0"] - 1e-9)
    # the search moved exactly when the starting bounds missed the target
    before = stats["pn_ratio_before"] if kwargs.get("variant") == "recipe" else stats["rho_before"]
    assert stats["active"] == float(before < kwargs["rho0"] - 1e-9) == float(stats["steps"] > 0)


garbage = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 0.0])


@settings(max_examples=200, deadline=None)
@given(seed=seeds, extra=variants, junk=st.lists(garbage, min_size=3, max_size=3))
def test_masked_positions_change_nothing(seed, extra, junk):
    ratio, adv, mask, old_logp, rho0 = _random_tokens(seed)
    base = bapo_bounds(ratio, adv, mask, old_logp, rho0=rho0, **extra)
    dirty = [x.clone() for x in (ratio, adv, old_logp)]
    for x, value in zip(dirty, junk, strict=True):
        x[~mask] = value
    assert bapo_bounds(dirty[0], dirty[1], mask, dirty[2], rho0=rho0, **extra) == base


@settings(max_examples=200, deadline=None)
@given(seed=seeds, extra=variants, dtype=st.sampled_from([torch.float32, F64]))
def test_extreme_log_ratios_stay_finite(seed, extra, dtype):
    ratio, adv, mask, old_logp, rho0 = _random_tokens(seed)
    signs = torch.where(torch.rand(ratio.shape, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)
    ratio = torch.exp(50.0 * signs).to(dtype)  # log-ratios of +-50
    c_low, c_high, stats = bapo_bounds(ratio, adv.to(dtype), mask, old_logp.to(dtype), rho0=rho0, **extra)
    assert math.isfinite(c_low) and math.isfinite(c_high)
    assert all(math.isfinite(v) for k, v in stats.items() if not k.startswith("pn_ratio"))


@settings(max_examples=200, deadline=None)
@given(seed=seeds, extra=variants)
def test_fake_two_rank_sum_equals_doubled_data(seed, extra):
    ratio, adv, mask, old_logp, rho0 = _random_tokens(seed)
    doubled = [torch.cat([x, x]) for x in (ratio, adv, mask, old_logp)]
    two_ranks = bapo_bounds(ratio, adv, mask, old_logp, rho0=rho0, reduce_sum=lambda t: 2 * t, **extra)
    one_rank = bapo_bounds(*doubled, rho0=rho0, **extra)
    assert two_ranks[:2] == one_rank[:2]
    assert two_ranks[2] == pytest.approx(one_rank[2])


def algorithm1_moves(tokens, rho0, low_range, high_range, low_step, high_step, contribution):
    """Algorithm 1 written as in the paper, recording every move ("high" or "low") it makes."""
    moves, kl, kh = [], 0, 0

    def rho():
        p, n = _naive_sums(tokens, low_range[0] + kl * low_step, high_range[0] + kh * high_step, contribution)
        return 1.0 if p + n == 0 else p / (p + n)

    while rho() < rho0 - 1e-9 and low_range[0] + (kl + 1) * low_step <= low_range[1] + 1e-9:
        if high_range[0] + (kh + 1) * high_step <= high_range[1] + 1e-9:
            kh, move = kh + 1, "high"
        else:
            kl, move = kl + 1, "low"
        moves.append(move)
    return moves, kl, kh


hyper = st.fixed_dictionaries(
    {
        "low_range": st.tuples(st.sampled_from([0.5, 0.6, 0.7]), st.sampled_from([0.75, 0.8, 0.9, 0.95])),
        "high_range": st.tuples(st.sampled_from([1.1, 1.2, 1.3]), st.sampled_from([1.3, 1.5, 2.0, 3.0])),
        "low_step": st.sampled_from([0.01, 0.02, 0.03, 0.05, 0.1]),
        "high_step": st.sampled_from([0.05, 0.1, 0.15, 0.25]),
    }
)


@settings(max_examples=300, deadline=None)
@given(
    seed=seeds,
    hp=hyper,
    contribution=st.sampled_from(["loss_value", "gradient"]),
    weight=st.sampled_from(["behavior_prob", "none"]),
    spread=st.floats(0.05, 2.0),
)
def test_search_is_algorithm1_move_for_move(seed, hp, contribution, weight, spread):
    """Same final bounds and the same number of moves as Algorithm 1 for any ranges and steps;
    the moves are all c_high first, then all c_low, and c_low moves only once c_high is capped."""
    ratio, adv, mask, old_logp, rho0 = _random_tokens(seed, spread=spread)
    c_low, c_high, stats = bapo_bounds(
        ratio, adv, mask, old_logp, rho0=rho0, contribution=contribution, weight=weight, **hp
    )
    tokens = _as_list(ratio, adv, mask, old_logp, weight)
    moves, kl, kh = algorithm1_moves(tokens, rho0, contribution=contribution, **hp)
    assert stats["steps"] == len(moves)
    assert c_low == pytest.approx(hp["low_range"][0] + kl * hp["low_step"], abs=1e-9)
    assert c_high == pytest.approx(hp["high_range"][0] + kh * hp["high_step"], abs=1e-9)
    # the implementation's own walk (the candidate path it searched), cut where it stopped, move for move
    highs = bounds_mod._candidates(*hp["high_range"], hp["high_step"], "paper")
    lows = bounds_mod._candidates(*hp["low_range"], hp["low_step"], "paper")
    path_h, path_l = bounds_mod._search_path(len(highs), len(lows), "paper")
    steps = int(stats["steps"])
    walked = ["high" if path_h[i + 1] > path_h[i] else "low" for i in range(steps)]
    assert walked == moves and (path_h[steps], path_l[steps]) == (kh, kl)
    if kl:
        assert c_high + hp["high_step"] > hp["high_range"][1] + 1e-9  # c_high was at its cap
