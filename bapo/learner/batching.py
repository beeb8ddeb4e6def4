"""Turning scored samples into padded learner tensors, and splitting them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bapo.types import ScoredSample, TrainBatch


def collate(samples: Sequence[ScoredSample], *, pad_id: int) -> TrainBatch:
    """Right-pad prompt+response rows; align response tensors with next-token logits."""
    rows = [list(s.sample.prompt.ids) + list(s.sample.response_ids) for s in samples]
    L = max(len(r) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1))
    old_logp = torch.zeros((B, L - 1))
    adv = torch.zeros((B, L - 1))
    for b, (s, row) in enumerate(zip(samples, rows, strict=True)):
        p, r = len(s.sample.prompt.ids), len(s.sample.response_ids)
        input_ids[b, : len(row)] = torch.tensor(row)
        attention_mask[b, : len(row)] = 1
        # logits at position t predict token t+1: response token j sits at p+j, predicted at p+j-1
        sl = slice(p - 1, p - 1 + r)
        mask[b, sl] = 1.0
        old_logp[b, sl] = torch.tensor(s.sample.logp, dtype=torch.float)
        adv[b, sl] = s.advantage
    versions = torch.tensor([s.sample.version for s in samples], dtype=torch.long)
    return TrainBatch(input_ids, attention_mask, mask, old_logp, adv, versions)


def split(batch: TrainBatch, size: int) -> list[TrainBatch]:
    """Micro-batches of at most ``size`` rows, each trimmed to its own longest row."""
    out = []
    for i in range(0, len(batch), size):
        am = batch.attention_mask[i : i + size]
        L = int(am.sum(1).max().item())
        out.append(
            TrainBatch(
                input_ids=batch.input_ids[i : i + size, :L],
                attention_mask=am[:, :L],
                mask=batch.mask[i : i + size, : L - 1],
                old_logp=batch.old_logp[i : i + size, : L - 1],
                adv=batch.adv[i : i + size, : L - 1],
                versions=batch.versions[i : i + size],
            )
        )
    return out
