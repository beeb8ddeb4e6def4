"""Making one rollout batch, and gathering the ranks' shares of it as tensors.

:class:`RolloutMaker` is what the off-policy producer (``bapo.offpolicy.Producer``)
runs, inline or on its thread: draw ``train.prompts_per_step`` prompts, load the
weights of the version the schedule asked for into the engine if it holds other
ones, generate with a seed derived from ``(seed, t)``, and grade. It owns the data
cursor (the prompt stream's state) for checkpoints.

Under torchrun every rank draws the same prompts and generates its share of them
(prompts rank, rank + world, ...) with its own seed; :meth:`RolloutMaker.gather`
then gives every rank the whole batch in rank order. An engine split over ``t`` ranks
(vLLM's ``tensor_parallel_size``) makes the ranks ``[g*t, (g+1)*t)`` one generator: they take
share ``g`` of ``world / t`` with one seed, and the gather keeps the first rank's copy of it.
The shares cross ranks as a few flat tensors (token ids, log-probs, UTF-8 bytes of the texts and extracted
answers, per-sample integers and rewards), never as pickled Python objects: a
paper-sized step holds tens of millions of tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from bapo import dist
from bapo.samples import Prompt, RolloutBatch, Sample
from bapo.seeding import derive_seed


class RolloutMaker:
    def __init__(
        self,
        prompts: Iterator[Prompt],
        engine: Any,
        verifier: Any,
        *,
        prompts_per_step: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        skipped: Any = None,
    ):
        """``prompts``: a prompt stream with ``state_dict``/``load_state_dict``; ``engine``: a rollout engine
        (``bapo.rollout.RolloutEngine``); ``verifier``: grades texts against answers; ``skipped``: the data
        loader's report (its ``skipped`` count is logged as ``data/skipped_rows``)."""
        self.prompts = prompts
        self.engine = engine
        self.verifier = verifier
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.rank, self.world = rank, world
        tp = int(getattr(engine, "tensor_parallel_size", 1))
        if world % tp:
            raise ValueError(f"the engine's tensor_parallel_size {tp} does not divide the {world} ranks")
        self.tp = tp
        self.share, self.shares = rank // tp, world // tp  # this rank's generator group, and how many
        self.skipped = skipped

    def make(self, t: int, version: int, weights: dict) -> RolloutBatch:
        """Generate and grade rollout batch ``t`` with the weights of ``version`` (this rank's share)."""
        t_sync = self.engine.load_weights(weights, version) if self.engine.version != version else 0.0
        prompts = tuple(next(self.prompts) for _ in range(self.prompts_per_step))
        mine = list(prompts[self.share :: self.shares])
        t0 = time.perf_counter()
        purpose = "rollout" if self.share == 0 else f"rollout/rank{self.share}"
        samples = self.engine.generate(mine, seed=derive_seed(self.seed, purpose, t))
        if self.shares > 1:  # group ids: the prompt's index in the whole batch
            samples = [dataclasses.replace(s, group=self.share + self.shares * s.group) for s in samples]
        t_rollout = time.perf_counter() - t0
        grades, rstats = self.verifier.grade([s.text for s in samples], [s.prompt.problem.answer for s in samples])
        n_tok = sum(len(s.response_ids) for s in samples)
        stats = rstats.as_dict() | {
            "rollout/tokens_per_s": n_tok / max(t_rollout, 1e-9),
            "time/rollout_s": t_rollout,
            "time/reward_s": rstats.verify_s,
            "time/sync_s": t_sync,
        }
        if self.skipped is not None:
            stats["data/skipped_rows"] = float(self.skipped.skipped)
        return RolloutBatch(
            t,
            version,
            tuple(samples),
            tuple(g.reward for g in grades),
            tuple(g.correct for g in grades),
            tuple(g.extracted for g in grades),
            stats,
            prompts,
        )

    def gather(self, item: RolloutBatch) -> RolloutBatch:
        """The whole batch on every rank (this rank's share in one process)."""
        return item if self.world == 1 else gather_batch(item, self.world, tp=self.tp)

    def state_dict(self) -> dict:
        return {"prompts": self.prompts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])


# ----------------------------------------------------------------------------- the gather


def _utf8(strings: list[str | None]) -> tuple[torch.Tensor, list[int]]:
    blobs = [b"" if s is None else s.encode("utf-8") for s in strings]
    sizes = [-1 if s is None else len(b) for s, b in zip(strings, blobs, strict=True)]
    data = b"".join(blobs)
    return (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)), sizes


def _strings(data: torch.Tensor, sizes: list[int]) -> list[str | None]:
    raw, out, at = data.numpy().tobytes(), [], 0
    for n in sizes:
        out.append(None if n < 0 else raw[at : at + n].decode("utf-8"))
        at += max(n, 0)
    return out


def encode_share(batch: RolloutBatch) -> list[torch.Tensor]:
    """One rank's share as flat tensors: ints, rewards, token ids, log-probs, text and answer bytes, stats, (t, v)."""
    s = batch.samples
    text, text_sizes = _utf8([x.text for x in s])
    answers, answer_sizes = _utf8(list(batch.extracted))
    ints = torch.tensor(
        [
            [x.group, len(x.response_ids), int(x.truncated), int(c), ts, az]
            for x, c, ts, az in zip(s, batch.correct, text_sizes, answer_sizes, strict=True)
        ],
        dtype=torch.long,
    ).reshape(-1)  # [n * 6]
    keys = sorted(batch.stats)
    return [
        ints,
        torch.tensor(batch.rewards, dtype=torch.float64),
        torch.cat([torch.as_tensor(x.response_ids, dtype=torch.long) for x in s] or [torch.zeros(0, dtype=torch.long)]),
        torch.cat([torch.as_tensor(x.logp, dtype=torch.float32) for x in s] or [torch.zeros(0)]),
        text,
        answers,
        torch.tensor([float(batch.stats[k]) for k in keys], dtype=torch.float64),
        torch.tensor([batch.index, batch.version], dtype=torch.long),
    ]


def decode_share(parts: list[torch.Tensor], like: RolloutBatch) -> RolloutBatch:
    """The inverse of :func:`encode_share` for another rank's share of the batch ``like`` (same prompts, keys)."""
    ints, rewards, tokens, logp, text, answers, stats, head = parts
    if head.tolist() != [like.index, like.version]:
        raise RuntimeError(f"ranks produced different rollout batches: {head.tolist()} vs {[like.index, like.version]}")
    rows = ints.reshape(-1, 6).tolist()
    texts = _strings(text, [r[4] for r in rows])
    extracted = _strings(answers, [r[5] for r in rows])
    samples, at = [], 0
    for (group, n, truncated, _, _, _), txt in zip(rows, texts, strict=True):
        samples.append(
            Sample(
                prompt=like.prompts[group],
                group=group,
                response_ids=tokens[at : at + n].clone(),
                logp=logp[at : at + n].clone(),
                text=txt,
                version=like.version,
                truncated=bool(truncated),
            )
        )
        at += n
    keys = sorted(like.stats)
    return RolloutBatch(
        like.index,
        like.version,
        tuple(samples),
        tuple(rewards.tolist()),
        tuple(bool(r[3]) for r in rows),
        tuple(extracted),
        dict(zip(keys, stats.tolist(), strict=True)),
        like.prompts,
    )


def merge_stats(parts: list[dict]) -> dict:
    """The ranks' batch stats as one batch's: time the slowest rank's, counts and throughput summed, else means."""
    out: dict[str, float] = {}
    for key in {k for p in parts for k in p}:
        vals = [float(p[key]) for p in parts if key in p]
        if key.startswith("time/"):
            out[key] = max(vals)  # the ranks generate in parallel: the step waits for the slowest
        elif key.endswith("tokens_per_s") or (key.startswith("reward/") and key != "reward/accuracy"):
            out[key] = sum(vals)  # counts and throughput add up
        elif key.startswith("data/"):
            out[key] = vals[0]  # every rank reads the same data
        else:
            out[key] = float(np.mean(vals))
    return out


def gather_batch(mine: RolloutBatch, world: int, *, tp: int = 1) -> RolloutBatch:
    """Every rank's share of one rollout batch, as one batch in rank order (the same on every rank).

    ``tp``: ranks ``[g*tp, (g+1)*tp)`` generated one share together; rank ``g*tp``'s copy of it is kept."""
    gathered = dist.all_gather_tensors(encode_share(mine))
    if len(gathered) != world:
        raise RuntimeError(f"gathered {len(gathered)} shares from {world} ranks")
    parts = [decode_share(p, mine) for p in gathered[::tp]]
    correct = tuple(c for p in parts for c in p.correct)
    stats = merge_stats([p.stats for p in parts])
    stats["reward/accuracy"] = sum(correct) / max(len(correct), 1)
    return RolloutBatch(
        mine.index,
        mine.version,
        tuple(s for p in parts for s in p.samples),
        tuple(r for p in parts for r in p.rewards),
        correct,
        tuple(x for p in parts for x in p.extracted),
        stats,
        mine.prompts,
    )
