"""The learner's side of the off-policy toolbox: correction weights reach the loss, and decoupled PPO's
log-linear proximal policy is what the loss clips against."""

import copy
import dataclasses

import pytest
import torch

from bapo.algos import surrogate_objective
from bapo.algos.correction import correction_weights, loglinear_proximal
from bapo.algos.objective import proximal_fn
from bapo.learner import collate
from bapo.samples import ScoredSample
from tests.helpers.learner import fake_batch, grads, make_learner


def _with(batch, **extras):
    return dataclasses.replace(batch, extras=dict(batch.extras) | extras)


def test_token_weights_scale_each_tokens_gradient(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model)
    a = make_learner(copy.deepcopy(tiny_model), bounds="fixed")
    b = make_learner(copy.deepcopy(tiny_model), bounds="fixed")
    a.accumulate(batch)
    b.accumulate(_with(batch, token_weight=2.0 * batch.mask))  # every token weighted 2: twice the gradient
    ga, gb = grads(a.model), grads(b.model)
    for k in ga:
        torch.testing.assert_close(gb[k], 2 * ga[k])
    c = make_learner(copy.deepcopy(tiny_model), bounds="fixed")
    out = c.accumulate(_with(batch, token_weight=torch.zeros_like(batch.mask)))  # all dropped: no gradient
    assert all(float(g.abs().max()) == 0.0 for g in grads(c.model).values()) and out["learner/loss"] == 0.0


def test_loglinear_proximal_is_the_old_log_probs_the_loss_sees(tiny_model, tiny_tok, monkeypatch):
    batch = fake_batch(tiny_tok, tiny_model)  # behaviour = the batch's old_logp, at version 0
    lrn = make_learner(copy.deepcopy(tiny_model), bounds="fixed")
    lrn.objective.proximal = proximal_fn(None)
    lrn.version = 4  # proximal version 2: alpha = (2 - 0) / (4 - 0) = 1/2
    seen = []
    real_loss = lrn.objective.loss

    def spy(inputs, **kw):
        seen.append((inputs.logp.detach(), inputs.old_logp, inputs.token_weight, inputs.mask))
        return real_loss(inputs, **kw)

    monkeypatch.setattr(lrn.objective, "loss", spy)
    lrn.accumulate(_with(batch, behaviour_logp=batch.old_logp.clone(), proximal_version=2.0 * batch.mask))
    for (logp, old, w, mask), mb in zip(seen, lrn.micro_batches(batch), strict=True):
        m = mask.bool()
        expected = mb.old_logp + 0.5 * (logp - mb.old_logp)
        torch.testing.assert_close(old[m], expected[m])
        torch.testing.assert_close(w[m], (0.5 * (logp - mb.old_logp)).exp()[m])


def test_collate_carries_the_engines_log_probs_weights_and_proximal_version(tiny_model, tiny_tok):
    batch = fake_batch(tiny_tok, tiny_model, n=2)
    samples = []
    for i in range(2):
        m = batch.mask[i].bool()
        s = ScoredSample(
            dataclasses.replace(_sample(batch, i, tiny_tok), logp=batch.old_logp[i][m]),
            0.0,
            1.0,
            False,
            behaviour_logp=batch.old_logp[i][m] - 0.1,
            token_weight=torch.full((int(m.sum()),), 0.5),
            proximal_version=3,
        )
        samples.append(s)
    tb = collate(samples, pad_id=0)
    m = tb.mask.bool()
    torch.testing.assert_close(tb.extras["behaviour_logp"][m], tb.old_logp[m] - 0.1)
    assert torch.all(tb.extras["token_weight"][m] == 0.5) and torch.all(tb.extras["proximal_version"][m] == 3)
    assert torch.all(tb.extras["token_weight"][~m] == 0)


def _sample(batch, i, tok):
    from bapo.samples import Problem, Prompt, Sample

    am = batch.attention_mask[i].bool()
    ids = batch.input_ids[i][am]
    m = batch.mask[i].bool()
    n_resp = int(m.sum())
    prompt_ids = tuple(ids[: len(ids) - n_resp].tolist())
    return Sample(
        Prompt(Problem(str(i), "p", "1"), "p", prompt_ids),
        i,
        ids[len(ids) - n_resp :],
        batch.old_logp[i][m],
        "t",
        0,
        False,
    )


def test_decoupled_weights_truncate_at_the_cap():
    behaviour = torch.tensor([[-1.0, -1.0]])
    logp = torch.tensor([[0.0, -3.0]])
    prox = loglinear_proximal(behaviour, logp, torch.tensor([0]), torch.tensor([1]), 1)  # alpha 1: prox = now
    w, _ = correction_weights(prox, behaviour, torch.ones(1, 2, dtype=torch.bool), kind="decoupled", cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, float(torch.tensor(-2.0).exp())])
    assert surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2).proximal is None
