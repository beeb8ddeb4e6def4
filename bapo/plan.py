"""A memory plan, read before launching: per-GPU peaks of generation and of the update, host memory per node.

``python train.py experiment=paper_7b --plan [--nproc N] [--gpu-memory GiB] [--host-memory GiB]`` (or
``scripts/gpu/plan.py`` with the same arguments) composes the config as training would, prints the plan and
exits 0 when it fits, 1 when it does not, 2 on a bad config; it starts nothing and writes no run folder.

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

Activation bytes per token are those of a transformers Qwen2 / Llama decoder layer with a flash or sdpa
kernel (no [L, L] score matrix), counted from what autograd saves (compute dtype ``b`` bytes, RMSNorm in
fp32, ``q``/``kv`` the query and key-value widths):

    one layer, all saved:  2 (4H + 4 + bH) + 2bH + b (2q + 2kv) + 4 heads + 4bI
    one layer, checkpointed:  bH (its input)
    one layer's backward temporaries:  2bI + 4H
    the head (final norm, LM head input):  (4H + 4 + bH) + bH

``tests/e2e/test_plan.py`` checks them against peaks measured on CPU (a tiny Qwen2 in fp32). vLLM's own
activations are estimated from its profiling run (``max_num_batched_tokens`` 16384, ``max_num_seqs`` 1024:
vLLM 0.32's offline defaults on 70 GB+ GPUs); its CUDA graphs, the CUDA context and NCCL are the constants
below. A plan fits when its peak is at most :data:`USABLE` of the device's memory (the allocators' fragmentation
takes the rest). Bad input (a GPU of no memory, a zero width) is a one-line ``error:`` and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo.engines.registry import engine_traits
from bapo.infra.checks import ConfigError, require
from bapo.rollout.placement import placement_class

GiB = 2**30
USABLE = 0.95  # of the device's memory: the rest is left to fragmentation
CUDA_CONTEXT_NCCL_GIB = 1.5  # per process: the CUDA context, cuBLAS workspaces, NCCL's communicator buffers
VLLM_CUDA_GRAPHS_GIB = 1.0  # vLLM 0.32 profiles them inside its share (before sizing the KV cache), frees them asleep
VLLM_NON_TORCH_GIB = 0.5  # inside the share: what vLLM's profile counts as non-torch memory
VLLM_BATCHED_TOKENS, VLLM_MAX_SEQS = 16384, 1024
GPUS_PER_NODE = 8
DEFAULT_GPU_GIB = 80.0  # H100 / A100 80GB
# A checkpoint's write rate per node, for the stop's save estimate: a shared file system's sustained write (NFS,
# Lustre, GPFS give 0.5-5 GB/s a client node); measure yours with dd and scale the printed time.
SAVE_GBPS_PER_NODE = 1.0
SLURM_KILL_WAIT_S = 30  # SLURM's default KillWait: SIGTERM, then SIGKILL this much later


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of an architecture (config.json fields and parameter counts)."""

    model_type: str
    params: int
    root_params: int  # outside the decoder layers: embeddings, final norm, an untied LM head
    layer_params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def model_shape(config) -> ModelShape:
    """The shape of a transformers config, its parameters counted on the meta device (nothing allocated)."""
    return _shape(config.to_json_string(use_diff=False))


@functools.lru_cache(maxsize=64)
def _shape(config_json: str) -> ModelShape:
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bapo.learner.fsdp import decoder_layers

    fields = json.loads(config_json)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_layers(model)
    total = sum(p.numel() for p in model.parameters())  # tied parameters once
    per_layer = sum(p.numel() for p in layers[0].parameters())
    heads = config.num_attention_heads
    return ModelShape(
        model_type=config.model_type,
        params=total,
        root_params=total - len(layers) * per_layer,
        layer_params=per_layer,
        layers=len(layers),
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
    )


def layer_activations_per_token(s: ModelShape, b: int) -> int:
    """Bytes autograd saves per token in one decoder layer (module docstring), compute dtype of ``b`` bytes."""
    H, I = s.hidden, s.intermediate
    norms = 2 * (4 * H + 4 + b * H)  # RMSNorm in fp32: its fp32 input, 1 / rms, the normalised output
    inputs = 2 * b * H  # the q/k/v and gate/up projections' shared inputs
    attention = b * (2 * s.q_dim + 2 * s.kv_dim) + 4 * s.heads  # q, k, v, output, log-sum-exp (fp32)
    mlp = 4 * b * I  # gate output, its SiLU, up output, the down projection's input
    return norms + inputs + attention + mlp


def checkpoint_per_token(s: ModelShape, b: int) -> int:
    """Bytes per token a checkpointed decoder layer keeps: its input."""
    return b * s.hidden


def layer_backward_per_token(s: ModelShape, b: int) -> int:
    """Bytes per token of one layer's backward temporaries (the MLP's intermediate gradients, the norm's fp32)."""
    return 2 * b * s.intermediate + 4 * s.hidden


def head_activations_per_token(s: ModelShape, b: int) -> int:
    """Bytes per token the final norm and the LM head keep for the backward."""
    return (4 * s.hidden + 4 + b * s.hidden) + b * s.hidden


def kv_per_token(s: ModelShape, b: int, tp: int) -> int:
    """KV-cache bytes per token on one GPU of a tensor-parallel group (key-value heads split, or replicated)."""
    return 2 * s.layers * max(1, s.kv_heads // tp) * s.head_dim * b


def vllm_activations(s: ModelShape, b: int, tp: int) -> int:
    """vLLM's profiled activation peak: a forward of ``VLLM_BATCHED_TOKENS`` tokens (one layer's transients:
    gate/up output, SiLU, q/k/v, attention output), or sampling ``VLLM_MAX_SEQS`` rows of fp32 logits
    (logits, probabilities, log-probs), whichever is larger."""
    forward = VLLM_BATCHED_TOKENS * (3 * s.intermediate + 3 * s.hidden) * b // tp
    sampler = VLLM_MAX_SEQS * s.vocab * 4 * 3
    return max(forward, sampler)


# ----------------------------------------------------------------------------- the plan


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


def _name(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16", 8: "fp64"}[nbytes]


def learner_state(u: Setup) -> dict[str, Item]:
    """The learner's sharded state on the GPU (none with CPU offload), the KL reference, the per-process constants."""
    N, k, m = u.shape.params, u.shard, u.master
    gpu = 0 if u.offload else 1
    ref = 0
    if u.rc.algo.kl_coef > 0:
        ref = 2 * N // u.world if u.fsdp else u.engine * N
    return {
        "masters": Item(f"learner: {_name(m)} master weights (1/{k})", gpu * m * N // k),
        "grads": Item(f"learner: {_name(m)} gradients (1/{k})", gpu * m * N // k),
        "adam": Item(f"learner: AdamW moments, 2 x {_name(m)} (1/{k})", gpu * 2 * m * N // k),
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
    root = Item(f"learner: {_name(b)} root params, unsharded ({s.root_params / 1e9:.2f} B)", b * s.root_params)
    layer_params = Item(
        f"learner: {_name(b)} params of 2 decoder layers (computed, prefetched)", 2 * b * s.layer_params
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
    chain = Item(f"logits chain: {_name(b)} logits, their gradient, one chunk", peak_bytes(K, s.vocab, logits))
    moments = [Moment("update, at the logits chain's backward", [*state, *unsharded, *acts, chain, *fixed])]

    grad_bytes = b + 4 if b != 4 else 4  # a half-precision gradient is reduce-scattered as an fp32 copy
    layer = (
        [Item("activations: the layer recomputed", layer_activations_per_token(s, b) * K)] if u.checkpointing else []
    )
    layer.append(Item("activations: the layer's backward temporaries", layer_backward_per_token(s, b) * K))
    if u.fsdp:  # unsharded gradients until their reduce-scatter (one process: they are the gradients above)
        layer += [
            Item(f"LM head gradient, {_name(b)}, held to the end of the backward", b * s.vocab * s.hidden),
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
        Item(f"HF engine: weights, {_name(u.engine)}", u.engine * s.params),
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
        items.append(Item(f"servers' staged weights in /dev/shm: {how}, {_name(u.engine)}", copies * u.engine * N))
    held = held_snapshots(rc)
    nbytes = 4 if rc.behaviour.recompute else u.engine
    items.append(
        Item(f"weight snapshots: {held} version(s) x {ranks} ranks, {_name(nbytes)}", held * ranks * N * nbytes)
    )
    if u.offload:
        items.append(Item(f"FSDP CPU offload: {ranks} ranks x 16 bytes x N / {u.world}", ranks * 16 * N // u.world))
    lazy = u.fsdp and (u.vllm or u.server) and rc.model.init != "random"  # the KL reference is meta-loaded too
    if not lazy:
        items.append(Item(f"start-up: {ranks} ranks load the whole model ({_name(u.master)})", ranks * u.master * N))
    export = DTYPE_BYTES[rc.model.dtype]  # gathered in the model's dtype, one tensor at a time, kept by rank 0
    items.append(Item(f"HF export, rank 0: the full state dict gathered ({_name(export)})", export * N))
    return items


def held_snapshots(rc) -> int:
    """Full weight copies the producer holds at once: async, the versions one staleness window spans (a batch
    every ``max(U, sync_every)`` updates); sync, one when two batches share a version (``sync_every > U``)."""
    every = max(rc.sizes.updates_per_step, rc.train.sync_every)
    if rc.train.async_rollout:
        return rc.buffer.max_staleness // every + 1
    return int(rc.train.sync_every > rc.sizes.updates_per_step)


def model_config(model) -> Any:
    """The transformers config of the typed ``model`` group: ``model.arch``, else the local checkpoint's."""
    from bapo.infra.checks import ConfigError
    from bapo.infra.paths import resolve_path
    from bapo.modeling import arch_config

    if model.arch:
        return arch_config(model.arch)
    path = Path(resolve_path(model.name_or_path))
    if (path / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    raise ConfigError(
        f"model.arch: the memory plan needs the model's config.json fields (model.arch, or a local "
        f"model.name_or_path); got model.name_or_path={model.name_or_path} and no model.arch"
    )


# ----------------------------------------------------------------------------- the verdict and the knobs


@dataclass
class Plan:
    """Per-GPU peaks of generation and of the update, host memory per node, and what to turn when it does not fit."""

    setup: Setup
    generation: Moment
    update: list[Moment]
    host: list[Item]
    engine: Engine | None  # vLLM's share; None for the HF engine
    sleep_level: int = 1
    host_limit: int | None = None  # bytes a node's host memory may hold (--host-memory)

    @property
    def limit(self) -> int:
        return int(USABLE * self.setup.device)

    @property
    def update_peak(self) -> Moment:
        return max(self.update, key=lambda m: m.total)

    @property
    def peak(self) -> int:
        return max(self.update_peak.total, self.generation.total)

    @property
    def host_total(self) -> int:
        return sum(i.bytes for i in self.host)

    @property
    def startup_free(self) -> int:
        """GPU memory free when vLLM starts: the learner (built first) holds its masters and the KL reference;
        a server's GPU is its own."""
        if self.setup.server:
            return self.setup.device
        st = learner_state(self.setup)
        return self.setup.device - st["context"].bytes - st["masters"].bytes - st["ref"].bytes

    @property
    def startup_ok(self) -> bool:
        return self.engine is None or self.engine.share <= self.startup_free

    @property
    def fits(self) -> bool:
        host_ok = self.host_limit is None or self.host_total <= self.host_limit
        return self.peak <= self.limit and self.startup_ok and host_ok

    def max_tokens(self) -> int:
        """The largest micro-batch token budget whose update fits (0: none)."""
        lo, hi = 0, 1 << 22
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if max(m.total for m in update_moments(self.setup, mid)) <= self.limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_utilization(self) -> float:
        """The largest ``rollout.gpu_memory_utilization`` (two decimals) that fits generation and start-up."""
        if self.engine is None:
            return 0.0
        rest = self.generation.total - self.engine.share
        room = min(self.limit - rest, self.startup_free)
        return max(0.0, math.floor(room / self.setup.device * 100) / 100)

    def max_hf_rows(self) -> int:
        """The most sequences the HF engine's KV cache may hold beside everything else (0: none)."""
        u = self.setup
        per = u.seq * kv_per_token(u.shape, u.engine, 1)
        kv = next(i for i in self.generation.items if i.what.startswith("HF engine: KV cache"))
        return max(0, (self.limit - (self.generation.total - kv.bytes)) // per)

    def advice(self) -> list[str]:
        """Which knob to turn, with the number to turn it to."""
        u, rc, out = self.setup, self.setup.rc, []
        seq, tokens = u.seq, self.max_tokens()
        if self.update_peak.total > self.limit:
            if tokens >= seq:
                out.append(f"learner.max_tokens_per_micro_batch={tokens} (or lower): the update then fits")
            else:
                out.append(f"no micro-batch holding one {seq}-token sequence fits the update:")
                if not u.fsdp:
                    out.append("  learner=fsdp (sharded state; activation checkpointing and CPU offload come with it)")
                if u.fsdp and not u.checkpointing:
                    out.append("  learner.activation_checkpointing=true")
                if u.fsdp and not u.offload:
                    out.append("  learner.cpu_offload=true (the learner's state to the host)")
                out.append("  or more ranks (--nproc / torchrun --nnodes): the sharded state shrinks as 1/W")
        if self.engine is not None:
            util, r = self.max_utilization(), rc.rollout
            e = self.engine
            need = e.weights + e.own + e.graphs + kv_per_token(u.shape, u.engine, r.tensor_parallel_size) * seq
            if self.generation.total > self.limit or not self.startup_ok:
                if util * u.device >= need:
                    out.append(f"rollout.gpu_memory_utilization={util:.2f} (or lower): generation then fits")
                else:
                    out.append(
                        f"vLLM's weights and one sequence's KV cache need {need / GiB:.1f} GiB: raise "
                        f"rollout.tensor_parallel_size (now {r.tensor_parallel_size})"
                        + ("" if u.offload or u.server else " or set learner.cpu_offload=true")
                    )
            elif self.engine.kv_tokens < seq:
                out.append("vLLM's KV cache holds no full-length sequence: raise rollout.gpu_memory_utilization")
            else:
                kv = vllm_engine(u, util).kv_tokens // seq
                out.append(f"room: rollout.gpu_memory_utilization up to {util:.2f} ({kv} sequences in the KV cache)")
        elif self.generation.total > self.limit and not u.workers:  # the HF engine: weights and its batch's KV
            rows = self.max_hf_rows()
            if rows >= rc.rollout.n:
                out.append(f"rollout.batch_size={rows // rc.rollout.n} (or lower): the HF engine's KV cache then fits")
            else:
                out.append("the HF engine does not fit one prompt's group: rollout=vllm (docs/gpu.md)")
        if self.update_peak.total <= self.limit:
            out.append(f"room: learner.max_tokens_per_micro_batch up to {tokens}")
        if self.host_limit is not None and self.host_total > self.host_limit:
            if self.sleep_level == 1 and u.vllm:
                out.append(
                    "host: rollout.sleep_level=2 (vLLM discards its weights while asleep instead of copying them)"
                )
            if rc.train.async_rollout:
                out.append("host: train.async_rollout=false (no weight snapshots)")
        return out

    def save_bytes(self) -> tuple[int, int]:
        """(bytes a rank writes, bytes a node writes) for one checkpoint: the learner's weights and AdamW moments
        (DCP shards under FSDP, the whole state in one process) and, on rank 0, the weight snapshots the producer
        holds. The stop's save, and every periodic one."""
        u, n = self.setup, self.setup.shape.params
        learner = 3 * u.master * n // u.shard  # masters and the two moments
        snapshots = held_snapshots(u.rc) * u.master * n
        ranks = min(u.world, GPUS_PER_NODE)
        return learner + snapshots, learner * ranks + snapshots

    def save_lines(self) -> list[str]:
        """The stop's save against the launcher's grace and SLURM's default KillWait (``render``)."""
        rank, node = self.save_bytes()
        seconds = node / (SAVE_GBPS_PER_NODE * 1e9)
        launcher = getattr(self.setup.rc, "launcher", None)
        grace = float(launcher.grace_s) if launcher is not None else None
        out = [
            "",
            "stop and save (a signal saves a checkpoint: docs/gpu.md, Stopping)",
            f"  a checkpoint: {rank / GiB:.1f} GiB a rank, {node / GiB:.1f} GiB a node; about {seconds:.0f} s at "
            f"{SAVE_GBPS_PER_NODE:g} GB/s a node (an assumed shared file system: scale by yours)",
        ]
        for name, limit in (("launcher.grace_s", grace), ("SLURM's default KillWait", SLURM_KILL_WAIT_S)):
            if limit is None:
                continue
            ok = seconds + 5 < limit  # a stop reaches its save within seconds
            verdict = "enough" if ok else "TOO SHORT: the save would be SIGKILLed"
            out.append(f"  {name} = {limit:g} s: {verdict}")
        if not all(seconds + 5 < limit for limit in (grace, SLURM_KILL_WAIT_S) if limit is not None):
            need = int(seconds * 2 + 30)
            out.append(
                f"  give the save time: launcher.grace_s={need} (torchrun --shutdown-timeout={need}); under SLURM "
                f"#SBATCH --signal=B:TERM@{need} (or USR1) and a KillWait over {need} s; and bound what a SIGKILL "
                "loses with checkpoint.every_minutes"
            )
        return out

    def render(self, label: str = "") -> str:
        u, s, r, ln = self.setup, self.setup.shape, self.setup.rc.rollout, self.setup.rc.learner
        gib = lambda n: f"{n / GiB:8.2f}"  # noqa: E731
        nodes = -(-(u.world + u.server_gpus) // GPUS_PER_NODE)
        engine = f"{r.engine}, tensor parallel {r.tensor_parallel_size}" if u.vllm or u.server else r.engine
        servers = ""
        if u.server:
            where = f"{u.server_gpus} GPUs of their own" if u.server_gpus else "elsewhere (rollout.url)"
            servers = f"; {u.world} vLLM server(s) on {where}"
        out = [
            f"memory plan: {label or 'the default config'}",
            f"  model {u.rc.model.name_or_path}: {s.model_type}, {s.params / 1e9:.2f} B parameters ({s.layers} "
            f"layers of {s.layer_params / 1e6:.0f} M, root {s.root_params / 1e9:.2f} B), vocabulary {s.vocab:,}",
            f"  {u.world} learner rank(s) on {nodes} node(s){servers}, {u.device / GiB:g} GiB a GPU, "
            f"{self.limit / GiB:.1f} GiB usable; learner={ln.kind} ({_name(u.compute)} compute, {_name(u.master)} "
            f"weights), rollout={engine}",
            f"  micro-batch: {u.tokens:,} tokens; longest sequence {u.seq:,} (prompt {u.prompt:,} + response "
            f"{r.max_new_tokens:,}); activation checkpointing {'on' if u.checkpointing else 'off'}",
            "",
            f"{'per GPU':<70}     GiB",
        ]
        for m in (self.generation, self.update_peak):
            out.append(f"{m.name:<70}{gib(m.total)}")
            out += [f"  {i.what:<68}{gib(i.bytes)}" for i in m.items if i.bytes]
        others = [m for m in self.update if m is not self.update_peak]
        out += [f"{m.name:<70}{gib(m.total)}" for m in others]
        if self.engine is not None:
            e = self.engine
            beside = "a GPU of its own" if u.server else "the learner's masters resident"
            out += [
                "",
                f"vLLM's share {e.share / GiB:.1f} GiB = weights {e.weights / GiB:.1f} + its activations "
                f"{e.own / GiB:.1f} + CUDA graphs {e.graphs / GiB:.1f} + KV cache {e.kv / GiB:.1f} ({e.kv_tokens:,} "
                f"tokens: {e.kv_tokens // u.seq} sequences of {u.seq:,})",
                f"vLLM's start-up check: {e.share / GiB:.1f} GiB requested, {self.startup_free / GiB:.1f} GiB free "
                f"({beside}): {'ok' if self.startup_ok else 'REFUSED, vLLM does not start'}",
            ]
        out += ["", f"{'host memory, per node':<70}{gib(self.host_total)}"]
        out += [f"  {i.what:<68}{gib(i.bytes)}" for i in self.host]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        out += ["", f"{verdict}: per-GPU peak {self.peak / GiB:.2f} GiB of {self.limit / GiB:.2f} GiB usable"]
        if self.host_limit is not None:
            out[-1] += f"; host {self.host_total / GiB:.1f} of {self.host_limit / GiB:.1f} GiB a node"
        out += [f"  {a}" for a in self.advice()]
        out += self.save_lines()
        return "\n".join(out)


def make_plan(rc, *, world: int, gpu_memory_gib: float = DEFAULT_GPU_GIB, host_memory_gib: float | None = None) -> Plan:
    """The memory plan of a typed run config (``bapo.config.build``) on ``world`` GPUs of ``gpu_memory_gib``."""
    u = setup(rc, world=world, gpu_memory_gib=gpu_memory_gib)
    sleep_level = int(getattr(rc.rollout, "sleep_level", 1))
    return Plan(
        setup=u,
        generation=generation(u),
        update=update_moments(u, u.tokens),
        host=host_items(u, sleep_level),
        engine=vllm_engine(u, rc.rollout.gpu_memory_utilization) if u.vllm or u.server else None,
        sleep_level=sleep_level,
        host_limit=None if host_memory_gib is None else int(host_memory_gib * GiB),
    )


def with_offload(rc, world: int, gpu_memory_gib: float) -> Plan | None:
    """The plan of ``rc`` with ``learner.cpu_offload=true``, when that is a change (an FSDP learner not offloaded)."""
    import dataclasses

    if rc.learner.kind != "fsdp" or rc.learner.cpu_offload:
        return None
    offloaded = dataclasses.replace(rc, learner=dataclasses.replace(rc.learner, cpu_offload=True))
    return make_plan(offloaded, world=world, gpu_memory_gib=gpu_memory_gib)


# ----------------------------------------------------------------------------- the command line


def compose(overrides: list[str]):
    """The composed config, as train.py would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from bapo.infra.checks import known_options
    from bapo.infra.paths import ROOT

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="train"), known_options():
        return hydra_compose(config_name="config", overrides=overrides)


@contextlib.contextmanager
def _world_size(world: int):
    """``$WORLD_SIZE`` as torchrun would set it, for the config's checks of what runs under ``world`` ranks."""
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        yield
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def learner_ranks(cfg) -> int:
    """The learner's ranks when neither ``--nproc`` nor ``$WORLD_SIZE`` says: the placement's GPUs, less those its
    launched vLLM servers take (``rollout.gpus``)."""
    r = cfg.rollout
    server_gpus = len([g for g in str(r.get("gpus") or "").split(",") if g.strip()]) if r.get("url") is None else 0
    own = engine_traits(r.engine).gpu_memory == "vllm_own_gpus"
    return max(1, int(cfg.placement.gpus) - (server_gpus if own else 0))


def plan_for(overrides: list[str], *, nproc=None, gpu_memory=None, host_memory=None) -> Plan:
    """The plan of ``python train.py <overrides>`` on ``nproc`` learner ranks (else $WORLD_SIZE, else the
    placement's)."""
    from bapo.config import build

    cfg = compose(overrides)
    world = nproc or int(os.environ.get("WORLD_SIZE") or learner_ranks(cfg))
    with _world_size(world):
        rc = build(cfg, "plan")  # nothing is written: the run folder is only a name here
    if engine_traits(rc.rollout.engine).spans_ranks:  # the launch's rule: a tensor-parallel engine spans whole groups
        from bapo.engines.vllm import check_tensor_parallel

        check_tensor_parallel(rc.rollout.tensor_parallel_size, world)
    gpu = gpu_memory or rc.placement.gpu_memory_gib
    return make_plan(rc, world=world, gpu_memory_gib=gpu, host_memory_gib=host_memory)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_one_gpu(rc, launched: bool | None = None) -> None:
    """``learner=fsdp`` in one process on a GPU machine (no launcher started it: ``launched``, default
    ``$WORLD_SIZE`` set): one rank, one GPU. Refused unless the memory plan says the run fits there, naming the
    smallest change that fits (CPU offload) or the launch that spreads it over the node. Called by the training
    entry once the config is built, before the model loads."""
    launched = "WORLD_SIZE" in os.environ if launched is None else launched
    if rc.learner.kind != "fsdp" or launched or not cuda_available():
        return
    verdict = _one_gpu_verdict(rc)
    require(
        verdict is None,
        "learner.kind",
        f"fsdp in one process trains on one GPU, and {verdict}; or launch it on every GPU of the node: "
        f"`python train.py ...` with launcher.nproc_per_node=auto (the default) or "
        f"`torchrun --standalone --nproc_per_node=<GPUs> train.py ...` (the same overrides), or pick a smaller "
        f"model or placement (python train.py ... --plan prints the memory plan)",
    )


def _one_gpu_verdict(rc) -> str | None:
    """Why the run cannot fit on this machine's first GPU, by the memory plan, and the smallest change that fits
    (None: it fits, or the model's shape is not known before it is loaded)."""
    import torch

    have = torch.cuda.get_device_properties(0).total_memory / 2**30
    try:
        p = make_plan(rc, world=1, gpu_memory_gib=have)
    except ConfigError:
        return None
    if p.fits:
        return None
    s, gib = p.setup.shape, 2**30
    why = f"the memory plan of its {s.params / 1e9:.1f}B parameters needs {p.peak / gib:.0f} GiB a GPU "
    why += f"(cuda:0 has {p.limit / gib:.0f} GiB usable of {have:.0f})"
    offloaded = with_offload(rc, 1, have)
    if offloaded is not None and offloaded.fits:
        why += f": it fits with learner.cpu_offload=true ({offloaded.peak / gib:.0f} GiB a GPU, its state on the host)"
    return why


class _OneLine(argparse.ArgumentParser):
    """Bad arguments are one ``error:`` line and exit status 2, as every entry point's bad input is."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _amount(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number of GiB, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number of GiB, got {text!r}")
        return value

    return parse


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nproc must be a whole number of ranks, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--nproc must be >= 1, got {text!r}")
    return value


def cli(argv: list[str], prog: str = "train.py") -> int:
    """``<prog> <overrides> --plan [--nproc N] [--gpu-memory GiB] [--host-memory GiB]``: print the plan.

    Exit status 0 when it fits, 1 when it does not, 2 for bad input (``error: <Class>: <message>``)."""
    from hydra.errors import HydraException

    from bapo.infra.checks import UserError

    parser = _OneLine(prog=f"{prog} [overrides] --plan", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the memory plan and exit")
    parser.add_argument("--nproc", type=_count, help="learner ranks (default: $WORLD_SIZE, else the placement's)")
    parser.add_argument("--gpu-memory", type=_amount("--gpu-memory"), metavar="GiB",
                        help="memory of one GPU (default: the placement's)")  # fmt: skip
    parser.add_argument("--host-memory", type=_amount("--host-memory"), metavar="GiB",
                        help="host memory of one node, to check")  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}: Hydra's own flags do not combine with --plan")
    try:
        plan = plan_for(overrides, nproc=args.nproc, gpu_memory=args.gpu_memory, host_memory=args.host_memory)
    except (UserError, HydraException) as e:
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(plan.render(" ".join(overrides)))
    return 0 if plan.fits else 1
