"""GPU check: the scale path and the users' commands on one GPU in under 8 minutes, with nothing to download.

    bash scripts/gpu_check.sh                 # torchrun --standalone --nproc_per_node=1 scripts/gpu_check.py
    python scripts/gpu_check.py --dry-run     # the same code on CPU with tiny shapes (the test runs it)

One JSON summary on stdout (and ``--out``, rewritten after every section, so a run killed at the cap keeps what
it did), opening with ``headline``: MFU and tokens/s, the memory plan against the measured peak, which sections
ran, failed or were skipped and why, and the seconds of each. Exit status 1 when a section failed, 2 when the
machine cannot run the check (no GPU without ``--dry-run``, a package missing).

Sections (``--only`` picks some):

models     every GPU model config (conf/model/*.yaml with a ``model.arch``) built with random weights: the
           parameter count on the meta device, and where it fits a bf16 forward on the GPU (finite logits).
learner    ``bapo.learner.Learner`` with the paper's BAPO objective on an FSDP2-sharded 1.5B shape (NCCL, bf16
           parameters, fp32 gradient reduction): tokens/s and MFU.
rollout    ``bapo.rollout.HFRollout`` on the GPU (bf16): generated tokens/s.
vllm       ``VLLMRollout`` on a random-weight model of the bench shape: tokens/s, a weight sync streamed from
           FSDP2 shards, sleep/wake; skipped and said so where vLLM does not import.
metaload   a stand-in at the 7B's width (hidden 3584, vocabulary 152,064, ``--standin-layers`` layers) written into
           a temporary HF cache under ``deepseek-ai/DeepSeek-R1-Distill-Qwen-7B``, resolved offline by
           ``bapo.modeling.model_path``, meta-loaded by the FSDP learner as the loop builds it; shards and a
           forward pass against an eager load (``scripts/gpu_check_scale.py``).
budget     that learner's update with micro-batches of exactly the placement's token budget (gpu_node's 16,384,
           gpu_node_h200's 32,768), bf16, activation checkpointing: ``torch.cuda.max_memory_allocated`` beside
           ``bapo.plan``'s update peak for the same run config, and their ratio.
qwen7b     ``python train.py algo=bapo model=qwen7b`` at toy size against a stand-in under Qwen/Qwen2.5-7B-Instruct,
           on this GPU without torchrun (a one-rank group, NCCL, bf16) (``scripts/gpu_check_commands.py``).
world2     two processes: ``scripts/gpu_check_worker.py`` (meta-load, update, streamed sync into each rank's
           engine) and ``train.py experiment=paper_7b`` through a checkpoint, a resume and the export, under
           ``torchrun --nproc_per_node=2``: on two GPUs (NCCL) where there are two, else on the CPU (gloo), beside
           the GPU sections.

Each section has a time budget (:data:`SECTIONS`, seconds on one H200); one that no longer fits before the cap
(``--time-limit``, gpu_check.sh's timeout) is skipped and says so, and the summary is printed before the cap.

FLOPs (MFU's numerator). Per forward pass over sequences of lengths L_i:
    2 * N * sum(L_i)  +  2 * n_layers * d_attn * sum(L_i^2)
N counts the weights of every matmul (all nn.Linear, lm_head included, embeddings excluded:
a lookup is not a matmul); the second term is causal attention (QK^T and AV, 2 FLOPs per
multiply-add, half of the L x L scores; PaLM's convention counts the full square and reports
higher). A training pass is 3 forwards (backward = 2x forward, no activation recomputation
counted). BAPO's paper scope needs the whole mini-batch's ratios before the first backward, so
the learner makes one extra no-grad forward per update (``prepass`` in the summary), and it is
counted: the update's FLOPs are 4 forwards. MFU = FLOPs / seconds / (peak x world size).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from scripts import gpu_check_commands as commands  # noqa: E402
from scripts import gpu_check_scale as scale  # noqa: E402
from scripts.gpu_check_scale import forward_flops, matmul_params, sync, synthetic_batch  # noqa: E402

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets.
# The longest matching key wins, so "H100 PCIe" is not read as "H100".
PEAK_BF16_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "GH200": 989.0,
    "H100": 989.0,  # SXM (the device name reads "H100 80GB HBM3")
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
}
# What --dry-run shrinks every architecture to (same model type, norms, rope, tying).
TINY_ARCH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    bos_token_id=510,
    eos_token_id=511,
)
# Each section and the seconds it is given on one H200 (world2 runs on the CPU beside the others there).
SECTIONS = {"models": 45, "learner": 30, "rollout": 20, "vllm": 60, "metaload": 75, "budget": 45, "qwen7b": 90,
            "world2": 240}  # fmt: skip
SUMMARY_S = 10  # kept free before the cap to write the summary
REQUIRED = ("hydra", "omegaconf", "transformers", "safetensors", "huggingface_hub", "tokenizers", "math_verify", "tqdm")


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    hits = [k for k in PEAK_BF16_TFLOPS if k.lower() in device_name.lower()]
    return PEAK_BF16_TFLOPS[max(hits, key=len)] if hits else None


def model_configs() -> dict[str, dict]:
    """Every model config that carries an architecture, composed by Hydra the way train.py does."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    out = {}
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
            if "arch:" not in path.read_text():
                continue
            cfg = compose(config_name="config", overrides=[f"model={path.stem}"])
            model = OmegaConf.to_container(cfg.model, resolve=True)
            if model.get("arch"):
                out[path.stem] = model
    return out


def run_config(*overrides: str):
    """The typed config train.py would build with ``overrides`` (bapo.config.build)."""
    from hydra import compose, initialize_config_dir

    from bapo.config import build

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="config", overrides=list(overrides))
    return build(cfg, tempfile.gettempdir())


def shrink(arch: dict) -> dict:
    return {**arch, **TINY_ARCH}


def init_group(device: torch.device) -> str:
    """A one-process group: torchrun's environment when launched by it, else an in-process store."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:  # plain `python scripts/gpu_check.py`: an in-process store is enough for a world of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return backend


# ----------------------------------------------------------------------------- checks


def check_models(configs: dict[str, dict], device: torch.device, dry: bool) -> dict:
    """models: parameter counts of the real shapes (meta device) and a random-weight forward of each."""
    from bapo.modeling import load_model

    out: dict[str, Any] = {}
    seen: dict[str, str] = {}  # an alias (model=qwen7b is model=qwen2.5_7b) is built once
    for name, m in configs.items():
        t0 = time.perf_counter()
        row: dict[str, Any] = {"name_or_path": m["name_or_path"]}
        key = json.dumps([m["name_or_path"], m["arch"]], sort_keys=True)
        if key in seen:
            first = out[seen[key]]
            out[name] = row | {"params": first["params"], "forward": f"as {seen[key]}", "same_as": seen[key]}
            continue
        seen[key] = name
        meta = load_model("", init="random", arch=m["arch"], dtype="bfloat16", device="meta")
        row["params"] = sum(p.numel() for p in meta.parameters())
        del meta
        arch = shrink(m["arch"]) if dry else m["arch"]
        dtype = "float32" if dry else "bfloat16"
        need = (4 if dry else 2) * row["params"] * 1.1
        if device.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(device)[0]:
            row["forward"] = f"skipped: needs {need / 2**30:.0f} GiB"
        else:
            model = load_model("", init="random", arch=arch, dtype=dtype, device=device).eval()
            ids = torch.randint(0, arch["vocab_size"], (2, 64), device=device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits  # [2, 64, V]
            row["forward"] = "ok" if bool(torch.isfinite(logits).all()) else "non-finite logits"
            row["logits_shape"] = list(logits.shape)
            del model, logits
            gc.collect()  # a transformers model holds reference cycles: freed by the collector, not by del
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        out[name] = row
    fine = ("ok", "skipped", "as ")
    return {"ok": all(r["forward"].startswith(fine) for r in out.values()), **out}


def check_learner(arch: dict, device: torch.device, args) -> dict:
    """learner: the real Learner on an FSDP2-sharded model; tokens/s and MFU."""
    from bapo.algos import build_objective
    from bapo.learner import Learner
    from bapo.modeling import load_model

    torch.manual_seed(0)
    model = load_model("", init="random", arch=arch, dtype="float32", device=device)  # fp32 master weights
    n_matmul = matmul_params(model)
    rc = run_config("algo=bapo", "learner=fsdp", "learner.lr=1e-6", f"learner.micro_batch_size={args.micro_batch}",
                    "learner.packing=false", "logger=none")  # fmt: skip
    # the learner shards the model itself (its FSDP2 strategy: every decoder layer, then the root)
    objective = build_objective(rc.algo)
    learner = Learner(model, rc.learner, objective=objective, pad_id=0, max_response_len=args.response_len)
    model = learner.model
    p = next(model.parameters())
    fsdp = {
        "sharded": type(p).__name__ == "DTensor",
        "param_dtype": "bfloat16" if device.type == "cuda" else "float32",
        "reduce_dtype": "float32",
        "units": len(model.model.layers) + 1,
    }
    before = next(model.parameters()).detach().full_tensor().clone()
    rows = args.micro_batch * args.micro_batches
    lengths = [args.prompt_len + args.response_len] * rows
    flops = forward_flops(n_matmul, arch, lengths) * (3 + int(learner.objective.prepass))
    times, metrics = [], {}
    for step in range(args.warmup + args.updates):
        batch = synthetic_batch(arch["vocab_size"], rows, args.prompt_len, args.response_len, seed=step)
        sync(device)
        t0 = time.perf_counter()
        metrics = learner.update(batch)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    changed = float((next(model.parameters()).detach().full_tensor() - before).abs().max())
    sec = sum(times) / len(times)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(name, args.peak_tflops)
    achieved = flops / sec / 1e12
    out = {
        **fsdp,
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "matmul_params": n_matmul,
        "tokens_per_update": sum(lengths),
        "micro_batches": args.micro_batches,
        "micro_batch_rows": args.micro_batch,
        "prepass": learner.objective.prepass,
        "seconds_per_update": round(sec, 4),
        "tokens_per_s": round(sum(lengths) / sec, 1),
        "tflops_per_s": round(achieved, 2),
        "peak_tflops": peak,
        "mfu": None if peak is None or device.type != "cuda" else round(achieved / (peak * dist.get_world_size()), 4),
        "loss": metrics.get("learner/loss"),
        "grad_norm": metrics.get("learner/grad_norm"),
        "weights_changed": changed,
        "ok": bool(math.isfinite(metrics.get("learner/grad_norm", math.nan)) and changed > 0),
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del learner, model
    return out


class StubTokenizer:
    """What HFRollout needs from a tokenizer, for random-weight models with no tokenizer files."""

    def __init__(self, eos_token_id: int):
        self.eos_token_id = self.pad_token_id = eos_token_id

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def check_rollout(arch: dict, device: torch.device, args) -> dict:
    """rollout: HF generate with the KV cache on the device (a random model seldom samples EOS: rows run full)."""
    from bapo.modeling import load_model
    from bapo.rollout import HFRollout
    from bapo.samples import Problem, Prompt

    torch.manual_seed(0)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model = load_model("", init="random", arch=arch, dtype=dtype, device=device)
    n = args.rollout_n
    engine = HFRollout(
        model,
        StubTokenizer(arch["eos_token_id"]),
        n=n,
        temperature=1.0,
        max_new_tokens=args.rollout_tokens,
        batch_size=args.rollout_prompts * n,
    )
    g = torch.Generator().manual_seed(0)

    def prompts(k: int) -> list[Prompt]:
        rows = torch.randint(0, arch["vocab_size"] - 2, (k, args.prompt_len), generator=g).tolist()
        return [Prompt(Problem(str(i), "", ""), "", tuple(r)) for i, r in enumerate(rows)]

    engine.max_new_tokens = 4
    engine.generate(prompts(2))  # warm-up: kernels, allocator
    engine.max_new_tokens = args.rollout_tokens
    sync(device)
    t0 = time.perf_counter()
    samples = engine.generate(prompts(args.rollout_prompts))
    sync(device)
    sec = time.perf_counter() - t0
    tokens = sum(len(s.response_ids) for s in samples)
    logp_ok = all(math.isfinite(x) and x <= 1e-6 for s in samples for x in s.logp)
    out = {
        "dtype": dtype,
        "sequences": len(samples),
        "new_tokens": tokens,
        "seconds": round(sec, 3),
        "tokens_per_s": round(tokens / sec, 1),
        "ok": bool(len(samples) == args.rollout_prompts * n and tokens > 0 and logp_ok),
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del engine, model
    return out


def check_vllm(arch: dict, device: torch.device, args) -> dict:
    """vllm: generation, a streamed weight sync from FSDP2 shards, sleep/wake (GPU); skipped without vLLM."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # absent, or a broken install (a torchvision built for another torch)
        return {"ok": True, "skipped": f"vLLM not importable ({type(e).__name__}: {e}); the other checks ran"}
    from bapo.learner import fsdp
    from bapo.learner.strategy import StreamedWeights
    from bapo.modeling import load_model
    from bapo.rollout.vllm import VLLMRollout
    from bapo.samples import Problem, Prompt

    torch.manual_seed(0)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    if device.type == "cpu":  # vLLM's CPU attention has no kernel for the dry run's head_dim 16
        arch = arch | {"num_attention_heads": 2, "num_key_value_heads": 2}
    init_group(device)
    with tempfile.TemporaryDirectory(prefix="gpu_check-vllm-") as tmp:
        load_model("", init="random", arch=arch, dtype=dtype, device="cpu").save_pretrained(tmp)
        n = args.rollout_n
        engine = VLLMRollout(
            tmp, StubTokenizer(arch["eos_token_id"]), n=n, temperature=1.0, max_new_tokens=args.rollout_tokens,
            dtype=dtype, seed=0, enforce_eager=args.dry_run, gpu_memory_utilization=0.4,
            enable_sleep_mode=device.type == "cuda", skip_tokenizer_init=True, max_model_len=arch.get(
                "max_position_embeddings", args.prompt_len + args.rollout_tokens),
        )  # fmt: skip
        try:
            g = torch.Generator().manual_seed(0)
            rows = torch.randint(
                0, arch["vocab_size"] - 2, (args.rollout_prompts, args.prompt_len), generator=g
            ).tolist()
            prompts = [Prompt(Problem(str(i), "", ""), "", tuple(r)) for i, r in enumerate(rows)]
            engine.generate(prompts[:2], n=1)  # warm-up
            sync(device)
            t0 = time.perf_counter()
            samples = engine.generate(prompts)
            sync(device)
            sec = time.perf_counter() - t0
            tokens = sum(len(s.response_ids) for s in samples)
            policy = fsdp.wrap(load_model(tmp, dtype="float32"), device=device)  # fp32 master shards, like the learner
            engine.sleep()  # as during the learner's update (a no-op on CPU)
            sync(device)
            t0 = time.perf_counter()
            engine.load_weights(StreamedWeights(policy, device), version=1)
            sync(device)
            sync_s = time.perf_counter() - t0
            again = engine.generate(prompts[:2], n=1)
            logp_ok = all(math.isfinite(x) and x <= 1e-6 for s in samples + again for x in s.logp)
            out = {
                "dtype": dtype,
                "sequences": len(samples),
                "new_tokens": tokens,
                "seconds": round(sec, 3),
                "tokens_per_s": round(tokens / sec, 1),
                "sync_s": round(sync_s, 3),
                "sleep_mode": engine.sleep_mode,
                "ok": bool(
                    len(samples) == args.rollout_prompts * n and tokens > 0 and logp_ok and again[0].version == 1
                ),
            }
        finally:
            engine.close()  # before the process group goes (vLLM tears its groups down on shutdown)
    return out


# ----------------------------------------------------------------------------- main


def status(summary: dict, name: str) -> str:
    """ "ok", "skipped: why", or "FAILED: the error's first line" for a section of the summary."""
    sec = summary.get(name)
    if sec is None:
        return "not run"
    if sec.get("skipped"):
        return f"skipped: {sec['skipped']}"
    if sec.get("ok"):
        return "ok"
    if sec.get("error"):
        return f"FAILED: {str(sec['error']).splitlines()[0]}"
    return "FAILED" + (f": {', '.join(sec['failed_checks'])}" if sec.get("failed_checks") else "")


def headline(summary: dict) -> dict:
    """The figures a reader wants first, pulled from the sections that ran (None where one did not)."""

    def get(section: str, key: str):
        return summary.get(section, {}).get(key)

    budgets = {t: r for t, r in (get("budget", "budgets") or {}).items() if "skipped" not in r}
    first = next(iter(budgets.values()), {})
    peak = summary.get("peak_tflops")
    tflops = first.get("tflops_per_s")
    world2 = summary.get("world2", {})
    return {
        "mfu": get("learner", "mfu"),
        "learner_tokens_per_s": get("learner", "tokens_per_s"),
        "budget_tokens_per_s": first.get("tokens_per_s"),
        "budget_mfu": round(tflops / peak, 4) if tflops and peak and not summary.get("dry_run") else None,
        "plan_vs_measured": {
            t: {k: r.get(k) for k in ("measured_peak_gib", "plan_torch_gib", "measured_over_plan", "within_plan")}
            for t, r in budgets.items()
        },
        "hf_rollout_tokens_per_s": get("rollout", "tokens_per_s"),
        "vllm_tokens_per_s": get("vllm", "tokens_per_s"),
        "vllm_sync_s": get("vllm", "sync_s"),
        "world2": world2.get("variant") and f"{world2['variant']} ({world2.get('why')})",
        "sections": {name: status(summary, name) for name in SECTIONS if name in summary},
        "seconds": {
            name: summary[name].get("background_s", summary[name].get("seconds"))
            for name in SECTIONS
            if name in summary
        },  # fmt: skip
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes, few steps: check the script itself")
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections")
    p.add_argument("--bench-model", default="qwen2.5_1.5b", help="model config whose shape the learner/rollout use")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of one GPU (overrides the table)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=1792)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch (each prompt+response long)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per update (gradient accumulation)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--updates", type=int, default=4, help="timed optimizer updates")
    p.add_argument("--rollout-prompts", type=int, default=32)
    p.add_argument("--rollout-n", type=int, default=4)
    p.add_argument("--rollout-tokens", type=int, default=384)
    p.add_argument("--standin-layers", type=int, default=2, help="decoder layers of the 7B-wide stand-in")
    p.add_argument("--budgets", type=int, nargs="+", default=[16384, 32768],
                   help="tokens per micro-batch of the budget section (gpu_node's, gpu_node_h200's)")  # fmt: skip
    p.add_argument("--time-limit", type=float, help="seconds to the cap (default: $GPU_CHECK_TIMEOUT, else 480; "
                   "an hour for --dry-run, which checks the script, not the machine's speed)")  # fmt: skip
    p.add_argument("--scratch", type=Path, default=None, help="folder for the stand-ins and runs (default: a temp dir)")
    p.add_argument("--keep-scratch", action="store_true", help="keep the stand-ins and run folders afterwards")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    if args.time_limit is None:
        args.time_limit = 3600.0 if args.dry_run else float(os.environ.get("GPU_CHECK_TIMEOUT", 480))
    if args.dry_run:  # seconds on two CPU cores
        args.prompt_len, args.response_len, args.micro_batch, args.micro_batches = 8, 24, 2, 2
        args.warmup, args.updates = 1, 1
        args.rollout_prompts, args.rollout_n, args.rollout_tokens = 2, 2, 8
        args.budgets = [512, 1024]
    return args


def preflight() -> list[str]:
    """The packages the check needs that this Python does not have."""
    return [m for m in REQUIRED if importlib.util.find_spec(m) is None]


class Sections:
    """Runs the sections in order, each against the cap: timed, recorded, written out as it goes."""

    def __init__(self, summary: dict, args, t0: float):
        self.summary, self.args = summary, args
        self.deadline = t0 + args.time_limit - SUMMARY_S

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def run(self, name: str, fn, device: torch.device, needs: float | None = None) -> None:
        budget = SECTIONS[name] / (10 if self.args.dry_run else 1) if needs is None else needs
        if self.left() < budget:
            self.record(name, {"ok": True, "skipped": f"{self.left():.0f} s left before the cap, it needs ~{budget} s"})
            return
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # record and go on: one summary with every section's outcome
            out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        self.record(name, out)
        gc.collect()  # what a section left in reference cycles (transformers models) goes before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    def record(self, name: str, out: dict) -> None:
        self.summary[name] = out
        seconds = out.get("background_s", out.get("seconds", 0))
        print(f"gpu_check: {name}: {status(self.summary, name)} ({seconds} s)", file=sys.stderr)
        if self.args.out:
            self.args.out.write_text(json.dumps(self.summary, indent=2) + "\n")


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    if args.dry_run:  # the CPU even where there is a GPU: every rank and child sees none
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    missing = preflight()
    if missing or (not args.dry_run and not torch.cuda.is_available()):
        why = f"missing Python packages: {missing}" if missing else "no CUDA device; --dry-run checks the script on CPU"
        print(json.dumps({"ok": False, "error": why}), file=sys.stderr)
        return 2
    if args.dry_run:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.scratch))
    try:
        return run(args, device, scratch, t_start)
    finally:
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def run(args, device: torch.device, scratch: Path, t_start: float) -> int:
    """Every wanted section, then the summary; 0 when all passed, else 1."""
    wanted = [s for s in SECTIONS if s in set(args.only or SECTIONS)]
    scale.serve_hub_cache(scratch / "hub")  # this process serves the stand-ins only: nothing else, nothing downloaded
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    summary: dict[str, Any] = {
        "device": name,
        "gpus": torch.cuda.device_count(),
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": importlib.metadata.version("transformers"),
        "vllm_installed": commands.has("vllm"),
        "flash_attn_installed": commands.has("flash_attn"),
        "peak_tflops": peak_tflops(name, args.peak_tflops),
        "scratch": str(scratch),
    }
    sections = Sections(summary, args, t_start)
    configs = model_configs()
    bench = shrink(configs[args.bench_model]["arch"]) if args.dry_run else configs[args.bench_model]["arch"]
    summary["bench_model"] = args.bench_model
    summary["backend"] = init_group(device)
    world2 = background = None
    if "world2" in wanted:
        world2 = commands.World2(scratch / "world2", gpus=summary["gpus"], deadline=sections.deadline)
        if not world2.nccl:  # on the CPU: beside the GPU sections (its stand-in written on this thread first)
            background = Background(world2.run, before=world2.prepare)
    sc = scale.Scale(args, device, scratch, run_config)
    checks = {
        "models": lambda: check_models(configs, device, args.dry_run),
        "learner": lambda: check_learner(bench, device, args),
        "rollout": lambda: check_rollout(bench, device, args),
        "vllm": lambda: check_vllm(bench, device, args),
        "metaload": sc.metaload,
        "budget": sc.budget,
        "qwen7b": lambda: qwen7b(sc, scratch, device, sections.deadline),
        "world2": lambda: background.result(sections.left()) if background else world2.prepare() or world2.run(),
    }
    for section in wanted:  # world2 on its thread is only waited for: it needs no time of its own
        sections.run(section, checks[section], device, needs=0 if section == "world2" and background else None)
    if dist.is_initialized():
        dist.destroy_process_group()
    failed = [s for s in wanted if not summary[s]["ok"]]
    summary = {"headline": headline(summary)} | summary
    summary |= {"failed": failed, "ok": not failed, "seconds": round(time.perf_counter() - t_start, 1)}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if not failed else 1


def qwen7b(sc: scale.Scale, scratch: Path, device: torch.device, deadline: float) -> dict:
    """The command at toy size on this device, and what the memory plan says of it at its real size here (one
    GPU: ``bapo.config`` refuses at start-up a run whose plan does not fit)."""
    from bapo.plan import GiB, plan_for

    sc.release()  # the GPU to the child process
    out = commands.check_qwen7b(scratch / "qwen7b", cuda=device.type == "cuda", deadline=deadline)
    memory = torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else None
    p = plan_for(commands.QWEN7B, nproc=1, gpu_memory=memory)  # as documented: vLLM, whatever is installed here
    out["real_size_plan"] = {"gpu_memory_gib": round(p.setup.device / GiB, 1), "fits": p.fits,
                             "peak_gib": round(p.peak / GiB, 1), "advice": p.advice()}  # fmt: skip
    return out


class Background:
    """``fn()`` on a thread, after ``before()`` on the caller's; :meth:`result` waits for it (an exception of either
    is the section's error)."""

    def __init__(self, fn, before=None):
        self._out: dict | None = None
        self._t0 = time.perf_counter()
        try:
            if before is not None:
                before()
        except Exception as e:
            self._out = self._failed(e)
            return
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _failed(self, e: Exception) -> dict:
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        return out | {"background_s": round(time.perf_counter() - self._t0, 1)}

    def _run(self, fn) -> None:
        try:
            self._out = fn() | {"background_s": round(time.perf_counter() - self._t0, 1)}
        except Exception as e:
            self._out = self._failed(e)

    def result(self, timeout: float) -> dict:
        t0 = time.perf_counter()
        if self._out is None:
            self._thread.join(max(0.0, timeout))
        if self._out is None:
            return {"ok": False, "error": f"still running at the cap ({timeout:.0f} s waited)"}
        return self._out | {"waited_s": round(time.perf_counter() - t0, 1)}


if __name__ == "__main__":
    sys.exit(main())
