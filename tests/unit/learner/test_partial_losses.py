"""The losses on a response whose tokens came from several policy versions (partial rollouts), on a 2-segment toy.

Each token's ratio denominator is its own behaviour log-prob. What each option means for such a response:

- ``old_logp=rollout``: the engine's log-prob of each token, under the weights that sampled it (as recorded).
- ``old_logp=recompute``: the learner's log-prob of each token under *its own version's* weights (one forward
  per version, selected per token): ``Learner.response_logp(samples, TokenVersionWeights(...))``.
- TIS / MIS / geo_reject: token weights pi_v(t) / mu_v(t) per token; at sequence level the product over all
  tokens, which is the ratio of the two composite policies that generated the response segment by segment.
- decoupled PPO: the proximal policy is one policy (the learner at the step's start) for every token; the
  behaviour->proximal weight is per token; ``proximal=loglinear`` interpolates with each token's own version:
  alpha_t = (v_prox - v_t) / (v_now - v_t).
"""

import math

import torch

from bapo.algos.correction import correction_weights, loglinear_proximal
from bapo.learner import Learner, TokenVersionWeights, collate
from bapo.samples import Problem, Prompt, Sample, ScoredSample
from tests.helpers.config import learner_cfg
from tests.helpers.engines import learner_logp
from tests.helpers.fakes import perturbed
from tests.helpers.learner import make_learner


def two_segment_sample(versions=(3, 3, 5, 5), logp=(-1.0, -1.0, -2.0, -2.0)):
    prompt = Prompt(Problem("0", "p", "1"), "p", (5, 6, 7))
    ids = torch.tensor([9, 10, 11, 2])
    return Sample(prompt, 0, ids, torch.tensor(logp), "t", min(versions), False, torch.tensor(versions))


def test_loglinear_proximal_uses_each_tokens_own_version():
    # v_prox = 6, v_now = 7; tokens of version 3: alpha = (6-3)/(7-3) = 0.75; of version 5: (6-5)/(7-5) = 0.5.
    behav = torch.tensor([[-1.0, -1.0, -2.0, -2.0]])
    logp = torch.tensor([[-0.6, -1.4, -1.0, -3.0]])
    prox = loglinear_proximal(behav, logp, torch.tensor([[3, 3, 5, 5]]), torch.tensor([6]), 7)
    # -1 + 0.75 * 0.4 = -0.7; -1 + 0.75 * -0.4 = -1.3; -2 + 0.5 * 1 = -1.5; -2 + 0.5 * -1 = -2.5
    torch.testing.assert_close(prox, torch.tensor([[-0.7, -1.3, -1.5, -2.5]]))


def test_collate_carries_each_tokens_version_where_a_response_has_several():
    s = two_segment_sample()
    batch = collate([ScoredSample(s, 0.0, 1.0, False)], pad_id=0)
    # prompt of 3: response token j is predicted at position 2 + j
    assert batch.extras["token_version"][0].tolist() == [0, 0, 3, 3, 5, 5] and batch.versions.tolist() == [3]
    plain = Sample(s.prompt, 0, s.response_ids, s.logp, "t", 3, False)
    assert "token_version" not in collate([ScoredSample(plain, 0.0, 1.0, False)], pad_id=0).extras


def test_the_learners_loglinear_anchor_interpolates_by_token_version(tiny_model):
    from bapo.algos import surrogate_objective
    from bapo.algos.objective import proximal_fn

    objective = surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2)
    objective.proximal = proximal_fn(None)
    lrn = Learner(tiny_model, learner_cfg(), objective=objective, pad_id=0, device="cpu")
    lrn.version = 7
    s = two_segment_sample()
    scored = ScoredSample(s, 0.0, 1.0, False, behaviour_logp=s.logp, proximal_version=6)
    mb = collate([scored], pad_id=0)
    logp = torch.zeros_like(mb.old_logp)
    logp[0, 2:6] = torch.tensor([-0.6, -1.4, -1.0, -3.0])
    old, kw = lrn._anchor(mb, logp)
    torch.testing.assert_close(old[0, 2:6], torch.tensor([-0.7, -1.3, -1.5, -2.5]))
    # the weight behaviour -> proximal: e^(prox - behav) = e^0.3, e^-0.3, e^0.5, e^-0.5
    torch.testing.assert_close(kw["token_weight"][0, 2:6], torch.tensor([0.3, -0.3, 0.5, -0.5]).exp())


def test_sequence_level_corrections_take_the_product_over_both_segments():
    # learner (pi) and engine (mu) log-probs of a 2-segment response: lw = [0.1, 0.1, -0.5, -0.5]
    old = torch.tensor([[-1.0, -1.0, -2.0, -2.0]])
    behav = torch.tensor([[-1.1, -1.1, -1.5, -1.5]])
    mask = torch.ones_like(old)
    w, _ = correction_weights(old, behav, mask, kind="tis", level="token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.1, 0.1, -0.5, -0.5]]).exp())
    w, _ = correction_weights(old, behav, mask, kind="tis", level="sequence", cap=2.0)
    torch.testing.assert_close(w, torch.full((1, 4), math.exp(-0.8)))  # e^(0.1 + 0.1 - 0.5 - 0.5)
    w, _ = correction_weights(old, behav, mask, kind="mis", level="sequence", cap=1.1)
    torch.testing.assert_close(w, torch.full((1, 4), math.exp(-0.8)))  # 0.45 <= 1.1: kept
    w, _ = correction_weights(old, behav, mask, kind="geo_reject", cap=1.1)
    assert w.tolist() == [[0.0] * 4]  # geometric mean e^(-0.2) = 0.82 < 1 / 1.1: dropped


def test_recompute_scores_each_token_under_its_own_versions_weights(tiny_model, tiny_tok):
    # A response whose first two tokens came from version 3's weights and the rest from version 5's (the
    # learner's current ones): recompute must use each token's own, not the oldest's or the newest's.
    old = perturbed(tiny_model, 0.05, seed=3)
    lrn = make_learner(tiny_model)
    lrn.version = 5
    prompt = Prompt(Problem("0", "p", "1"), "p", (5, 6, 7, 8))
    samples = [
        Sample(
            prompt, 0, torch.tensor([9, 10, 11, 12, 2]), torch.zeros(5), "t", 3, False, torch.tensor([3, 3, 5, 5, 5])
        ),  # noqa: E501
        Sample(prompt, 0, torch.tensor([13, 2]), torch.zeros(2), "t", 3, False, torch.tensor([3, 3])),
    ]
    lp = lrn.response_logp(samples, TokenVersionWeights({3: old.state_dict(), 5: None}))
    at_old, at_now = learner_logp(old, samples, 1.0), learner_logp(tiny_model, samples, 1.0)
    torch.testing.assert_close(lp[0, :5], torch.cat([at_old[0][:2], at_now[0][2:]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[1, :2], at_old[1], atol=1e-5, rtol=0)
    assert (at_old[0][:2] - at_now[0][:2]).abs().max() > 1e-3  # the versions' weights do differ
    try:
        lrn.response_logp(samples, TokenVersionWeights({5: None}))
    except KeyError as e:
        assert "versions [3]" in str(e)
    else:
        raise AssertionError("a version without weights must be refused")
