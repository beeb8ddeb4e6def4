"""The ``reward`` group's schema (conf/reward/): what grades (``kind``, a name in ``bapo.reward.registry.REWARDS``),
the grader's pool and the reward's shaping. A reward's own keys go in a subclass, its class's ``config``."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from bapo.infra.checks import choice, require, resumable
from bapo.reward.extract import FALLBACKS


@dataclass
class RewardConfig:
    kind: str = MISSING  # what grades: a name in bapo.reward.registry.REWARDS, or package.module:Class
    num_workers: int = resumable()
    timeout_s: float = resumable()
    fallback: str = MISSING
    format_reward: float = MISSING  # for an extracted but wrong answer
    overlong_buffer: int = MISSING  # DAPO's soft overlong penalty zone, in tokens; 0 = off

    def __post_init__(self) -> None:
        require(self.num_workers >= 0, "reward.num_workers", "must be >= 0")
        require(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        choice(self.fallback, "reward.fallback", FALLBACKS)
        require(-1 <= self.format_reward < 1, "reward.format_reward", f"must be in [-1, 1), got {self.format_reward}")
        require(self.overlong_buffer >= 0, "reward.overlong_buffer", f"must be >= 0, got {self.overlong_buffer}")
