"""HF transformers generation engine (the CPU path, and single-GPU runs without vLLM).

Samples ``n`` responses per prompt and returns, for each, the token ids, the behaviour
log-probabilities of the sampled tokens and the policy version of the weights that produced
them. Two decode paths (``decode=``, see :mod:`bapo.engines.decode`): ``"lean"``, a sampling
loop over the model's forward (the default; ``scripts/bench/bench_decode.py`` times it against HF ``generate``,
docs/perf.md has the figures), and ``"generate"``, HF ``generate`` as a fallback. Both sample plain
softmax(logits / T), ignoring the
checkpoint's generation defaults, and stop at the first of the tokenizer's and the
checkpoint's eos ids. Each is reproducible for a seed; they draw different tokens for the same
seed (greedy decoding agrees).

The behaviour log-probability is taken under softmax(logits / temperature), which is what
the learner recomputes, one step at a time (never the batch's ``[B, T, V]`` logits). top-k is
off. ``top_p < 1`` samples from the nucleus, whose log-probs are not the learner's, so it is
refused unless the engine is built with ``logprobs=False`` (evaluation); such an engine's
samples carry NaN log-probs.

Prompts are grouped by length before they are cut into batches of ``batch_size`` sequences, so
that a batch pads little; samples come back in prompt order.

The engine owns its own copy of the weights: the learner pushes new weights in with
:meth:`load_weights`, so between two syncs the engine keeps generating with the older policy,
exactly as an off-policy engine on another device would.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import MISSING

from bapo.engines.base import EngineContext, RolloutEngine, SamplingDefaults, constructor_kwargs, make_sample
from bapo.engines.config import RolloutCommon
from bapo.engines.decode import Sampling, Segments, generate_decode, lean_decode
from bapo.engines.registry import EngineTraits
from bapo.infra.checks import choice, require, resumable
from bapo.samples import Prompt, Sample

DECODERS = {"lean": lean_decode, "generate": generate_decode}


@dataclass
class HFRolloutConfig(RolloutCommon):
    """``rollout=hf`` (conf/rollout/hf.yaml): transformers on the learner's device."""

    batch_size: int = resumable()
    decode: str = MISSING  # lean: the project's sampling loop | generate: HF generate (the fallback)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.batch_size > 0, "rollout.batch_size", "must be > 0")
        choice(self.decode, "rollout.decode", tuple(DECODERS))
        require(
            self.partial_budget is None or self.decode == "lean",
            "rollout.decode",
            "rollout.partial_budget continues responses with per-position draws that only the lean loop has: "
            f"use rollout.decode=lean (got {self.decode})",
        )


class HFRollout(RolloutEngine):
    """Batched sampling with the lean loop or HF ``generate``."""

    traits = EngineTraits(
        needs_model_copy=True,
        can_sleep=False,
        behaviour_logprobs=True,
        weights="in_process",
        spans_ranks=False,
        continues=True,
        runs_in_workers=True,
    )
    config = HFRolloutConfig

    @classmethod
    def from_config(cls, cfg: HFRolloutConfig, ctx: EngineContext) -> HFRollout:
        """The engine of ``rollout=hf``, sampling with ``ctx.model`` (loaded from ``ctx.path`` in ``ctx.dtype`` when
        None). ``ctx.seed`` and ``ctx.max_model_len`` are unused: each ``generate`` call is seeded, and the model's
        context bounds a sequence."""
        model = ctx.model
        if model is None:
            from bapo.modeling import load_model, pick_device

            model = load_model(ctx.path, dtype=ctx.dtype, device=pick_device("auto"))
        return cls(model, ctx.tokenizer, **constructor_kwargs(cls, cfg, ctx))

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        batch_size: int = 128,
        decode: str = "lean",
        **sampling: Any,
    ):
        """``sampling``: the :class:`~bapo.engines.base.SamplingDefaults` (``n``, ``temperature``, ...)."""
        defaults = SamplingDefaults(**sampling)
        choice(decode, "rollout.decode", tuple(DECODERS))
        self.model = model.eval()
        self._hold_sampling(tokenizer, getattr(model, "generation_config", None), defaults)
        self.batch_size = batch_size
        self.decode = decode
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Load the learner's weights; returns the seconds it took."""
        t0 = time.perf_counter()
        self.model.load_state_dict(weights, strict=True)
        self.version = version
        return time.perf_counter() - t0

    def _generate(self, prompts: Sequence[Prompt], n: int, temperature: float, seed: int | None) -> list[Sample]:
        """Sample ``n`` responses per prompt; ``temperature=0`` means greedy; ``seed`` makes it reproducible."""
        if seed is not None:
            torch.manual_seed(seed)
        per_call = max(1, self.batch_size // n)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))  # stable: ties keep prompt order
        out: list[Sample | None] = [None] * (len(prompts) * n)
        for start in range(0, len(order), per_call):
            chunk = order[start : start + per_call]
            for row, sample in enumerate(self._generate_chunk([prompts[i] for i in chunk], chunk, n, temperature)):
                out[chunk[row // n] * n + row % n] = sample
        return out  # type: ignore[return-value]

    def _generate_chunk(
        self, prompts: Sequence[Prompt], groups: Sequence[int], n: int, temperature: float
    ) -> list[Sample]:
        width = max(len(p.ids) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, P]
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p.ids) :] = torch.tensor(p.ids)
            attn[i, width - len(p.ids) :] = 1
        tokens, logp = DECODERS[self.decode](
            self.model, ids.to(self.device), attn.to(self.device), self._sampling(n, temperature)
        )
        tokens, logp = tokens.cpu(), logp.cpu()  # [B*n, T] each
        return [
            make_sample(
                prompts[row // n],
                groups[row // n],
                tokens[row],
                logp[row] if self.logprobs else None,
                self.stop_ids,
                self.version,
                self.tokenizer,
            )
            for row in range(tokens.shape[0])
        ]

    def _sampling(self, n: int, temperature: float) -> Sampling:
        return Sampling(n, self.max_new_tokens, temperature, self.stop_ids, self.pad_id, self.top_p)

    def _segments(
        self, rows: list[list[int]], caps: list[int], seeds: list[int], offsets: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`RolloutEngine._segments` with the lean loop, ``batch_size`` rows a call, grouped by length."""
        out: list = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = max(len(rows[i]) for i in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)  # [B, P] left-padded
            attn = torch.zeros_like(ids)
            for r, i in enumerate(chunk):
                ids[r, width - len(rows[i]) :] = torch.tensor(rows[i])
                attn[r, width - len(rows[i]) :] = 1
            pick = torch.tensor(chunk)
            segs = Segments(
                torch.tensor(caps)[pick], torch.tensor(seeds, dtype=torch.long)[pick], torch.tensor(offsets)[pick]
            )
            tokens, logp = lean_decode(
                self.model, ids.to(self.device), attn.to(self.device), self._sampling(1, self.temperature), segs
            )
            for r, i in enumerate(chunk):
                out[i] = (tokens[r].cpu(), logp[r].cpu())
        return out
