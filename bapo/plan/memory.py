"""What the memory plan counts: a GPU's memory at the largest moments of a step, and a node's host memory.

What is counted, per GPU (W ranks, FSDP2 over all of them; ``N`` parameters, ``N_root`` of them in the
root module: embeddings, final norm, untied LM head; ``N_layer`` in each decoder layer):

* generation (vLLM awake): the learner's resident state (fp32 masters ``4N/W`` and AdamW's two moments
  ``8N/W``; the gradients are freed by ``zero_grad``, and vLLM's wake-up empties torch's cache first),
  the KL reference (sharded bf16, ``2N/W``), vLLM's share ``gpu_memory_utilization x device`` (its bf16
  weights ``/ tensor_parallel_size``, its own activations, its CUDA graphs (vLLM 0.32 profiles them inside the
  share before it sizes the KV cache) and the KV cache it leaves) and the CUDA context with NCCL's buffers.
  With ``rollout=vllm_server`` the engine has GPUs of its own: the learner's ranks are the placement's GPUs less
  the servers' (``rollout.gpus``), and a server's GPU holds vLLM's share alone.
* the update (vLLM asleep: nothing of it stays, its graphs' pool is freed with the rest), at its largest
  moments, the largest printed: the
  logits chain's backward (``bapo.learner.logprobs.peak_bytes``: the logits and their gradient in bf16 plus
  one chunk's fp32 workspace), the first decoder layer's backward (its recomputed activations and backward
  temporaries), the root's gradient reduce-scatter at the end, and with a KL reference its forward (the
  policy's logits kept beside the reference's). No-grad forwards (BAPO's pre-pass, recomputed old
  log-probs) hold one copy of the logits and so less than the chain's backward. Throughout: the sharded masters,
  gradients and AdamW moments (``16N/W``), the root's bf16 parameters, which FSDP2 keeps unsharded from the
  forward to the end of the backward (``fully_shard(model, reshard_after_forward=False)``), two decoder
  layers' bf16 parameters (the one computed and the one prefetched) and one layer's gradients (bf16, and
  the fp32 copy reduce-scattered), and the activations at ``learner.max_tokens_per_micro_batch`` tokens.
  With activation checkpointing each layer keeps only its input; without it, everything below. Shared-prompt
  packing with the sdpa kernel adds its dense [W, W] masks.
* host memory per node: vLLM's bf16 weights while it sleeps at level 1 (offloaded to pinned memory; level
  2 discards them), the servers' staged weight copies (tmpfs: one a node in sync mode, one a server in async)
  and the writers' chunk buffers (``bapo.engines.staging.writer_bytes``; in async mode a chunk of the snapshot
  is also cast on the learner's GPU beside the update),
  async weight snapshots (one full copy per held version and rank, in the engine's dtype,
  fp32 under ``learner.old_logp=recompute``), FSDP's CPU offload (``16N/W`` per rank), and the full
  state dict rank 0 gathers for an HF export (in the model's dtype).

Bytes per token come from :mod:`bapo.plan.shape`; vLLM's CUDA graphs, the CUDA context and NCCL are the
constants below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bapo.engines.registry import engine_traits
from bapo.plan.shape import (
    DTYPE_BYTES,
    ModelShape,
    checkpoint_per_token,
    head_activations_per_token,
    kv_per_token,
    layer_activations_per_token,
    layer_backward_per_token,
    model_config,
    model_shape,
    vllm_activations,
)
from bapo.rollout.placement import placement_class

GiB = 2**30
CUDA_CONTEXT_NCCL_GIB = 1.5  # per process: the CUDA context, cuBLAS workspaces, NCCL's communicator buffers
VLLM_CUDA_GRAPHS_GIB = 1.0  # vLLM 0.32 profiles them inside its share (before sizing the KV cache), frees them asleep
VLLM_NON_TORCH_GIB = 0.5  # inside the share: what vLLM's profile counts as non-torch memory
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Item:
    what: str
    bytes: int


@dataclass
class Moment:
    name: str
    items: list[Item]

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)


@dataclass(frozen=True)
class Setup:
    """What the plan reads of a run: the typed config, the model's shape and the hardware."""

    rc: Any  # bapo.config.RunConfig
    shape: ModelShape
    world: int
    device: int  # bytes of one GPU
    compute: int  # bytes per element of the learner's compute dtype (its unsharded params, activations, logits)
    master: int  # bytes per element of the learner's weights, gradients and AdamW moments
    engine: int  # bytes per element of the rollout engine's weights and KV cache
    prompt: int  # the longest prompt
    tokens: int  # tokens per micro-batch

    @property
    def fsdp(self) -> bool:
        return self.rc.learner.kind == "fsdp"

    @property
    def shard(self) -> int:
        return self.world if self.fsdp else 1

    @property
    def checkpointing(self) -> bool:
        return self.fsdp and self.rc.learner.activation_checkpointing

    @property
    def offload(self) -> bool:
        return self.fsdp and self.rc.learner.cpu_offload

    @property
    def vllm(self) -> bool:
        """vLLM beside the learner on its GPUs (it sleeps during updates)."""
        return engine_traits(self.rc.rollout.engine).gpu_memory == "vllm_beside"

    @property
    def workers(self) -> bool:
        """Rollout in worker processes of its own, on the host (a placement whose traits say ``in_workers``)."""
        return placement_class(getattr(self.rc.placement, "mode", "colocated")).traits.in_workers

    @property
    def server(self) -> bool:
        """vLLM servers on GPUs of their own (none of the learner's)."""
        return engine_traits(self.rc.rollout.engine).gpu_memory == "vllm_own_gpus"

    @property
    def server_gpus(self) -> int:
        """GPUs of this node the launched servers take (0: servers given by URL live elsewhere)."""
        r = self.rc.rollout
        if not self.server or r.url is not None:
            return 0
        return len([g for g in (r.gpus or "").split(",") if g.strip()]) or self.world * r.tensor_parallel_size

    @property
    def seq(self) -> int:
        return self.prompt + self.rc.rollout.max_new_tokens


def setup(rc, *, world: int, gpu_memory_gib: float) -> Setup:
    """The :class:`Setup` of a typed run config (``bapo.config.build``) on ``world`` GPUs of ``gpu_memory_gib``."""
    from bapo.config import prompt_limit

    m, ln = rc.model, rc.learner
    config = model_config(m)
    fsdp = ln.kind == "fsdp"
    context = getattr(config, "max_position_embeddings", None)
    prompt = prompt_limit(rc.data.max_prompt_tokens, rc.rollout.max_new_tokens, context)
    return Setup(
        rc=rc,
        shape=model_shape(config),
        world=world,
        device=int(gpu_memory_gib * GiB),
        compute=(4 if ln.mixed_precision == "fp32" else 2) if fsdp else DTYPE_BYTES[m.dtype],  # auto: bf16 on GPU
        master=4 if fsdp else DTYPE_BYTES[m.dtype],
        engine=DTYPE_BYTES[m.dtype],
        prompt=prompt,
        tokens=max(ln.max_tokens_per_micro_batch or 0, prompt + rc.rollout.max_new_tokens)
        if ln.max_tokens_per_micro_batch
        else ln.micro_batch_size * (prompt + rc.rollout.max_new_tokens),
    )


def dtype_name(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16", 8: "fp64"}[nbytes]


def learner_state(u: Setup) -> dict[str, Item]:
    """The learner's sharded state on the GPU (none with CPU offload), the KL reference, the per-process constants."""
    N, k, m = u.shape.params, u.shard, u.master
    gpu = 0 if u.offload else 1
    ref = 0
    if u.rc.algo.kl_coef > 0:
        ref = 2 * N // u.world if u.fsdp else u.engine * N
    return {
        "masters": Item(f"learner: {dtype_name(m)} master weights (1/{k})", gpu * m * N // k),
        "grads": Item(f"learner: {dtype_name(m)} gradients (1/{k})", gpu * m * N // k),
        "adam": Item(f"learner: AdamW moments, 2 x {dtype_name(m)} (1/{k})", gpu * 2 * m * N // k),
        "ref": Item("KL reference (algo.kl_coef > 0): bf16, sharded" if u.fsdp else "KL reference", ref),
        "context": Item("CUDA context, cuBLAS workspaces, NCCL buffers", int(CUDA_CONTEXT_NCCL_GIB * GiB)),
    }


def attention_mask_bytes(u: Setup, tokens: int) -> int:
    """The dense [W, W] masks of shared-prompt packing (the sdpa and eager kernels; flash-attention needs none):
    a bool mask on the device and the additive bias sdpa makes of it, for rows of W = the longest sequence
    (at least 256, ``bapo.learner.batching.pack_shared``) holding ``tokens`` in all."""
    kernel = str(getattr(u.rc.model, "attn_implementation", None) or "sdpa")
    if not u.rc.learner.packing or "flash" in kernel:
        return 0
    width = min(tokens, max(256, u.seq))
    return -(-tokens // width) * width * width * (1 + u.compute)


def update_moments(u: Setup, tokens: int) -> list[Moment]:
    """The update's GPU memory at its largest moments, at ``tokens`` tokens per micro-batch (module docstring)."""
    from bapo.learner.logprobs import peak_bytes

    s, b, K = u.shape, u.compute, tokens
    st = learner_state(u)
    state = [st["masters"], st["grads"], st["adam"], st["ref"]]
    fixed = [st["context"]]
    if u.server and u.rc.train.async_rollout:  # the producer stages a host snapshot while the learner updates
        from bapo.engines.staging import writer_bytes

        fixed.append(Item("weight staging beside the update: a snapshot's chunk cast on this GPU", writer_bytes(True)))
    root = Item(f"learner: {dtype_name(b)} root params, unsharded ({s.root_params / 1e9:.2f} B)", b * s.root_params)
    layer_params = Item(
        f"learner: {dtype_name(b)} params of 2 decoder layers (computed, prefetched)", 2 * b * s.layer_params
    )
    unsharded = [root, layer_params] if u.fsdp else []
    per_layer = checkpoint_per_token(s, b) if u.checkpointing else layer_activations_per_token(s, b)
    how = "checkpointed: its input" if u.checkpointing else "no checkpointing: all saved"
    acts = [
        Item(f"activations: {s.layers} layers x {per_layer / 1024:.1f} KiB/token ({how})", s.layers * per_layer * K),
        Item("activations: final norm, LM head input", head_activations_per_token(s, b) * K),
        Item("attention mask of shared-prompt packing (sdpa), dense", attention_mask_bytes(u, K)),
    ]
    logits = torch_dtype(b)
    chain = Item(f"logits chain: {dtype_name(b)} logits, their gradient, one chunk", peak_bytes(K, s.vocab, logits))
    moments = [Moment("update, at the logits chain's backward", [*state, *unsharded, *acts, chain, *fixed])]

    grad_bytes = b + 4 if b != 4 else 4  # a half-precision gradient is reduce-scattered as an fp32 copy
    layer = (
        [Item("activations: the layer recomputed", layer_activations_per_token(s, b) * K)] if u.checkpointing else []
    )
    layer.append(Item("activations: the layer's backward temporaries", layer_backward_per_token(s, b) * K))
    if u.fsdp:  # unsharded gradients until their reduce-scatter (one process: they are the gradients above)
        layer += [
            Item(f"LM head gradient, {dtype_name(b)}, held to the end of the backward", b * s.vocab * s.hidden),
            Item("the layer's gradients, unsharded, and their reduce-scatter", grad_bytes * s.layer_params),
        ]
    moments.append(Moment("update, at the first decoder layer's backward", [*state, *unsharded, *acts, *layer, *fixed]))
    if u.fsdp:
        grads = Item("root gradients, unsharded, and their reduce-scatter", grad_bytes * s.root_params)
        moments.append(Moment("update, at the root's reduce-scatter", [*state, root, grads, *fixed]))
    if u.rc.algo.kl_coef > 0:
        ref = peak_bytes(K, s.vocab, logits, backward=False) + b * (s.root_params + 2 * s.layer_params) * u.fsdp
        ref_items = [
            Item("the policy's logits, kept for the chain's backward", b * K * s.vocab),
            Item("KL reference forward: its root and 2 layers unsharded, its logits", ref),
        ]
        moments.append(Moment("update, at the KL reference's forward", [*state, *unsharded, *acts, *ref_items, *fixed]))
    return moments


def torch_dtype(nbytes: int):
    import torch

    return {4: torch.float32, 2: torch.bfloat16, 8: torch.float64}[nbytes]


@dataclass(frozen=True)
class Engine:
    """vLLM's share of a GPU while it generates."""

    share: int
    weights: int
    own: int  # its activations and non-torch memory
    graphs: int  # its CUDA graphs (profiled inside the share)
    kv_tokens: int

    @property
    def kv(self) -> int:
        return self.share - self.weights - self.own - self.graphs


def vllm_engine(u: Setup, utilization: float) -> Engine:
    r, s = u.rc.rollout, u.shape
    share = int(utilization * u.device)
    weights = u.engine * s.params // r.tensor_parallel_size
    own = vllm_activations(s, u.engine, r.tensor_parallel_size) + int(VLLM_NON_TORCH_GIB * GiB)
    graphs = 0 if r.enforce_eager else int(VLLM_CUDA_GRAPHS_GIB * GiB)
    kv_tokens = max(0, share - weights - own - graphs) // kv_per_token(s, u.engine, r.tensor_parallel_size)
    return Engine(share, weights, own, graphs, kv_tokens)


def generation(u: Setup, utilization: float | None = None) -> Moment:
    """GPU memory while the engine generates: the learner's resident state beside it (gradients are freed)."""
    st, r = learner_state(u), u.rc.rollout
    resident, fixed = [st["masters"], st["adam"], st["ref"]], [st["context"]]
    if u.vllm or u.server:
        util = r.gpu_memory_utilization if utilization is None else utilization
        what = "weights, its activations, CUDA graphs, KV cache"
        share = Item(f"vLLM share: {util:.2f} x the GPU ({what})", vllm_engine(u, util).share)
        if u.server:  # a GPU of the server's own: nothing of the learner beside it
            return Moment(f"a server's GPU, generating (x{r.tensor_parallel_size} a server)", [share])
        return Moment("generation (vLLM awake)", [*resident, share, *fixed])
    if u.workers:  # the HF engine runs in worker processes on the host: nothing of it on the GPU
        return Moment("between updates (rollout in worker processes, on the host)", [*resident, *fixed])
    return Moment("generation (HF engine)", [*resident, *hf_engine(u), *fixed])


def hf_engine(u: Setup) -> list[Item]:
    """The HF engine: a copy of the policy in model.dtype and the KV cache of rollout.batch_size prompts x n."""
    r, s = u.rc.rollout, u.shape
    rows = r.batch_size * r.n
    return [
        Item(f"HF engine: weights, {dtype_name(u.engine)}", u.engine * s.params),
        Item(f"HF engine: KV cache of {rows} sequences", rows * u.seq * kv_per_token(s, u.engine, 1)),
    ]


def host_items(u: Setup, sleep_level: int) -> list[Item]:
    """Host memory per node (module docstring)."""
    rc, N = u.rc, u.shape.params
    ranks = min(u.world, GPUS_PER_NODE)
    items = []
    if u.vllm and rc.rollout.enable_sleep_mode:
        level1 = sleep_level == 1
        weights = u.engine * N // rc.rollout.tensor_parallel_size
        what = f"vLLM asleep, level {sleep_level}: {ranks} engines' weights in pinned memory"
        items.append(
            Item(what if level1 else f"vLLM asleep, level {sleep_level}: weights discarded", level1 * ranks * weights)
        )
    if u.workers:
        k = getattr(u.rc.placement, "workers", 1)  # placement.workers; one for a placement without the key
        items += [Item(f"rollout worker x{k}: {i.what}", k * i.bytes) for i in hf_engine(u)]
    if u.server:  # async: every rank stages its own snapshot; sync: the node's first rank writes the shared copy
        from bapo.engines.staging import writer_bytes

        writers = ranks if rc.train.async_rollout else 1
        items.append(Item(f"weight staging: {writers} writer(s)' chunk buffers, pinned", writers * writer_bytes(False)))
    if u.server and u.server_gpus:
        servers = u.server_gpus // rc.rollout.tensor_parallel_size
        copies = servers if rc.train.async_rollout else 1
        how = f"one a server ({servers})" if rc.train.async_rollout else "one a node (every rank syncs at once)"
        items.append(Item(f"servers' staged weights in /dev/shm: {how}, {dtype_name(u.engine)}", copies * u.engine * N))
    held = held_snapshots(rc)
    nbytes = 4 if rc.behaviour.recompute else u.engine
    items.append(
        Item(f"weight snapshots: {held} version(s) x {ranks} ranks, {dtype_name(nbytes)}", held * ranks * N * nbytes)
    )
    if u.offload:
        items.append(Item(f"FSDP CPU offload: {ranks} ranks x 16 bytes x N / {u.world}", ranks * 16 * N // u.world))
    lazy = u.fsdp and (u.vllm or u.server) and rc.model.init != "random"  # the KL reference is meta-loaded too
    if not lazy:
        items.append(
            Item(f"start-up: {ranks} ranks load the whole model ({dtype_name(u.master)})", ranks * u.master * N)
        )
    export = DTYPE_BYTES[rc.model.dtype]  # gathered in the model's dtype, one tensor at a time, kept by rank 0
    items.append(Item(f"HF export, rank 0: the full state dict gathered ({dtype_name(export)})", export * N))
    return items


def held_snapshots(rc) -> int:
    """Full weight copies the producer holds at once: async, the versions one staleness window spans (a batch
    every ``max(U, sync_every)`` updates); sync, one when two batches share a version (``sync_every > U``)."""
    every = max(rc.sizes.updates_per_step, rc.train.sync_every)
    if rc.train.async_rollout:
        return rc.buffer.max_staleness // every + 1
    return int(rc.train.sync_every > rc.sizes.updates_per_step)
