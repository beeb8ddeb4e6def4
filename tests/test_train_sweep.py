"""A re-launched sweep skips its finished runs (resume=auto) and each run folder stays its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)

ROOT = Path(__file__).resolve().parents[1]


def sweep(out: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [
        sys.executable, "train.py", "-m", "debug=smoke", "algo=bapo,grpo", "train.steps=1", "eval.every=0",
        "resume=auto", f"hydra.sweep.dir={out}",
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout + p.stderr


def test_relaunched_sweep_skips_completed_runs(tmp_path):
    sweep(tmp_path)
    runs = sorted(p for p in tmp_path.iterdir() if (p / "final_metrics.json").exists())
    assert [p.name.split(",")[0] for p in runs] == ["algo=bapo", "algo=grpo"]  # folder name = the overrides
    before = {p: (p / "metrics.jsonl").read_text() for p in runs}
    out = sweep(tmp_path)
    assert out.count("nothing to do") == 2
    assert {p: (p / "metrics.jsonl").read_text() for p in runs} == before
    assert json.loads((runs[1] / "final_metrics.json").read_text())["clip/low"] == 0.8
