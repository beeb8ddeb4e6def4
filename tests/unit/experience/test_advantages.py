"""Scoring a rollout batch: recomputed behaviour log-probs, shaped rewards, per-token advantages as tensors."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from bapo.algos import grpo_advantages
from bapo.experience.scoring import proximal, recompute_logp, score
from bapo.samples import Problem, Prompt, RolloutBatch, Sample
from tests.helpers.config import learner_cfg


def batch_of(tok, model, lengths=(3, 5, 2, 4), version=0) -> RolloutBatch:
    """Two groups of two samples with random response tokens; recorded log-probs are -1 everywhere."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, n in enumerate(lengths):
        prompt = Prompt(Problem(str(i // 2), "p", "1"), "p", (5, 6, 7))
        ids = torch.randint(3, len(tok), (n,), generator=g)
        samples.append(Sample(prompt, i // 2, ids, torch.full((n,), -1.0), "t", version, False))
    rewards, correct = (1.0, 0.0, 0.0, 0.0), (True, False, False, False)
    return RolloutBatch(1, version, tuple(samples), rewards, correct, ("1", None, "2", "3"), {"reward/accuracy": 0.25})


def learner(model):
    from bapo.algos import surrogate_objective
    from bapo.learner import Learner

    return Learner(
        model, learner_cfg(), objective=surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2), pad_id=0
    )


GRPO = SimpleNamespace(advantage="grpo", norm_std=True, critic=None, correction=None, overlong_filter=False)


def test_recompute_takes_the_learners_log_probs_at_the_given_weights(tiny_model, tiny_tok):
    batch = batch_of(tiny_tok, tiny_model)
    lrn = learner(copy.deepcopy(tiny_model))
    new, stats = recompute_logp(batch, lrn, None)
    expected = lrn.response_logp(list(batch.samples))
    for i, s in enumerate(new.samples):
        assert s.logp.dtype == torch.float32 and torch.equal(s.logp, expected[i, : len(s.response_ids)])
    assert stats["rollout/logp_mismatch_max"] == pytest.approx(float((expected[expected != 0] + 1).abs().max()))
    # an older version's snapshot: other weights, other log-probs
    old = {k: v + 0.05 for k, v in lrn.snapshot().items()}
    at_old, _ = recompute_logp(batch, lrn, old)
    assert not torch.equal(at_old.samples[0].logp, new.samples[0].logp)
    twin = learner(copy.deepcopy(tiny_model))
    twin.model.load_state_dict(old)
    assert torch.allclose(at_old.samples[0].logp, twin.response_logp([batch.samples[0]])[0, :3])


def test_score_shapes_the_reward_not_accuracy_and_gives_per_token_tensors(tiny_model, tiny_tok):
    batch = batch_of(tiny_tok, tiny_model)
    scored, stats = score(batch, learner(tiny_model), algo=GRPO, max_new_tokens=5, overlong_buffer=2, group_size=2)
    # overlong penalty over the last 2 of 5 tokens: lengths 3, 5, 2, 4 -> 0, -1, 0, -0.5
    assert [s.reward for s in scored] == [1.0, -1.0, 0.0, -0.5]
    assert [s.correct for s in scored] == [True, False, False, False]  # accuracy stays the verifier's
    adv = grpo_advantages(torch.tensor([1.0, -1.0, 0.0, -0.5], dtype=torch.float64), 2)
    for s, a in zip(scored, adv.tolist(), strict=True):
        assert s.token_adv.dtype == torch.float32 and s.token_adv.shape == s.sample.response_ids.shape
        assert torch.all(s.token_adv == torch.tensor(a, dtype=torch.float32)) and s.advantage == pytest.approx(a, 1e-6)
    assert stats["reward/mean"] == pytest.approx(-0.125) and stats["rollout/response_len"] == 3.5
    assert stats["rollout/version"] == 0.0 and stats["reward/accuracy"] == 0.25


def _algo(correction=None, overlong_filter=False):
    return SimpleNamespace(
        advantage="grpo", norm_std=True, critic=None, correction=correction, overlong_filter=overlong_filter
    )


def test_an_injected_mismatch_gives_back_the_analytic_tis_weights(tiny_model, tiny_tok):
    # The engine's log-probs are the learner's own minus a known delta_t, so pi / mu = e^{delta_t} exactly:
    # token TIS must give min(e^{delta_t}, cap) and sequence TIS min(e^{sum_t delta_t}, cap).
    lrn = learner(tiny_model)
    batch = batch_of(tiny_tok, tiny_model)
    exact = lrn.response_logp(list(batch.samples))  # [B, T] the learner's at version 0
    g = torch.Generator().manual_seed(2)
    deltas = [0.4 * torch.randn(len(s.response_ids), generator=g) for s in batch.samples]
    engine = [
        dataclasses.replace(s, logp=exact[i, : len(s.response_ids)] - deltas[i]) for i, s in enumerate(batch.samples)
    ]
    batch = dataclasses.replace(batch, samples=tuple(engine))
    kw = dict(max_new_tokens=5, overlong_buffer=0, group_size=2, behaviour={"weights": None})
    tis = SimpleNamespace(kind="tis", level="token", cap=1.5)
    scored, stats = score(batch, lrn, algo=_algo(tis), **kw)
    for s, d, e in zip(scored, deltas, engine, strict=True):
        torch.testing.assert_close(s.token_weight, d.double().exp().clamp(max=1.5).float(), rtol=1e-5, atol=1e-6)
        assert torch.equal(s.behaviour_logp, e.logp)  # the engine's log-probs travel on with the sample
    all_d = torch.cat(deltas).double()
    assert stats["correction/cut_frac"] == pytest.approx(float((all_d.exp() > 1.5).double().mean()))
    assert stats["correction/kl_k3"] == pytest.approx(float((all_d.exp() - all_d - 1).mean()), rel=1e-4)
    seq = SimpleNamespace(kind="tis", level="sequence", cap=10.0)
    scored, _ = score(batch, lrn, algo=_algo(seq), **kw)
    for s, d in zip(scored, deltas, strict=True):
        expected = torch.full_like(d, min(float(d.double().sum().exp()), 10.0))
        torch.testing.assert_close(s.token_weight, expected, rtol=1e-5, atol=1e-6)


def test_no_mismatch_gives_tis_weights_of_one(tiny_model, tiny_tok):
    lrn = learner(tiny_model)
    batch = batch_of(tiny_tok, tiny_model)
    exact = lrn.response_logp(list(batch.samples))
    same = [dataclasses.replace(s, logp=exact[i, : len(s.response_ids)]) for i, s in enumerate(batch.samples)]
    batch = dataclasses.replace(batch, samples=tuple(same))
    tis = SimpleNamespace(kind="tis", level="token", cap=2.0)
    scored, stats = score(
        batch, lrn, algo=_algo(tis), max_new_tokens=5, overlong_buffer=0, group_size=2, behaviour={"weights": None}
    )
    assert all(torch.all(s.token_weight == 1.0) for s in scored)
    assert stats["correction/ess"] == 1.0 and stats["correction/kl_k3"] == 0.0


def test_overlong_filter_zeroes_the_weights_of_truncated_responses(tiny_model, tiny_tok):
    batch = batch_of(tiny_tok, tiny_model)
    cut = [dataclasses.replace(s, truncated=i == 1) for i, s in enumerate(batch.samples)]
    batch = dataclasses.replace(batch, samples=tuple(cut))
    scored, _ = score(
        batch, learner(tiny_model), algo=_algo(overlong_filter=True), max_new_tokens=5, overlong_buffer=0, group_size=2
    )
    assert [bool(torch.all(s.token_weight == 0)) for s in scored] == [False, True, False, False]
    assert all(torch.all(s.token_weight == 1) for i, s in enumerate(scored) if i != 1)
    assert scored[1].advantage != 0  # it still shapes its group's baseline


def test_decoupled_proximal_is_the_current_policy_weighted_from_the_engine(tiny_model, tiny_tok):
    lrn = learner(tiny_model)
    batch = batch_of(tiny_tok, tiny_model)  # engine log-probs -1 everywhere
    scored, _ = score(batch, lrn, algo=_algo(), max_new_tokens=5, overlong_buffer=0, group_size=2)
    exact = SimpleNamespace(kind="decoupled", proximal="exact", cap=2.0)
    prox, stats = proximal(scored, lrn, exact)
    now = lrn.response_logp([s.sample for s in scored])
    for i, (p, s) in enumerate(zip(prox, scored, strict=True)):
        n = len(s.sample.response_ids)
        assert torch.equal(p.sample.logp, now[i, :n].float())  # the clip's old log-probs: the proximal policy
        assert torch.equal(p.behaviour_logp, s.sample.logp)  # behaviour: the engine's
        torch.testing.assert_close(p.token_weight, (now[i, :n].double() + 1).exp().clamp(max=2.0).float())
    assert "decoupled/ess" in stats
    loglin = SimpleNamespace(kind="decoupled", proximal="loglinear", cap=None)
    prox, _ = proximal(scored, lrn, loglin)
    assert all(p.proximal_version == lrn.version and torch.equal(p.sample.logp, p.behaviour_logp) for p in prox)
