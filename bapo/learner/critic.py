"""The PPO critic: a value head on a copy of the policy's transformer, with its own optimizer.

Choice of critic. The value model is a *separate* network: a deep copy of the
policy's trunk (``model.base_model``: embeddings and decoder layers, no LM head),
initialised from the policy's weights, with a scalar linear head (zero-initialised,
so every value starts at 0 and the first advantages are the plain returns). This is
what verl, OpenRLHF and TRL's PPO do (a critic initialised from the actor or a
reward model). We preferred it to a value head on the policy's own trunk, which
shares features but lets the value loss's gradients move the policy and needs a
loss-mixing coefficient; a separate model keeps the policy update exactly the
surrogate's and gives the critic its own learning rate. It costs a second copy of
the trunk in memory and a forward per micro-batch.

The learner drives it: :meth:`values` at scoring time (before any update on the
batch: those are the old values of GAE and of the value clip), and per micro-batch
:meth:`backward` on the clipped value loss (``bapo.algos.value_loss``), then
:meth:`step` once per optimizer update (gradient clipping, AdamW, a non-finite
update skipped). No RL math lives here.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from bapo.algos import explained_variance, value_loss
from bapo.samples import TrainBatch


class ValueModel(nn.Module):
    """V(s_t) for every position t of a sequence: trunk hidden state -> linear -> scalar."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.trunk = copy.deepcopy(policy.base_model)
        hidden = policy.config.hidden_size
        p = next(self.trunk.parameters())
        self.head = nn.Linear(hidden, 1, dtype=p.dtype, device=p.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, L, H]
        return self.head(h).squeeze(-1).float()  # [B, L]


class Critic:
    def __init__(
        self,
        policy: nn.Module,
        *,
        lr: float,
        vf_clip: float | None,
        agg: str = "token-mean",
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        grad_clip: float = 1.0,
    ):
        self.model = ValueModel(policy).train()
        self.device = next(self.model.parameters()).device
        self.vf_clip, self.agg, self.grad_clip = vf_clip, agg, grad_clip
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps
        )
        self.skipped_updates = 0
        self._seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._stats: dict[str, float] = {}

    def _values(self, mb: TrainBatch) -> torch.Tensor:
        ids, am = mb.input_ids.to(self.device), mb.attention_mask.to(self.device)
        return self.model(ids, am)[:, :-1]  # [B, L-1], aligned with mb.mask like the policy's logp

    @torch.no_grad()
    def values(self, mb: TrainBatch) -> torch.Tensor:
        """[B, L-1] values of one micro-batch, no grad (CPU)."""
        return self._values(mb).cpu()

    def backward(self, mb: TrainBatch, totals: dict) -> None:
        """Accumulate the gradient of one micro-batch's clipped value loss (mini-batch normalisers)."""
        missing = [k for k in ("old_values", "returns") if k not in mb.extras]
        if missing:
            raise ValueError(f"the critic needs {missing} in the batch (scored with advantage: gae)")
        v = self._values(mb)  # [B, L-1]
        old, ret, mask = (t.to(self.device) for t in (mb.extras["old_values"], mb.extras["returns"], mb.mask))
        loss, st = value_loss(v, old, ret, mask, vf_clip=self.vf_clip, agg=self.agg, **totals)
        loss.backward()
        w = mb.num_tokens / max(totals["num_tokens"], 1.0)
        for k, x in st.items():
            if k != "tokens":
                self._stats[k] = self._stats.get(k, 0.0) + w * float(x)
        self._seen.append((v.detach().cpu(), ret.cpu(), mask.cpu()))

    def discard(self) -> None:
        """Drop the gradient and the stats accumulated for an update that will not be made (a stop request)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._seen, self._stats = [], {}

    def step(self) -> dict[str, float]:
        """Clip, step (unless the gradient is not finite), and return the update's critic metrics."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.skipped_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        values = torch.cat([v[m.bool()] for v, _, m in self._seen] or [torch.zeros(0)])  # [n]
        rets = torch.cat([r[m.bool()] for _, r, m in self._seen] or [torch.zeros(0)])  # [n]
        out = {f"learner/{k}": v for k, v in self._stats.items()}
        out["learner/explained_var"] = explained_variance(values, rets, torch.ones_like(values, dtype=torch.bool))
        out["learner/critic_grad_norm"] = grad_norm
        out["learner/critic_skipped_updates"] = float(self.skipped_updates)
        self._seen, self._stats = [], {}
        return out

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
