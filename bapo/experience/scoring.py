"""Scoring a rollout batch for the learner: behaviour log-probs, shaped rewards, critic values, advantages.

Between the producer and the buffer, on the learner's thread:

1. ``learner.old_logp=recompute``: the behaviour log-probs become the learner's own
   forward at the version that generated the batch (the current policy, or the
   snapshot the producer kept for that version), removing the engine-versus-learner
   numerical mismatch; the mismatch is logged (``rollout/logp_mismatch_*``). A batch
   already too stale for the buffer is not recomputed: the buffer drops it anyway,
   and its snapshot may be gone. Without recompute the mismatch is measured on a sampled share of
   the rows of each batch made at the learner's own weights (``learner.logp_check_share``,
   :func:`check_logp`). The engine's log-probs stay on each sample
   (``behaviour_logp``), and a rollout correction (``algo.correction``: TIS, MIS,
   geometric rejection; ``bapo.algos.correction``) turns the two into per-token weights
   (``token_weight``), logged under ``correction/``.
2. Reward shaping (``bapo.reward.overlong_penalty``) on top of the verifier's reward;
   ``correct`` (accuracy) stays the verifier's.
3. The critic's values (with GAE), taken now, before any update on the batch.
4. Advantages (``bapo.algos.compute_advantages``), per response token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bapo import algos
from bapo.algos.correction import logp_mismatch
from bapo.infra import dist
from bapo.reward import overlong_penalty
from bapo.samples import RolloutBatch, Sample, ScoredSample


def recompute_logp(batch: RolloutBatch, learner: Any, weights: dict | None) -> tuple[RolloutBatch, dict]:
    """The batch with the learner's log-probs (at ``weights``, or the current policy for None) as behaviour.

    The engine's log-probs are in ``stats["engine_logp"]`` (one tensor per sample, in order)."""
    samples = list(batch.samples)
    lp = learner.response_logp(samples, weights)  # [B, T]
    rows = [lp[i, : len(s.response_ids)].to(torch.float32) for i, s in enumerate(samples)]
    engine = [torch.as_tensor(s.logp, dtype=torch.float32) for s in samples]
    new = [dataclasses.replace(s, logp=row) for s, row in zip(samples, rows, strict=True)]
    mismatch = logp_mismatch(torch.cat(rows or [torch.zeros(0)]), torch.cat(engine or [torch.zeros(0)]))
    stats = {f"rollout/logp_mismatch_{k}": v for k, v in mismatch.items()} | {"engine_logp": engine}
    return dataclasses.replace(batch, samples=tuple(new)), stats


def check_logp(batch: RolloutBatch, learner: Any, *, share: float, seed: int) -> dict:
    """The engine-vs-learner mismatch (``rollout/logp_mismatch_*``) on a share of the batch's rows, the batch left
    as it is (the engine's log-probs stay the behaviour): :func:`recompute_logp` on the rows :func:`check_rows`
    picks, at the weights that generated them, which must be the learner's own. Nothing (no forward) for a batch
    of an older version (async): whether its snapshot is still held depends on the producer thread's timing, and
    a run's metrics must not."""
    if batch.version != learner.version:  # its weights are held or not as the producer's thread happens to run
        return {}
    rows = check_rows(batch, share, seed, at_least=dist.world_size())  # the learner shards them: one a rank at least
    if not rows:
        return {}
    _, stats = recompute_logp(dataclasses.replace(batch, samples=tuple(batch.samples[i] for i in rows)), learner, None)
    stats.pop("engine_logp")
    return stats


def check_rows(batch: RolloutBatch, share: float, seed: int, at_least: int = 1) -> list[int]:
    """``share`` of the rows generated wholly at the batch's version (a partial rollout's older segments had other
    weights), at least ``at_least`` (the ranks the learner shards them over), drawn by ``seed`` alone (every rank
    draws the same), in order; none for share 0."""
    whole = [i for i, s in enumerate(batch.samples) if bool((s.token_versions() == batch.version).all())]
    if share <= 0 or not whole:
        return []
    k = min(len(whole), max(at_least, round(share * len(whole))))
    picked = torch.randperm(len(whole), generator=torch.Generator().manual_seed(seed))[:k]
    return sorted(whole[i] for i in picked.tolist())


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D per-sample tensors -> ([B, T] right-padded with 0, [B, T] bool mask)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), width), dtype=torch.float64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = True
    return out, mask


def corrected(scored: list[ScoredSample], engine_logp: list[torch.Tensor], correction) -> tuple[list, dict]:
    """Attach the engine's log-probs and, for a rollout correction (tis, mis, geo_reject), its token weights.

    Decoupled PPO's weights need the proximal policy: :func:`proximal` computes them when the step starts."""
    kind = "none" if correction is None else correction.kind
    out = [dataclasses.replace(s, behaviour_logp=e) for s, e in zip(scored, engine_logp, strict=True)]
    if kind in ("none", "decoupled"):
        return out, {}
    old, mask = padded([s.sample.logp for s in scored])
    behaviour, _ = padded(engine_logp)
    w, st = algos.correction_weights(
        old, behaviour, mask, kind=kind, level=getattr(correction, "level", "token"), cap=correction.cap
    )
    out = [dataclasses.replace(s, token_weight=w[i, : len(s.sample.logp)].float()) for i, s in enumerate(out)]
    return out, {f"correction/{k}": v for k, v in st.items()}


def overlong_filtered(scored: list[ScoredSample]) -> list[ScoredSample]:
    """DAPO's overlong filtering: truncated responses (no end-of-turn token) carry no loss (token weight 0).

    They still shape their group's advantage baseline and count in the loss's normalisers."""
    out = []
    for s in scored:
        w = s.token_weight if s.token_weight is not None else torch.ones(len(s.sample.response_ids))
        out.append(dataclasses.replace(s, token_weight=torch.zeros_like(w) if s.sample.truncated else w))
    return out


def proximal(samples: list[ScoredSample], learner: Any, correction) -> tuple[list[ScoredSample], dict]:
    """Decoupled PPO (arXiv 2505.24298) at the start of a step: the clip's old log-probs become the proximal
    policy's, the learner at its current version (before the step's first update), and each token is weighted
    by the behaviour->proximal ratio (truncated at ``correction.cap``). Behaviour is the engine's log-probs.

    ``proximal=exact`` runs one forward pass over the step's samples (a collective under FSDP: every rank calls
    it with the same samples); ``loglinear`` only records the proximal version, and the learner interpolates
    the proximal log-probs at each update (``bapo.algos.correction.loglinear_proximal``)."""
    behaviour = [s.behaviour_logp if s.behaviour_logp is not None else s.sample.logp for s in samples]
    if correction.proximal == "loglinear":
        v = learner.version
        out = [
            dataclasses.replace(s, behaviour_logp=b, sample=dataclasses.replace(s.sample, logp=b), proximal_version=v)
            for s, b in zip(samples, behaviour, strict=True)
        ]
        return out, {}
    lp = learner.response_logp([s.sample for s in samples])  # [B, T] at the current (proximal) version
    prox = [lp[i, : len(b)].to(torch.float32) for i, b in enumerate(behaviour)]
    old, mask = padded(prox)
    behav, _ = padded(behaviour)
    w, st = algos.correction_weights(old, behav, mask, kind="decoupled", cap=correction.cap)
    out = []
    for i, (s, p, b) in enumerate(zip(samples, prox, behaviour, strict=True)):
        weight = w[i, : len(b)].float()
        if s.token_weight is not None:  # the overlong filter's zeros
            weight = weight * s.token_weight
        out.append(
            dataclasses.replace(s, sample=dataclasses.replace(s.sample, logp=p), behaviour_logp=b, token_weight=weight)
        )
    return out, {f"decoupled/{k}": v for k, v in st.items()}


def scored_samples(
    samples: list[Sample], correct, extracted, rewards: torch.Tensor, adv, returns, values
) -> list[ScoredSample]:
    """Attach the (shaped) reward, per-token advantages and (with a critic) old values and returns to each sample."""

    def row(t: torch.Tensor | None, i: int) -> torch.Tensor | None:  # sample i's response tokens of a [B, T] tensor
        return None if t is None else t[i, : len(samples[i].response_ids)].to(torch.float32).clone()

    return [
        ScoredSample(
            s,
            float(rewards[i]),
            float(adv[i, 0]) if len(s.response_ids) else 0.0,
            c,
            x,
            token_adv=row(adv, i),
            old_values=row(values, i),
            returns=row(returns, i),
        )
        for i, (s, c, x) in enumerate(zip(samples, correct, extracted, strict=True))
    ]


def score(
    batch: RolloutBatch,
    learner: Any,
    *,
    algo,
    max_new_tokens: int,
    overlong_buffer: int,
    group_size: int,
    behaviour: dict | None = None,
) -> tuple[list[ScoredSample], dict]:
    """Shape the rewards, take the critic's values now (before any update on them) and compute advantages.

    ``behaviour``: {"weights": snapshot or None} to recompute the behaviour log-probs (``learner.old_logp=
    recompute``) at the batch's version; None keeps the engine's."""
    lp_stats: dict = {}
    engine_logp = None
    if behaviour is not None:
        batch, lp_stats = recompute_logp(batch, learner, behaviour["weights"])
        engine_logp = lp_stats.pop("engine_logp")
    samples = list(batch.samples)
    lengths = [len(s.response_ids) for s in samples]
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)  # [B]
    # DAPO's soft overlong penalty shapes the reward only; `correct` (accuracy) stays the verifier's
    rewards = rewards + torch.tensor(
        [overlong_penalty(n, max_len=max_new_tokens, buffer=overlong_buffer) for n in lengths]
    )
    values = learner.values(samples)  # [B, T]; None without a critic
    critic = algo.critic
    adv, returns, adv_stats = algos.compute_advantages(
        algo.advantage,
        rewards,
        lengths,
        values=values,
        group_size=group_size,
        norm_std=algo.norm_std,
        gamma=critic.gamma if critic is not None else 1.0,
        lam=critic.lam if critic is not None else 1.0,
    )
    scored = scored_samples(samples, batch.correct, batch.extracted, rewards, adv, returns, values)
    if engine_logp is not None:
        scored, corr_stats = corrected(scored, engine_logp, algo.correction)
        lp_stats |= corr_stats
    if algo.overlong_filter:
        scored = overlong_filtered(scored)
    stats = dict(batch.stats) | lp_stats | {f"adv/{k}": float(v) for k, v in adv_stats.items()}
    stats |= {
        "reward/mean": float(rewards.mean()),
        "rollout/response_len": sum(lengths) / len(samples),
        "rollout/truncated": sum(s.truncated for s in samples) / len(samples),  # what overlong_filter drops
        "rollout/version": float(batch.version),
    }
    return scored, stats
