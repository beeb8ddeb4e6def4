"""The day-one GPU check's staging section (scripts/gpu/gpu_check.py runs it in a process of its own through
gpu_check_worker.py, in a one-rank process group: NCCL on a GPU, gloo on the CPU). It needs torch only, no vLLM:
what ``rollout=vllm_server`` does to a weight sync before a server reads it, on the device.

``staging``: the learner of a 7B-wide stand-in (random weights made on the device, FSDP2 as the loop wraps it)
hands its weights to :func:`bapo.engines.staging.save_weights` twice, as the split placement does:

- sync mode: the streamed FSDP2 weights (``learner.weights()``: each parameter cast to bf16 on its shard, gathered
  on the GPU, fingerprinted there, its bytes copied to the host a chunk at a time and appended to the file);
- async mode: the fp32 host snapshot (``learner.snapshot()``, as ``learner.old_logp=recompute`` keeps it), cast and
  fingerprinted on the GPU a chunk at a time (``device=``), as the engine passes it the rank's GPU.

Both folders go where a server's would (``/dev/shm`` where it exists). The workers' reader
(:class:`bapo.engines.staging.Reader`, on the GPU as a server's workers run it, and on the host) reads the first
back and checks it against its manifest; the two folders must hold the same bytes (the same digest: a cast is
the same on a shard and on the gathered tensor). Timed: each write, the read, and the fingerprint alone over the
same bf16 tensors on the GPU and on the host; from these rates, the cost of a 7B sync (15.2 GB of bf16). The host
memory a sync-mode write adds (peak RSS) shows that no copy of the model is held on the host.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

import torch

from scripts.gpu.gpu_check_scale import (
    gib,
    host_peak_reset,
    host_rss,
    one_rank_group,
    release,
    standin_learner,
    sync,
)

SEVEN_B_BF16 = 2 * 7_615_616_512  # bytes of one staged copy of DeepSeek-R1-Distill-Qwen-7B in bf16


def build(ctx, device: torch.device):
    """The learner of the stand-in's shape (random weights made on ``device``), FSDP2 as the loop builds it."""
    learner, arch, _, _ = standin_learner(ctx, device)
    return learner, arch


def timed(fn, device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def read_back(folder, device: torch.device) -> tuple[float, dict, list[torch.Tensor]]:
    """The workers' reader over ``folder`` on ``device``: (seconds, its checked reply, the tensors it read)."""
    from bapo.engines.staging import Reader

    reader = Reader(folder, device)
    tensors: list[torch.Tensor] = []
    seconds, _ = timed(lambda: tensors.extend(t for _, t in reader), device)
    return seconds, reader.check(), tensors


def fingerprint_rate(tensors: list[torch.Tensor], device: torch.device) -> tuple[float, float]:
    """(seconds, GB/s) of :func:`bapo.engines.staging.fingerprint` over ``tensors`` moved to ``device`` first."""
    from bapo.engines.staging import fingerprint

    there = [t.to(device) for t in tensors]
    fingerprint(there[0])  # warm-up: kernels, allocator
    seconds, _ = timed(lambda: [fingerprint(t) for t in there], device)
    nbytes = sum(t.numel() * t.element_size() for t in there)
    return seconds, nbytes / seconds / 1e9


def staging(ctx) -> dict:
    from bapo.engines.staging import make_root, save_weights

    device = one_rank_group()
    learner, arch = build(ctx, device)
    root = make_root(None, "gpu-check-staging-")
    out: dict[str, Any] = {"arch": arch, "device": str(device), "folder": str(root)}
    try:
        rss0, hwm = host_rss("VmRSS"), host_peak_reset()
        write_s, streamed = timed(lambda: save_weights(learner.weights(), root / "sync", torch.bfloat16), device)
        host_rise = host_rss() - rss0 if hwm and rss0 is not None else None
        snap_s, snap = timed(learner.snapshot, device)  # fp32 on the host, as old_logp=recompute keeps it
        cast_on = device if device.type == "cuda" else None
        async_s, cast = timed(lambda: save_weights(snap, root / "async", torch.bfloat16, device=cast_on), device)
        snap.clear()
        release(device)
        read_s, reply, tensors = read_back(root / "sync", device)
        host_read_s, host_reply, host_tensors = read_back(root / "sync", torch.device("cpu"))
        nbytes = streamed.nbytes
        gpu_fp_s, gpu_rate = fingerprint_rate(tensors, device)
        host_fp_s, host_rate = fingerprint_rate(host_tensors, torch.device("cpu"))
        del tensors, host_tensors
        rates = {"write_sync": nbytes / write_s / 1e9, "write_async": nbytes / async_s / 1e9,
                 "read": nbytes / read_s / 1e9, "fingerprint_device": gpu_rate,
                 "fingerprint_host": host_rate}  # fmt: skip
        out |= {
            "tensors": len(streamed.tensors),
            "file_gib": gib(nbytes),
            "write_sync_s": round(write_s, 3),
            "snapshot_s": round(snap_s, 3),
            "write_async_s": round(async_s, 3),
            "read_s": round(read_s, 3),
            "read_host_s": round(host_read_s, 3),
            "fingerprint_device_s": round(gpu_fp_s, 4),
            "fingerprint_host_s": round(host_fp_s, 4),
            "gb_per_s": {k: round(v, 2) for k, v in rates.items()},
            "sync_host_rise_gib": gib(host_rise),
            "digest": streamed.digest,
            "reply": reply,
            # 7B: 15.2 GB of bf16 written (sync mode: gathered, fingerprinted on the GPU, copied out), read back and
            # fingerprinted by a server's workers on their GPU, at this machine's rates
            "sync_7b_estimate_s": {
                "write": round(SEVEN_B_BF16 / 1e9 / rates["write_sync"], 1),
                "write_async_snapshot": round(SEVEN_B_BF16 / 1e9 / rates["write_async"], 1),
                "read": round(SEVEN_B_BF16 / 1e9 / rates["read"], 1),
                "fingerprint_device": round(SEVEN_B_BF16 / 1e9 / gpu_rate, 2),
                "fingerprint_host": round(SEVEN_B_BF16 / 1e9 / host_rate, 1),
            },
        }
        checks = {
            "read_back_as_written": reply == {"tensors": len(streamed.tensors), "digest": streamed.digest},
            "host_reader_agrees": host_reply == reply,
            "snapshot_cast_on_the_device_equals_the_stream": cast.digest == streamed.digest,
            # a sync-mode write holds one gathered parameter and its chunks on the host, never the model
            "no_host_copy_of_the_model": ctx.dry or host_rise is None or host_rise < 0.5 * nbytes,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out | {"checks": checks}
