"""The HF engine's two decode paths. Both take left-padded prompts and return the sampled
tokens and their log-probs, ``tokens [B*n, T]`` and ``logp [B*n, T]`` (rows grouped by prompt,
as ``num_return_sequences`` groups them), and both sample only from softmax(logits / T):

- :func:`lean_decode` (the default): a plain loop over the model's forward. The prompts are
  prefilled once and their KV cache is copied to the ``n`` samples (``generate`` prefills every
  copy); the cache is preallocated (a step writes one position instead of concatenating the whole
  cache anew) and so is the 4-D attention mask (sliced, not rebuilt, each step); a token is drawn
  by inverting the CDF at one uniform per row, and its log-prob comes from the same log-softmax;
  rows that have stopped are dropped from the batch and the cache as they finish.
- :func:`generate_decode` (the fallback, ``decode="generate"``): ``model.generate`` with a
  sampling config built from scratch. ``generate`` fills every field left unset in the config it
  is given from ``model.generation_config`` (the checkpoint's ``generation_config.json``): a
  checkpoint's ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``,
  ``suppress_tokens``, ``top_k``... would shape sampling while the recorded log-probs (and the
  learner's) are of the unpenalised distribution. So the model's defaults are replaced by an
  empty config for the call. The log-probs are taken one step at a time by a logits processor,
  which keeps one step's logits, not the batch's whole history.

The two paths sample the same distribution but not the same tokens for a seed: ``generate``'s
``torch.multinomial`` draws an exponential per vocabulary entry and row (``argmax(p / q)``),
which on CPU costs more than the forward pass of a small model (250 ms a step for 256 rows of a
49k vocabulary); the lean loop draws one uniform per row. Greedy decoding is the same on both.
Each path is reproducible for a seed.

Both take one :class:`Sampling` (what every row is sampled with). Partial rollouts
(``rollout.partial_budget``) continue responses from a prefix: :func:`lean_decode` then also takes
:class:`Segments`, a cap of new tokens per row and a counter-based uniform per (response seed, token
position) instead of the process's RNG, so that a response drawn in several segments draws the same
uniforms as one drawn at once (with unchanged weights: the same tokens). ``generate`` has no such
hook, so partial rollouts need the lean path (``bapo.engines.hf``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from bapo.infra import stop


@dataclass(frozen=True)
class Sampling:
    """How every row of one decode call is sampled: ``n`` continuations per prompt row, at most
    ``max_new_tokens`` each, from softmax(logits / ``temperature``) (greedy at 0; the nucleus ``top_p`` for
    evaluation only), ending at any of ``stop_ids``; rows are padded with ``pad_id``."""

    n: int
    max_new_tokens: int
    temperature: float
    stop_ids: tuple[int, ...]
    pad_id: int
    top_p: float = 1.0


@dataclass(frozen=True)
class Segments:
    """One segment of each row's response (partial rollouts; ``Sampling.n`` is then 1): a row ends at a stop
    id or after ``caps`` [B] new tokens. Token j of a response (``offsets`` [B]: tokens it already has) is
    drawn with :func:`counter_uniform` of ``(seeds [B], j)``, whatever segment draws it."""

    caps: torch.Tensor  # [B] long, >= 1
    seeds: torch.Tensor  # [B] int64
    offsets: torch.Tensor  # [B] long


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) [B] (float64), a pure function of (seed, position) per row: SplitMix64's output
    function applied to ``seed + (position + 1) * golden`` (int64 arithmetic wraps, as its uint64 does)."""
    z = seeds.long() + (positions.long() + 1) * _i64(0x9E3779B97F4A7C15)
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * 2.0**-53


# A row that stops is dropped from the batch once this share of the live rows has stopped:
# each drop copies the KV cache once, as a decode step's concatenation does anyway.
DROP_FRACTION = 0.1


def _pick(
    logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's tokens [b] and their log-probs [b] under softmax(logits / T).

    Sampling inverts the CDF at one uniform per row (``u`` [b]): one pass over the vocabulary,
    where ``torch.multinomial`` draws an exponential for every token (on CPU that costs more
    than the forward of a small model). The CDF is summed in float64: float32 rounding would
    move probability between neighbouring tail tokens of a 150k vocabulary. Greedy
    (``temperature <= 0``) scores the argmax under T = 1.
    """
    x = logits if temperature <= 0 else logits / temperature  # [b, V]
    if top_p < 1:
        x = _nucleus(x, top_p)
    logp = torch.log_softmax(x, dim=-1)  # [b, V]
    if temperature <= 0:
        tok = x.argmax(dim=-1)
    else:
        cdf = logp.exp().cumsum(dim=-1, dtype=torch.float64)  # [b, V]
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # first token with cdf > u
        tok = tok.clamp_(max=x.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the smallest set of tokens whose probability reaches ``top_p`` (evaluation only)."""
    sorted_x, order = torch.sort(x, descending=False)  # [b, V]
    drop = sorted_x.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[:, -1] = False  # keep at least the most likely token
    return x.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def _kv_cache(model, capacity: int):
    """A ``DynamicCache`` whose full-attention layers write into buffers preallocated for ``capacity``
    positions (a decode step copies one position in, instead of concatenating the whole cache anew),
    and whether all its layers are such. Layers of any other kind (sliding window, linear attention)
    keep transformers' own."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """``keys``/``values`` are views of the first ``length`` positions of the buffers."""

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h = key_states.shape[:2]
            self.kbuf = key_states.new_empty((b, h, capacity, key_states.shape[-1]))  # [B, H, C, D]
            self.vbuf = value_states.new_empty((b, h, capacity, value_states.shape[-1]))  # [B, H, C, Dv]
            self.length = 0
            self.is_initialized = True

        def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys, self.values = self.kbuf[:, :, : self.length], self.vbuf[:, :, : self.length]
            return self.keys, self.values

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            q = key_states.shape[-2]
            self.kbuf[:, :, self.length : self.length + q] = key_states
            self.vbuf[:, :, self.length : self.length + q] = value_states
            self.length += q
            return self._views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.kbuf, self.vbuf = self.kbuf.repeat_interleave(repeats, 0), self.vbuf.repeat_interleave(repeats, 0)
                self._views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
                self._views()

    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache, all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)


def _cache_kwarg(model) -> str:
    """transformers >= 5.20 names the forward's cache ``cache`` (``past_key_values`` is deprecated)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()  # lighter than no_grad per op; the caller clones what it keeps (bapo.engines.base.make_sample)
def lean_decode(
    model, ids: torch.Tensor, attn: torch.Tensor, sampling: Sampling, segments: Segments | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``n`` continuations of each left-padded prompt row (``ids``, ``attn``: [B, P]); with ``segments``
    (n = 1) a row is a prompt and its response so far, continued for at most its cap. A stop request raises
    :class:`bapo.infra.stop.Interrupted` between two tokens."""
    n, temperature, top_p = sampling.n, sampling.temperature, sampling.top_p
    stop_ids, pad_id = sampling.stop_ids, sampling.pad_id
    max_new_tokens = sampling.max_new_tokens if segments is None else int(segments.caps.max())
    if segments is not None and n != 1:
        raise ValueError(f"segments continue one response per row (n=1), got n={n}")
    B, P = ids.shape[0] * n, ids.shape[1]
    dev = ids.device
    cache, full_attention = _kv_cache(model, P + max_new_tokens)
    kw = {_cache_kwarg(model): cache, "use_cache": True}
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)  # [B0, P]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=1, **kw).logits
    logits = logits[:, -1].float().repeat_interleave(n, dim=0)  # [B, V]
    cache.batch_repeat_interleave(n)
    # A 4-D mask is used as given (sdpa: True = attend), for every layer: only where all layers attend
    # to the full past. Other kernels, and sliding-window layers, get transformers' masks built from 2-D.
    four_d = full_attention and getattr(model.config, "_attn_implementation", None) == "sdpa"
    mask = torch.zeros((B, P + max_new_tokens), dtype=torch.bool, device=dev)  # [B, P+T]
    mask[:, :P] = attn.bool().repeat_interleave(n, dim=0)
    next_pos = attn.long().sum(-1).repeat_interleave(n)  # [B] position of the first new token
    rows = torch.arange(B, device=dev)  # the live rows' indices in the full batch
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=dev)
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=dev)  # [B, T]
    logp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=dev)  # [B, T]
    if segments is not None:
        caps, seeds, offsets = (x.to(dev) for x in (segments.caps, segments.seeds, segments.offsets))
    for t in range(max_new_tokens):
        stop.check()  # a stop request gives the batch up between two tokens (bapo.infra.stop)
        if temperature <= 0:
            u = None
        elif segments is None:
            # one uniform per row of the full batch, so that a row's draws do not depend on which others stopped
            u = torch.rand(B, dtype=torch.float64, device=dev)[rows]  # [b]
        else:
            u = counter_uniform(seeds[rows], offsets[rows] + t)  # [b] the response's own draw for this position
        tok, lp = _pick(logits, temperature, top_p, u)  # [b], [b]
        tok = tok.masked_fill(done, pad_id)  # a row that stopped but is not dropped yet
        tokens[rows, t], logp[rows, t] = tok, lp
        done |= torch.isin(tok, stops)
        if segments is not None:
            done |= caps[rows] <= t + 1  # this segment's budget is spent
        n_done = int(done.sum())
        if t + 1 == max_new_tokens or n_done == len(rows):
            break
        if n_done and n_done >= DROP_FRACTION * len(rows):
            keep = (~done).nonzero()[:, 0]  # [b']
            cache.batch_select_indices(keep)
            rows, done, mask, next_pos, tok = rows[keep], done[keep], mask[keep], next_pos[keep], tok[keep]
        mask[:, P + t] = True
        step_mask = mask[:, None, None, : P + t + 1] if four_d else mask[:, : P + t + 1]
        logits = model(input_ids=tok[:, None], attention_mask=step_mask, position_ids=(next_pos + t)[:, None], **kw)
        logits = logits.logits[:, -1].float()  # [b, V]
    return tokens, logp


class _StepLogp:
    """A logits processor that records each sampled token's log-prob under softmax(logits / T).

    ``generate`` calls it with the raw logits of step t (custom processors run before the
    temperature warper) and the ids that include token t-1; it gathers token t-1's log-prob from
    the logits it kept and keeps step t's. :meth:`finish` takes the last step's. One ``[B, V]``
    step is held at a time, never the whole history.
    """

    def __init__(self, scale: float):
        self.scale = scale
        self.prev: torch.Tensor | None = None
        self.cols: list[torch.Tensor] = []

    def _logp(self, logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float() / self.scale, dim=-1).gather(-1, tok[:, None])[:, 0]  # [B]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.cols.append(self._logp(self.prev, input_ids[:, -1]))
        self.prev = scores
        return scores

    def finish(self, new: torch.Tensor) -> torch.Tensor:
        """Log-probs [B, T] of the new tokens ``new`` [B, T]."""
        if self.prev is not None and len(self.cols) < new.shape[1]:
            self.cols.append(self._logp(self.prev, new[:, len(self.cols)]))
        self.prev = None
        return torch.stack(self.cols, dim=1)


@contextmanager
def _no_checkpoint_defaults(model):
    """Hide the checkpoint's generation defaults from ``generate`` for the duration of the call."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def sampling_config(sampling: Sampling):
    """A neutral ``GenerationConfig``: plain (or nucleus) sampling at ``temperature``, nothing else."""
    from transformers import GenerationConfig

    sample = sampling.temperature > 0
    extra = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0) if sample else {}
    return GenerationConfig(
        do_sample=sample,
        max_new_tokens=sampling.max_new_tokens,
        num_return_sequences=sampling.n,
        eos_token_id=list(sampling.stop_ids),
        pad_token_id=sampling.pad_id,
        use_cache=True,
        **extra,
    )


@torch.no_grad()
def generate_decode(
    model, ids: torch.Tensor, attn: torch.Tensor, sampling: Sampling, segments: Segments | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.generate`` with :func:`sampling_config`; the same contract as :func:`lean_decode`, without
    ``segments`` (``generate`` draws from the process's RNG). A stop request ends ``generate`` at its next token
    (a stopping criterion) and raises :class:`bapo.infra.stop.Interrupted`."""
    from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    class OnStop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), stop.requested(), dtype=torch.bool, device=input_ids.device)

    if segments is not None:
        raise ValueError("decode=generate cannot continue responses in segments: use decode=lean")
    gc = sampling_config(sampling)
    record = _StepLogp(sampling.temperature if sampling.temperature > 0 else 1.0)
    with _no_checkpoint_defaults(model):
        seq = model.generate(
            input_ids=ids,
            attention_mask=attn,
            generation_config=gc,
            logits_processor=LogitsProcessorList([record]),
            stopping_criteria=StoppingCriteriaList([OnStop()]),
        )
    stop.check()
    new = seq[:, ids.shape[1] :]  # [B*n, T'], T' <= max_new_tokens
    return new, record.finish(new)
