"""The rollout interface: what the loop and ``eval.py`` may call on an engine, and the parts
every engine shares.

- :class:`RolloutEngine` is the interface every engine subclasses: ``version``, ``pad_id``, ``generate``,
  ``load_weights``, ``sleep`` and ``wake``, with the sampling defaults engines hold and no-op ``sleep``/``wake``.
- :class:`SamplingDefaults` are the keywords every engine's constructor takes (``n``, ``temperature``,
  ``max_new_tokens``, ``top_p``, ``logprobs``): what it samples with where a call says nothing.
- :class:`EngineContext` is what every engine's ``from_config(cfg, ctx)`` gets beside its typed config;
  :func:`constructor_kwargs` reads an engine's keyword arguments from the two by name, once for every engine.
- :func:`make_sample` is the one place a :class:`~bapo.samples.Sample` is built from an
  engine's raw output, so both engines cut responses, flag truncation and decode text alike.
- :meth:`RolloutEngine.extend` and :meth:`RolloutEngine.complete` are partial rollouts' two verbs
  (``rollout.partial_budget``): one segment more of each unfinished response (the engine's
  ``_segments`` continues prompt + prefix, re-prefilling the prefix, never re-sampling it), and a
  finished response as a Sample.
- :func:`stop_ids_of` and :func:`pad_id_of` derive the token ids every engine needs from the
  tokenizer and the checkpoint, once.

Stop tokens. A response ends at the first of *any* end-of-sequence id: the tokenizer's and
those of the checkpoint's ``generation_config.json`` (an int or a list; Qwen2.5 base models
list ``<|endoftext|>`` while their tokenizer's eos is ``<|im_end|>``, or the reverse).
Stopping on the tokenizer's alone lets a model run on past the end it was trained to emit.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from bapo.infra.checks import ConfigError
from bapo.samples import Partial, Prompt, Sample


class RolloutEngine(ABC):
    """A generation engine: samples responses with its own copy of the policy's weights. Every engine subclasses
    it, implementing :meth:`load_weights` and :meth:`_generate`, and declares ``traits``, ``config`` and
    ``from_config`` for the registry (:mod:`bapo.engines.registry`).

    ``version`` is the policy version of the weights it holds (set by :meth:`load_weights`); every sample it
    returns carries it. ``pad_id`` pads token rows (the learner's collate uses the same id).
    ``tensor_parallel_size`` is the number of torchrun ranks one engine spans; those ranks must generate the
    same prompts with the same seed (``bapo.rollout.maker``, ``bapo.eval.evaluate``).

    What it gives: ``from_config`` (the constructor's keywords read from the typed config and the context), the
    sampling defaults every engine holds (:meth:`_hold_sampling`), ``generate`` filling
    them in before the engine's own ``_generate``, no-op ``sleep``/``wake``, and :meth:`extend` (partial
    rollouts) for an engine that implements ``_segments``.
    """

    version: int = 0
    pad_id: int
    tensor_parallel_size: int = 1  # ranks per engine (vLLM under torchrun may span several)
    sync_parts: Mapping[str, float] = {}  # the last load_weights' seconds by part (write, reload, ...), if it splits

    @classmethod
    def from_config(cls, cfg, ctx: EngineContext) -> RolloutEngine:
        """The engine of the typed rollout config ``cfg``, loading the checkpoint at ``ctx.path`` itself:
        ``cls(ctx.path, ctx.tokenizer, **constructor_kwargs(cls, cfg, ctx))``. An engine that samples with a
        model of this process (``ctx.model``) overrides it."""
        return cls(ctx.path, ctx.tokenizer, **constructor_kwargs(cls, cfg, ctx))

    @classmethod
    def preflight(cls, cfg) -> None:
        """What the engine needs of this machine, given its typed config, checked before anything loads (raise a
        one-line ConfigError). Nothing by default."""
        return None

    @abstractmethod
    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Replace the engine's weights with the learner's; returns the seconds it took. ``weights`` is read
        once, in the engine's own order: under FSDP it is a streamed mapping whose reads are collectives, so
        every rank loads at the same time."""

    def _hold_sampling(self, tokenizer, generation_config, sampling: SamplingDefaults) -> None:
        """Keep the sampling defaults every engine has and derive its pad and stop ids (from ``tokenizer`` and
        the checkpoint's ``generation_config``, which may be None); the engine starts at version 0."""
        self.tokenizer = tokenizer
        self.n = sampling.n
        self.temperature = sampling.temperature
        self.max_new_tokens = sampling.max_new_tokens
        self.top_p = sampling.top_p
        self.logprobs = sampling.logprobs
        self.version = 0
        self.pad_id = pad_id_of(tokenizer)
        self.stop_ids = stop_ids_of(tokenizer, generation_config)

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """``n`` responses per prompt (the engine's own ``n`` and ``temperature`` where a call gives none), grouped
        by prompt (sample ``i`` answers ``prompts[i // n]``). ``temperature=0`` is greedy; ``seed`` makes the
        call reproducible."""
        n = self.n if n is None else n
        temperature = self.temperature if temperature is None else temperature
        return self._generate(prompts, n, temperature, seed)

    @abstractmethod
    def _generate(self, prompts: Sequence[Prompt], n: int, temperature: float, seed: int | None) -> list[Sample]:
        """The engine's sampling, with ``n`` and ``temperature`` filled in."""

    def extend(self, partials: Sequence[Partial], *, budget: int) -> list[Partial]:
        """One segment more of each response: at most ``budget`` new tokens (and no more than
        ``max_new_tokens`` in all), sampled with the engine's weights, tagged with its version. A response
        continues from its prompt and tokens so far, seeded by its own seed at its own positions."""
        if not partials:
            return []
        rows = [list(p.prompt.ids) + p.response_ids.tolist() for p in partials]
        caps = [min(budget, self.max_new_tokens - len(p.response_ids)) for p in partials]
        if min(caps) < 1:
            raise ValueError("extend() was given a response that already has max_new_tokens tokens")
        new = self._segments(rows, caps, [p.seed for p in partials], [len(p.response_ids) for p in partials])
        stops = torch.tensor(self.stop_ids, dtype=torch.long)
        out = []
        for p, cap, (ids, lp) in zip(partials, caps, new, strict=True):
            ids, lp = ids[:cap].long(), lp[:cap].float()  # [c]
            hits = torch.isin(ids, stops).nonzero()
            end = int(hits[0, 0]) + 1 if len(hits) else len(ids)
            out.append(
                Partial(
                    p.prompt,
                    torch.cat([p.response_ids, ids[:end]]),
                    torch.cat([p.logp, lp[:end]]),
                    torch.cat([p.versions, torch.full((end,), self.version, dtype=torch.long)]),
                    p.seed,
                    p.segments + 1,
                    bool(len(hits)),
                )
            )
        return out

    def _segments(
        self, rows: list[list[int]], caps: list[int], seeds: list[int], offsets: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each row (prompt + response so far), up to ``caps`` new token ids and their log-probs, at the
        engine's temperature; token j of the response (``offsets``: tokens it has) drawn from (seed, j)."""
        raise NotImplementedError(f"{type(self).__name__} cannot continue responses (rollout.partial_budget)")

    def complete(self, partial: Partial, group: int) -> Sample:
        """A finished response as the Sample the learner trains on (its version the oldest token's)."""
        return make_sample(
            partial.prompt,
            group,
            partial.response_ids,
            partial.logp,
            self.stop_ids,
            int(partial.versions.min()) if len(partial.versions) else self.version,
            self.tokenizer,
            versions=partial.versions,
        )

    def sleep(self) -> None:  # noqa: B027 (a no-op by design: most engines have nothing to free)
        """Release accelerator memory while the learner updates (nothing to free by default)."""

    def wake(self) -> None:  # noqa: B027 (a no-op by design)
        """Undo :meth:`sleep` (engines also wake themselves before they load or generate)."""


@dataclass(frozen=True)
class SamplingDefaults:
    """What an engine samples with where a ``generate`` call says nothing: the keywords every engine's constructor
    takes beside its own. ``n`` responses per prompt at ``temperature``, at most ``max_new_tokens`` tokens each;
    ``top_p < 1`` only with ``logprobs=False`` (evaluation: :func:`check_top_p`, checked here)."""

    n: int
    temperature: float = 1.0
    max_new_tokens: int = 64
    top_p: float = 1.0
    logprobs: bool = True

    def __post_init__(self) -> None:
        check_top_p(self.top_p, self.logprobs)

    @classmethod
    def take(cls, kwargs: dict[str, Any]) -> SamplingDefaults:
        """The defaults that ``kwargs`` names, taken out of it (what stays is for the engine's library)."""
        return cls(**{f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs})


@dataclass(frozen=True)
class EngineContext:
    """What an engine is built with beside its typed rollout config: the run's model and how it is used.

    ``path``: the checkpoint an engine that loads its own weights reads; ``model``: the engine's own copy
    of the weights, for an engine whose traits say it needs one (loaded from ``path`` in ``dtype`` when
    None). ``seed`` seeds an engine's sampler where it has one of its own. ``max_model_len``: the longest
    prompt + response the engine must hold, which sizes a KV cache (None: the model's whole context).
    ``logprobs=False`` (evaluation) allows ``top_p < 1``; training engines record the log-probs the
    learner needs and sample the full distribution. ``syncs_together``: every rank loads each version of the
    weights at the same time (sync mode), so an engine may share one staged copy between a node's ranks.
    """

    path: str
    tokenizer: Any
    model: Any = None
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    logprobs: bool = True
    top_p: float = 1.0
    syncs_together: bool = False


def constructor_kwargs(cls: type, cfg, ctx: EngineContext) -> dict[str, Any]:
    """The :class:`SamplingDefaults` and the keyword-only arguments of ``cls``'s constructor, each taken by its
    name from the typed rollout config ``cfg`` (an engine's YAML keys are its constructor's arguments) or from
    ``ctx`` (``dtype``, ``seed``, ``max_model_len``, ``top_p``, ``logprobs``, ``syncs_together``): an engine takes
    the context its constructor names. A constructor that passes ``**kwargs`` on (a subclass adding a key to its
    parent engine's) takes its parents' keyword-only arguments too, up the class hierarchy to the first constructor
    without ``**kwargs``. An argument that neither has, or that both have, is a TypeError naming it."""
    names = [f.name for f in fields(SamplingDefaults)] + keyword_only(cls)
    out: dict[str, Any] = {}
    for name in dict.fromkeys(names):
        sources = [s for s in (cfg, ctx) if hasattr(s, name)]
        if len(sources) != 1:
            where = "neither" if not sources else "both"
            raise TypeError(f"{cls.__name__}({name}=...): {where} the rollout config and the EngineContext name it")
        out[name] = getattr(sources[0], name)
    return out


def keyword_only(cls: type) -> list[str]:
    """The keyword-only arguments of ``cls.__init__`` and, where it takes ``**kwargs``, of the constructors above
    it in the method resolution order that it may pass them on to."""
    names: list[str] = []
    for klass in cls.__mro__:
        if not issubclass(klass, RolloutEngine) or "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names += [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def pad_id_of(tokenizer) -> int:
    """The id that pads token rows: the tokenizer's pad token, else its eos token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token to pad with")
    return int(pad)


def stop_ids_of(tokenizer, generation_config=None) -> tuple[int, ...]:
    """The union of the tokenizer's eos id and the checkpoint's ``generation_config.eos_token_id``
    (an int, a list or None), the tokenizer's first."""
    ids: list[int] = []
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        for i in [source] if isinstance(source, int) else list(source or ()):
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("no end-of-sequence id: neither the tokenizer nor the generation config names one")
    return tuple(ids)


def check_top_p(top_p: float, logprobs: bool) -> None:
    """Refuse nucleus sampling where the log-probs are for training.

    With ``top_p < 1`` tokens come from the renormalised nucleus while the learner scores the
    full tempered distribution, so the recorded log-probs would be of neither. Evaluation
    (``logprobs=False``) may use it.
    """
    if not 0 < top_p <= 1:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], got {top_p}")
    if top_p < 1 and logprobs:
        raise ConfigError(
            f"rollout.top_p: {top_p} < 1 samples from the nucleus, but training log-probs are of the full "
            "distribution; nucleus sampling is for evaluation only (an engine built with logprobs=False)"
        )


def make_sample(
    prompt: Prompt,
    group: int,
    token_ids: Sequence[int] | torch.Tensor,
    logp: Sequence[float] | torch.Tensor | None,
    stop_ids: Sequence[int],
    version: int,
    tokenizer,
    *,
    versions: torch.Tensor | None = None,
) -> Sample:
    """One :class:`Sample` from an engine's raw row of tokens.

    The response is cut after the first stop id (kept: the learner trains on it); rows with
    no stop id are ``truncated``. ``logp`` is one log-prob per token of ``token_ids`` (or
    None when the engine records none: evaluation, then they are NaN, so that no training
    step can use them unnoticed). ``text`` is the response without its stop token and
    without special tokens. ``versions``: each token's version, for a response generated in
    segments (``version`` is then its oldest).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)  # [T]
    hits = torch.isin(ids, torch.as_tensor(list(stop_ids), dtype=torch.long)).nonzero()
    stopped = len(hits) > 0
    end = int(hits[0, 0]) + 1 if stopped else len(ids)
    ids = ids[:end].clone()
    if logp is None:
        lp = torch.full((end,), math.nan, dtype=torch.float32)
    else:
        lp = torch.as_tensor(logp, dtype=torch.float32).reshape(-1)[:end].clone()
        if len(lp) != end:
            raise ValueError(f"{len(lp)} log-probs for a response of {end} tokens")
    text = tokenizer.decode((ids[: end - 1] if stopped else ids).tolist(), skip_special_tokens=True)
    return Sample(
        prompt=prompt,
        group=group,
        response_ids=ids,
        logp=lp,
        text=text,
        version=version,
        truncated=not stopped,
        versions=None if versions is None else torch.as_tensor(versions, dtype=torch.long)[:end].clone(),
    )
