"""GPU check: the scale path on one GPU in a few minutes, with nothing to download.

    bash scripts/gpu_check.sh                 # torchrun --standalone --nproc_per_node=1 scripts/gpu_check.py
    python scripts/gpu_check.py --dry-run     # the same code on CPU with tiny shapes (seconds; the test runs it)

Six checks, each recorded in one JSON summary on stdout (and ``--out``), which opens with the
headline figures (``headline``: MFU, the learner's, HF rollout's and vLLM's tokens/s, vLLM's
weight-sync seconds):

a. models: every GPU model config (conf/model/*.yaml with a ``model.arch``) is built with random
   weights from its config.json fields: the parameter count on the meta device, then, where it
   fits in memory, the bf16 model on the GPU and one forward pass (finite logits).
b. fsdp: ``fully_shard`` on every decoder layer and the root, in a one-process group (NCCL on a
   GPU, gloo on CPU), mixed precision bf16 parameters with fp32 gradient reduction (fp32 on CPU).
c. learner: ``bapo.learner.Learner`` with the paper's BAPO objective (conf/algo/bapo.yaml) on the
   sharded 1.5B-shaped model: tokens/s and MFU against the GPU's dense bf16 peak (a table keyed
   by ``torch.cuda.get_device_name()``, or ``--peak-tflops``).
d. rollout: ``bapo.rollout.HFRollout`` on the GPU (bf16): generated tokens/s.
e. loop: ``python train.py model=tiny learner.device=cuda train.steps=3 debug=smoke`` as a subprocess.
f. vllm: ``bapo.rollout.vllm.VLLMRollout`` on a random-weight model of the bench shape saved to a
   temporary folder: generated tokens/s, then the weights of an FSDP2-sharded copy streamed into
   the engine (``StreamedWeights``, one parameter gathered at a time: the training path's sync,
   seconds in ``sync_s``), and on a GPU a sleep/wake cycle before generating again. Where vLLM is
   not importable the check passes with ``skipped`` saying so, and the other checks still run.

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
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

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
LOOP_METRICS = ("eval/accuracy", "learner/loss", "learner/grad_norm", "policy/version", "time/step_s")
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME")
TORCHRUN_ENV += ("ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


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


def matmul_params(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def forward_flops(n_matmul: int, arch: dict, lengths: list[int]) -> float:
    d_attn = arch["hidden_size"]  # num_attention_heads x head_dim for Qwen2
    return 2.0 * n_matmul * sum(lengths) + 2.0 * arch["num_hidden_layers"] * d_attn * sum(n * n for n in lengths)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    """(a) Parameter counts of the real shapes (meta device) and a random-weight forward of each."""
    from bapo.modeling import load_model

    out: dict[str, Any] = {}
    for name, m in configs.items():
        t0 = time.perf_counter()
        row: dict[str, Any] = {"name_or_path": m["name_or_path"]}
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
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        out[name] = row
    return {"ok": all(r["forward"] == "ok" or r["forward"].startswith("skipped") for r in out.values()), **out}


def synthetic_batch(arch: dict, rows: int, prompt_len: int, response_len: int, seed: int):
    """Full-length rows (no padding): random prompt+response ids, one advantage per sequence."""
    from bapo.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    L = prompt_len + response_len
    ids = torch.randint(0, arch["vocab_size"], (rows, L), generator=g)
    mask = torch.zeros(rows, L - 1)
    mask[:, prompt_len - 1 :] = 1.0  # logits at t predict token t+1
    old_logp = -math.log(arch["vocab_size"]) + 0.1 * torch.randn(rows, L - 1, generator=g)
    adv = torch.where(torch.rand(rows, 1, generator=g) < 0.5, -1.0, 1.0).expand(rows, L - 1).clone()
    return TrainBatch(ids, torch.ones_like(ids), mask, old_logp, adv, torch.zeros(rows, dtype=torch.long))


def check_learner(arch: dict, device: torch.device, args) -> dict:
    """(b) + (c): the real Learner on an FSDP2-sharded model; tokens/s and MFU."""
    from bapo.learner import Learner
    from bapo.loop import make_objective
    from bapo.modeling import load_model

    torch.manual_seed(0)
    model = load_model("", init="random", arch=arch, dtype="float32", device=device)  # fp32 master weights
    n_matmul = matmul_params(model)
    rc = run_config("algo=bapo", "learner=fsdp", "learner.lr=1e-6", f"learner.micro_batch_size={args.micro_batch}",
                    "learner.packing=false", "logger=none")  # fmt: skip
    # the learner shards the model itself (its FSDP2 strategy: every decoder layer, then the root)
    objective = make_objective(rc.algo)
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
        batch = synthetic_batch(arch, rows, args.prompt_len, args.response_len, seed=step)
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
    """(d) HF generate with the KV cache on the device; a random model seldom samples EOS, so rows run full length."""
    from bapo.modeling import load_model
    from bapo.rollout import HFRollout
    from bapo.types import Problem, Prompt

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
    """(f) vLLM generation, a streamed weight sync from FSDP2 shards, sleep/wake (GPU); skipped without vLLM."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # absent, or a broken install (a torchvision built for another torch)
        return {"ok": True, "skipped": f"vLLM not importable ({type(e).__name__}: {e}); the other checks ran"}
    from bapo.learner import fsdp
    from bapo.learner.strategy import StreamedWeights
    from bapo.modeling import load_model
    from bapo.rollout.vllm import VLLMRollout
    from bapo.types import Problem, Prompt

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


def check_loop(device: torch.device, args) -> dict:
    """(e) The real loop on the shipped tiny model, in a child process with torchrun's variables removed."""
    with tempfile.TemporaryDirectory(prefix="gpu_check-run-") as tmp:
        return _run_loop(Path(tmp), device, args)


def _run_loop(run_dir: Path, device: torch.device, args) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), "model=tiny", f"learner.device={device.type}"]
    cmd += [f"train.steps={args.loop_steps}", "debug=smoke", "logger=none", f"hydra.run.dir={run_dir}"]
    cmd += args.loop_override
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "disabled")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.loop_timeout)
    out: dict[str, Any] = {
        "cmd": "python train.py " + " ".join(cmd[2:]),
        "rc": proc.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    final = run_dir / "final_metrics.json"
    if proc.returncode == 0 and final.exists():
        metrics = json.loads(final.read_text())
        out["final"] = {k: metrics[k] for k in LOOP_METRICS if k in metrics}
    else:
        out["stderr_tail"] = proc.stderr[-2000:]
    out["ok"] = proc.returncode == 0 and final.exists()
    return out


# ----------------------------------------------------------------------------- main


def headline(summary: dict) -> dict:
    """The figures a reader wants first, pulled from the checks that ran (None where a check did not)."""

    def get(check: str, key: str):
        return summary.get(check, {}).get(key)

    return {
        "mfu": get("learner", "mfu"),
        "learner_tokens_per_s": get("learner", "tokens_per_s"),
        "hf_rollout_tokens_per_s": get("rollout", "tokens_per_s"),
        "vllm_tokens_per_s": get("vllm", "tokens_per_s"),
        "vllm_sync_s": get("vllm", "sync_s"),
        "vllm": "skipped" if get("vllm", "skipped") else ("ran" if "vllm" in summary else "not run"),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes, few steps: check the script itself")
    p.add_argument(
        "--only", nargs="+", choices=["models", "learner", "rollout", "loop", "vllm"], help="run only these checks"
    )
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
    p.add_argument("--loop-steps", type=int, default=3)
    p.add_argument("--loop-timeout", type=int, default=300)
    p.add_argument("--loop-override", nargs="*", default=[], help="extra train.py overrides for the loop check")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    if args.dry_run:  # seconds on two CPU cores
        args.prompt_len, args.response_len, args.micro_batch, args.micro_batches = 8, 24, 2, 2
        args.warmup, args.updates = 1, 1
        args.rollout_prompts, args.rollout_n, args.rollout_tokens = 2, 2, 8
        args.loop_steps = min(args.loop_steps, 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    if args.dry_run:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    wanted = set(args.only or ["models", "learner", "rollout", "loop", "vllm"])
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    t_all = time.perf_counter()
    configs = model_configs()
    bench = shrink(configs[args.bench_model]["arch"]) if args.dry_run else configs[args.bench_model]["arch"]
    summary["bench_model"] = args.bench_model
    checks = {
        "models": lambda: check_models(configs, device, args.dry_run),
        "learner": lambda: check_learner(bench, device, args),
        "rollout": lambda: check_rollout(bench, device, args),
        "loop": lambda: check_loop(device, args),
        "vllm": lambda: check_vllm(bench, device, args),
    }
    if "learner" in wanted:
        summary["backend"] = init_group(device)
    for name, fn in checks.items():
        if name not in wanted:
            continue
        try:
            summary[name] = fn()
        except Exception as e:  # record and go on: one summary with every check's outcome
            summary[name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    if dist.is_initialized():
        dist.destroy_process_group()
    summary = {"headline": headline(summary)} | summary
    failed = [name for name in checks if name in summary and not summary[name]["ok"]]
    summary["failed"] = failed
    summary["ok"] = not failed
    summary["seconds"] = round(time.perf_counter() - t_all, 1)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
