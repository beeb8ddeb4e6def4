"""Making one rollout batch, and gathering the ranks' shares of it as tensors.

:class:`RolloutMaker` is what the off-policy producer (``bapo.rollout.producer.Producer``)
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

Partial rollouts (``rollout.partial_budget = b``; :class:`PartialPool`). Responses are generated in
segments of at most b tokens, one segment per step with that step's weights, so a long response is
finished by newer policies than the ones that began it; every token keeps its own behaviour log-prob
and version. A group goes out only when all its n responses have finished (GRPO needs the group's
rewards), and every step still emits exactly ``train.prompts_per_step`` groups. The rule, at step t:

1. every unfinished response in the pool gets one segment;
2. while fewer than the quota of groups have finished: if the pool holds fewer than ``2 x quota``
   groups, admit fresh prompts (as many groups as are still missing, room permitting) and give each
   response one segment; otherwise complete the oldest unfinished groups with the step's weights (the
   rest of each response in one segment);
3. emit the quota finished groups that were admitted first; the rest stay in the pool.

A response needs at most S = ceil(max_new_tokens / b) segments, so a group admitted at step t0 has
finished by step t0 + S - 1; with at most 2 x quota groups in the pool it has also been emitted by then
(were it not, quota older finished groups emitted at step t0 + S - 1 and the quota groups emitted at
step t0 + S - 2 would, with it, make 2 x quota + 1 groups in the pool at step t0 + S - 2). So a token
is at most S - 1 steps older than the step that trains on it: the bound ``bapo.config`` checks
``buffer.max_staleness`` against, and that the admission schedule keeps (``bapo.rollout.schedule``).
Response j of the g-th group ever admitted samples with seed ``derive_seed(seed, "rollout/partial",
g * n + j)`` at each of its token positions (``bapo.engines.decode.counter_uniform``), so the draws of
a response do not depend on how its segments fell. The pool (tokens, log-probs, versions, flags,
admission order) is part of :meth:`RolloutMaker.state_dict`: a resumed run continues the same responses.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from bapo.infra import dist
from bapo.infra.seeding import derive_seed
from bapo.samples import Partial, Prompt, RolloutBatch, Sample


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
        partial_budget: int | None = None,
    ):
        """``prompts``: a prompt stream with ``state_dict``/``load_state_dict``; ``engine``: a rollout engine
        (``bapo.engines.RolloutEngine``); ``verifier``: grades texts against answers; ``skipped``: the data
        loader's report (its ``skipped`` count is logged as ``data/skipped_rows``); ``partial_budget``: tokens
        per response per step (partial rollouts, :class:`PartialPool`), or None."""
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
        self.pool = None
        if partial_budget is not None:
            if world > 1:
                raise ValueError("partial rollouts run in one process: rollout.partial_budget under torchrun")
            self.pool = PartialPool(
                engine, budget=partial_budget, quota=prompts_per_step, n=engine.n, seed=seed, fresh=self.prompts
            )

    def make(self, t: int, version: int, weights: dict) -> RolloutBatch:
        """Generate and grade rollout batch ``t`` with the weights of ``version`` (this rank's share)."""
        t_sync = self.engine.load_weights(weights, version) if self.engine.version != version else 0.0
        t0 = time.perf_counter()
        pool_stats: dict[str, float] = {}
        if self.pool is not None:
            samples, pool_stats = self.pool.step()
            prompts = tuple(samples[i * self.engine.n].prompt for i in range(self.prompts_per_step))
            n_tok = int(pool_stats["rollout/new_tokens"])
        else:
            prompts = tuple(next(self.prompts) for _ in range(self.prompts_per_step))
            mine = list(prompts[self.share :: self.shares])
            purpose = "rollout" if self.share == 0 else f"rollout/rank{self.share}"
            samples = self.engine.generate(mine, seed=derive_seed(self.seed, purpose, t))
            if self.shares > 1:  # group ids: the prompt's index in the whole batch
                samples = [dataclasses.replace(s, group=self.share + self.shares * s.group) for s in samples]
            n_tok = sum(len(s.response_ids) for s in samples)
        t_rollout = time.perf_counter() - t0
        grades, rstats = self.verifier.grade([s.text for s in samples], [s.prompt.problem.answer for s in samples])
        stats = (
            pool_stats
            | rstats.as_dict()
            | {
                "rollout/tokens_per_s": n_tok / max(t_rollout, 1e-9),
                "time/rollout_s": t_rollout,
                "time/reward_s": rstats.verify_s,
                "time/sync_s": t_sync,
            }
            | {f"time/sync_{k}_s": v for k, v in (getattr(self.engine, "sync_parts", {}) if t_sync else {}).items()}
        )
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
        return {"prompts": self.prompts.state_dict()} | ({} if self.pool is None else {"pool": self.pool.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        if self.pool is not None:
            if "pool" not in state:
                raise ValueError("this checkpoint has no partial-rollout pool: it was written without partial_budget")
            self.pool.load_state_dict(state["pool"])


# ----------------------------------------------------------------------------- partial rollouts


class PartialPool:
    """The responses in flight under a token budget, and the rule that makes each step's groups (module
    docstring). ``engine`` extends and completes responses (``extend``, ``complete``); ``fresh``: the prompt
    stream new groups are drawn from."""

    def __init__(self, engine: Any, *, budget: int, quota: int, n: int, seed: int, fresh: Iterator[Prompt]):
        self.engine, self.budget, self.quota, self.n, self.seed = engine, budget, quota, n, seed
        self.fresh = fresh
        self.capacity = 2 * quota  # groups in the pool at most (the staleness bound's argument)
        self.groups: list[list[Partial]] = []  # in admission order, each n responses
        self.admitted = 0  # groups ever admitted: the next group's index, which seeds its responses

    @property
    def max_new_tokens(self) -> int:
        return self.engine.max_new_tokens

    def _done(self, group: list[Partial]) -> bool:
        return all(p.finished(self.max_new_tokens) for p in group)

    def _extend(self, groups: list[list[Partial]], counts: dict, *, whole: bool = False) -> None:
        """One segment more of every unfinished response of ``groups`` (in place); ``whole``: the rest of each
        response in one segment (the same tokens as several segments with these weights, prefilled once)."""
        todo = [(g, i) for g in groups for i, p in enumerate(g) if not p.finished(self.max_new_tokens)]
        if not todo:
            return
        before = [g[i] for g, i in todo]
        budget = self.max_new_tokens if whole else self.budget
        for (g, i), p in zip(todo, self.engine.extend(before, budget=budget), strict=True):
            g[i] = p
        counts["reprefill"] += sum(len(p.response_ids) for p in before)
        counts["new"] += sum(
            len(g[i].response_ids) - len(p.response_ids) for (g, i), p in zip(todo, before, strict=True)
        )
        counts["segments"] += len(todo)

    def _admit(self, k: int) -> list[list[Partial]]:
        new = []
        for _ in range(k):
            prompt = next(self.fresh)
            seeds = [derive_seed(self.seed, "rollout/partial", self.admitted * self.n + j) for j in range(self.n)]
            empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0, dtype=torch.long))
            new.append([Partial(prompt, *empty, seed=s) for s in seeds])
            self.admitted += 1
        self.groups += new
        return new

    def step(self) -> tuple[list[Sample], dict[str, float]]:
        """This step's ``quota`` finished groups as samples (group ids 0, 1, ... in emission order), and stats."""
        counts = {"reprefill": 0, "new": 0, "segments": 0, "admitted": 0, "forced": 0}
        self._extend(self.groups, counts)
        while (short := self.quota - sum(map(self._done, self.groups))) > 0:
            room = self.capacity - len(self.groups)
            if room > 0:
                fresh = self._admit(min(short, room))
                counts["admitted"] += len(fresh)
                self._extend(fresh, counts)
            else:  # the pool is full: finish its oldest unfinished groups with this step's weights
                oldest = [g for g in self.groups if not self._done(g)][:short]
                counts["forced"] += len(oldest)
                self._extend(oldest, counts, whole=True)
        out = [g for g in self.groups if self._done(g)][: self.quota]
        self.groups = [g for g in self.groups if not any(g is o for o in out)]
        responses = [p for g in out for p in g]
        samples = [self.engine.complete(p, k // self.n) for k, p in enumerate(responses)]
        stats = {
            "rollout/new_tokens": float(counts["new"]),
            "rollout/reprefill_tokens": float(counts["reprefill"]),
            "rollout/segments": float(counts["segments"]),
            "rollout/segments_per_response": sum(p.segments for p in responses) / len(responses),
            "rollout/resumed_frac": sum(p.segments > 1 for p in responses) / len(responses),
            "rollout/admitted_groups": float(counts["admitted"]),
            "rollout/forced_groups": float(counts["forced"]),
            "rollout/pool_groups": float(len(self.groups)),
        }
        return samples, stats

    def state_dict(self) -> dict:
        """The pool as tensors and plain values (a checkpoint loads it without running code)."""
        return {
            "admitted": self.admitted,
            "groups": [
                [
                    {
                        "prompt": p.prompt,
                        "ids": p.response_ids,
                        "logp": p.logp,
                        "versions": p.versions,
                        "seed": p.seed,
                        "segments": p.segments,
                        "stopped": p.stopped,
                    }
                    for p in g
                ]
                for g in self.groups
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self.admitted = int(state["admitted"])
        self.groups = [
            [
                Partial(
                    r["prompt"], r["ids"], r["logp"], r["versions"], int(r["seed"]), int(r["segments"]), r["stopped"]
                )
                for r in g
            ]
            for g in state["groups"]
        ]


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
    return join_shares([decode_share(p, mine) for p in gathered[::tp]])


def join_shares(parts: list[RolloutBatch]) -> RolloutBatch:
    """The shares of one rollout batch (ranks', or rollout workers') as one batch, in share order: samples
    concatenated (their group ids are already the batch's), stats merged (:func:`merge_stats`), accuracy
    recounted over all the samples."""
    first = parts[0]
    for p in parts[1:]:
        if (p.index, p.version) != (first.index, first.version):
            raise RuntimeError(f"shares of different batches: {(p.index, p.version)} vs {(first.index, first.version)}")
    correct = tuple(c for p in parts for c in p.correct)
    stats = merge_stats([p.stats for p in parts])
    stats["reward/accuracy"] = sum(correct) / max(len(correct), 1)
    return RolloutBatch(
        first.index,
        first.version,
        tuple(s for p in parts for s in p.samples),
        tuple(r for p in parts for r in p.rewards),
        correct,
        tuple(x for p in parts for x in p.extracted),
        stats,
        first.prompts,
    )
