"""What a loss reads of one micro-batch: :class:`LossInputs`, one typed record instead of a dozen arguments.

The tensors are ``[B, T]`` over response positions: the current policy's log-probs ``logp`` (with their graph), the
behaviour policy's ``old_logp``, the advantages ``adv`` and the ``mask`` of real response tokens; ``entropy`` (the
policy's per-token entropy, for an entropy bonus), ``ref_logp`` (the frozen reference's, for a KL term) and
``token_weight`` (a correction's detached weight per token) where the run has them. The normalisers ``num_tokens``,
``num_seqs`` and ``max_len`` are the whole mini-batch's (summed over its micro-batches and ranks), so that
micro-batches accumulate to the mini-batch's loss (BAPO.md, "Loss aggregation").

An :class:`bapo.algos.objective.Objective`'s ``loss`` is called as ``loss(inputs, **params, **loss_kw)``: the
hyper-parameters, keyword-only. :func:`loss_of` makes such a loss of a function with the tensors positional
(``policy_loss(logp, old_logp, adv, mask, *, ...)``, the public API of BAPO.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's tensors and the mini-batch's normalisers (module docstring)."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    num_tokens: float | None = None
    num_seqs: float | None = None
    max_len: float | None = None
    entropy: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    token_weight: torch.Tensor | None = None

    def apply(self, fn: LossFn, **hyper: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """``fn(logp, old_logp, adv, mask, *, normalisers, entropy, ref_logp[, token_weight], **hyper)``; a
        ``token_weight`` goes only where the run has one (a loss without corrections takes none)."""
        extra = {} if self.token_weight is None else {"token_weight": self.token_weight}
        return fn(
            self.logp,
            self.old_logp,
            self.adv,
            self.mask,
            num_tokens=self.num_tokens,
            num_seqs=self.num_seqs,
            max_len=self.max_len,
            entropy=self.entropy,
            ref_logp=self.ref_logp,
            **extra,
            **hyper,
        )


def loss_of(fn: LossFn) -> LossFn:
    """The objective's loss ``loss(inputs, **hyper)`` of ``fn``, a loss with the tensors positional and everything
    else keyword-only (``policy_loss``, ``eps_feedback_loss``); ``loss.__wrapped__`` is ``fn``."""

    def loss(inputs: LossInputs, **hyper: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return inputs.apply(fn, **hyper)

    loss.__wrapped__ = fn  # type: ignore[attr-defined]
    loss.__name__ = f"loss_of({fn.__name__})"
    return loss
