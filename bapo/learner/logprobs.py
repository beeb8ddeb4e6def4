"""Log-probs of the sampled tokens and per-token entropy from the policy's logits, computed in chunks of tokens.

For logits ``z`` [..., V] and a temperature ``T``, with ``p = softmax(z / T)``:

    logp[k]    = log p[k, target_k]
    entropy[k] = -sum_j p[k, j] log p[k, j]        (a -inf logit has p = 0 and adds 0)

Written as one expression (``log_softmax``, ``gather``, ``exp``, a product, a mask and a sum), autograd
keeps about six [tokens x V] fp32 tensors alive at once: 6.25x the logits' fp32 size, measured on CPU
(``tests/e2e/learner/test_logprobs.py``), i.e. 3.6 MB a token at Qwen's 152,064-token vocabulary.
:func:`logp_entropy` computes the same numbers over chunks of tokens and saves only the logits for the
backward pass, which recomputes each chunk's softmax and writes the gradient into one [tokens x V] tensor:

    d logp[k]    / d z[k, j] = (1[j = target_k] - p[k, j]) / T
    d entropy[k] / d z[k, j] = -p[k, j] (log p[k, j] + entropy[k]) / T

(the second from dH/du_j = -sum_i (log p_i + 1) p_i (1[i = j] - p_j) with u = z / T). What is alive at the
peak is the logits, their gradient (both in the logits' dtype: bf16 under FSDP's mixed precision) and one
chunk's workspace (:func:`peak_bytes`): 2.25x the fp32 [K, V] size for fp32 logits, 1.25x for bf16 ones.
verl computes its entropy in chunks in the same spirit.

All arithmetic is in fp32 at least (float64 stays float64), as ``log_softmax(logits.float() / T)`` is; the
values are those of that one expression, chunk by chunk.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

WORKSPACE_BYTES = 256 * 2**20  # the most one chunk's temporaries take
# A chunk holds at most two [rows, V] tensors in the compute dtype (its log-softmax and its probabilities, or
# the upcast logits and the log-softmax) and one bool mask: bytes per element of the chunk.
WORKSPACE_TENSORS, WORKSPACE_MASKS = 2, 1


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision logits, else their own dtype (fp32, float64)."""
    return torch.promote_types(dtype, torch.float32)


def workspace_per_element(dtype: torch.dtype) -> int:
    """Bytes of workspace per element of a chunk of logits of ``dtype``."""
    return WORKSPACE_TENSORS * compute_dtype(dtype).itemsize + WORKSPACE_MASKS


def chunk_rows(
    tokens: int, vocab: int, dtype: torch.dtype = torch.float32, workspace_bytes: int = WORKSPACE_BYTES
) -> int:
    """Tokens per chunk: as many as fit ``workspace_bytes`` of workspace, and no more than an eighth of the
    tokens, so that the workspace stays small beside the logits at any size."""
    return max(1, min(workspace_bytes // (vocab * workspace_per_element(dtype)), -(-tokens // 8)))


def peak_bytes(
    tokens: int, vocab: int, dtype: torch.dtype, *, backward: bool = True, workspace_bytes: int = WORKSPACE_BYTES
) -> int:
    """The chain's peak, the logits included: the logits, their gradient (``backward``; both in ``dtype``) and
    one chunk's workspace. A forward without gradient holds the logits and the workspace only."""
    rows = chunk_rows(tokens, vocab, dtype, workspace_bytes)
    copies = 2 if backward else 1
    return copies * tokens * vocab * dtype.itemsize + rows * vocab * workspace_per_element(dtype)


def _blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """2-D [rows, V] views of ``x`` [..., V] that cover it in row-major order, without copying (a sliced
    [B, L, V] tensor such as ``logits[:, :-1]`` cannot be viewed as one [B * L, V] block)."""
    if x.dim() <= 2:
        return [x.reshape(-1, x.shape[-1])]  # a view: 1-D and 2-D tensors always are
    try:
        return [x.view(-1, x.shape[-1])]
    except RuntimeError:
        return [b for sub in x.unbind(0) for b in _blocks(sub)]


def _chunks(x: torch.Tensor, rows: int):
    """(first token, [n, V] view) over ``x`` [..., V], ``n <= rows``, in row-major token order."""
    start = 0
    for block in _blocks(x):
        for chunk in block.split(rows):
            yield start, chunk
            start += chunk.shape[0]


def _log_softmax(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    z = chunk.to(compute_dtype(chunk.dtype))
    if temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1)  # [n, V]


def _entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """-sum(where(p > 0, p log p, 0)) over the last dim: -inf logits add 0 (as does a NaN row, whose logp is NaN)."""
    probs = logp_all.exp()  # [n, V]
    drop = (probs > 0).logical_not_()  # [n, V] bool
    return -probs.mul_(logp_all).masked_fill_(drop, 0.0).sum(-1)  # [n]


def _forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool, rows: int):
    """(logp [N], entropy [N] or None) over the flattened tokens, one chunk at a time."""
    n_tok, dtype = targets.numel(), compute_dtype(logits.dtype)
    flat_targets = targets.reshape(-1).long()
    logp = torch.empty(n_tok, dtype=dtype, device=logits.device)
    ent = torch.empty(n_tok, dtype=dtype, device=logits.device) if entropy else None
    for start, chunk in _chunks(logits, rows):
        stop = start + chunk.shape[0]
        logp_all = _log_softmax(chunk, temperature)  # [n, V]
        logp[start:stop] = logp_all.gather(-1, flat_targets[start:stop, None]).squeeze(-1)
        if ent is not None:
            ent[start:stop] = _entropy(logp_all)
        del logp_all
    return logp, ent


class LogpEntropy(torch.autograd.Function):
    """``(logp, entropy)`` of ``logits`` [..., V] at ``targets`` [...] (module docstring), chunked over tokens.

    Saves the logits (no copy) and the per-token entropy; the backward recomputes each chunk's softmax. With
    ``entropy_grad=False`` the entropy is returned without a gradient (the loss does not use it).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, entropy: bool, entropy_grad: bool, rows: int):
        logp, ent = _forward(logits, targets, temperature, entropy, rows)
        ctx.temperature, ctx.rows, ctx.entropy_grad = temperature, rows, entropy and entropy_grad
        ctx.save_for_backward(logits, targets, ent if ctx.entropy_grad else None)
        shape = targets.shape
        if ent is None:
            return logp.view(shape), None
        ent = ent.view(shape)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp.view(shape), ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        logits, targets, ent = ctx.saved_tensors
        T = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [..., V]
        flat_grad = grad.view(-1, logits.shape[-1])
        flat_targets = targets.reshape(-1).long()
        g_logp = grad_logp.reshape(-1) if grad_logp is not None else None
        g_ent = grad_ent.reshape(-1) if grad_ent is not None and ent is not None else None
        for start, chunk in _chunks(logits, ctx.rows):
            stop = start + chunk.shape[0]
            logp_all = _log_softmax(chunk, T)  # [n, V]
            probs = logp_all.exp()  # [n, V]; becomes d(loss)/d(z / T) in place
            term = None
            if g_ent is not None:  # p (log p + H), 0 where p = 0, in logp_all's storage
                term = logp_all.add_(ent[start:stop, None]).mul_(probs).masked_fill_(probs == 0, 0.0)
            gl = g_logp[start:stop, None].to(probs.dtype) if g_logp is not None else None  # [n, 1]
            if gl is not None:
                probs.mul_(-gl)
            else:
                probs.zero_()
            if term is not None:
                probs.addcmul_(term, g_ent[start:stop, None].to(probs.dtype), value=-1.0)
            if gl is not None:
                probs.scatter_add_(-1, flat_targets[start:stop, None], gl)
            if T != 1.0:
                probs.div_(T)
            flat_grad[start:stop] = probs
            del logp_all, probs, term
        return grad, None, None, None, None, None


def logp_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = True,
    entropy_grad: bool = True,
    workspace_bytes: int = WORKSPACE_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` [...] and entropies [...] (or None) under softmax(logits [..., V] / T).

    ``entropy_grad``: whether the entropy carries a gradient (the loss has an entropy term); without one it is
    computed like a metric. Outputs are fp32 at least. Peak memory: :func:`peak_bytes`.
    """
    rows = chunk_rows(targets.numel(), logits.shape[-1], logits.dtype, workspace_bytes)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return _forward_shaped(logits, targets, temperature, entropy, rows)
    return LogpEntropy.apply(logits, targets, float(temperature), bool(entropy), bool(entropy_grad), rows)


def _forward_shaped(logits, targets, temperature, entropy, rows):
    logp, ent = _forward(logits, targets, temperature, entropy, rows)
    return logp.view(targets.shape), None if ent is None else ent.view(targets.shape)
