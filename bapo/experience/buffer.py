"""Staleness-controlled replay buffer.

Every sample carries the policy version that generated it. The staleness of a
sample in an update is ``learner_version - sample.version``. With
``max_staleness = k`` no update ever uses a sample whose staleness exceeds k:
:meth:`get` drops such samples (and counts them) before it hands anything out,
looking ``horizon`` updates ahead (a batch taken now is trained on for
``updates_per_step`` updates), and :meth:`check` refuses a batch that would
break the bound. Which weights a batch is generated with is decided upstream
(``bapo/rollout/producer.py``); this is the last line of defence and the drop counter.

Samples are kept in prompt groups, because GRPO advantages are defined per
group and a group is dropped or served whole.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from omegaconf import MISSING

from bapo.infra.checks import choice, require
from bapo.samples import ScoredSample


class StalenessError(RuntimeError):
    pass


class ReplayBuffer:
    def __init__(self, *, max_staleness: int | None, capacity: int, sampling: str = "fifo", seed: int = 0):
        if sampling not in ("fifo", "uniform"):
            raise ValueError(f"buffer.sampling must be 'fifo' or 'uniform', got {sampling!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"buffer.max_staleness must be >= 0 or null, got {max_staleness}")
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.sampling = sampling
        self.rng = random.Random(seed)
        self.groups: deque[list[ScoredSample]] = deque()
        self.dropped_stale = 0
        self.dropped_capacity = 0
        self.served = 0

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)

    def put(self, samples: Sequence[ScoredSample]) -> None:
        """Add samples, grouped by (prompt group, version); evict the oldest groups past capacity."""
        groups: dict[tuple[int, int], list[ScoredSample]] = {}
        for s in samples:
            groups.setdefault((s.sample.group, s.sample.version), []).append(s)
        self.groups.extend(groups.values())
        while len(self) > self.capacity and self.groups:
            self.dropped_capacity += len(self.groups.popleft())

    def _evict_stale(self, version: int) -> None:
        if self.max_staleness is None:
            return
        keep = deque()
        for g in self.groups:
            if version - g[0].sample.version > self.max_staleness:
                self.dropped_stale += len(g)
            else:
                keep.append(g)
        self.groups = keep

    def admissible(self, sample_version: int, version: int, *, horizon: int = 0) -> bool:
        """Would samples of ``sample_version`` stay within the bound for the next ``horizon`` updates?

        (What :meth:`get` keeps at learner ``version``; a batch that fails is dropped there.)"""
        return self.max_staleness is None or version + horizon - sample_version <= self.max_staleness

    def get(self, num_samples: int, version: int, horizon: int = 0) -> list[ScoredSample]:
        """Remove and return whole groups totalling at most ``num_samples`` samples.

        Groups that would exceed the bound at any of the next ``horizon`` updates
        (learner versions ``version ... version + horizon``) are dropped first.
        """
        self._evict_stale(version + horizon)
        if self.sampling == "uniform":  # a uniform draw of whole groups; the rest keep their (FIFO) order
            order = list(range(len(self.groups)))
            self.rng.shuffle(order)
            chosen, total = [], 0
            for i in order:
                if total + len(self.groups[i]) <= num_samples:
                    chosen.append(i)
                    total += len(self.groups[i])
            out = [s for i in chosen for s in self.groups[i]]
            taken = set(chosen)
            self.groups = deque(g for i, g in enumerate(self.groups) if i not in taken)
            self.served += len(out)
            return out
        out: list[ScoredSample] = []
        while self.groups and len(out) + len(self.groups[0]) <= num_samples:
            out.extend(self.groups.popleft())
        self.served += len(out)
        return out

    def check(self, samples: Sequence[ScoredSample], version: int) -> dict[str, float]:
        """Staleness of ``samples`` at learner ``version``; raises if the bound is broken.

        Returns the mean, the max and the count of samples at each staleness value
        (``buffer/staleness_hist/<s>``).
        """
        stale = [version - s.sample.version for s in samples]
        worst = max(stale, default=0)
        if self.max_staleness is not None and worst > self.max_staleness:
            raise StalenessError(f"sample staleness {worst} exceeds buffer.max_staleness={self.max_staleness}")
        if min(stale, default=0) < 0:
            raise StalenessError(f"a sample is from the future: version {version - min(stale)} > learner {version}")
        out = {
            "buffer/staleness_mean": sum(stale) / max(len(stale), 1),
            "buffer/staleness_max": float(worst),
        }
        for v in stale:
            key = f"buffer/staleness_hist/{v}"
            out[key] = out.get(key, 0.0) + 1.0
        return out

    def metrics(self) -> dict[str, float]:
        return {
            "buffer/size": float(len(self)),
            "buffer/dropped": float(self.dropped_stale + self.dropped_capacity),
            "buffer/dropped_stale": float(self.dropped_stale),
            "buffer/dropped_capacity": float(self.dropped_capacity),
            "buffer/served": float(self.served),
        }

    def state_dict(self) -> dict:
        return {
            "groups": [list(g) for g in self.groups],
            "rng": self.rng.getstate(),
            "counters": (self.dropped_stale, self.dropped_capacity, self.served),
        }

    def load_state_dict(self, state: dict) -> None:
        self.groups = deque(list(g) for g in state["groups"])
        st = state["rng"]
        self.rng.setstate((st[0], tuple(st[1]), st[2]))
        self.dropped_stale, self.dropped_capacity, self.served = state["counters"]


# ----------------------------------------------------------------------------- config


@dataclass
class BufferConfig:
    max_staleness: int = MISSING
    enforce: str = MISSING  # admission (producer waits) | drop (stale samples are dropped)
    capacity: int = MISSING
    sampling: str = MISSING

    def __post_init__(self) -> None:
        require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            "buffer.max_staleness",
            f"must be an integer >= 0, got {self.max_staleness!r}",
        )
        choice(self.enforce, "buffer.enforce", ("admission", "drop"))
        require(self.capacity > 0, "buffer.capacity", "must be > 0")
        choice(self.sampling, "buffer.sampling", ("fifo", "uniform"))
