"""The real loop's integrity: every mode does what it says, no run loses or mixes results, no checkpoint runs code.

Each test reproduces a failure a user could hit (the docstrings say which)."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bapo import checkpoint
from bapo.checkpoint import CheckpointError
from bapo.config import ConfigError
from bapo.learner import TrainingDiverged
from bapo.loop import run
from tests.helpers.config import smoke_cfg
from tests.helpers.metrics import TIMING, rows

pytestmark = pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


def training(row: dict) -> dict:
    """A row's training metrics: no evaluation, no timing."""
    return {k: v for k, v in row.items() if not k.startswith(("eval/", *TIMING))}


# ----------------------------------------------------------------------------- silent wrong results


SYNC2 = ["train.steps=4", "train.sync_every=2", "learner.mini_batches_per_rollout=1", "buffer.max_staleness=1"]
SYNC2 += ["learner.lr=1e-3", "checkpoint.every=1", "checkpoint.keep=4"]


@pytest.mark.slow
def test_sync_every_2_is_not_changed_by_evaluation_or_resume(tmp_path):
    """Before: the snapshot of version v served a later batch while the learner kept updating the same
    tensors, so after an evaluation the next batch was on-policy (ratio exactly 1) but labelled stale 1,
    and a resumed run diverged from the uninterrupted one."""
    run(smoke_cfg([*SYNC2, "eval.every=0"]), tmp_path / "plain")
    run(smoke_cfg([*SYNC2, "eval.every=1"]), tmp_path / "eval")
    plain, evaluated = rows(tmp_path / "plain"), rows(tmp_path / "eval")
    assert [training(r) for r in plain[1:]] == [training(r) for r in evaluated[1:]]
    # batch 4 is generated at version 2 and trained at version 3: stale by one, so the ratio is not exactly 1
    assert plain[4]["rollout/version"] == 2 and plain[4]["buffer/staleness_max"] == 1
    assert plain[4]["learner/ratio_mean"] != 1.0
    # resume from step 3's checkpoint (as if killed after it): the same step 4
    cut = tmp_path / "resumed"
    run(smoke_cfg([*SYNC2, "eval.every=0", "train.steps=3"]), cut)
    run(smoke_cfg([*SYNC2, "eval.every=0", "resume=auto"]), cut)
    assert [training(r) for r in rows(cut)[1:]] == [training(r) for r in plain[1:]]


def test_weights_that_overflow_stop_the_run_naming_the_checkpoint_folder(tmp_path):
    """Before: lr=1e30 made the weights inf inside an update whose loss and gradient were finite, and the
    next rollout crashed in sampling with 'probability tensor contains inf/nan'. It diverges at the first
    update, so there is no checkpoint to name, and the message says so."""
    with pytest.raises(TrainingDiverged, match=r"not finite after update \d+.*learner\.lr=1e\+30.*no checkpoint was"):
        run(smoke_cfg(["learner.lr=1e30", "train.steps=2"]), tmp_path)


# ----------------------------------------------------------------------------- hangs


@pytest.mark.slow
def test_drop_mode_with_recompute_finishes(tmp_path):
    """Before: release() freed the snapshot a queued batch still waited for, and the run hung forever,
    deaf to SIGTERM."""
    cmd = [sys.executable, "train.py", "debug=smoke", "train.steps=4", "train.async_rollout=true"]
    cmd += ["buffer.enforce=drop", "learner.mini_batches_per_rollout=2", "buffer.max_staleness=1"]
    cmd += ["learner.old_logp=recompute", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rs = rows(tmp_path)
    assert [r["step"] for r in rs] == [0, 1, 2, 3, 4]
    assert all(r["buffer/staleness_max"] <= 1 for r in rs[1:])


# ----------------------------------------------------------------------------- lost or mixed results


def test_a_fresh_run_refuses_a_used_folder_unless_told_to_overwrite(tmp_path):
    """Before: a fresh run B in run A's folder pruned its own checkpoint and later 'resumed' A."""
    run(smoke_cfg(["train.steps=2", "eval.every=0"]), tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"resume=auto.*overwrite=true"):
        run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # untouched
    run(smoke_cfg(["train.steps=1", "eval.every=0", "overwrite=true"]), tmp_path)
    assert [r["step"] for r in rows(tmp_path)] == [0, 1]
    assert [s for s, _ in checkpoint.step_dirs(tmp_path / "checkpoints")] == [1]  # A's are gone


def test_an_incompatible_resume_fails_before_touching_the_folder(tmp_path):
    """Before: final_metrics.json was deleted and config.yaml overwritten before the checkpoint was read,
    and the mismatch surfaced as a size-mismatch dump or KeyError: 'critic'."""
    run(smoke_cfg(["train.steps=2", "eval.every=0"]), tmp_path)
    snapshot = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"}
    with pytest.raises(ConfigError, match=r"algo\.name: 'bapo' -> 'grpo'"):
        run(smoke_cfg(["train.steps=3", "eval.every=0", "algo=grpo", "resume=auto"]), tmp_path)
    with pytest.raises(ConfigError, match=r"algo\.critic"):
        run(smoke_cfg(["train.steps=3", "eval.every=0", "algo=ppo", "resume=auto"]), tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"} == snapshot


def test_a_compatible_change_on_resume_is_recorded(tmp_path):
    run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path)
    run(smoke_cfg(["train.steps=2", "eval.every=0", "resume=auto", "checkpoint.keep=3"]), tmp_path)
    history = [json.loads(x) for x in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    changed = {c["key"] for h in history for c in h["changes"]}
    assert {"train.steps", "checkpoint.keep", "resume"} <= changed


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    run(smoke_cfg(["train.steps=3", "eval.every=0", "checkpoint.every=1", "checkpoint.keep=3"]), tmp_path)
    newest = tmp_path / "checkpoints" / "step_000003" / "learner" / "learner.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    (tmp_path / "final_metrics.json").unlink()
    caplog.set_level("WARNING")
    run(
        smoke_cfg(["train.steps=3", "eval.every=0", "checkpoint.every=1", "checkpoint.keep=3", "resume=auto"]), tmp_path
    )
    assert "step_000003" in caplog.text  # the skipped folder is named
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2, 3]


def test_a_checkpoint_with_non_finite_weights_is_refused(tmp_path):
    run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path)
    ckpt = tmp_path / "checkpoints" / "step_000001"
    state = torch.load(ckpt / "learner" / "learner.pt", weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name].fill_(float("nan"))
    torch.save(state, ckpt / "learner" / "learner.pt")
    checkpoint.write_manifest(ckpt)  # re-signed: the finiteness check, not the checksum, must catch it
    with pytest.raises(CheckpointError, match="not finite"):
        run(smoke_cfg(["train.steps=2", "eval.every=0", "resume=auto"]), tmp_path)


@pytest.mark.slow
def test_two_runs_on_one_folder_leave_the_first_intact(tmp_path):
    """Before: both exited 0 and the second unlinked the first's open metrics.jsonl."""
    args = [sys.executable, "train.py", "debug=smoke", f"hydra.run.dir={tmp_path}"]
    first = subprocess.Popen([*args, "train.steps=12"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.time() + 300
        while not (tmp_path / "metrics.jsonl").exists() and time.time() < deadline:
            assert first.poll() is None, first.communicate()[0][-2000:]
            time.sleep(0.1)
        second = subprocess.run([*args, "overwrite=true"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert second.returncode != 0
        assert f"pid {first.pid}" in second.stdout + second.stderr  # the holder is named
        out, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
    assert first.returncode == 0, out[-2000:]
    assert [r["step"] for r in rows(tmp_path)] == list(range(13))


# ----------------------------------------------------------------------------- small items


def test_a_config_error_leaves_no_run_folder(tmp_path):
    target = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", "rollout.temperature=-1", f"hydra.run.dir={target}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "rollout.temperature" in proc.stdout + proc.stderr
    assert not target.exists()


def test_the_export_is_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path)
    finally:
        os.umask(old)
    export = tmp_path / "export"
    assert stat.S_IMODE(export.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044 for p in export.iterdir())


def test_a_finished_async_run_extends_with_the_snapshots_it_needs(tmp_path, hang_guard):
    """A finished run's checkpoint must hold the weights the batches after its last step are made with:
    admission with k = 3 makes batch 7 with version 3, which no batch up to 6 asks for."""
    over = ["train.async_rollout=true", "buffer.max_staleness=3", "learner.mini_batches_per_rollout=1"]
    over += ["eval.every=0", "checkpoint.every=0"]
    run(smoke_cfg([*over, "train.steps=6"]), tmp_path / "extended")
    run(smoke_cfg([*over, "train.steps=8", "resume=auto"]), tmp_path / "extended")
    run(smoke_cfg([*over, "train.steps=8"]), tmp_path / "straight")
    a, b = rows(tmp_path / "extended"), rows(tmp_path / "straight")
    assert [r["rollout/version"] for r in a[1:]] == [0, 0, 0, 0, 1, 2, 3, 4]
    assert [training(r) for r in a[1:]] == [training(r) for r in b[1:]]
