import copy
import math

import pytest
import torch

from bapo.algos import bapo_bounds, make_bound_fn, token_logp
from bapo.learner import Learner, collate, split
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


def make_learner(model, **kw):
    args = dict(bound_fn=make_bound_fn("bapo"), adaptive_bounds=True, lr=1e-3, micro_batch_size=3)
    args.update(kw)
    return Learner(model, **args)


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
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
    learner = make_learner(
        tiny_model, bound_fn=make_bound_fn("fixed", ratio_low=0.8, ratio_high=1.2), adaptive_bounds=False
    )
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
