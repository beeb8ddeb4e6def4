"""The policy update: micro-batching, gradient accumulation, optimizer step, weights out."""

from bapo.learner.batching import collate, split
from bapo.learner.learner import Learner

__all__ = ["Learner", "collate", "split"]
