"""The day-one GPU check's machine sections and the user's one-GPU command (scripts/gpu/gpu_check.py runs each in a
process of its own through gpu_check_worker.py).

``env``: torch, CUDA and cuDNN versions against the project's pin, the GPU (name, capability, memory total and
free, the NVIDIA driver), a bf16 matrix product (TFLOP/s, and its agreement with fp32). Without a CUDA device and
without ``--dry-run`` it fails with ``no_gpu``, and the driver stops there with exit status 2. An NVIDIA driver
older than :data:`MIN_DRIVER` fails it in one line: the pinned vLLM is built for CUDA 13.

``host``: ``/dev/shm`` (where ``rollout=vllm_server`` stages each weight sync: one bf16 copy of the model at
the peak, the new one written before the old is removed) and host memory (which holds vLLM's weights while it
sleeps at level 1) against paper_7b's model; the toy stand-in in a dry run.

``qwen7b``: what ``python train.py algo=bapo model=qwen7b`` would do on this machine: the memory plan of the GPUs
it sees (``--plan --nproc <GPUs> --gpu-memory <GiB of one>``), the same with ``learner.cpu_offload=true``, and the
launch's own decision (``bapo.entry.launch.decide``: the ranks it would start, with or without the learner's state
on the host, or its one-line refusal). A dry run plans one 141 GiB GPU (an H200), which the launch is shown through
its test hook ``$BAPO_FAKE_DEVICES``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
QWEN7B = ["algo=bapo", "model=qwen7b"]  # python train.py algo=bapo model=qwen7b
DRY_GPUS = (1, 141)  # what a dry run plans: one H200
MIN_DRIVER = 580  # vllm==0.32.0's wheel links libcudart.so.13: CUDA 13 needs an NVIDIA driver of at least 580
FAKE_DRIVER = "GPU_CHECK_DRIVER"  # test hook: the driver version the env section reads instead of the machine's
PAPER_MODEL = "r1_distill_qwen_7b"  # experiment=paper_7b's
STAGED_COPIES = 1  # a version is removed once its server has loaded it: one copy at the peak (bapo/engines/staging.py)


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GiB, 2)


def pinned_torch() -> str | None:
    found = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    return found.group(1) if found else None


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("transformers", "tokenizers", "hydra-core", "huggingface-hub", "vllm", "flash-attn", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def driver() -> str | None:
    """The NVIDIA driver's version: ``nvidia-smi``'s, else the kernel module's (/proc/driver/nvidia/version); None
    where neither says. ``$GPU_CHECK_DRIVER`` (test hook) stands in for both."""
    if os.environ.get(FAKE_DRIVER):
        return os.environ[FAKE_DRIVER]
    if shutil.which("nvidia-smi") is not None:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.strip().splitlines()[0].strip()
    try:
        found = re.search(r"Kernel Module\s+([0-9][0-9.]*)", Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def driver_problem(version: str | None) -> str | None:
    """Why an NVIDIA driver of ``version`` cannot run the pinned vLLM, in one line (None: it can, or is unknown)."""
    if version is None:
        return None
    major = re.match(r"\s*(\d+)", version)
    if major is None:
        return f"the NVIDIA driver's version {version!r} cannot be read"
    if int(major.group(1)) >= MIN_DRIVER:
        return None
    return (
        f"the NVIDIA driver {version} is older than {MIN_DRIVER}: vllm==0.32.0 (the pin) is built for CUDA 13 "
        f"(libcudart.so.13), which needs a driver >= {MIN_DRIVER}; pip installs it anyway and nothing runs: "
        "update the driver"
    )


def matmul(device, n: int) -> dict:
    """A bf16 [n, n] @ [n, n] product: TFLOP/s over 10 after 3 warm-ups, and its distance from the fp32 product."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device) for _ in range(2))
    a16, b16 = a.bfloat16(), b.bfloat16()
    for _ in range(3):
        c = a16 @ b16
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        c = a16 @ b16
    sync(device)
    sec = (time.perf_counter() - t0) / 10
    ref = a16.float() @ b16.float()
    rel = float((c.float() - ref).norm() / ref.norm())
    return {"matmul_n": n, "bf16_tflops": float(f"{2 * n**3 / sec / 1e12:.3g}"), "bf16_rel_error": round(rel, 5)}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def env(ctx) -> dict:
    import torch

    pin = pinned_torch()
    out = {
        "torch": torch.__version__,
        "torch_pin": pin,
        "torch_is_pin": torch.__version__.split("+")[0] == pin,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "python_executable": sys.executable,
        "packages": versions(),
    }
    if not ctx.dry and not torch.cuda.is_available():
        why = f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda})"
        return out | {"no_gpu": True, "fail": why}
    device = ctx.device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        out |= {
            "gpu": props.name,
            "gpus": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "gpu_memory_gib": gib(total),
            "gpu_free_gib": gib(free),
            "bf16_supported": torch.cuda.is_bf16_supported(),
        }
    else:
        out |= {"gpu": None, "gpus": 0, "device": "cpu (--dry-run)"}
    out["driver"] = driver() if device.type == "cuda" or os.environ.get(FAKE_DRIVER) else None
    out["driver_min"] = MIN_DRIVER
    out |= matmul(device, 256 if ctx.dry else 8192)
    checks = {"bf16_matmul_matches_fp32": out["bf16_rel_error"] < 0.02, "bf16_matmul_ran": out["bf16_tflops"] > 0}
    if device.type == "cuda":
        checks["bf16_supported"] = out["bf16_supported"]
    why = driver_problem(out["driver"])
    return out | {"checks": checks} | ({"fail": why} if why else {})


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty off Linux)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in lines) if v.strip().endswith("kB")}


def model_bytes(ctx) -> tuple[str, int]:
    """(which model, its bf16 bytes): paper_7b's model, or the dry run's toy stand-in."""
    from bapo.modeling import arch_config
    from bapo.plan.shape import model_shape

    if ctx.dry:
        from scripts.gpu.gpu_check_scale import standin_arch

        arch = {"model_type": "qwen2", **standin_arch(ctx.standin_layers, dry=True)}
        return "the dry run's stand-in", 2 * model_shape(arch_config(arch)).params
    from omegaconf import OmegaConf

    arch = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{PAPER_MODEL}.yaml").arch, resolve=True)
    return f"model={PAPER_MODEL}", 2 * model_shape(arch_config(arch)).params


def host(ctx) -> dict:
    which, weights = model_bytes(ctx)
    need = STAGED_COPIES * weights
    mem = meminfo()
    out = {"model": which, "bf16_weights_gib": gib(weights), "staging_need_gib": gib(need),
           "host_memory_gib": gib(mem.get("MemTotal")), "host_available_gib": gib(mem.get("MemAvailable")),
           "cpus": os.cpu_count()}  # fmt: skip
    shm = Path("/dev/shm")
    if shm.is_dir():
        st = os.statvfs(shm)
        out |= {"shm_gib": gib(st.f_frsize * st.f_blocks), "shm_free_gib": gib(st.f_frsize * st.f_bavail)}
    else:
        out |= {"shm_gib": None, "shm_free_gib": None}
    tmp = shutil.disk_usage(os.environ.get("TMPDIR", "/tmp"))
    out["tmp_free_gib"] = gib(tmp.free)
    shm_ok = out["shm_free_gib"] is not None and out["shm_free_gib"] * GiB >= need
    if not shm_ok:
        out["advice"] = (
            f"/dev/shm holds {out['shm_free_gib']} GiB, one server's sync stages {gib(need)} GiB: give the container "
            "--shm-size (or --ipc=host), or set rollout.weights_dir to a local disk"
        )
    available = mem.get("MemAvailable")
    checks = {"shm_holds_a_sync": shm_ok, "host_holds_sleeping_weights": available is None or available >= weights}
    return out | {"checks": checks}


def seen_gpus(ctx) -> tuple[int, float]:
    """(GPUs, GiB of one) this machine gives a run: every CUDA device this process sees; :data:`DRY_GPUS` in a
    dry run."""
    import torch

    if ctx.dry or not torch.cuda.is_available():
        return DRY_GPUS
    return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / GiB


def plan_command(extra: list[str], env: dict, gpus: int, gib: float) -> dict:
    """``python train.py algo=bapo model=qwen7b <extra> --plan ...`` on ``gpus`` GPUs of ``gib``: exit status, the
    ranks planned, the verdict line and its advice."""
    cmd = [sys.executable, "train.py", *QWEN7B, *extra, "--plan", "--nproc", str(gpus), "--gpu-memory", f"{gib:.0f}"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    text = p.stdout + p.stderr
    ranks = re.search(r"^\s*(\d+) (?:learner )?rank\(s\)", p.stdout, re.M)
    verdict = re.search(r"^(fits|DOES NOT FIT): (.*)$", p.stdout, re.M)
    advice = p.stdout.split(verdict.group(0), 1)[1].strip().splitlines() if verdict else []
    return {
        "cmd": " ".join(["python", *cmd[1:]]),
        "rc": p.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "ranks": int(ranks.group(1)) if ranks else None,
        "fits": verdict.group(1) == "fits" if verdict else None,
        "verdict_line": verdict.group(0) if verdict else (text.strip().splitlines() or [""])[-1][:300],
        "advice": [a.strip() for a in advice],
        "traceback": "Traceback" in text,
    }


def launch_decision(env: dict) -> dict:
    """What ``bapo.entry.launch.decide`` chooses for ``python train.py algo=bapo model=qwen7b`` here (in this process,
    ``env`` applied): the ranks, the plan's changes and why, or the refusal's one line."""
    from bapo.entry.launch import decide
    from bapo.entry.plan import compose
    from bapo.infra.checks import ConfigError

    saved = dict(os.environ)
    os.environ.update(env)
    os.environ.pop("WORLD_SIZE", None)
    try:
        how = decide(compose(QWEN7B), QWEN7B)
    except ConfigError as e:
        return {"refused": str(e), "one_line": "\n" not in str(e)}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"nproc": how.nproc, "chosen": how.chosen, "reason": how.reason, "changes": dict(how.changes)}


def qwen7b(ctx) -> dict:
    from bapo.entry.launch import FAKE_DEVICES

    gpus, gib = seen_gpus(ctx)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.pop("WORLD_SIZE", None)
    if ctx.dry:
        env[FAKE_DEVICES] = f"{gpus}x{gib:g}"  # the launch sees the planned GPUs (its test hook)
    plain = plan_command([], env, gpus, gib)
    offload = plan_command(["learner.cpu_offload=true"], env, gpus, gib)
    launch = launch_decision({k: v for k, v in env.items() if k == FAKE_DEVICES})
    names_offload = any("learner.cpu_offload=true" in a for a in plain["advice"])
    out = {"gpus_seen": gpus, "gpu_memory_gib": round(gib, 1), "plan": plain, "plan_cpu_offload": offload,
           "launch": launch, "refusal_names_cpu_offload": names_offload}  # fmt: skip
    checks = {}
    for key, p in (("plan", plain), ("plan_cpu_offload", offload)):
        checks[f"{key}_ran"] = p["rc"] in (0, 1) and not p["traceback"] and p["fits"] is not None
        checks[f"{key}_planned_the_gpus_seen"] = p["ranks"] == gpus
    checks["launch_decided"] = launch.get("nproc", 0) >= 1 or launch.get("one_line", False)
    return {"fits": plain["fits"], "cpu_offload_fits": offload["fits"]} | out | {"checks": checks}
