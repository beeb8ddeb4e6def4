"""Objectives (chooser + loss + state) and the advantage entry point the loop calls."""

import pytest
import torch

from bapo.algos import (
    bapo_bounds,
    compute_advantages,
    eps_feedback_g,
    eps_feedback_loss,
    eps_feedback_objective,
    eps_feedback_sums,
    fixed_bounds,
    grpo_advantages,
    policy_loss,
    positive_contribution,
    surrogate_objective,
)
from tests.helpers.algos import eps_state

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
    # every algorithm's window under clip/, the search's own diagnostics under bapo/
    assert stats == {
        "clip/low": lo,
        "clip/high": hi,
        "clip/rho": bstats["rho_after"],
        "clip/P": bstats["P"],
        "clip/N": bstats["N"],
        "bapo/rho_before": bstats["rho_before"],
        "bapo/search_steps": bstats["steps"],
        "bapo/target_met": bstats["target_met"],
        "bapo/search_active": bstats["active"],
        "bapo/signal": bstats["signal"],
        "bapo/beyond_bounds": bstats["beyond"],
        "bapo/reach": bstats["reach"],
        "bapo/target_reached": bstats["target_reached"],
        "bapo/rho_moved": bstats["rho_moved"],
    }
    assert bstats["active"] == 1.0  # the search engaged on these tokens, so its outcome is logged
    assert obj.loss.__wrapped__ is policy_loss and obj.adaptive and obj.prepass and not obj.stateful
    assert obj.after_update(stats) == {} and obj.state_dict() == {}
    assert not surrogate_objective("bapo", scope="micro_batch").prepass
    assert obj.loss_kw["agg"] == "seq-mean-token-sum" and obj.loss_kw["dual_clip"] == 3.0
    fixed = surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.28)
    params, stats = fixed.choose(ratio, adv, mask, old)
    assert not fixed.adaptive and not fixed.prepass and params == {"ratio_low": 0.8, "ratio_high": 1.28}
    _, _, fstats = fixed_bounds(ratio, adv, mask, old, ratio_low=0.8, ratio_high=1.28)
    assert stats == {"clip/low": 0.8, "clip/high": 1.28, "clip/rho": fstats["rho_after"], "clip/P": fstats["P"],
                     "clip/N": fstats["N"]}  # fmt: skip
    with pytest.raises(ValueError, match="kind"):
        surrogate_objective("eps_feedback")


def test_eps_feedback_objective_chooses_g_and_steps_eps():
    ratio, adv, mask, old = _tokens(1)
    state = eps_state()
    obj = eps_feedback_objective(state, entropy_coef=0.01)
    params, stats = obj.choose(ratio, adv, mask, old, reduce_sum=lambda t: 2 * t)  # two equal ranks: same g
    g = eps_feedback_g(eps_feedback_sums(ratio, adv, mask, eps=0.2))
    assert params == {"eps": 0.2, "g": pytest.approx(g)}
    assert stats["clip/low"] == pytest.approx(0.8) and stats["clip/high"] == pytest.approx(1.2)
    p, n = positive_contribution(ratio, adv, mask, old, ratio_low=0.8, ratio_high=1.2)
    assert stats["clip/rho"] == pytest.approx(float(p / (p + n)))  # the same measure as every other algorithm
    assert stats["eps_feedback/g"] == pytest.approx(g)
    assert obj.loss.__wrapped__ is eps_feedback_loss and obj.adaptive and obj.stateful
    expected = 0.22 if g > 1 else 0.18 if g < 0.5 else 0.2
    assert obj.after_update(stats) == {"eps_feedback/eps_next": pytest.approx(expected)}
    assert state.eps == pytest.approx(expected) and obj.state_dict()["eps"] == pytest.approx(expected)


def test_eps_feedback_objective_hands_the_loss_every_shared_keyword_and_the_states_rule():
    obj = eps_feedback_objective(eps_state(g_high=2.0, widen=0.25), kl_coef=0.1, dual_clip=3.0)
    assert obj.loss_kw == {  # the learner reads entropy_coef here: the loss's own default when not given
        "dual_clip": 3.0,
        "agg": "token-mean",
        "entropy_coef": 0.01,
        "kl_coef": 0.1,
        "kl_estimator": "k3",
        "g_high": 2.0,
        "widen": 0.25,
    }
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['entropy_cof', 'widen'\]"):
        eps_feedback_objective(eps_state(), entropy_cof=0.1, widen=0.1)  # the rule's constants are the state's


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
