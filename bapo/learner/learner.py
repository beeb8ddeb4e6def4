"""Single-process learner: micro-batching, gradient accumulation, clipping, AdamW.

The learner holds no RL math. It gets the bound-choice function (BAPO's search
or fixed bounds) and the loss from ``bapo.algos`` and only decides *when* they
run:

* ``scope="mini_batch"`` (paper): one pair of bounds per optimizer update. For
  an adaptive bound function that needs the current ratios of the whole
  mini-batch before the first backward pass, so the learner runs a no-grad
  forward over every micro-batch first (one extra forward per update).
* ``scope="micro_batch"`` (authors' code): bounds are chosen on each
  micro-batch from the same forward pass that carries the gradient.

Losses are normalised by mini-batch totals (tokens, sequences), so gradient
accumulation over micro-batches equals one pass over the whole mini-batch.
An update whose gradient norm is not finite is skipped and counted, never applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from bapo.algos import entropy_from_logits, policy_loss, token_logp
from bapo.learner.batching import split
from bapo.types import TrainBatch

BoundFn = Callable[..., tuple[float, float, dict]]


class Learner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        bound_fn: BoundFn,
        adaptive_bounds: bool,
        scope: str = "mini_batch",
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        warmup_steps: int = 0,
        grad_clip: float = 1.0,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        dual_clip: float | None = None,
        agg: str = "token-mean",
        entropy_coef: float = 0.0,
        max_response_len: int = 64,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if scope not in ("mini_batch", "micro_batch"):
            raise ValueError(f"scope must be 'mini_batch' or 'micro_batch', got {scope!r}")
        self.model = model.train()
        self.device = next(model.parameters()).device
        self.bound_fn = bound_fn
        self.prepass = adaptive_bounds and scope == "mini_batch"
        self.scope = scope
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.loss_kw = dict(dual_clip=dual_clip, agg=agg, entropy_coef=entropy_coef)
        self.max_response_len = max_response_len
        self.reduce_sum = reduce_sum
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0
        )
        self.skipped_updates = 0

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def _forward(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids = mb.input_ids.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mb.attention_mask.to(self.device)).logits
        logits = logits[:, :-1]
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()  # log-softmax in fp32 at least
        logits = logits / self.temperature  # [B, L-1, V]
        logp = token_logp(logits, ids[:, 1:])  # [B, L-1]
        with torch.set_grad_enabled(self.loss_kw["entropy_coef"] != 0 and torch.is_grad_enabled()):
            ent = entropy_from_logits(logits)  # [B, L-1]
        return logp, ent

    @staticmethod
    def _flat(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """Concatenate per-micro-batch (ratio, adv, mask, old_logp) as 1-D tensors of masked tokens."""
        cols = list(zip(*parts, strict=True))
        masks = [m.bool() for m in cols[2]]
        return tuple(torch.cat([t[m] for t, m in zip(col, masks, strict=True)]) for col in cols)

    def _bounds(self, parts) -> tuple[float, float, dict]:
        ratio, adv, mask, old = self._flat(parts)
        return self.bound_fn(
            ratio, adv, torch.ones_like(mask, dtype=ratio.dtype), old, reduce_sum=self.reduce_sum
        )

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer update on a mini-batch; returns its metrics."""
        out = self.accumulate(batch)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        else:
            self.skipped_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        out.update({"learner/grad_norm": grad_norm, "learner/lr": self.scheduler.get_last_lr()[0]})
        out["learner/skipped_updates"] = float(self.skipped_updates)
        return out

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Forward and backward over the micro-batches of one mini-batch; gradients accumulate."""
        micro = split(batch, self.micro_batch_size)
        totals = dict(
            num_tokens=float(batch.mask.sum()),
            num_seqs=float((batch.mask.sum(1) > 0).sum()),
            max_len=self.max_response_len,
        )
        bounds = None
        if self.prepass:
            with torch.no_grad():
                parts = []
                for mb in micro:
                    logp, _ = self._forward(mb)
                    parts.append(
                        (torch.exp((logp.cpu() - mb.old_logp).clamp(-20, 20)), mb.adv, mb.mask, mb.old_logp)
                    )
            bounds = self._bounds(parts)

        stats: dict[str, float] = {}
        seen, per_micro_bounds = [], []
        for mb in micro:
            logp, ent = self._forward(mb)
            old, adv, mask = (t.to(self.device) for t in (mb.old_logp, mb.adv, mb.mask))
            ratio = torch.exp((logp.detach() - old).clamp(-20, 20))  # [B, L-1]
            seen.append((ratio.cpu(), mb.adv, mb.mask, mb.old_logp))
            if bounds is None or self.scope == "micro_batch":
                lo, hi, bst = self._bounds([seen[-1]]) if mb.num_tokens > 0 else (1.0, 1.0, {})
                per_micro_bounds.append((lo, hi, bst, mb.num_tokens))
            else:
                lo, hi, _ = bounds
            loss, st = policy_loss(
                logp, old, adv, mask, ratio_low=lo, ratio_high=hi, entropy=ent, **self.loss_kw, **totals
            )
            loss.backward()
            w = mb.num_tokens / max(totals["num_tokens"], 1.0)
            for k, v in st.items():
                stats[k] = stats.get(k, 0.0) + w * float(v)
            stats["loss"] = stats.get("loss", 0.0) + float(loss.detach())

        out = {f"learner/{k}": v for k, v in stats.items()}
        out.update(self._bound_metrics(bounds, per_micro_bounds, seen))
        return out

    def _bound_metrics(self, bounds, per_micro, seen) -> dict[str, float]:
        if bounds is None and self.scope == "mini_batch":
            bounds = self._bounds(seen)  # fixed bounds: rho over the whole mini-batch, no extra forward
        if bounds is not None:
            lo, hi, bst = bounds
        else:  # micro-batch scope: token-weighted means over micro-batches
            tot = sum(t for *_, t in per_micro) or 1
            lo = sum(b[0] * b[3] for b in per_micro) / tot
            hi = sum(b[1] * b[3] for b in per_micro) / tot
            keys = {k for b in per_micro for k in b[2]}
            bst = {k: sum(float(b[2].get(k, 0.0)) * b[3] for b in per_micro) / tot for k in keys}
        out = {"bapo/ratio_low": float(lo), "bapo/ratio_high": float(hi)}
        names = {"rho_after": "bapo/rho", "rho_before": "bapo/rho_before", "steps": "bapo/search_steps"}
        for k, v in bst.items():
            out[names.get(k, f"bapo/{k}")] = float(v)
        return out
