"""DAPO's dynamic sampling (arXiv 2503.14476, ``algo.filter_groups=true``): keep only informative groups.

A prompt group whose responses are all correct or all wrong has identical rewards, hence zero GRPO
advantages: it costs a forward and backward pass and teaches nothing. :class:`GroupFilter` wraps the
producer's batch maker (``bapo.rollout.maker.RolloutMaker``). It makes rollout batch ``t`` as usual, drops
the groups whose verdicts are all equal (judged by **correctness**, the verifier's verdict, not by the
shaped reward, so the overlong penalty or a format bonus cannot make a group look informative), and
refills the batch with fresh groups, generated with the same weights and version, until it again holds
``train.prompts_per_step`` groups. Refills are bounded: at most ``MAX_EXTRA_ROUNDS`` extra generation
rounds per batch; if the batch is still short after them, it is topped up with the dropped groups
(they add nothing to the loss, and every size downstream stays what the config says). Surplus groups of
the last round are discarded, as in DAPO.

Why inside the maker: the batch keeps its index and version, so the off-policy schedule
(``bapo.rollout.producer``: which version batch t is generated with) is unchanged, async admission works as
before, and a resumed run is exact: refill round r of batch t draws its sampling seed from the batch
index ``t + r * REFILL_STRIDE`` (never a real batch's), and its prompts from the same data cursor that
the checkpoint saves after each batch.

Metrics (``filter/``): extra generation rounds, groups dropped (over all rounds), groups topped up.
``reward/accuracy`` and the other reward stats stay those of the batch's first round: the policy's
accuracy on fresh prompts, not on the filtered selection.

Under torchrun each rank makes only its share of a batch, so ranks would disagree on the refills;
``bapo.config.check_combinations`` refuses the combination.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bapo.samples import RolloutBatch

MAX_EXTRA_ROUNDS = 4  # extra generation rounds per batch at most (DAPO's max_num_gen_batches bounds the same)
REFILL_STRIDE = 1 << 40  # refill round r of batch t uses batch index t + r * REFILL_STRIDE for its seed
TIMES = ("time/rollout_s", "time/reward_s")  # summed over the rounds


@dataclasses.dataclass
class Group:
    """One prompt's responses with their verdicts, as the rollout batch holds them."""

    prompt: Any
    rows: list[tuple[Any, float, bool, str | None]]  # (sample, reward, correct, extracted)

    @property
    def informative(self) -> bool:
        return len({c for _, _, c, _ in self.rows}) > 1


def groups_of(batch: RolloutBatch) -> list[Group]:
    """The batch's prompt groups in order of first appearance (samples of a group stay contiguous)."""
    by_id: dict[int, Group] = {}
    for s, r, c, x in zip(batch.samples, batch.rewards, batch.correct, batch.extracted, strict=True):
        by_id.setdefault(s.group, Group(s.prompt, [])).rows.append((s, r, c, x))
    return list(by_id.values())


def assemble(first: RolloutBatch, groups: list[Group], stats: dict) -> RolloutBatch:
    """One rollout batch of ``groups`` (renumbered 0, 1, ...) with the index and version of ``first``."""
    rows = [(dataclasses.replace(s, group=g), r, c, x) for g, grp in enumerate(groups) for s, r, c, x in grp.rows]
    samples, rewards, correct, extracted = (tuple(col) for col in zip(*rows, strict=True)) if rows else ((),) * 4
    prompts = tuple(g.prompt for g in groups)
    return RolloutBatch(first.index, first.version, samples, rewards, correct, extracted, stats, prompts)


class GroupFilter:
    """A batch maker that keeps informative groups only, refilling from the same maker (module docstring)."""

    def __init__(self, maker: Any, *, prompts_per_step: int, max_extra_rounds: int = MAX_EXTRA_ROUNDS):
        if max_extra_rounds < 0:
            raise ValueError(f"max_extra_rounds must be >= 0, got {max_extra_rounds}")
        self.maker = maker
        self.prompts_per_step = prompts_per_step
        self.max_extra_rounds = max_extra_rounds

    def make(self, t: int, version: int, weights: dict) -> RolloutBatch:
        first = self.maker.make(t, version, weights)
        kept, dropped, rounds = [], [], 0
        stats = dict(first.stats)
        batch = first
        while True:
            for g in groups_of(batch):
                (kept if g.informative else dropped).append(g)
            if len(kept) >= self.prompts_per_step or rounds == self.max_extra_rounds:
                break
            rounds += 1
            batch = self.maker.make(t + rounds * REFILL_STRIDE, version, weights)
            for k in TIMES:
                stats[k] = stats.get(k, 0.0) + batch.stats.get(k, 0.0)
        short = max(0, self.prompts_per_step - len(kept))
        stats |= {
            "filter/extra_rounds": float(rounds),
            "filter/dropped_groups": float(len(dropped)),
            "filter/topped_up_groups": float(short),
        }
        return assemble(first, kept[: self.prompts_per_step] + dropped[:short], stats)

    def gather(self, item: RolloutBatch) -> RolloutBatch:
        return self.maker.gather(item)

    def state_dict(self) -> dict:
        return self.maker.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.maker.load_state_dict(state)
