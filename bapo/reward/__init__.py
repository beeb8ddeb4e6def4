"""Reward stage: extract the final answer from a response and check it against the gold answer.

``score_math(response, answer)`` is the one-call API. ``MathVerifier`` scores batches
with a pool of worker subprocesses and returns ``reward/...`` stats for the logger. ``reward.kind`` picks the
verifier (:mod:`bapo.reward.registry`: ``build_verifier``, the one builder training and eval.py use).
``overlong_penalty`` is DAPO's length shaping, added to the reward by the loop.
"""

from bapo.reward.extract import extract_answer, last_boxed, last_number
from bapo.reward.pool import Grade, MathVerifier, RewardStats, score_math
from bapo.reward.registry import REWARD_CONFIGS, REWARDS, Verifier, build_verifier, reward_class
from bapo.reward.shaping import overlong_penalty
from bapo.reward.verify import is_equivalent, normalize_answer

__all__ = [
    "REWARDS",
    "REWARD_CONFIGS",
    "Grade",
    "MathVerifier",
    "Verifier",
    "build_verifier",
    "reward_class",
    "RewardStats",
    "extract_answer",
    "is_equivalent",
    "last_boxed",
    "last_number",
    "normalize_answer",
    "overlong_penalty",
    "score_math",
]
