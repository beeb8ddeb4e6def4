"""One forward pass over a micro-batch: its layout on the learner's device, the model call, and the log-probs
and entropies of its response tokens, aligned with the padded batch's ``mask``.

Logits are computed only where they can predict a response token. Padded: from the batch's first such
position on (both outputs are 0 before it). Packed (``learner.packing``): only at response tokens (both are 0
outside ``mask``), in a layout chosen by the attention kernel: flash-attention gets one padding-free row with
varlen bounds (``batching.pack``); the mask kernels (sdpa, eager) get each prompt once with its responses after
it, under a 4-D mask (``batching.pack_shared``), so a group of n samples pays for its prompt once instead of n
times.

A micro-batch's layout is made once per update (:class:`ForwardInputs`) and reused by every pass over it:
BAPO's pre-pass, the training pass and the reference model's. The 4-D mask is built on the learner's device
(``batching.shared_mask``), never on the host and copied over, when a pass first needs it; the policy's and
the reference's forwards of one pass share it, and :meth:`ForwardInputs.release` drops it after the pass.
It is not kept from the pre-pass to the training pass: holding every micro-batch's mask at once would take
N R W^2 bytes of device memory (at paper_7b about 55 micro-batches of 2 x 8.3k x 8.3k: 7 GiB per GPU, in no
memory plan), to save a build that costs milliseconds on the device (``scripts/bench/bench_mask.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bapo.learner.batching import Packed, SharedPrompts, pack, pack_shared, shared_mask, unpack
from bapo.samples import TrainBatch

MASK_KERNELS = ("sdpa", "eager")  # attention kernels that take a 4-D mask: the shared-prompt layout


class ForwardInputs:
    """A micro-batch and its layouts on ``device``, made when a pass first needs them and kept for the next
    passes; the 4-D mask is kept until :meth:`release` (module docstring)."""

    def __init__(self, mb: TrainBatch, *, packing: bool, device: torch.device | str):
        self.mb, self.packing, self.device = mb, packing, torch.device(device)
        self._shared: SharedPrompts | None = None
        self._packed: Packed | None = None
        self._masks: dict[torch.dtype | None, torch.Tensor] = {}

    def shared(self) -> SharedPrompts:
        if self._shared is None:
            self._shared = pack_shared(self.mb).to(self.device)
        return self._shared

    def packed(self) -> Packed:
        if self._packed is None:
            self._packed = pack(self.mb).to(self.device)
        return self._packed

    def mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The shared-prompt layout's mask [R, 1, W, W] on the device: bool (None; sdpa reads True as "attend"),
        or 0 and ``dtype``'s minimum (eager adds it to the scores)."""
        if dtype not in self._masks:
            allowed = shared_mask(self.shared(), self.device)[:, None]  # [R, 1, W, W]
            if dtype is not None:
                allowed = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(
                    ~allowed, torch.finfo(dtype).min
                )
            self._masks[dtype] = allowed
        return self._masks[dtype]

    def release(self) -> None:
        """Drop the masks (the layouts stay): the pass that used them is over."""
        self._masks.clear()


LogpEntropyFn = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]


def forward(
    model: torch.nn.Module, inputs: ForwardInputs, logp_entropy: LogpEntropyFn, *, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [B, L-1], entropy [B, L-1] or None) of ``inputs.mb`` under ``model``, from the logits through
    ``logp_entropy(logits, targets, entropy)`` (module docstring for the layouts)."""
    mb, device = inputs.mb, inputs.device
    kernel = str(getattr(model.config, "_attn_implementation", ""))
    if inputs.packing and kernel in MASK_KERNELS:
        sp = inputs.shared()
        dtype = model.get_input_embeddings().weight.dtype if kernel == "eager" else None
        logits = model(
            input_ids=sp.input_ids, position_ids=sp.position_ids, attention_mask=inputs.mask(dtype), use_cache=False
        ).logits  # [R, W, V]
        logits = logits.flatten(0, 1)[sp.keep.to(logits.device)]  # [K, V]
        # outputs' device, not the learner's: with FSDP's CPU offload the parameters live on the CPU
        logp, ent = logp_entropy(logits, sp.targets.to(logits.device), entropy)  # [K], [K]
        mask = mb.mask.to(logits.device)
        return unpack(logp, mask), None if ent is None else unpack(ent, mask)
    if inputs.packing:
        pk = inputs.packed()
        kw = {}
        if "flash" in kernel:  # varlen bounds, no per-layer sync
            cu = pk.cu_seqlens
            kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=pk.max_seqlen, max_length_k=pk.max_seqlen)
        logits = model(
            input_ids=pk.input_ids,
            position_ids=pk.position_ids,
            logits_to_keep=pk.keep,
            use_cache=False,  # with a cache HF ignores the position-id restarts: sequences would see each other
            **kw,
        ).logits[0]  # [K, V]
        logp, ent = logp_entropy(logits, pk.targets.to(logits.device), entropy)  # [K], [K]
        mask = mb.mask.to(logits.device)
        return unpack(logp, mask), None if ent is None else unpack(ent, mask)
    ids = mb.input_ids.to(device)
    first = int(mb.mask.any(0).int().argmax())  # the first position whose logits predict a response token
    logits = model(
        input_ids=ids,
        attention_mask=mb.attention_mask.to(device),
        logits_to_keep=ids.shape[1] - first,  # positions first .. L-1
        use_cache=False,
    ).logits  # [B, L-first, V]
    logp, ent = logp_entropy(logits[:, :-1], ids[:, first + 1 :].to(logits.device), entropy)  # [B, L-1-first]
    return F.pad(logp, (first, 0)), None if ent is None else F.pad(ent, (first, 0))  # [B, L-1] each
