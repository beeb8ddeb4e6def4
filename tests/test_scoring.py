"""Scoring a rollout batch: recomputed behaviour log-probs, shaped rewards, per-token advantages as tensors."""

import copy
from types import SimpleNamespace

import pytest
import torch

from bapo.algos import grpo_advantages
from bapo.scoring import recompute_logp, score
from bapo.types import Problem, Prompt, RolloutBatch, Sample
from tests.conftest import learner_cfg


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
