import copy
import math

import pytest
import torch

from bapo.algos import CardState, bapo_bounds, card_g, card_objective, card_sums, surrogate_objective, token_logp
from bapo.learner import Critic, Learner, collate, split
from bapo.types import Problem, Prompt, Sample, ScoredSample


def fake_batch(tok, model, n=8, seed=0):
    """Real sequences with behaviour log-probs from a slightly perturbed policy (so ratios != 1)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt_ids = tuple(torch.randint(3, len(tok), (5 + i % 3,), generator=g).tolist())
        resp = tuple(torch.randint(3, len(tok), (4 + (i * 5) % 9,), generator=g).tolist())
        x = torch.tensor([prompt_ids + resp])
        with torch.no_grad():
            lp = token_logp(model(input_ids=x).logits[:, :-1].float(), x[:, 1:])[0, len(prompt_ids) - 1 :]
        lp = lp + 0.3 * torch.randn(lp.shape, generator=g)
        prompt = Prompt(Problem(str(i), "p", "1"), "p", prompt_ids)
        s = Sample(prompt, i // 4, resp, tuple(lp.tolist()), "t", 0, False)
        samples.append(ScoredSample(s, 0.0, float(torch.randn(1, generator=g)), False))
    return collate(samples, pad_id=tok.pad_token_id)


def make_learner(model, agg="token-mean", bounds="bapo", **kw):
    fixed = {"ratio_low": 0.8, "ratio_high": 1.2} if bounds == "fixed" else {}
    args = dict(objective=surrogate_objective(bounds, agg=agg, **fixed), lr=1e-3, micro_batch_size=3)
    args.update(kw)
    return Learner(model, **args)


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


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
    assert out["bapo/ratio_low"] == pytest.approx(lo) and out["bapo/ratio_high"] == pytest.approx(hi)
    assert out["bapo/rho"] == pytest.approx(float(st["rho_after"]), rel=1e-5)


def test_update_changes_weights_and_logs(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    before = copy.deepcopy(tiny_model.state_dict())
    out = make_learner(tiny_model).update(batch)
    assert any(not torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())
    for key in (
        "learner/entropy",
        "learner/grad_norm",
        "bapo/ratio_low",
        "bapo/ratio_high",
        "bapo/rho",
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


def test_micro_scope_runs_and_logs_bounds(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    out = make_learner(tiny_model, scope="micro_batch").update(batch)
    assert 0.6 <= out["bapo/ratio_low"] <= 0.9 and 1.2 <= out["bapo/ratio_high"] <= 3.0


def test_split_trims_padding(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    parts = split(batch, 3)
    assert sum(len(p) for p in parts) == len(batch)
    assert sum(p.num_tokens for p in parts) == batch.num_tokens
    for p in parts:
        assert p.attention_mask[:, -1].any()  # no all-padding column at the end


# ---------------------------------------------------------------- critic, reference model, card state


def scored_batch(tok, model, n=8, seed=0, critic_fields=True):
    """Like fake_batch, with per-token advantages, old values and returns (as PPO scoring makes them)."""
    base = fake_batch(tok, model, n=n, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    extras = {}
    if critic_fields:
        extras = {k: torch.randn(base.mask.shape, generator=g) * base.mask for k in ("old_values", "returns")}
    adv = torch.randn(base.mask.shape, generator=g) * base.mask  # token-level advantages
    return type(base)(base.input_ids, base.attention_mask, base.mask, base.old_logp, adv, base.versions, extras)


def make_critic(model, **kw):
    return Critic(model, lr=1e-2, vf_clip=0.2, **kw)


def test_values_are_the_critics_per_response_token(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    critic = make_critic(tiny_model)
    torch.nn.init.normal_(critic.model.head.weight)  # non-zero values
    values = make_learner(tiny_model, critic=critic).values(batch)  # [B, T]
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
    critic = make_critic(tiny_model)
    before = copy.deepcopy(critic.model.state_dict())
    out = make_learner(tiny_model, critic=critic, bounds="fixed").update(batch)
    assert any(not torch.equal(before[k], v) for k, v in critic.model.state_dict().items())
    for key in ("learner/value_loss", "learner/value_clip_frac", "learner/explained_var", "learner/critic_grad_norm"):
        assert math.isfinite(out[key]), key
    assert critic.optimizer is not make_learner(tiny_model).optimizer
    # the critic's trunk is its own copy: training it leaves the policy alone
    assert all(p.data_ptr() != q.data_ptr() for p in critic.model.parameters() for q in tiny_model.parameters())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_critic_grad_accumulation_equals_one_pass(tiny_model, tiny_tok, agg):
    batch = scored_batch(tiny_tok, tiny_model)
    model = copy.deepcopy(tiny_model).double()
    c1, c2 = make_critic(model, agg=agg), make_critic(model, agg=agg)
    for c in (c1, c2):
        torch.nn.init.normal_(c.model.head.weight, std=0.1)
    c2.model.load_state_dict(c1.model.state_dict())
    make_learner(copy.deepcopy(model), critic=c1, micro_batch_size=3, agg=agg, bounds="fixed").accumulate(batch)
    make_learner(copy.deepcopy(model), critic=c2, micro_batch_size=len(batch), agg=agg, bounds="fixed").accumulate(
        batch
    )
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
def test_card_eps_follows_its_rule_on_the_updates_g(tiny_model, tiny_tok, scope):
    batch = scored_batch(tiny_tok, tiny_model, critic_fields=False)
    batch.adv.copy_(torch.where(batch.adv < 0, 4 * batch.adv, batch.adv))  # negatives dominate: g > 1
    state = CardState()
    learner = make_learner(tiny_model, objective=card_objective(state), scope=scope, lr=1e-2)
    eps_seen = []
    for _ in range(4):
        eps = state.eps
        with torch.no_grad():  # g over every token of the update, computed independently
            logits = learner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        ratio = torch.exp(token_logp(logits[:, :-1], batch.input_ids[:, 1:]) - batch.old_logp)
        g = card_g(card_sums(ratio, batch.adv, batch.mask, eps=eps))
        out = learner.update(batch)
        expected = min(1.1 * eps, 0.5) if g > 1 else max(0.9 * eps, 0.1) if g < 0.5 else eps
        assert state.eps == pytest.approx(expected) and out["card/eps_next"] == pytest.approx(expected)
        assert out["card/eps"] == pytest.approx(eps)
        if scope == "mini_batch":
            assert out["card/g"] == pytest.approx(g, rel=1e-4)
        eps_seen.append(state.eps)
        batch.adv.mul_(-1.0)  # flip the balance: now positives dominate, g < 0.5
    assert eps_seen[0] > 0.2 and min(eps_seen) < max(eps_seen)


def test_card_grad_accumulation_equals_one_pass(tiny_model, tiny_tok):
    batch = scored_batch(tiny_tok, tiny_model, critic_fields=False)
    m1, m2 = copy.deepcopy(tiny_model).double(), copy.deepcopy(tiny_model).double()
    make_learner(m1, objective=card_objective(CardState()), micro_batch_size=3).accumulate(batch)
    make_learner(m2, objective=card_objective(CardState()), micro_batch_size=len(batch)).accumulate(batch)
    g1, g2 = grads(m1), grads(m2)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-9, atol=1e-12)


def test_skipped_update_does_not_step_card_state(tiny_model, tiny_tok):
    batch = scored_batch(tiny_tok, tiny_model, critic_fields=False)
    batch.adv[batch.mask.bool()] = float("nan")
    state = CardState()
    out = make_learner(tiny_model, objective=card_objective(state)).update(batch)
    assert out["learner/skipped_updates"] == 1.0 and state.eps == 0.2 and "card/eps_next" not in out


def test_state_dict_round_trip_restores_card_and_critic(tiny_model, tiny_tok):
    batch = scored_batch(tiny_tok, tiny_model)

    def fresh():
        model = copy.deepcopy(tiny_model)
        return make_learner(model, objective=card_objective(CardState()), critic=make_critic(model), lr=1e-2)

    a = fresh()
    for _ in range(2):
        a.update(batch)
    b = fresh()
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.objective.state == a.objective.state
    out_a, out_b = a.update(batch), b.update(batch)
    assert out_a["card/eps_next"] == out_b["card/eps_next"]
    assert out_a["learner/loss"] == pytest.approx(out_b["learner/loss"], rel=1e-6)
    assert out_a["learner/value_loss"] == pytest.approx(out_b["learner/value_loss"], rel=1e-6)
