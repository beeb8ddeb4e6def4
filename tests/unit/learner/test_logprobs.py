"""The chunked log-prob / entropy chain (bapo/learner/logprobs.py): values, gradients and peak memory.

The reference is the one-expression chain the learner used before (``reference`` below: log-softmax, gather,
exp, a masked product, a sum, all under autograd). Measured on CPU with this file's harness, at K = 512 tokens
and V = 152,064 (Qwen's vocabulary), its forward + backward peaks at **6.25x** one fp32 [K, V] tensor, the
logits included (7.25x at a temperature != 1, which adds logits / T). The chunked chain peaks at **2.25x**
(fp32 logits) and **1.25x** (bf16 logits): the logits, their gradient and one chunk's workspace.
"""

import math

import pytest
import torch

from bapo.learner.logprobs import chunk_rows, logp_entropy, peak_bytes
from tests.helpers.learner import reference


def _inputs(shape, vocab, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(vocab, shape, generator=g)
    return logits, targets


def test_hand_computed_two_tokens():
    # logits [0, ln 3] -> p = [1/4, 3/4]; target 1: logp = ln(3/4) = -0.287682;
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.346574 + 0.215762 = 0.562335.
    # d logp / dz = onehot - p = [-1/4, 1/4]; d H / dz_j = -p_j (ln p_j + H):
    #   j=0: -1/4 (-1.386294 + 0.562335) = 0.205990; j=1: -3/4 (-0.287682 + 0.562335) = -0.205990.
    # A -inf third logit has p = 0: it changes nothing and gets gradient 0.
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")]], dtype=torch.float64)
    logits.requires_grad_()
    logp, ent = logp_entropy(logits, torch.tensor([1]))
    assert logp.item() == pytest.approx(-0.287682, abs=1e-6)
    assert ent.item() == pytest.approx(0.562335, abs=1e-6)
    (g,) = torch.autograd.grad(logp.sum(), logits, retain_graph=True)
    torch.testing.assert_close(g, torch.tensor([[-0.25, 0.25, 0.0]], dtype=torch.float64))
    (g,) = torch.autograd.grad(ent.sum(), logits)
    torch.testing.assert_close(g, torch.tensor([[0.205990, -0.205990, 0.0]], dtype=torch.float64), atol=1e-6, rtol=0)


def test_temperature_divides_logits_and_gradient():
    # softmax(z / 2) at z = [0, 2 ln 3] is the same [1/4, 3/4]; the gradient is (onehot - p) / 2
    logits = torch.tensor([[0.0, 2 * math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    logp, _ = logp_entropy(logits, torch.tensor([0]), temperature=2.0, entropy=False)
    assert logp.item() == pytest.approx(-1.3862943611198906, abs=1e-12)  # ln(1/4)
    logp.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[0.375, -0.375]], dtype=torch.float64))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("layout", ["flat", "batched", "sliced"])
def test_values_equal_the_reference_exactly(layout, temperature):
    """Chunk by chunk the same fp32 operations: bit-for-bit the reference's numbers (the learner's results do
    not move), for every layout the learner passes (packed [K, V], padded [B, L, V], a sliced view of it)."""
    shape = {"flat": (37,), "batched": (3, 13), "sliced": (3, 14)}[layout]
    logits, targets = _inputs(shape, 50)
    if layout == "sliced":
        logits, targets = logits[:, :-1], targets[:, :-1]
        assert not logits.is_contiguous()
    want = reference(logits, targets, temperature)
    for budget in (1, 50 * 9 * 4, 2**30):  # one token per chunk, four, all (capped at an eighth)
        got = logp_entropy(logits, targets, temperature=temperature, workspace_bytes=budget)
        assert got[0].shape == targets.shape and got[1].shape == targets.shape
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bf16_logits_are_computed_in_fp32():
    logits, targets = _inputs((20,), 64, dtype=torch.bfloat16)
    logp, ent = logp_entropy(logits, targets, temperature=0.7)
    assert logp.dtype == ent.dtype == torch.float32
    want = reference(logits, targets, 0.7)
    assert torch.equal(logp, want[0]) and torch.equal(ent, want[1])


@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_the_reference_autograd(entropy_grad, dtype):
    logits, targets = _inputs((3, 9), 40, dtype=dtype)
    logits[0, 2, :7] = float("-inf")  # masked vocabulary entries: p = 0, no gradient, nothing to the entropy
    targets[0, 2] = 20
    wl, we = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)  # upstream grads

    def grads(fn):
        x = logits.clone().requires_grad_()
        logp, ent = fn(x)
        loss = (logp.double() * wl).sum()
        if entropy_grad:
            loss = loss + (ent.double() * we).sum()
        else:
            assert not ent.requires_grad
        loss.backward()
        return x.grad

    # The one-expression chain's entropy gradient is NaN at a -inf logit (0 x -inf in the product's backward):
    # the reference sees -1e4 there instead, where p is exactly 0 too.
    want = grads(lambda x: reference(x.masked_fill(x.isinf(), -1e4)[:, :-1], targets[:, :-1], 0.8, entropy_grad))
    kw = dict(temperature=0.8, entropy_grad=entropy_grad, workspace_bytes=1)  # one token per chunk
    got = grads(lambda x: logp_entropy(x[:, :-1], targets[:, :-1], **kw))
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert (got[0, 2, :7] == 0).all() and (got[:, -1] == 0).all()
    if dtype == torch.bfloat16:  # both round an fp32 gradient to bf16: at most one bf16 step apart
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradcheck_float64(temperature):
    logits, targets = _inputs((2, 5), 7, dtype=torch.float64, scale=1.0)
    logits[1, 1, 3] = float("-inf")
    logits.requires_grad_()

    def fn(x):
        return logp_entropy(x, targets, temperature=temperature, workspace_bytes=1)  # one token per chunk

    assert chunk_rows(10, 7, torch.float64, 1) == 1
    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-6)


def test_no_grad_gives_the_same_values_and_no_graph():
    logits, targets = _inputs((11,), 30)
    logits.requires_grad_()
    with_grad = logp_entropy(logits, targets, temperature=0.7)
    with torch.no_grad():
        without = logp_entropy(logits, targets, temperature=0.7)
    assert without[0].grad_fn is None and without[1].grad_fn is None
    assert torch.equal(with_grad[0].detach(), without[0]) and torch.equal(with_grad[1].detach(), without[1])
    assert logp_entropy(logits.detach(), targets, entropy=False)[1] is None


def test_chunk_rows_follow_the_byte_budget():
    # fp32: two fp32 temporaries and a bool mask = 9 bytes an element; 152,064 x 9 = 1,368,576 bytes a token
    assert chunk_rows(10**6, 152064, torch.float32, 256 * 2**20) == 196  # 268,435,456 // 1,368,576
    assert chunk_rows(10**6, 152064, torch.bfloat16, 256 * 2**20) == 196  # the workspace is fp32 either way
    assert chunk_rows(512, 152064) == 64  # at most an eighth of the tokens
    assert chunk_rows(3, 152064) == 1
    # the peak: two copies of [K, V] in the logits' dtype and 64 rows of workspace
    assert peak_bytes(512, 152064, torch.float32) == 2 * 512 * 152064 * 4 + 64 * 152064 * 9
    assert peak_bytes(512, 152064, torch.bfloat16, backward=False) == 512 * 152064 * 2 + 64 * 152064 * 9
