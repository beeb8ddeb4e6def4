"""The values passed between stages.

Stages (data, rollout, reward, buffer, learner) never import each other; they
exchange only these frozen dataclasses. ``bapo/loop.py`` is the one place that
wires them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Problem:
    """One math problem with its gold answer."""

    id: str
    problem: str
    answer: str
    source: str = ""


@dataclass(frozen=True)
class Prompt:
    """A problem rendered through the chat template and tokenized."""

    problem: Problem
    text: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """One generated response, tagged with the policy version that produced it.

    ``logp`` holds the behaviour log-probabilities of the sampled tokens under the
    sampling distribution (logits / temperature), one per response token.
    ``version`` is the oldest policy version that produced any of its tokens.
    """

    prompt: Prompt
    group: int  # index of the prompt's group within its rollout batch
    response_ids: tuple[int, ...]
    logp: tuple[float, ...]
    text: str
    version: int
    truncated: bool  # hit max_new_tokens without an end-of-turn token


@dataclass(frozen=True)
class ScoredSample:
    """A sample after reward and advantage estimation.

    ``advantage`` is one number per sequence (GRPO's; with GAE, the first token's).
    ``token_adv``, when given, holds one advantage per response token and takes
    precedence. With a critic, ``old_values`` (the critic's values when the sample
    was scored) and ``returns`` (its GAE targets) are per response token too.
    """

    sample: Sample
    reward: float
    advantage: float
    correct: bool
    extracted: str | None = None
    token_adv: tuple[float, ...] | None = None
    old_values: tuple[float, ...] | None = None
    returns: tuple[float, ...] | None = None


@dataclass(frozen=True)
class TrainBatch:
    """Right-padded tensors for one learner micro- or mini-batch.

    Response positions are aligned with next-token prediction: ``mask[b, t]`` is 1
    where ``input_ids[b, t + 1]`` is a response token, so ``logp`` from the model's
    logits at position t lines up with ``old_logp[b, t]`` and ``adv[b, t]``.
    """

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    mask: torch.Tensor  # [B, L-1] float, 1 on response tokens
    old_logp: torch.Tensor  # [B, L-1] float
    adv: torch.Tensor  # [B, L-1] float
    versions: torch.Tensor  # [B] long
    extras: dict = field(default_factory=dict)  # more [B, L-1] tensors: old_values, returns (PPO)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class RolloutBatch:
    """One rollout batch as the producer hands it to the learner: the samples of
    ``train.prompts_per_step`` prompts, generated at one policy ``version``, with the
    verifier's verdicts (reward, correct, extracted answer per sample)."""

    index: int  # the training step that consumes it (1-based)
    version: int
    samples: tuple[Sample, ...]
    rewards: tuple[float, ...]
    correct: tuple[bool, ...]
    extracted: tuple[str | None, ...]
    stats: dict  # reward/... counts and time/... of the producer for this batch
