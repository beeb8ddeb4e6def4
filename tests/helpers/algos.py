"""What the tests of bapo.algos' losses share: a random padded batch, the gradient-accumulation check, and the
eps-feedback heuristic's state as the shipped config starts it."""

import pytest
import torch

from bapo.algos import EpsFeedbackState

# The heuristic's starting eps and rule constants, as conf/algo/eps_feedback.yaml sets them.
RULE = dict(eps=0.2, eps_min=0.1, eps_max=0.5, grow=1.1, shrink=0.9, g_high=1.0, g_low=0.5, widen=0.5)


def random_batch(seed, *, b, t, spread, dtype=torch.float64):
    """(logp, old, adv, mask) of ``b`` sequences of up to ``t`` tokens, seeded: log-ratios of std ``spread``, one
    advantage a sequence, right-padded masks of random length (some may be empty; the first is full)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    logp = old + torch.randn(b, t, generator=g, dtype=dtype) * spread
    adv = torch.randn(b, 1, generator=g, dtype=dtype).expand(b, t).clone()
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = t  # at least one sequence with tokens
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logp, old, adv, mask


def assert_accumulation_matches(loss_fn, logp, old, adv, mask, parts, *, norms, per_token=None, **kw):
    """``loss_fn`` over the micro-batches ``parts`` (row slices of the mini-batch), each given the mini-batch's
    ``norms`` (``agg_normalisers``), sums to the loss of one pass over the mini-batch, and the gradients the
    micro-batches accumulate into ``logp`` (and into each tensor of ``per_token`` that requires one) are the
    mini-batch's.

    ``per_token``: the [B, T] tensors the loss takes by keyword (``entropy``, ``ref_logp``), sliced with the rows;
    ``kw``: the loss's hyper-parameters, the same in every pass."""
    per_token = per_token or {}
    full_logp = logp.clone().requires_grad_()
    full, _ = loss_fn(full_logp, old, adv, mask, **per_token, **kw)
    full.backward()
    full_grads = {name: x.grad.clone() for name, x in per_token.items() if x.requires_grad}
    for name in full_grads:
        per_token[name].grad = None
    micro_logp, total = logp.clone().requires_grad_(), 0.0
    for rows in parts:
        sliced = {name: x[rows] for name, x in per_token.items()}
        loss, _ = loss_fn(micro_logp[rows], old[rows], adv[rows], mask[rows], **sliced, **kw, **norms)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad)
    for name, grad in full_grads.items():
        torch.testing.assert_close(per_token[name].grad, grad)


def eps_state(**over: float) -> EpsFeedbackState:
    return EpsFeedbackState(**RULE | over)
