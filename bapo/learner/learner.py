"""The policy learner (one process, or one FSDP rank): micro-batching, gradient accumulation, clipping, AdamW.

The learner holds no RL math. It runs an :class:`bapo.algos.Objective` (a
parameter chooser and a loss: BAPO's search or fixed bounds feeding the clipped
surrogate, or the card heuristic) and only decides *when* each part runs:

* ``scope="mini_batch"`` (paper): one choice per optimizer update. For an
  adaptive chooser (BAPO's search, the card's g) that needs the current ratios of
  the whole mini-batch before the first backward pass, so the learner runs a
  no-grad forward over every micro-batch first (one extra forward per update;
  ``scripts/bench_scope.py`` measures it).
* ``scope="micro_batch"`` (authors' code): the choice is made on each micro-batch
  from the same forward pass that carries the gradient.

Optional parts, each a built object handed in by the loop: a ``critic``
(:class:`bapo.learner.critic.Critic`, for GAE; trained on the same micro-batches
with its own optimizer) and a frozen ``ref_model`` whose log-probs (no grad) feed
the loss's KL term. An objective with state (the card's eps) is stepped after each
applied update.

Losses are normalised by mini-batch totals (tokens, sequences), so gradient
accumulation over micro-batches equals one pass over the whole mini-batch.
An update whose gradient norm is not finite is skipped and counted, never applied.

Micro-batches hold ``micro_batch_size`` rows, or with ``max_tokens_per_micro_batch``
as many rows as fit in that many tokens. ``packing`` concatenates each micro-batch's
sequences into one row for the forward pass (``bapo.learner.batching.pack``); the
loss still sees padded [B, L-1] tensors, so neither choice changes it.

Data parallel (FSDP2, ``bapo.learner.fsdp``): every rank gets its shard of the
mini-batch. With ``reduce_sum`` the normalisers are the totals over all ranks, so a
rank's loss is its share of the global loss and the ranks' gradients must be
*summed* (``fsdp.wrap`` makes FSDP sum them); the logged stats are summed the same
way. ``reduce_max`` lets the ranks agree on a number of micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bapo.algos import Objective, entropy_from_logits, importance_ratio, token_logp
from bapo.learner.batching import pack, response_rows, split, split_by_tokens, unpack, without_tokens
from bapo.learner.critic import Critic
from bapo.types import TrainBatch

# Names of the chooser's stats in the metrics (the rest keep their own name).
STAT_NAMES = {"rho_after": "rho", "rho_before": "rho_before", "steps": "search_steps"}
# Loss stats that are a micro-batch's share of the mini-batch's value (mini-batch normalisers) or a count:
# summed over micro-batches. The others are means over the call's own tokens: token-weighted.
ADDITIVE_STATS = ("pg_loss", "tokens")


class Learner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        objective: Objective,
        scope: str = "mini_batch",
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        warmup_steps: int = 0,
        grad_clip: float = 1.0,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        max_response_len: int = 64,
        critic: Critic | None = None,
        ref_model: torch.nn.Module | None = None,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
        packing: bool = False,
        max_tokens_per_micro_batch: int | None = None,
    ):
        if scope not in ("mini_batch", "micro_batch"):
            raise ValueError(f"scope must be 'mini_batch' or 'micro_batch', got {scope!r}")
        self.model = model.train()
        self.device = next(model.parameters()).device
        self.objective = objective
        self.prepass = objective.adaptive and scope == "mini_batch"
        self.scope = scope
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.max_response_len = max_response_len
        self.critic = critic
        self.ref_model = None if ref_model is None else ref_model.eval().requires_grad_(False)
        self.reduce_sum = reduce_sum
        self.reduce_max = reduce_max
        self.packing = packing
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0
        )
        self.skipped_updates = 0
        self._update_stats: dict[str, float] = {}  # the chooser's stats over the last update's tokens

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def _forward(self, model: torch.nn.Module, mb: TrainBatch, entropy: bool = True):
        """(logp [B, L-1], entropy [B, L-1] or None) of a right-padded micro-batch, aligned with ``mb.mask``.

        With packing the model sees one padding-free row and computes logits only where
        they predict a response token; both outputs are then 0 outside ``mb.mask``.
        """
        if self.packing:
            pk = pack(mb)
            kw = {}
            if "flash" in str(getattr(model.config, "_attn_implementation", "")):  # varlen bounds, no per-layer sync
                cu = pk.cu_seqlens.to(self.device)
                kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=pk.max_seqlen, max_length_k=pk.max_seqlen)
            logits = model(
                input_ids=pk.input_ids.to(self.device),
                position_ids=pk.position_ids.to(self.device),
                logits_to_keep=pk.keep.to(self.device),
                use_cache=False,  # with a cache HF ignores the position-id restarts: sequences would see each other
                **kw,
            ).logits[0]  # [K, V]
            # outputs' device, not self.device: with FSDP's CPU offload the parameters live on the CPU
            logp, ent = self._logp_entropy(logits, pk.targets.to(logits.device), entropy)  # [K], [K]
            mask = mb.mask.to(logits.device)
            return unpack(logp, mask), None if ent is None else unpack(ent, mask)
        ids = mb.input_ids.to(self.device)
        logits = model(input_ids=ids, attention_mask=mb.attention_mask.to(self.device), use_cache=False).logits
        return self._logp_entropy(logits[:, :-1], ids[:, 1:].to(logits.device), entropy)  # [B, L-1] each

    def _logp_entropy(self, logits: torch.Tensor, targets: torch.Tensor, entropy: bool):
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()  # log-softmax in fp32 at least
        logits = logits / self.temperature  # [..., V]
        logp = token_logp(logits, targets)  # [...]
        if not entropy:
            return logp, None
        with torch.set_grad_enabled(self.objective.loss_kw["entropy_coef"] != 0 and torch.is_grad_enabled()):
            ent = entropy_from_logits(logits)  # [...]
        return logp, ent

    def micro_batches(self, batch: TrainBatch, *, sync: bool = True) -> list[TrainBatch]:
        """The micro-batches of ``batch``: by token budget when set, else by ``micro_batch_size`` rows.

        ``sync`` (with ``reduce_max``): ranks agree on the count, and a rank with fewer
        micro-batches adds ones without response tokens (they add 0 to loss and gradients),
        since FSDP's collectives need the same number of passes on every rank.
        """
        if self.max_tokens_per_micro_batch:
            micro = split_by_tokens(batch, self.max_tokens_per_micro_batch, packed=self.packing)
        else:
            micro = split(batch, self.micro_batch_size)
        if sync and self.reduce_max is not None:
            count = int(self.reduce_max(torch.tensor([len(micro)], dtype=torch.float64)).item())
            micro += [without_tokens(batch) for _ in range(count - len(micro))]
        return micro

    @torch.no_grad()
    def _ref_logp(self, mb: TrainBatch) -> torch.Tensor | None:
        return None if self.ref_model is None else self._forward(self.ref_model, mb, entropy=False)[0]

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor | None:
        """The critic's values [B, T] per response token (right-padded), or None without a critic.

        Called at scoring time, before any update on these samples: GAE's and the value
        clip's old values.
        """
        if self.critic is None:
            return None
        rows = [response_rows(self.critic.values(mb), mb.mask) for mb in self.micro_batches(batch, sync=False)]
        width = max(r.shape[1] for r in rows)
        return torch.cat([F.pad(r, (0, width - r.shape[1])) for r in rows])  # [B, T]

    def _reduced(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over ranks through ``reduce_sum`` (which may reduce in place and return None)."""
        if self.reduce_sum is None:
            return t
        out = self.reduce_sum(t)
        return t if out is None else out

    @torch.no_grad()
    def response_logp(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probs [B, T] of each row's response tokens (right-padded) under ``model`` (default: the
        policy): ``learner.old_logp=recompute``'s behaviour log-probs, in the learner's own numerics."""
        model = self.model if model is None else model
        rows = [
            response_rows(self._forward(model, mb, entropy=False)[0].cpu(), mb.mask)
            for mb in split(batch, self.micro_batch_size)
        ]
        width = max(r.shape[1] for r in rows)
        return torch.cat([F.pad(r, (0, width - r.shape[1])) for r in rows])  # [B, T]

    @staticmethod
    def _flat(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """Concatenate per-micro-batch (ratio, adv, mask, old_logp) as 1-D tensors of masked tokens."""
        cols = list(zip(*parts, strict=True))
        masks = [m.bool() for m in cols[2]]
        return tuple(torch.cat([t[m] for t, m in zip(col, masks, strict=True)]) for col in cols)

    def _choose(self, parts) -> tuple[dict[str, float], dict[str, float]]:
        ratio, adv, mask, old = self._flat(parts)
        ones = torch.ones_like(mask, dtype=ratio.dtype)
        return self.objective.choose(ratio, adv, ones, old, reduce_sum=self.reduce_sum)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer update on a mini-batch; returns its metrics."""
        out = self.accumulate(batch)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        if math.isfinite(grad_norm) and math.isfinite(out.get("learner/loss", 0.0)):
            self.optimizer.step()
            self.scheduler.step()
            after = self.objective.after_update(self._update_stats)
            out.update({f"{self.objective.prefix}/{k}": float(v) for k, v in after.items()})
        else:
            self.skipped_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            out.update(self.critic.step())
        out.update({"learner/grad_norm": grad_norm, "learner/lr": self.scheduler.get_last_lr()[0]})
        out["learner/skipped_updates"] = float(self.skipped_updates)
        return out

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Forward and backward over the micro-batches of one mini-batch; gradients accumulate."""
        micro = self.micro_batches(batch)
        local = torch.tensor([batch.mask.sum(), (batch.mask.sum(1) > 0).sum()], dtype=torch.float64)
        num_tokens, num_seqs = self._reduced(local).tolist()  # over all ranks: the loss's normalisers are global
        totals = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=self.max_response_len)
        chosen = None
        if self.prepass:
            with torch.no_grad():
                parts = []
                for mb in micro:
                    logp, _ = self._forward(self.model, mb, entropy=False)
                    ratio = importance_ratio(logp.cpu(), mb.old_logp)  # [B, L-1]
                    parts.append((ratio, mb.adv, mb.mask, mb.old_logp))
            chosen = self._choose(parts)

        stats: dict[str, float] = {}
        seen, per_micro = [], []
        for mb in micro:
            logp, ent = self._forward(self.model, mb)
            old, adv, mask = (t.to(logp.device) for t in (mb.old_logp, mb.adv, mb.mask))
            ratio = importance_ratio(logp.detach(), old)  # [B, L-1]
            seen.append((ratio.cpu(), mb.adv, mb.mask, mb.old_logp))
            params, cstats = chosen if chosen is not None else self._choose([seen[-1]])
            per_micro.append((cstats, mb.num_tokens))
            loss, st = self.objective.loss(
                logp,
                old,
                adv,
                mask,
                **params,
                **self.objective.loss_kw,
                entropy=ent,
                ref_logp=self._ref_logp(mb),
                **totals,
            )
            loss.backward()
            if self.critic is not None:
                self.critic.backward(mb, totals)
            w = mb.num_tokens / max(totals["num_tokens"], 1.0)
            for k, v in st.items():
                stats[k] = stats.get(k, 0.0) + (1.0 if k in ADDITIVE_STATS else w) * float(v)
            stats["loss"] = stats.get("loss", 0.0) + float(loss.detach())

        if self.reduce_sum is not None:  # each rank holds its share of the token-weighted means and of the loss
            keys = sorted(stats)
            summed = self._reduced(torch.tensor([stats[k] for k in keys], dtype=torch.float64)).tolist()
            stats = dict(zip(keys, summed, strict=True))
        logged, self._update_stats = self._choice_stats(chosen, per_micro, seen)
        out = {f"learner/{k}": v for k, v in stats.items()}
        out.update({f"{self.objective.prefix}/{STAT_NAMES.get(k, k)}": float(v) for k, v in logged.items()})
        return out

    def _choice_stats(self, chosen, per_micro, seen) -> tuple[dict[str, float], dict[str, float]]:
        """(the chooser's stats to log, its stats over all of the update's tokens).

        Mini-batch scope: one choice, over every token of the update (for fixed bounds,
        recomputed from the ratios already seen: no extra forward). Micro-batch scope:
        token-weighted means of the per-micro-batch choices are logged, and a stateful
        objective steps on a choice over all of the update's tokens.
        """
        if chosen is not None:
            return chosen[1], chosen[1]
        whole = self._choose(seen)[1] if self.scope == "mini_batch" or self.objective.state is not None else None
        if self.scope == "mini_batch":
            return whole, whole
        tot = sum(n for _, n in per_micro) or 1
        keys = {k for st, _ in per_micro for k in st}
        logged = {k: sum(float(st.get(k, 0.0)) * n for st, n in per_micro) / tot for k in keys}
        return logged, logged if whole is None else whole

    def state_dict(self) -> dict:
        """Everything an exact resume needs: policy, optimizer, schedule, critic, objective state."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "skipped_updates": self.skipped_updates,
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        if self.objective.state is not None:
            state["objective"] = self.objective.state.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_updates = state["skipped_updates"]
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        if self.objective.state is not None:
            self.objective.state.load_state_dict(state["objective"])
