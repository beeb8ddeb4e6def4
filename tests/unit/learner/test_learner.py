import copy
import math
from types import SimpleNamespace

import pytest
import torch

from bapo.algos import (
    bapo_bounds,
    eps_feedback_g,
    eps_feedback_objective,
    eps_feedback_sums,
    surrogate_objective,
    token_logp,
)
from bapo.learner import split
from tests.helpers.algos import eps_state
from tests.helpers.learner import fake_batch, grads, make_learner


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_grad_accumulation_equals_one_pass(tiny_model, tiny_tok, agg):
    batch = fake_batch(tiny_tok, tiny_model)
    # float64, so that the only possible difference is the normalisation, not summation order
    m1, m2 = copy.deepcopy(tiny_model).double(), copy.deepcopy(tiny_model).double()
    make_learner(m1, micro_batch_size=3, agg=agg).accumulate(batch)
    make_learner(m2, micro_batch_size=len(batch), agg=agg).accumulate(batch)
    g1, g2 = grads(m1), grads(m2)
    assert g1.keys() == g2.keys()
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-9, atol=1e-12)


def test_minibatch_scope_bounds_equal_direct_search(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    out = make_learner(copy.deepcopy(tiny_model)).accumulate(batch)
    with torch.no_grad():
        logits = tiny_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ratio = torch.exp(token_logp(logits[:, :-1].float(), batch.input_ids[:, 1:]) - batch.old_logp)
    lo, hi, st = bapo_bounds(ratio, batch.adv, batch.mask, batch.old_logp)
    assert out["clip/low"] == pytest.approx(lo) and out["clip/high"] == pytest.approx(hi)
    assert out["clip/rho"] == pytest.approx(float(st["rho_after"]), rel=1e-5)


def test_update_changes_weights_and_logs(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    before = copy.deepcopy(tiny_model.state_dict())
    out = make_learner(tiny_model).update(batch)
    assert any(not torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())
    for key in (
        "learner/entropy",
        "learner/grad_norm",
        "clip/low",
        "clip/high",
        "clip/rho",
        "learner/loss",
    ):
        assert math.isfinite(out[key]), key
    assert out["learner/entropy"] > 0


def test_nonfinite_update_is_skipped(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    batch.adv[batch.mask.bool()] = float("nan")
    before = copy.deepcopy(tiny_model.state_dict())
    learner = make_learner(tiny_model, objective=surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2))
    out = learner.update(batch)
    assert out["learner/skipped_updates"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())
    good = fake_batch(tiny_tok, tiny_model, seed=1)
    assert learner.update(good)["learner/skipped_updates"] == 1.0  # the run goes on
    assert math.isfinite(learner.update(good)["learner/grad_norm"])


def test_micro_scope_searches_each_micro_batch_on_its_own(tiny_model, tiny_tok):
    """scope=micro_batch (the authors' code): one search per micro-batch, on that micro-batch's tokens only;
    the logged bounds are the token-weighted mean of the per-micro-batch choices."""
    batch = fake_batch(tiny_tok, tiny_model)
    out = make_learner(copy.deepcopy(tiny_model), scope="micro_batch", micro_batch_size=3).accumulate(batch)
    lows, highs, weights = [], [], []
    for mb in split(batch, 3):  # an independent search per micro-batch, from the initial weights
        with torch.no_grad():
            logits = tiny_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        ratio = torch.exp(token_logp(logits[:, :-1].float(), mb.input_ids[:, 1:]) - mb.old_logp)
        lo, hi, _ = bapo_bounds(ratio, mb.adv, mb.mask, mb.old_logp)
        lows.append(lo), highs.append(hi), weights.append(mb.num_tokens)
    assert len(set(zip(lows, highs, strict=True))) > 1  # the micro-batches really chose differently
    mean = lambda xs: sum(x * w for x, w in zip(xs, weights, strict=True)) / sum(weights)  # noqa: E731
    assert out["clip/low"] == pytest.approx(mean(lows), rel=1e-6)
    assert out["clip/high"] == pytest.approx(mean(highs), rel=1e-6)
    whole = make_learner(copy.deepcopy(tiny_model), scope="mini_batch", micro_batch_size=3).accumulate(batch)
    assert (whole["clip/low"], whole["clip/high"]) != (out["clip/low"], out["clip/high"])


def test_micro_scope_averages_a_stat_over_the_micro_batches_that_report_it(tiny_model, tiny_tok):
    """bapo/target_reached exists only where a micro-batch's search engaged: its logged value is the mean over
    those micro-batches (token-weighted), not a mean that counts the others as 0."""
    batch = fake_batch(tiny_tok, tiny_model)
    learner = make_learner(copy.deepcopy(tiny_model), scope="micro_batch", micro_batch_size=3)
    per_micro = [({"bapo/target_reached": 1.0, "clip/low": 0.6}, 10), ({"clip/low": 0.8}, 30)]
    logged, _ = learner._choice_stats(None, per_micro, [])
    assert logged["bapo/target_reached"] == 1.0
    assert logged["clip/low"] == pytest.approx((0.6 * 10 + 0.8 * 30) / 40)
    out = learner.accumulate(batch)
    assert "bapo/beyond_bounds" in out and 0.0 <= out["bapo/beyond_bounds"] <= 1.0


def test_split_trims_padding(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    parts = split(batch, 3)
    assert sum(len(p) for p in parts) == len(batch)
    assert sum(p.num_tokens for p in parts) == batch.num_tokens
    for p in parts:
        assert p.attention_mask[:, -1].any()  # no all-padding column at the end


# ---------------------------------------------------------------- critic, reference model, eps-feedback state


def scored_batch(tok, model, n=8, seed=0, critic_fields=True):
    """Like fake_batch, with per-token advantages, old values and returns (as PPO scoring makes them)."""
    base = fake_batch(tok, model, n=n, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    extras = {}
    if critic_fields:
        extras = {k: torch.randn(base.mask.shape, generator=g) * base.mask for k in ("old_values", "returns")}
    adv = torch.randn(base.mask.shape, generator=g) * base.mask  # token-level advantages
    return type(base)(base.input_ids, base.attention_mask, base.mask, base.old_logp, adv, base.versions, extras)


CRITIC = SimpleNamespace(lr=1e-2, vf_clip=0.2)  # the algo.critic fields the learner reads


def test_values_are_the_critics_per_response_token(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    learner = make_learner(tiny_model, critic_cfg=CRITIC)
    critic = learner.critic
    torch.nn.init.normal_(critic.model.head.weight)  # non-zero values
    values = learner.values(batch)  # [B, T]
    lengths = batch.mask.sum(1).long()
    assert values.shape == (len(batch), int(lengths.max()))
    for b in range(len(batch)):
        row = batch.attention_mask[b].bool()
        with torch.no_grad():
            v = critic.model(batch.input_ids[b : b + 1, row], batch.attention_mask[b : b + 1, row])[0, :-1]
        expected = v[batch.mask[b, : row.sum() - 1].bool()]
        torch.testing.assert_close(values[b, : lengths[b]], expected, rtol=1e-4, atol=1e-5)  # fp32, padded vs unpadded
        assert torch.all(values[b, lengths[b] :] == 0)
    assert make_learner(tiny_model).values(batch) is None  # no critic, no values


def test_critic_trains_with_its_own_optimizer_and_logs(tiny_model, tiny_tok):
    batch = scored_batch(tiny_tok, tiny_model)
    learner = make_learner(tiny_model, critic_cfg=CRITIC, bounds="fixed")
    critic = learner.critic
    before = copy.deepcopy(critic.model.state_dict())
    out = learner.update(batch)
    assert any(not torch.equal(before[k], v) for k, v in critic.model.state_dict().items())
    for key in ("learner/value_loss", "learner/value_clip_frac", "learner/explained_var", "learner/critic_grad_norm"):
        assert math.isfinite(out[key]), key
    # the critic's optimizer holds the critic's parameters and none of the policy's, and the reverse
    critic_params = {id(p) for g in critic.optimizer.param_groups for p in g["params"]}
    policy_params = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert critic_params == {id(p) for p in critic.model.parameters()}
    assert policy_params == {id(p) for p in learner.model.parameters()} and not critic_params & policy_params
    # the critic's trunk is its own copy: training it leaves the policy alone
    assert all(p.data_ptr() != q.data_ptr() for p in critic.model.parameters() for q in tiny_model.parameters())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_critic_grad_accumulation_equals_one_pass(tiny_model, tiny_tok, agg):
    batch = scored_batch(tiny_tok, tiny_model)
    model = copy.deepcopy(tiny_model).double()
    l1 = make_learner(copy.deepcopy(model), critic_cfg=CRITIC, micro_batch_size=3, agg=agg, bounds="fixed")
    l2 = make_learner(copy.deepcopy(model), critic_cfg=CRITIC, micro_batch_size=len(batch), agg=agg, bounds="fixed")
    c1, c2 = l1.critic, l2.critic
    torch.nn.init.normal_(c1.model.head.weight, std=0.1)
    c2.model.load_state_dict(c1.model.state_dict())
    l1.accumulate(batch)
    l2.accumulate(batch)
    g1, g2 = grads(c1.model), grads(c2.model)
    assert g1.keys() == g2.keys() and g1
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-9, atol=1e-12)


def test_kl_to_reference_is_zero_at_start_then_grows(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    objective = surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2, kl_coef=0.1)
    learner = make_learner(tiny_model, objective=objective, ref_model=copy.deepcopy(tiny_model), lr=1e-2)
    first = learner.update(batch)
    assert first["learner/kl_ref"] == 0.0  # the policy is still the reference: k3(0) = 0
    assert all(not p.requires_grad for p in learner.ref_model.parameters())
    second = learner.update(batch)
    assert second["learner/kl_ref"] > 0.0
    with pytest.raises(ValueError, match="ref_logp"):  # a KL coefficient without a reference model
        make_learner(tiny_model, objective=objective).update(batch)


@pytest.mark.parametrize("scope", ["mini_batch", "micro_batch"])
def test_eps_feedback_eps_follows_its_rule_on_the_updates_g(tiny_model, tiny_tok, scope):
    batch = scored_batch(tiny_tok, tiny_model, critic_fields=False)
    batch.adv.copy_(torch.where(batch.adv < 0, 4 * batch.adv, batch.adv))  # negatives dominate: g > 1
    state = eps_state()
    learner = make_learner(tiny_model, objective=eps_feedback_objective(state), scope=scope, lr=1e-2)
    eps_seen = []
    for _ in range(4):
        eps = state.eps
        with torch.no_grad():  # g over every token of the update, computed independently
            logits = learner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        ratio = torch.exp(token_logp(logits[:, :-1], batch.input_ids[:, 1:]) - batch.old_logp)
        g = eps_feedback_g(eps_feedback_sums(ratio, batch.adv, batch.mask, eps=eps))
        out = learner.update(batch)
        expected = min(1.1 * eps, 0.5) if g > 1 else max(0.9 * eps, 0.1) if g < 0.5 else eps
        assert state.eps == pytest.approx(expected) and out["eps_feedback/eps_next"] == pytest.approx(expected)
        assert out["eps_feedback/eps"] == pytest.approx(eps)
        if scope == "mini_batch":
            assert out["eps_feedback/g"] == pytest.approx(g, rel=1e-4)
        eps_seen.append(state.eps)
        batch.adv.mul_(-1.0)  # flip the balance: now positives dominate, g < 0.5
    assert eps_seen[0] > 0.2 and min(eps_seen) < max(eps_seen)


def test_eps_feedback_grad_accumulation_equals_one_pass(tiny_model, tiny_tok):
    batch = scored_batch(tiny_tok, tiny_model, critic_fields=False)
    m1, m2 = copy.deepcopy(tiny_model).double(), copy.deepcopy(tiny_model).double()
    make_learner(m1, objective=eps_feedback_objective(eps_state()), micro_batch_size=3).accumulate(batch)
    make_learner(m2, objective=eps_feedback_objective(eps_state()), micro_batch_size=len(batch)).accumulate(batch)
    g1, g2 = grads(m1), grads(m2)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-9, atol=1e-12)


def test_skipped_update_does_not_step_eps_feedback_state(tiny_model, tiny_tok):
    batch = scored_batch(tiny_tok, tiny_model, critic_fields=False)
    batch.adv[batch.mask.bool()] = float("nan")
    state = eps_state()
    out = make_learner(tiny_model, objective=eps_feedback_objective(state)).update(batch)
    assert out["learner/skipped_updates"] == 1.0 and state.eps == 0.2 and "eps_feedback/eps_next" not in out


def test_save_load_round_trip_restores_eps_feedback_and_critic(tiny_model, tiny_tok, tmp_path):
    batch = scored_batch(tiny_tok, tiny_model)

    def fresh():
        model = copy.deepcopy(tiny_model)
        return make_learner(model, objective=eps_feedback_objective(eps_state()), critic_cfg=CRITIC, lr=1e-2)

    a = fresh()
    for _ in range(2):
        a.update(batch)
    b = fresh()
    a.save(tmp_path / "learner")
    b.load(tmp_path / "learner")
    assert b.objective.state == a.objective.state and b.version == a.version == 2
    out_a, out_b = a.update(batch), b.update(batch)
    assert out_a["eps_feedback/eps_next"] == out_b["eps_feedback/eps_next"]
    assert out_a["learner/loss"] == pytest.approx(out_b["learner/loss"], rel=1e-6)
    assert out_a["learner/value_loss"] == pytest.approx(out_b["learner/value_loss"], rel=1e-6)


# ---------------------------------------------------------------- dropout, and stats that mean what they say


def test_dropout_is_off_so_on_policy_ratios_are_exactly_one(tiny_tok):
    """A checkpoint with dropout: before, the learner's passes ran in train mode, so the pre-pass, the loss
    and recompute each saw other masks and an on-policy ratio was not 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.paths import TINY

    config = AutoConfig.from_pretrained(TINY, attention_dropout=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.model.embed_tokens = torch.nn.Sequential(model.model.embed_tokens, torch.nn.Dropout(0.5))
    learner = make_learner(model, bounds="fixed")
    batch = fake_batch(tiny_tok, learner.model)
    with torch.no_grad():
        lp = learner.response_logp(batch)  # recompute's log-probs, then used as the behaviour
    on_policy = type(batch)(
        batch.input_ids, batch.attention_mask, batch.mask, torch.zeros_like(batch.old_logp), batch.adv, batch.versions
    )
    for b in range(len(batch)):
        on_policy.old_logp[b, batch.mask[b].bool()] = lp[b, : int(batch.mask[b].sum())]
    out = learner.accumulate(on_policy)
    assert out["learner/ratio_max"] == 1.0 and out["learner/ratio_mean"] == 1.0 and out["learner/approx_kl"] == 0.0
    assert all(m.p == 0.0 for m in learner.model.modules() if isinstance(m, torch.nn.Dropout))


def test_clip_fractions_are_over_their_own_sign_and_ratio_max_is_the_max(tiny_model, tiny_tok):
    """Before: clip_frac_high/low were divided by all tokens, and ratio_max was a mean of micro-batch maxima."""
    from bapo.algos import importance_ratio

    batch = fake_batch(tiny_tok, tiny_model, n=12)
    out = make_learner(copy.deepcopy(tiny_model), bounds="fixed", micro_batch_size=5).accumulate(batch)
    with torch.no_grad():  # an independent count over the whole mini-batch
        logits = tiny_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ratio = importance_ratio(token_logp(logits[:, :-1].float(), batch.input_ids[:, 1:]), batch.old_logp)
    m = batch.mask.bool()
    pos, neg = m & (batch.adv > 0), m & (batch.adv < 0)
    assert 0 < pos.sum() < m.sum() and 0 < neg.sum() < m.sum()
    high = (pos & (ratio > 1.2)).sum() / pos.sum()
    low = (neg & (ratio < 0.8)).sum() / neg.sum()
    assert high > 0 and low > 0
    assert out["learner/clip_frac_high"] == pytest.approx(float(high), rel=1e-6)
    assert out["learner/clip_frac_low"] == pytest.approx(float(low), rel=1e-6)
    assert out["learner/ratio_max"] == pytest.approx(float(ratio[m].max()), rel=1e-5)
    assert out["learner/pos_tokens"] == pos.sum() and out["learner/neg_tokens"] == neg.sum()
