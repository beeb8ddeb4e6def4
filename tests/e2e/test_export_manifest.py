"""train.py on a truncated export, through the entry point."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bapo.checkpoint import MANIFEST
from tests.helpers.exports import truncate

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


@pytest.mark.slow
def test_train_py_on_a_truncated_export_is_one_line_naming_the_file(tmp_path):
    from bapo.loop import run
    from tests.helpers.config import smoke_cfg

    run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path / "first")
    export = tmp_path / "first" / "export"
    assert (export / MANIFEST).is_file()
    truncate(export / "model.safetensors")
    cmd = [sys.executable, "train.py", "debug=smoke", "model=hf", f"model.name_or_path={export}"]
    cmd += ["model.max_new_tokens=48", f"hydra.run.dir={tmp_path / 'second'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: CheckpointError: {export / 'model.safetensors'}: truncated or altered"), last
