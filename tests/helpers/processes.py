"""Processes the end-to-end tests start: the FSDP loop under torchrun, and the interpreter of an engine."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
FSDP_LOOP = ["train.py", "learner=fsdp", "debug=smoke", "learner.lr=1e-3", "train.steps=4", "checkpoint.every=2"]


def torchrun(run_dir: Path, *extra: str, launcher=TORCHRUN) -> str:
    """The smoke-sized FSDP loop (``FSDP_LOOP`` and ``extra``) under ``launcher``, in ``run_dir``; its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    p = subprocess.run(
        [*launcher, *FSDP_LOOP, *extra, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def vllm_python() -> str | None:
    """The interpreter of the vLLM variants: this one if it has vLLM, else the repository's .venv-vllm."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = ROOT / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


def python_for(engine: str) -> str:
    """The interpreter that runs ``engine`` ("hf" or a vLLM one): skips (fails on CI) where there is none."""
    if engine == "hf":
        return sys.executable
    py = vllm_python()
    if py is None:
        why = f"vLLM is not installed here nor in {ROOT / '.venv-vllm'} (make vllm-cpu)"
        if os.environ.get("CI"):
            pytest.fail(f"CI builds .venv-vllm, but {why}")
        pytest.skip(why)
    return py


def train_py(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python train.py *args`` from the repository root, its output captured; a non-zero exit fails the test."""
    cmd = [sys.executable, "train.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def plugin_env(plug: Path) -> dict:
    """This environment with ``plug`` (a folder of modules outside the repository) and the repository importable."""
    return {**os.environ, "PYTHONPATH": f"{plug}:{ROOT}"}
