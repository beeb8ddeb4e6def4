"""The policy learner: micro-batching, gradient accumulation, clipping, AdamW; its version and weights.

The learner holds no RL math. It runs an :class:`bapo.algos.Objective` (a
parameter chooser and a loss: BAPO's search or fixed bounds feeding the clipped
surrogate, or the eps-feedback heuristic) and only decides *when* each part runs,
from the objective's flags:

* ``prepass`` (an adaptive chooser with ``scope=mini_batch``, the paper's): one
  choice per optimizer update over the current ratios of the whole mini-batch,
  known before the first backward pass, so the learner runs a no-grad forward over
  every micro-batch first (one extra forward per update; ``scripts/bench/bench_scope.py``
  measures it).
* otherwise the choice is made on each micro-batch from the same forward pass that
  carries the gradient (``scope=micro_batch``, the authors' code), or once from the
  ratios already seen (fixed bounds: no extra forward).

The learner owns what a run needs of the policy: its **version** (the optimizer-
update counter, +1 at every update, skipped ones too), its **weights** for the
rollout engine, and its **checkpoint** (``save``/``load``) and **HF export**. How
the model is distributed is a strategy chosen here from ``learner.kind``
(``bapo.learner.strategy``: one process, or FSDP2 under torchrun); no caller
branches on it.

Dropout is switched off in the policy (and the reference model): the behaviour
log-probs, BAPO's pre-pass and the loss must all see the same function, so that an
on-policy ratio is exactly 1 (TRL's ``disable_dropout`` does the same).

Losses are normalised by mini-batch totals (tokens, sequences), so gradient
accumulation over micro-batches equals one pass over the whole mini-batch, and
the loss stats are merged by their own denominators (``bapo.algos.stats``). An
update whose loss or gradient norm is not finite is skipped and counted, never
applied; ``max_consecutive_skips`` in a row, or weights that turn non-finite
after an applied update, raise :class:`TrainingDiverged`.

Micro-batches hold ``micro_batch_size`` rows, or with ``max_tokens_per_micro_batch``
as many rows as fit in that many tokens. ``packing`` concatenates each micro-batch's
sequences into one row for the forward pass (``bapo.learner.batching.pack``); the
loss still sees padded [B, L-1] tensors, so neither choice changes it.

Data parallel (FSDP2): every rank gets its shard of the mini-batch. The normalisers
are the totals over all ranks (``reduce_sum``), so a rank's loss is its share of the
global loss and the ranks' gradients are *summed* (the strategy makes FSDP sum them).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from bapo.algos import LossInputs, Objective, importance_ratio, stats
from bapo.infra import ckpt_folder, stop
from bapo.infra.checks import RunFailed
from bapo.learner.batching import collate, response_rows, split, split_by_tokens, without_tokens
from bapo.learner.critic import Critic
from bapo.learner.forward import ForwardInputs, forward
from bapo.learner.logprobs import logp_entropy
from bapo.learner.strategy import make_strategy
from bapo.samples import ScoredSample, TokenVersionWeights, TrainBatch


class TrainingDiverged(RunFailed, RuntimeError):
    """Updates keep failing, or the weights are no longer finite: the run cannot go on."""


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Zero every dropout of an HF model: ``nn.Dropout`` modules, attention dropout attributes and config fields."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "dropout", "attn_dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for name, value in list(vars(config).items()):
            if isinstance(value, float) and ("dropout" in name or name.endswith("_pdrop")):
                setattr(config, name, 0.0)
    return model


class Learner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg,
        *,
        objective: Objective,
        pad_id: int,
        temperature: float = 1.0,
        max_response_len: int = 64,
        critic_cfg=None,
        agg: str = "token-mean",
        ref_model: torch.nn.Module | None = None,
        device: torch.device | None = None,
        weights_dtype: torch.dtype | None = None,
        snapshot_dtype: torch.dtype | None = None,
    ):
        """``cfg``: the typed ``learner`` group (``bapo.config.SingleLearnerConfig`` / ``FSDPLearnerConfig``).

        ``critic_cfg`` (``algo.critic``) adds a GAE critic on a copy of the policy's trunk;
        ``ref_model`` a frozen reference for the loss's KL term (sharded like the policy under FSDP).
        ``weights_dtype``: the dtype of the weights handed to an engine and of the HF export (the model's, e.g.
        bf16, while FSDP's masters are fp32); ``snapshot_dtype``: of the kept copies (fp32 when recompute
        evaluates the learner at an older version; the engine's dtype otherwise). None: the learner's own.
        """
        self.cfg = cfg
        self.objective = objective
        self.pad_id = pad_id
        self.temperature = temperature
        self.max_response_len = max_response_len
        self.strategy = make_strategy(cfg, device)
        self.model = self.strategy.wrap(disable_dropout(model)).train()
        self.device = self.strategy.device
        self.critic = None
        if critic_cfg is not None:  # a copy of the policy's trunk, on the policy's device
            if not self.strategy.supports_critic:
                raise NotImplementedError("learner.kind=fsdp: algo.advantage=gae (the PPO critic) is single-process")
            opt_kw = dict(betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=cfg.eps, grad_clip=cfg.grad_clip)
            self.critic = Critic(self.model, lr=critic_cfg.lr, vf_clip=critic_cfg.vf_clip, agg=agg, **opt_kw)
        self.weights_dtype, self.snapshot_dtype = weights_dtype, snapshot_dtype
        self.ref_model = None
        if ref_model is not None:
            self.ref_model = self.strategy.wrap_frozen(disable_dropout(ref_model).requires_grad_(False)).eval()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=cfg.eps
        )
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
        )
        self.version = 0  # optimizer updates so far, skipped ones included
        self.skipped_updates = 0
        self.consecutive_skips = 0
        self._scratch: torch.nn.Module | None = None  # the policy at an older version (recompute)
        self._update_stats: dict[str, float] = {}  # the chooser's stats over the last update's tokens

    # ------------------------------------------------------------------ weights out

    def weights(self) -> dict[str, torch.Tensor]:
        """The full weights under their HF names, for an engine that loads them before the next update.

        May alias the live parameters (one process); a collective under FSDP (every rank gets them, in
        ``weights_dtype``, cast before the gather)."""
        return self.strategy.full_weights(self.model, self.weights_dtype)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The full weights as a copy that later updates do not touch, in ``snapshot_dtype`` (a collective
        under FSDP)."""
        return self.strategy.snapshot(self.model, self.snapshot_dtype)

    def shard(self, items: Sequence) -> list:
        """This rank's share of a mini-batch (all of it in one process)."""
        return self.strategy.shard(items)

    # ------------------------------------------------------------------ forward passes

    def _forward(self, model: torch.nn.Module, mb: TrainBatch | ForwardInputs, entropy: bool = True):
        """(logp [B, L-1], entropy [B, L-1] or None) of a right-padded micro-batch, aligned with ``mb.mask``
        (``bapo.learner.forward``: the layouts). ``mb`` as :class:`ForwardInputs` (:meth:`_inputs`) reuses the
        layout an earlier pass over the same micro-batch made."""
        inputs = mb if isinstance(mb, ForwardInputs) else self._inputs(mb)
        return forward(model, inputs, self._logp_entropy, entropy=entropy)

    def _inputs(self, mb: TrainBatch) -> ForwardInputs:
        return ForwardInputs(mb, packing=self.cfg.packing, device=self.device)

    def _logp_entropy(self, logits: torch.Tensor, targets: torch.Tensor, entropy: bool):
        """Log-probs of ``targets`` [...] and entropies [...] under softmax(logits [..., V] / T), in fp32 at least,
        computed in chunks of tokens (``bapo.learner.logprobs``: the logits, their gradient and one chunk's
        workspace are all it holds); the entropy carries a gradient only when the loss uses it (``entropy_coef``)."""
        return logp_entropy(
            logits,
            targets,
            temperature=self.temperature,
            entropy=entropy,
            entropy_grad=self.objective.loss_kw["entropy_coef"] != 0,
        )

    def micro_batches(self, batch: TrainBatch, *, sync: bool = True) -> list[TrainBatch]:
        """The micro-batches of ``batch``: by token budget when set, else by ``micro_batch_size`` rows.

        ``sync`` (data parallel): ranks agree on the count, and a rank with fewer
        micro-batches adds ones without response tokens (they add 0 to loss and gradients),
        since FSDP's collectives need the same number of passes on every rank.
        """
        if self.cfg.max_tokens_per_micro_batch:
            micro = split_by_tokens(batch, self.cfg.max_tokens_per_micro_batch, packed=self.cfg.packing)
        else:
            micro = split(batch, self.cfg.micro_batch_size)
        return micro + self._padding(batch, len(micro)) if sync else micro

    def _padding(self, batch: TrainBatch, count: int) -> list[TrainBatch]:
        """Micro-batches without response tokens that bring this rank's ``count`` up to the ranks' largest."""
        if self.strategy.reduce_max is None:
            return []
        most = int(self.strategy.reduce_max(torch.tensor([count], dtype=torch.float64)).item())
        return [without_tokens(batch) for _ in range(most - count)]

    @torch.no_grad()
    def _ref_logp(self, mb: TrainBatch | ForwardInputs) -> torch.Tensor | None:
        return None if self.ref_model is None else self._forward(self.ref_model, mb, entropy=False)[0]

    @torch.no_grad()
    def values(self, samples: Sequence | TrainBatch) -> torch.Tensor | None:
        """The critic's values [B, T] per response token (right-padded), or None without a critic.

        Called at scoring time, before any update on these samples: GAE's and the value
        clip's old values.
        """
        if self.critic is None:
            return None
        batch = samples if isinstance(samples, TrainBatch) else collate(samples, pad_id=self.pad_id)
        rows = [response_rows(self.critic.values(mb), mb.mask) for mb in self.micro_batches(batch, sync=False)]
        width = max(r.shape[1] for r in rows)
        return torch.cat([F.pad(r, (0, width - r.shape[1])) for r in rows])  # [B, T]

    @torch.no_grad()
    def response_logp(
        self, samples: Sequence | TrainBatch, weights: dict[str, torch.Tensor] | TokenVersionWeights | None = None
    ) -> torch.Tensor:
        """Log-probs [B, T] of each sample's response tokens (right-padded) under the policy, or under
        ``weights`` (an older version's snapshot): ``learner.old_logp=recompute``'s behaviour
        log-probs, in the learner's own numerics, in micro-batches by the token budget.

        Under FSDP every rank must call it with the same samples (a collective): each rank runs the forward
        of its share only (every world-th sample from its rank), and the shares are gathered, so every rank
        returns every row. A collated ``TrainBatch`` is computed whole, on this rank.

        ``weights`` as :class:`TokenVersionWeights` (samples whose tokens came from several versions: partial
        rollouts) scores each token under its own version's weights: one pass per version, selected per token."""
        if isinstance(weights, TokenVersionWeights):
            return self._logp_by_token_version(samples, weights)
        if isinstance(samples, TrainBatch) or self.strategy.gather is None:
            batch = samples if isinstance(samples, TrainBatch) else collate(samples, pad_id=self.pad_id)
            return self._response_logp(batch, weights)
        samples, lengths = list(samples), [len(s.response_ids) for s in samples]
        mine = self.strategy.shard_indices(len(samples))
        lp = self._response_logp(collate([samples[i] for i in mine], pad_id=self.pad_id), weights)  # [len(mine), T]
        flat = torch.cat([lp[k, : lengths[i]] for k, i in enumerate(mine)])  # this rank's rows, end to end
        rows: list[torch.Tensor] = [torch.zeros(0)] * len(samples)
        for rank, (part,) in enumerate(self.strategy.gather([flat])):
            at = 0
            for i in self.strategy.shard_indices(len(samples), rank):
                rows[i], at = part[at : at + lengths[i]], at + lengths[i]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, T]

    def _logp_by_token_version(self, samples: Sequence, weights: TokenVersionWeights) -> torch.Tensor:
        """:meth:`response_logp` with each response token [B, T] under the weights of its own version."""
        samples = list(samples)
        versions = torch.nn.utils.rnn.pad_sequence(
            [s.token_versions() for s in samples], batch_first=True, padding_value=-1
        )  # [B, T]
        out = torch.zeros(versions.shape)
        for v, w in sorted(weights.by_version.items()):
            here = versions == v  # [B, T]
            if here.any():
                lp = self.response_logp(samples, w)  # [B, T'] T' = longest response, = T
                out = torch.where(here, lp[:, : out.shape[1]].to(out.dtype), out)
        missing = sorted(set(versions[versions >= 0].unique().tolist()) - set(weights.by_version))
        if missing:
            raise KeyError(f"no weights for the tokens of versions {missing} (given {sorted(weights.by_version)})")
        return out

    def _response_logp(self, batch: TrainBatch, weights: dict[str, torch.Tensor] | None) -> torch.Tensor:
        with self.strategy.policy_at(self.model, weights, self._scratch_model) as model:
            micro = self.micro_batches(batch, sync=False)
            real = len(micro)
            rows = []
            for mb in micro + self._padding(batch, real):  # FSDP: every rank runs as many forwards
                stop.check_agreed()  # recompute gives up between two micro-batches on a stop (every rank together)
                rows.append(response_rows(self._forward(model, mb, entropy=False)[0].cpu(), mb.mask))
            rows = rows[:real]
        width = max(r.shape[1] for r in rows)
        return torch.cat([F.pad(r, (0, width - r.shape[1])) for r in rows])  # [B, T]

    def _scratch_model(self) -> torch.nn.Module:
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.model).eval().requires_grad_(False)
        return self._scratch

    # ------------------------------------------------------------------ updates

    @staticmethod
    def _flat(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """Concatenate per-micro-batch (ratio, adv, mask, old_logp) as 1-D tensors of masked tokens."""
        cols = list(zip(*parts, strict=True))
        masks = [m.bool() for m in cols[2]]
        return tuple(torch.cat([t[m] for t, m in zip(col, masks, strict=True)]) for col in cols)

    def _choose(self, parts) -> tuple[dict[str, float], dict[str, float]]:
        ratio, adv, mask, old = self._flat(parts)
        ones = torch.ones_like(mask, dtype=ratio.dtype)
        return self.objective.choose(ratio, adv, ones, old, reduce_sum=self.strategy.reduce_sum)

    def learn(self, samples: Sequence[ScoredSample]) -> dict[str, float]:
        """One optimizer update on a mini-batch of scored samples (this rank's share of it under FSDP)."""
        return self.update(collate(self.shard(samples), pad_id=self.pad_id))

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer update on a collated mini-batch; returns its metrics. Raises TrainingDiverged.

        A stop request between two micro-batches (agreed by every rank: :func:`bapo.infra.stop.check_agreed`)
        drops the gradient accumulated so far and raises :class:`bapo.infra.stop.Interrupted`: the learner is as
        it was before the update (its version, weights and optimizer untouched)."""
        try:
            out = self.accumulate(batch)
        except stop.Interrupted:
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic is not None:
                self.critic.discard()
            raise
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        applied = math.isfinite(grad_norm) and math.isfinite(out.get("learner/loss", 0.0))
        if applied:
            self.optimizer.step()
            self.scheduler.step()
            out.update(self.objective.after_update(self._update_stats))
            self.consecutive_skips = 0
        else:
            self.skipped_updates += 1
            self.consecutive_skips += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            out.update(self.critic.step())
        self.version += 1
        out.update({"learner/grad_norm": grad_norm, "learner/lr": self.scheduler.get_last_lr()[0]})
        out["learner/skipped_updates"] = float(self.skipped_updates)
        if self.consecutive_skips >= self.cfg.max_consecutive_skips:
            raise TrainingDiverged(
                f"{self.consecutive_skips} optimizer updates in a row had a non-finite loss or gradient "
                f"(learner.max_consecutive_skips={self.cfg.max_consecutive_skips}), at policy version {self.version}"
            )
        if applied and not self.strategy.params_finite(self.model):
            raise TrainingDiverged(
                f"the policy's weights are not finite after update {self.version} although its loss and gradient "
                f"norm ({grad_norm:.3g}) were: the step overflowed (learner.lr={self.cfg.lr})"
            )
        return out

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Forward and backward over the micro-batches of one mini-batch; gradients accumulate."""
        micro = self.micro_batches(batch)
        local = torch.tensor([batch.mask.sum(), (batch.mask.sum(1) > 0).sum()], dtype=torch.float64)
        reduce_sum = self.strategy.reduce_sum
        num_tokens, num_seqs = (local if reduce_sum is None else reduce_sum(local)).tolist()
        totals = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=self.max_response_len)
        chosen = None
        inputs = [self._inputs(mb) for mb in micro]  # each micro-batch laid out once, for every pass below
        if self.objective.prepass:
            with torch.no_grad():
                parts = []
                for x in inputs:
                    stop.check_agreed()
                    logp, _ = self._forward(self.model, x, entropy=False)
                    x.release()
                    old = self._anchor(x.mb, logp.cpu())[0]
                    ratio = importance_ratio(logp.cpu(), old)  # [B, L-1]
                    parts.append((ratio, x.mb.adv, x.mb.mask, old))
            chosen = self._choose(parts)

        sums: dict[str, float] = {}
        seen, per_micro = [], []
        for x in inputs:
            stop.check_agreed()  # a stop gives the update up between two micro-batches (every rank together)
            mb = x.mb
            logp, ent = self._forward(self.model, x)
            old, weight_kw = self._anchor(mb, logp)
            adv, mask = (t.to(logp.device) for t in (mb.adv, mb.mask))
            ratio = importance_ratio(logp.detach(), old)  # [B, L-1]
            seen.append((ratio.cpu(), mb.adv, mb.mask, old.cpu()))
            params, cstats = chosen if chosen is not None else self._choose([seen[-1]])
            per_micro.append((cstats, mb.num_tokens))
            inputs = LossInputs(
                logp,
                old,
                adv,
                mask,
                **totals,
                entropy=ent,
                ref_logp=self._ref_logp(x),  # the policy's layout and mask, reused
                token_weight=weight_kw.get("token_weight"),
            )
            loss, st = self.objective.loss(inputs, **params, **self.objective.loss_kw)
            x.release()
            loss.backward()
            if self.critic is not None:
                self.critic.backward(mb, totals)
            sums = stats.add_sums(sums, stats.to_sums(st | {"loss": float(loss.detach())}))

        sums = stats.reduce_sums(sums, reduce_sum, self.strategy.reduce_max)
        logged, self._update_stats = self._choice_stats(chosen, per_micro, seen)
        out = {f"learner/{k}": v for k, v in stats.from_sums(sums).items()}
        out.update({k: float(v) for k, v in logged.items()})
        return out

    def _anchor(self, mb: TrainBatch, logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The old log-probs the loss clips against for ``mb``, and the correction's token weights as
        ``{"token_weight": ...}`` (empty without a correction), on ``logp``'s device.

        Decoupled PPO with ``proximal=loglinear`` (``objective.proximal``) interpolates the old log-probs
        from the current ones and the samples' versions, with no forward pass of its own."""
        dev, ex = logp.device, mb.extras
        old, weight = mb.old_logp.to(dev), ex.get("token_weight")
        if self.objective.proximal is not None and "proximal_version" in ex:
            mask = mb.mask.to(dev)
            prox_version = ex["proximal_version"].amax(dim=1)  # [B] broadcast over each row's response tokens
            # each token's own behaviour version where a response spans several (partial rollouts), else the row's
            behaviour_version = ex["token_version"].to(dev) if "token_version" in ex else mb.versions
            old, prox_weight = self.objective.proximal(
                logp.detach(), ex["behaviour_logp"].to(dev), mask, behaviour_version, prox_version, self.version
            )
            weight = prox_weight if weight is None else prox_weight * weight.to(dev)  # times the overlong filter's
        return old, {} if weight is None else {"token_weight": weight.to(dev)}

    def _choice_stats(self, chosen, per_micro, seen) -> tuple[dict[str, float], dict[str, float]]:
        """(the chooser's stats to log, its stats over all of the update's tokens).

        Mini-batch scope: one choice, over every token of the update (for fixed bounds,
        recomputed from the ratios already seen: no extra forward). Micro-batch scope:
        token-weighted means of the per-micro-batch choices are logged (a stat over the
        micro-batches that report it), and a stateful
        objective steps on a choice over all of the update's tokens.
        """
        if chosen is not None:
            return chosen[1], chosen[1]
        mini = self.objective.scope == "mini_batch"
        whole = self._choose(seen)[1] if mini or self.objective.stateful else None
        if mini:
            return whole, whole
        keys = {k for st, _ in per_micro for k in st}
        logged = {}
        for k in keys:  # a stat only some micro-batches have (bapo/target_reached) is their mean
            have = [(float(st[k]), n) for st, n in per_micro if k in st]
            logged[k] = sum(v * n for v, n in have) / (sum(n for _, n in have) or 1)
        return logged, logged if whole is None else whole

    # ------------------------------------------------------------------ checkpoints and export

    def state_dict(self) -> dict:
        """The small state beside the weights: version, schedule, skip counts, the objective's state."""
        return {
            "version": self.version,
            "scheduler": self.scheduler.state_dict(),
            "skipped_updates": self.skipped_updates,
            "consecutive_skips": self.consecutive_skips,
            "objective": self.objective.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_updates = int(state["skipped_updates"])
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.objective.load_state_dict(state["objective"])

    def save(self, path: Path) -> None:
        """Write the learner (weights, AdamW, the critic, the state above) into the folder ``path``.

        Under FSDP a collective: every rank writes its shard (DCP)."""
        self.strategy.save(
            path, model=self.model, optimizer=self.optimizer, extra=self.state_dict(), critic=self.critic
        )

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (resharding under FSDP); refuses non-finite weights."""
        extra = self.strategy.load(path, model=self.model, optimizer=self.optimizer, critic=self.critic)
        self.load_state_dict(extra)
        if not self.strategy.params_finite(self.model):
            raise ckpt_folder.CheckpointError(f"{path}: the policy's weights in this checkpoint are not finite")

    def export_hf(self, out: Path, tokenizer, extra: dict[str, str] | None = None) -> None:
        """An HF folder (config + safetensors in ``weights_dtype`` + tokenizer + ``extra``'s text files, e.g. the
        run's ``bapo_config.yaml``) of the current policy, renamed into place."""
        self.strategy.export_hf(self.model, Path(out), tokenizer, dtype=self.weights_dtype, extra=extra)
