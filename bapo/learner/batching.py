"""Turning scored samples into padded learner tensors, and splitting them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bapo.types import Sample, ScoredSample, TrainBatch

TOKEN_EXTRAS = ("old_values", "returns")  # optional per-token fields of ScoredSample -> TrainBatch.extras


def collate(samples: Sequence[ScoredSample | Sample], *, pad_id: int) -> TrainBatch:
    """Right-pad prompt+response rows; align response tensors with next-token logits.

    Plain (unscored) samples get zero advantages: that is enough for a forward pass,
    e.g. the critic's values at scoring time.
    """
    scored = [s if isinstance(s, ScoredSample) else None for s in samples]
    plain = [s.sample if isinstance(s, ScoredSample) else s for s in samples]
    rows = [list(s.prompt.ids) + list(s.response_ids) for s in plain]
    L = max(len(r) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1))
    old_logp = torch.zeros((B, L - 1))
    adv = torch.zeros((B, L - 1))
    names = [k for k in TOKEN_EXTRAS if any(s is not None and getattr(s, k) is not None for s in scored)]
    extras = {k: torch.zeros((B, L - 1)) for k in names}
    for b, (s, row) in enumerate(zip(plain, rows, strict=True)):
        p, r = len(s.prompt.ids), len(s.response_ids)
        input_ids[b, : len(row)] = torch.tensor(row)
        attention_mask[b, : len(row)] = 1
        # logits at position t predict token t+1: response token j sits at p+j, predicted at p+j-1
        sl = slice(p - 1, p - 1 + r)
        mask[b, sl] = 1.0
        old_logp[b, sl] = torch.tensor(s.logp, dtype=torch.float)
        sc = scored[b]
        if sc is not None:
            adv[b, sl] = torch.tensor(sc.token_adv) if sc.token_adv is not None else sc.advantage
        for k in names:
            value = None if sc is None else getattr(sc, k)
            if value is None:
                raise ValueError(f"some samples carry {k} and others do not; cannot collate them together")
            extras[k][b, sl] = torch.tensor(value, dtype=torch.float)
    versions = torch.tensor([s.version for s in plain], dtype=torch.long)
    return TrainBatch(input_ids, attention_mask, mask, old_logp, adv, versions, extras)


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
                extras={k: v[i : i + size, : L - 1] for k, v in batch.extras.items()},
            )
        )
    return out


def response_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L-1] values at response positions -> [B, T] right-padded per response (T = longest)."""
    m = mask.bool()
    lengths = m.sum(1)  # [B]
    out = x.new_zeros((x.shape[0], int(lengths.max().item()) if len(lengths) else 0))  # [B, T]
    for b in range(x.shape[0]):
        out[b, : int(lengths[b])] = x[b][m[b]]
    return out
