"""Weight sync and loading under torchrun, the streamed path against the full-copy one: seconds and peak RSS per rank.

    torchrun --nproc_per_node=2 scripts/bench/bench_weight_sync.py MODEL_DIR --load new  # .venv-vllm for the sync part

Loading. ``--load old``: every rank loads the whole checkpoint in fp32, then shards it (the former path);
``--load new``: the model is built on the meta device and each rank reads only its rows of every tensor
(``bapo.learner.fsdp.load_local_shards``). Reported: the peak RSS of the load, and its rise over the
process's RSS before it.

Sync (when vLLM is importable). ``old``: every rank gathers the full state dict
(``fsdp.full_state_dict(rank0_only=False)``), writes it as safetensors and the engine reloads that
folder (the former ``VLLMRollout.load_weights``); ``new``: ``engine.load_weights(StreamedWeights)``,
one parameter gathered and handed to the engine at a time, nothing on disk. Median seconds of
``--repeats`` syncs, and the peak RSS rise during them (``/proc/self/clear_refs`` resets the peak).
Prints one JSON line per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def rss_mb(field: str = "VmRSS") -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--load", choices=("old", "new"), default="new")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-sync", action="store_true")
    args = ap.parse_args()

    from bapo.infra import dist
    from bapo.learner import fsdp
    from bapo.learner.weights import StreamedWeights
    from bapo.modeling import load_model, load_tokenizer

    device = dist.init()
    out: dict = {"rank": dist.rank(), "model": Path(args.model).name, "load": args.load}
    reset_peak()
    before = rss_mb()
    t0 = time.perf_counter()
    model = load_model(args.model, device="meta" if args.load == "new" else "cpu")
    model = fsdp.wrap(model, device=device)
    out |= {
        "load_s": time.perf_counter() - t0,
        "load_peak_mb": rss_mb("VmHWM"),
        "load_rise_mb": rss_mb("VmHWM") - before,
    }
    if not args.no_sync:
        from bapo.engines.vllm import VLLMRollout

        engine = VLLMRollout(args.model, load_tokenizer(args.model), n=1, enforce_eager=True, seed=0)
        folder = Path(tempfile.mkdtemp(prefix="bench-sync-"))

        def old() -> None:
            engine._weights_dir = folder
            engine._reload_from_disk(fsdp.full_state_dict(model, rank0_only=False))
            if engine.tied and engine.on_cpu:
                from bapo.engines.vllm import _repack_lm_head

                engine.llm.collective_rpc(_repack_lm_head)
            engine.llm.reset_prefix_cache()

        def new() -> None:
            engine.load_weights(StreamedWeights(model, device), version=1)

        for name, fn in (("old", old), ("new", new)):
            times, rises = [], []
            for _ in range(args.repeats):
                dist.barrier()
                reset_peak()
                base = rss_mb()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                rises.append(rss_mb("VmHWM") - base)
            out |= {f"sync_{name}_s": statistics.median(times), f"sync_{name}_rise_mb": max(rises)}
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}), flush=True)
    dist.teardown()


if __name__ == "__main__":
    main()
