"""Turning scored samples into padded learner tensors; micro-batches by rows or by token budget; packing.

Packing removes padding from the forward pass only: the loss still sees [B, L-1]
tensors aligned with the padded batch's mask (``unpack``), so every aggregation mode
(including the per-sequence ones) is computed exactly as without packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from bapo.samples import Sample, ScoredSample, TrainBatch

# optional per-token fields of ScoredSample -> TrainBatch.extras (``proximal_version``, one int per sample, is
# broadcast over the sample's response tokens)
TOKEN_EXTRAS = ("old_values", "returns", "behaviour_logp", "token_weight", "proximal_version")


def collate(samples: Sequence[ScoredSample | Sample], *, pad_id: int) -> TrainBatch:
    """Right-pad prompt+response rows; align response tensors with next-token logits.

    Plain (unscored) samples get zero advantages: that is enough for a forward pass,
    e.g. the critic's values at scoring time.
    """
    scored = [s if isinstance(s, ScoredSample) else None for s in samples]
    plain = [s.sample if isinstance(s, ScoredSample) else s for s in samples]
    prompts = [torch.as_tensor(s.prompt.ids, dtype=torch.long) for s in plain]
    responses = [torch.as_tensor(s.response_ids, dtype=torch.long) for s in plain]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    L, B = max(lengths), len(plain)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1))
    old_logp = torch.zeros((B, L - 1))
    adv = torch.zeros((B, L - 1))
    names = [k for k in TOKEN_EXTRAS if any(s is not None and getattr(s, k) is not None for s in scored)]
    extras = {k: torch.zeros((B, L - 1)) for k in names}
    for b, (s, prompt, resp) in enumerate(zip(plain, prompts, responses, strict=True)):
        p, r = len(prompt), len(resp)
        input_ids[b, :p] = prompt
        input_ids[b, p : p + r] = resp
        attention_mask[b, : p + r] = 1
        # logits at position t predict token t+1: response token j sits at p+j, predicted at p+j-1
        sl = slice(p - 1, p - 1 + r)
        mask[b, sl] = 1.0
        old_logp[b, sl] = torch.as_tensor(s.logp, dtype=torch.float)
        sc = scored[b]
        if sc is not None:
            adv[b, sl] = torch.as_tensor(sc.token_adv, dtype=torch.float) if sc.token_adv is not None else sc.advantage
        for k in names:
            value = None if sc is None else getattr(sc, k)
            if value is None:
                raise ValueError(f"some samples carry {k} and others do not; cannot collate them together")
            extras[k][b, sl] = torch.as_tensor(value, dtype=torch.float)  # a scalar broadcasts
    versions = torch.tensor([s.version for s in plain], dtype=torch.long)
    if any(s.versions is not None for s in plain):  # partial rollouts: each token's version (decoupled loglinear)
        extras["token_version"] = torch.zeros((B, L - 1))
        for b, s in enumerate(plain):
            p = len(s.prompt.ids)
            extras["token_version"][b, p - 1 : p - 1 + len(s.response_ids)] = s.token_versions().float()
    return TrainBatch(input_ids, attention_mask, mask, old_logp, adv, versions, extras)


def take_rows(batch: TrainBatch, start: int, stop: int) -> TrainBatch:
    """Rows ``start:stop`` of a right-padded batch, trimmed to their own longest row."""
    am = batch.attention_mask[start:stop]
    L = int(am.sum(1).max().item())
    return TrainBatch(
        input_ids=batch.input_ids[start:stop, :L],
        attention_mask=am[:, :L],
        mask=batch.mask[start:stop, : L - 1],
        old_logp=batch.old_logp[start:stop, : L - 1],
        adv=batch.adv[start:stop, : L - 1],
        versions=batch.versions[start:stop],
        extras={k: v[start:stop, : L - 1] for k, v in batch.extras.items()},
    )


def split(batch: TrainBatch, size: int) -> list[TrainBatch]:
    """Micro-batches of at most ``size`` rows, each trimmed to its own longest row."""
    return [take_rows(batch, i, i + size) for i in range(0, len(batch), size)]


def split_by_tokens(batch: TrainBatch, max_tokens: int, *, packed: bool) -> list[TrainBatch]:
    """Dynamic micro-batches: consecutive rows, as many as fit in a budget of ``max_tokens``.

    The cost of a micro-batch is what the forward pass sees: its real tokens when
    ``packed``, rows x longest row when padded. A row longer than the budget on its own
    makes a micro-batch by itself (the budget is then exceeded, never a row cut).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = batch.attention_mask.sum(1).tolist()
    bounds, start, longest, total = [], 0, 0, 0
    for i, n in enumerate(lengths):
        longest, total = max(longest, n), total + n
        cost = total if packed else longest * (i - start + 1)
        if i > start and cost > max_tokens:
            bounds.append((start, i))
            start, longest, total = i, n, n
    bounds.append((start, len(lengths)))
    return [take_rows(batch, a, b) for a, b in bounds]


def without_tokens(batch: TrainBatch) -> TrainBatch:
    """The first row of ``batch`` with no response token: a micro-batch that adds exactly 0 to the loss.

    Data-parallel ranks must run the same number of forward/backward passes (FSDP's
    collectives are per pass); a rank with fewer micro-batches runs these.
    """
    one = take_rows(batch, 0, 1)
    zero = torch.zeros_like(one.mask)
    return TrainBatch(one.input_ids, one.attention_mask, zero, one.old_logp, zero, one.versions, dict(one.extras))


@dataclass(frozen=True)
class Packed:
    """A micro-batch's response-bearing rows concatenated into one row, without padding.

    ``position_ids`` restart at 0 for each sequence. With no attention mask, HF's
    Llama / Qwen2 attention reads the restarts as sequence boundaries: sdpa and eager
    get a block-diagonal causal mask, flash-attention a varlen call (``cu_seqlens``).
    ``keep`` are the positions whose logits predict a response token (the only
    logits computed), ``targets`` the tokens they predict, in the row-major order of
    the padded batch's ``mask``.
    """

    input_ids: torch.Tensor  # [1, N] long
    position_ids: torch.Tensor  # [1, N] long
    keep: torch.Tensor  # [K] long, K = response tokens
    targets: torch.Tensor  # [K] long
    cu_seqlens: torch.Tensor  # [S + 1] int32 sequence starts in the packed row, then N
    max_seqlen: int

    def to(self, device: torch.device | str) -> Packed:
        """The same layout with its tensors on ``device``."""
        tensors = ("input_ids", "position_ids", "keep", "targets", "cu_seqlens")
        return replace(self, **{f: getattr(self, f).to(device) for f in tensors})


def _right_padded(mb: TrainBatch, who: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention mask, row lengths, response mask, rows with a response token) of a micro-batch whose rows must
    be right-padded (``who`` names the caller in the error)."""
    am = mb.attention_mask.bool()  # [B, L]
    lengths = am.sum(1)  # [B]
    if not torch.equal(am, torch.arange(am.shape[1]) < lengths[:, None]):
        raise ValueError(f"{who} needs right-padded rows (attention_mask = 1...1 0...0)")
    m = mb.mask.bool()  # [B, L-1]
    return am, lengths, m, m.any(1)


def pack(mb: TrainBatch) -> Packed:
    """Pack a right-padded micro-batch (rows without a response token are dropped, unless all are)."""
    am, lengths, m, used = _right_padded(mb, "pack")  # [B, L], [B], [B, L-1], [B]
    if not used.any():  # no response token at all: keep one row, so the forward still runs
        used = torch.arange(len(mb)) == 0
    lengths = torch.where(used, lengths, torch.zeros_like(lengths))  # [B]
    offsets = lengths.cumsum(0) - lengths  # [B] start of each row in the packed row
    tok = am & used[:, None]  # [B, L]
    b, t = m.nonzero(as_tuple=True)  # [K], [K] row-major, like m-indexing
    seq = lengths[used]  # [S]
    return Packed(
        input_ids=mb.input_ids[tok].unsqueeze(0),
        position_ids=(am.cumsum(1) - 1)[tok].unsqueeze(0),
        keep=offsets[b] + t,
        targets=mb.input_ids[b, t + 1],
        cu_seqlens=torch.cat([seq.new_zeros(1), seq.cumsum(0)]).to(torch.int32),
        max_seqlen=int(seq.max()),
    )


@dataclass(frozen=True)
class SharedPrompts:
    """A micro-batch laid out for the attention-mask kernels (sdpa, eager): each prompt once.

    The rows of a group (the ``n`` samples of one prompt) repeat their prompt in the padded
    layout; here a *segment* holds the prompt once and then each response after it, and
    the mask (:func:`shared_mask`) lets each response token see the prompt and its own earlier
    tokens only, at the positions it has in its own sequence, so every response token's logits are
    those of its padded row (only the float summation differs). Segments are packed
    first-fit into rows of the longest segment's width; a padding slot sees only itself.
    ``keep`` indexes the flattened [R * W] positions whose logits predict a response token
    (the prompt's last position once per response: its logits predict every first token),
    in the row-major order of the padded batch's ``mask``, and ``targets`` are those tokens.

    The mask, by definition: query q may see key k when both are in one segment, k's position is not
    after q's, and k is a prompt token or in q's own response (``segment``, ``position_ids``,
    ``branch``). It is built from ``causal`` and ``sees``, the blocks where it is True.
    """

    input_ids: torch.Tensor  # [R, W] long
    position_ids: torch.Tensor  # [R, W] long
    keep: torch.Tensor  # [K] long, K = response tokens
    targets: torch.Tensor  # [K] long
    segment: torch.Tensor  # [R, W] long, a padding slot: a segment of its own (negative)
    branch: torch.Tensor  # [R, W] long, 0: a prompt token, i: the segment's response i
    causal: tuple[tuple[int, int, int], ...]  # (row, start, stop): a prompt or a response, causal within itself
    sees: tuple[tuple[int, int, int, int, int], ...]  # (row, q0, q1, k0, k1): a response's tokens see its prompt

    def to(self, device: torch.device | str) -> SharedPrompts:
        """The same layout with its tensors on ``device``."""
        tensors = ("input_ids", "position_ids", "keep", "targets", "segment", "branch")
        return replace(self, **{f: getattr(self, f).to(device) for f in tensors})


def shared_mask(sp: SharedPrompts, device: torch.device | str = "cpu") -> torch.Tensor:
    """``sp``'s attention mask [R, W, W] (query x key, True: attend), made on ``device``.

    Zeros, then each block a token may see written in place: its own earlier tokens (a triangle, sliced
    from one lower-triangular tensor) and, for a response, its prompt (a rectangle). Nothing of size
    [R, W, W] is made on the host and copied over (a paper_7b micro-batch's mask is 2 x 8.3k x 8.3k =
    131 MiB), and the work is one write of the mask plus its True blocks, not five elementwise passes over
    the whole mask (``scripts/bench/bench_mask.py``)."""
    R, W = sp.input_ids.shape
    allowed = torch.zeros((R, W, W), dtype=torch.bool, device=device)  # [R, W, W]
    widest = max((stop - start for _, start, stop in sp.causal), default=0)
    tri = torch.ones((widest, widest), dtype=torch.bool, device=device).tril_()  # [n, n]
    for r, start, stop in sp.causal:
        allowed[r, start:stop, start:stop] = tri[: stop - start, : stop - start]
    for r, q0, q1, k0, k1 in sp.sees:
        allowed[r, q0:q1, k0:k1] = True
    allowed.diagonal(dim1=1, dim2=2).fill_(True)  # a padding slot sees itself (every other token already does)
    return allowed


def pack_shared(mb: TrainBatch, *, max_width: int = 256) -> SharedPrompts:
    """Lay out a right-padded micro-batch with shared prompts (rows without a response token are dropped,
    unless all are). A segment holds a prompt and as many of its responses as fit in ``max_width`` tokens
    (or in the longest row, if that is longer); the rest of the group starts another segment."""
    _, lengths, m, used = _right_padded(mb, "pack_shared")  # [B], [B, L-1], [B]
    starts = torch.where(used, m.int().argmax(1) + 1, lengths).tolist()  # [B] prompt length (response start)
    rows = used.nonzero()[:, 0].tolist() or [0]  # no response token at all: keep one row, so the forward runs
    lengths, ids = lengths.tolist(), mb.input_ids
    cap = max(max_width, max(lengths[b] for b in rows))
    groups: dict[tuple, list[int]] = {}
    for b in rows:
        groups.setdefault(tuple(ids[b, : starts[b]].tolist()), []).append(b)
    segments: list[list[int]] = []  # each: rows sharing one prompt, prompt + responses <= cap tokens
    for members in groups.values():
        p, size = starts[members[0]], None
        for b in members:
            n = lengths[b] - p
            if size is None or size + n > cap:
                segments.append([])
                size = p
            segments[-1].append(b)
            size += n
    seg_len = [starts[s[0]] + sum(lengths[b] - starts[b] for b in s) for s in segments]
    width, fill = max(seg_len), []  # first-fit decreasing into rows of `width`
    place = [0] * len(segments)  # (row, offset) of each segment
    for i in sorted(range(len(segments)), key=lambda i: -seg_len[i]):
        r = next((r for r, used_w in enumerate(fill) if used_w + seg_len[i] <= width), len(fill))
        fill += [0] * (r + 1 - len(fill))
        place[i], fill[r] = (r, fill[r]), fill[r] + seg_len[i]
    R = len(fill)
    input_ids = torch.zeros((R, width), dtype=torch.long)
    pos = torch.zeros((R, width), dtype=torch.long)
    seg = -1 - torch.arange(R * width).view(R, width)  # [R, W] padding: a segment of its own
    branch = torch.zeros((R, width), dtype=torch.long)  # [R, W] 0: a prompt token, i: response i
    keep: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * len(ids)
    causal, sees = [], []  # the blocks where the mask is True (SharedPrompts)
    for i, s in enumerate(segments):
        r, o = place[i]
        p = starts[s[0]]
        input_ids[r, o : o + p] = ids[s[0], :p]
        pos[r, o : o + p] = torch.arange(p)
        seg[r, o : o + seg_len[i]] = i
        causal.append((r, o, o + p))
        at = o + p
        for j, b in enumerate(s, start=1):
            n = lengths[b] - p
            input_ids[r, at : at + n] = ids[b, p : lengths[b]]
            pos[r, at : at + n] = torch.arange(p, p + n)
            branch[r, at : at + n] = j
            if n:  # the prompt's last token predicts the first response token, each response token the next
                keep[b] = r * width + torch.cat([torch.tensor([o + p - 1]), torch.arange(at, at + n - 1)])
                causal.append((r, at, at + n))
                sees.append((r, at, at + n, o, o + p))
            at += n
    b, t = m.nonzero(as_tuple=True)  # [K], [K] row-major, like m-indexing
    return SharedPrompts(input_ids, pos, torch.cat(keep), ids[b, t + 1], seg, branch, tuple(causal), tuple(sees))


def unpack(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[K] per-response-token values (``Packed.keep`` order) -> [B, L-1] aligned with ``mask``; 0 elsewhere."""
    out = values.new_zeros(mask.shape)  # [B, L-1]
    return out.masked_scatter(mask.bool().to(values.device), values)


def response_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L-1] values at response positions -> [B, T] right-padded per response (T = longest)."""
    m = mask.bool()
    lengths = m.sum(1)  # [B]
    out = x.new_zeros((x.shape[0], int(lengths.max().item()) if len(lengths) else 0))  # [B, T]
    for b in range(x.shape[0]):
        out[b, : int(lengths[b])] = x[b][m[b]]
    return out
