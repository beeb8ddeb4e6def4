"""Scoring a rollout batch for the learner: behaviour log-probs, shaped rewards, critic values, advantages.

Between the producer and the buffer, on the learner's thread:

1. ``learner.old_logp=recompute``: the behaviour log-probs become the learner's own
   forward at the version that generated the batch (the current policy, or the
   snapshot the producer kept for that version), removing the engine-versus-learner
   numerical mismatch; the mismatch is logged (``rollout/logp_mismatch_*``). A batch
   already too stale for the buffer is not recomputed: the buffer drops it anyway,
   and its snapshot may be gone.
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
from bapo.reward import overlong_penalty
from bapo.types import RolloutBatch, Sample, ScoredSample


def recompute_logp(batch: RolloutBatch, learner: Any, weights: dict | None) -> tuple[RolloutBatch, dict]:
    """The batch with the learner's log-probs (at ``weights``, or the current policy for None) as behaviour."""
    samples = list(batch.samples)
    lp = learner.response_logp(samples, weights)  # [B, T]
    new, diffs = [], []
    for i, s in enumerate(samples):
        row = lp[i, : len(s.response_ids)].to(torch.float32)
        diffs.append((row - torch.as_tensor(s.logp, dtype=torch.float32)).abs())
        new.append(dataclasses.replace(s, logp=row))
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    stats = {
        "rollout/logp_mismatch_mean": float(d.mean()) if d.numel() else 0.0,
        "rollout/logp_mismatch_max": float(d.max()) if d.numel() else 0.0,
    }
    return dataclasses.replace(batch, samples=tuple(new)), stats


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
    if behaviour is not None:
        batch, lp_stats = recompute_logp(batch, learner, behaviour["weights"])
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
    stats = dict(batch.stats) | lp_stats | {f"adv/{k}": float(v) for k, v in adv_stats.items()}
    stats |= {
        "reward/mean": float(rewards.mean()),
        "rollout/response_len": sum(lengths) / len(samples),
        "rollout/truncated": sum(s.truncated for s in samples) / len(samples),
        "rollout/version": float(batch.version),
    }
    return scored, stats
