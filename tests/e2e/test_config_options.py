"""A user's bad command through the real entry points: one line, exit status 2, and the tree left as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


# ----------------------------------------------------------------------------- the users' commands


def _snapshot(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "script, args, expect",
    [
        (
            "train.py",
            ["experiment=paper_8b", "train.steps=1"],
            "error: ConfigError: experiment: 'paper_8b' is not an option",
        ),
        ("train.py", ["debug=smok", "--plan"], "error: ConfigError: debug: 'smok' is not an option"),
        ("eval.py", ["learner=fsdpx"], "error: ConfigError: learner: 'fsdpx' is not an option"),
        ("train.py", ["debug=smoke", "train.async_rollout=2"], "error: ConfigError: train.async_rollout: must be"),
        ("train.py", ["debug=smoke", "seed=-1"], "error: ConfigError: seed: must be an integer in [0, 2**32)"),
    ],
)
def test_the_users_command_is_one_line_exit_2_and_leaves_the_tree_as_it_was(tmp_path, script, args, expect):
    (tmp_path / "keep.txt").write_text("x")
    before = _snapshot(tmp_path)
    hydra = [] if "--plan" in args else [f"hydra.run.dir={tmp_path / 'run'}"]
    cmd = [sys.executable, str(ROOT / script), *args, *hydra]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [p.stderr.strip().splitlines()[-1]], p.stderr[-2000:]
    assert p.stderr.startswith(expect), p.stderr
    assert _snapshot(tmp_path) == before
