"""The values passed between stages.

Stages (data, rollout, reward, buffer, learner) never import each other; they
exchange only these frozen dataclasses. ``bapo/loop.py`` is the one place that
wires them together.

Per-token data travels as 1-D tensors (token ids as int64, log-probs, advantages,
values and returns as float32), never as Python tuples of floats: a paper-sized
step holds tens of millions of tokens, which is what crosses ranks
(``bapo.rollout.maker``) and what a checkpoint stores. Samples hold tensors, so they
compare by identity (``eq=False``), not by value.
"""

from __future__ import annotations

from collections.abc import Mapping
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


@dataclass(frozen=True, eq=False)
class Sample:
    """One generated response, tagged with the policy version that produced it.

    ``response_ids`` [T] (int64) are the sampled tokens, ending with a stop token unless
    ``truncated``; ``logp`` [T] (float32) holds the behaviour log-probabilities of the
    sampled tokens under the sampling distribution (logits / temperature).
    ``version`` is the oldest policy version that produced any of its tokens; ``versions`` [T] (int64), the
    version of each token, is set for a response generated in segments across versions (partial rollouts,
    ``rollout.partial_budget``) and None when one version produced all of it (:meth:`token_versions`).
    """

    prompt: Prompt
    group: int  # index of the prompt's group within its rollout batch
    response_ids: torch.Tensor  # [T] int64
    logp: torch.Tensor  # [T] float32
    text: str
    version: int
    truncated: bool  # hit max_new_tokens without an end-of-turn token
    versions: torch.Tensor | None = None  # [T] int64; None: every token is ``version``'s

    def token_versions(self) -> torch.Tensor:
        """The version of each response token [T] (int64)."""
        if self.versions is not None:
            return self.versions
        return torch.full((len(self.response_ids),), self.version, dtype=torch.long)


@dataclass(frozen=True, eq=False)
class Partial:
    """A response being generated in segments of at most ``rollout.partial_budget`` tokens, one segment per
    rollout step, each with the weights the schedule gives that step (``bapo.rollout.maker``).

    ``response_ids`` [T] (int64), ``logp`` [T] (float32: the behaviour log-probs, each under the weights that
    sampled it) and ``versions`` [T] (int64: those weights' policy version) are the response so far; ``seed``
    is its own sampling seed (token j is drawn from a uniform of (seed, j), whichever segment draws it);
    ``segments`` counts the segments generated; ``stopped``: it ended with a stop token.
    """

    prompt: Prompt
    response_ids: torch.Tensor  # [T] int64
    logp: torch.Tensor  # [T] float32
    versions: torch.Tensor  # [T] int64
    seed: int
    segments: int = 0
    stopped: bool = False

    def finished(self, max_new_tokens: int) -> bool:
        """Ended with a stop token, or has all ``max_new_tokens`` tokens (truncated)."""
        return self.stopped or len(self.response_ids) >= max_new_tokens


@dataclass(frozen=True, eq=False)
class ScoredSample:
    """A sample after reward and advantage estimation.

    ``advantage`` is one number per sequence (GRPO's; with GAE, the first token's).
    ``token_adv``, when given, holds one advantage per response token and takes
    precedence. With a critic, ``old_values`` (the critic's values when the sample
    was scored) and ``returns`` (its GAE targets) are per response token too.

    Off-policy corrections (``bapo.algos.correction``): ``behaviour_logp`` keeps the
    engine's log-probs when ``sample.logp`` holds the learner's (recompute, or decoupled
    PPO's proximal policy); ``token_weight`` is the correction's detached weight per
    token; ``proximal_version`` is decoupled PPO's proximal version when its log-probs are
    interpolated (``proximal=loglinear``) rather than computed.
    """

    sample: Sample
    reward: float
    advantage: float
    correct: bool
    extracted: str | None = None
    token_adv: torch.Tensor | None = None  # [T] float32
    old_values: torch.Tensor | None = None  # [T] float32
    returns: torch.Tensor | None = None  # [T] float32
    behaviour_logp: torch.Tensor | None = None  # [T] float32, the engine's
    token_weight: torch.Tensor | None = None  # [T] float32
    proximal_version: int | None = None


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


@dataclass(frozen=True, eq=False)
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
    prompts: tuple[Prompt, ...] = ()  # every prompt of the batch, in order (under torchrun: all ranks' shares)


@dataclass(frozen=True)
class TokenVersionWeights:
    """Weights by policy version for ``Learner.response_logp`` over samples whose tokens came from several versions
    (partial rollouts): each token is scored under ``by_version[its version]`` (None: the learner's current weights).
    Recompute's behaviour log-probs are then each token's own policy's, as with one version."""

    by_version: dict[int, Mapping[str, torch.Tensor] | None]
