"""The memory plan's verdict: per-GPU peaks, whether they fit, which knob to turn, and the printout.

A plan fits when its peak is at most :data:`USABLE` of the device's memory (the allocators' fragmentation
takes the rest), vLLM's share is free when it starts, and the host memory, when given, holds the node's part.
The training entry asks :func:`check_one_gpu` whether one GPU holds a run started in one process.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from bapo.infra.checks import ConfigError, require
from bapo.plan.memory import (
    GPUS_PER_NODE,
    Engine,
    GiB,
    Item,
    Moment,
    Setup,
    dtype_name,
    generation,
    held_snapshots,
    host_items,
    learner_state,
    setup,
    update_moments,
    vllm_engine,
)
from bapo.plan.shape import kv_per_token

USABLE = 0.95  # of the device's memory: the rest is left to fragmentation
DEFAULT_GPU_GIB = 80.0  # H100 / A100 80GB
# A checkpoint's write rate per node, for the stop's save estimate: a shared file system's sustained write (NFS,
# Lustre, GPFS give 0.5-5 GB/s a client node); measure yours with dd and scale the printed time.
SAVE_GBPS_PER_NODE = 1.0
SLURM_KILL_WAIT_S = 30  # SLURM's default KillWait: SIGTERM, then SIGKILL this much later


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
            f"{self.limit / GiB:.1f} GiB usable; learner={ln.kind} ({dtype_name(u.compute)} compute, "
            f"{dtype_name(u.master)} weights), rollout={engine}",
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
