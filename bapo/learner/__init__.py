"""The policy update: micro-batching, gradient accumulation, optimizer step, weights out; the PPO critic."""

from bapo.learner.batching import collate, response_rows, split
from bapo.learner.critic import Critic, ValueModel
from bapo.learner.learner import Learner

__all__ = ["Critic", "Learner", "ValueModel", "collate", "response_rows", "split"]
