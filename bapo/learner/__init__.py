"""The policy update: micro-batching, gradient accumulation, optimizer step, weights out; the PPO critic."""

from bapo.learner.batching import collate, response_rows, split
from bapo.learner.critic import Critic, ValueModel
from bapo.learner.learner import Learner, TokenVersionWeights, TrainingDiverged, disable_dropout
from bapo.learner.strategy import frozen_dtype, master_dtype

__all__ = [
    "Critic",
    "Learner",
    "TokenVersionWeights",
    "TrainingDiverged",
    "ValueModel",
    "collate",
    "disable_dropout",
    "frozen_dtype",
    "master_dtype",
    "response_rows",
    "split",
]
