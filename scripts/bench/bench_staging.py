"""Staging a weight sync (``bapo.engines.staging.save_weights``) against the plain cast plus safetensors' ``save_file``
of the same tensors, in one process.

    python scripts/bench/bench_staging.py [--gib 1.2] [--dir /dev/shm] [--rounds 3] [--threads 1]

An fp32 host snapshot, as the asynchronous split placement hands its server under ``learner.old_logp=recompute``:
one decoder layer of the 7B's width (hidden 3584, intermediate 18,944: 233 M parameters) plus rows of its
embedding, about ``--gib`` GiB in all. Variants, timed once a round each, in turn (medians over ``--rounds``):

- ``plain``: ``{k: v.to(bf16)}`` then ``safetensors.torch.save_file`` into the folder: the floor, no fingerprint;
- ``save_weights``: the same bf16 file and its manifest, every tensor fingerprinted where it was cast;
- ``read``: the server's workers' side on a host (``Reader``): the file read back, each tensor fingerprinted;
- ``fingerprint``: the fingerprint alone over the bf16 tensors already in memory (the host's rate).

Printed: each variant's seconds and GB/s of bf16, the ratio ``save_weights / plain`` (the goal: at most 1.3), and
the allocations each write holds at its peak (torch's profiler, one extra untimed pass: the plain write holds the
bf16 copy of the snapshot, a streamed one its chunk buffers). One torch thread by default, as a rank under a
launcher (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from scripts.bench.harness import medians, parser, start, timed  # noqa: E402

HIDDEN, INTER, KV = 3584, 18944, 512  # conf/model/r1_distill_qwen_7b.yaml: a decoder layer's matrices
GB = 1e9


def snapshot(gib: float) -> dict[str, torch.Tensor]:
    """One 7B-wide decoder layer's fp32 tensors, then embedding rows up to ``gib`` GiB."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "self_attn.q_proj.weight": (HIDDEN, HIDDEN), "self_attn.q_proj.bias": (HIDDEN,),
        "self_attn.k_proj.weight": (KV, HIDDEN), "self_attn.k_proj.bias": (KV,),
        "self_attn.v_proj.weight": (KV, HIDDEN), "self_attn.v_proj.bias": (KV,),
        "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (INTER, HIDDEN), "mlp.up_proj.weight": (INTER, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTER),
        "input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,),
    }  # fmt: skip
    out = {f"model.layers.0.{k}": torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    have = sum(t.numel() for t in out.values()) * 4
    rows = max(0, int((gib * 2**30 - have) / (4 * HIDDEN)))
    out["model.embed_tokens.weight"] = torch.randn(rows, HIDDEN, generator=g) * 0.02
    return out


def plain(snap: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in snap.items()}, str(folder / "model.safetensors"))


def staged(snap: dict[str, torch.Tensor], folder: Path) -> None:
    from bapo.engines.staging import save_weights

    save_weights(snap, folder, torch.bfloat16)


def read(folder: Path) -> None:
    from bapo.engines.staging import Reader

    reader = Reader(folder)
    for _ in reader:
        pass
    reader.check()


def fingerprints(tensors: dict[str, torch.Tensor]) -> None:
    from bapo.engines.staging import fingerprint

    for t in tensors.values():
        fingerprint(t)


def held(fn) -> int:
    """Bytes of torch's allocations alive at the peak of ``fn()`` over those alive before (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gib", type=float, default=1.2, help="fp32 snapshot size in GiB (the goal is stated for >= 1)")
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None, help="where to write")
    args = start(ap)
    snap = snapshot(args.gib)
    fp32 = sum(t.numel() for t in snap.values()) * 4
    bf16 = {k: v.to(torch.bfloat16) for k, v in snap.items()}
    root = Path(tempfile.mkdtemp(prefix="bench-staging-", dir=args.dir))
    print(f"snapshot: {len(snap)} fp32 tensors, {fp32 / 2**30:.2f} GiB ({fp32 / 2 / GB:.2f} GB of bf16 to write) "
          f"into {root}, {args.threads} torch thread(s)")  # fmt: skip
    runs: dict[str, list[float]] = {"plain": [], "save_weights": [], "read": [], "fingerprint": []}
    try:
        for _ in range(args.rounds):
            for name, fn in (("plain", lambda: plain(snap, root / "plain")),
                             ("save_weights", lambda: staged(snap, root / "staged")),
                             ("read", lambda: read(root / "staged")),
                             ("fingerprint", lambda: fingerprints(bf16))):  # fmt: skip
                seconds, _ = timed(fn)
                runs[name].append(seconds)
            shutil.rmtree(root / "plain")
        med = medians(runs)
        for name, s in med.items():
            print(f"{name:>13}: {s:6.3f} s  ({fp32 / 2 / GB / s:5.2f} GB/s of bf16)  rounds {runs[name]}")
        ratio = med["save_weights"] / med["plain"]
        print(f"save_weights / plain: {ratio:.2f} (goal: at most 1.3)")
        shutil.rmtree(root / "staged")
        peak_plain = held(lambda: plain(snap, root / "plain"))
        peak_staged = held(lambda: staged(snap, root / "staged"))
        print(f"held at the peak: plain {peak_plain / 2**20:.0f} MiB, save_weights {peak_staged / 2**20:.0f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
