"""Metrics and checkpoints in real runs of the loop: every checkpoint comes after its metrics, and a resume keeps
every intact row."""

import json
import logging
import os

import pytest

from bapo import checkpoint
from bapo.infra.tracking import LOST
from bapo.loop import run
from tests.helpers.config import smoke_cfg


@pytest.mark.slow
def test_every_checkpoint_comes_after_the_metrics_it_covers_are_on_disk(tmp_path, monkeypatch):
    """Before: metrics.jsonl was flushed, never fsynced, so a power loss could keep the checkpoint of step N
    and lose the metrics lines before it."""
    events = []
    real_fsync, real_save = os.fsync, checkpoint.save_run

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
            events.append(("metrics", json.loads(lines[-1])["step"]))
        return real_fsync(fd)

    def save_run(ckpt_dir, step, **kw):
        events.append(("checkpoint", step))
        return real_save(ckpt_dir, step, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(checkpoint, "save_run", save_run)
    run(smoke_cfg(["train.steps=3", "checkpoint.every=1", "eval.every=0"]), tmp_path)
    saves = [i for i, e in enumerate(events) if e[0] == "checkpoint"]
    assert [events[i][1] for i in saves] == [1, 2, 3]
    for i in saves:
        assert events[i - 1] == ("metrics", events[i][1]), events  # step N's row is on disk before its checkpoint


@pytest.mark.slow
def test_a_resume_keeps_every_intact_row_and_marks_the_lost_one(tmp_path, caplog):
    """In the real loop: the step-2 line cut short, steps 3-6 intact, resumed from the checkpoint of step 6."""
    over = ["eval.every=0", "checkpoint.every=3"]
    run(smoke_cfg([*over, "train.steps=6"]), tmp_path)
    f = tmp_path / "metrics.jsonl"
    lines = f.read_text().splitlines()
    before = [json.loads(x) for x in lines]
    lines[2] = lines[2][:40]
    f.write_text("\n".join(lines) + "\n")
    (tmp_path / "final_metrics.json").unlink()
    caplog.set_level(logging.WARNING)
    run(smoke_cfg([*over, "train.steps=8", "resume=auto"]), tmp_path)
    after = [json.loads(x) for x in f.read_text().splitlines()]
    assert [r["step"] for r in after] == list(range(9))
    assert after[2] == {"step": 2, LOST: 1.0}
    assert [after[s] for s in (0, 1, 3, 4, 5, 6)] == [before[s] for s in (0, 1, 3, 4, 5, 6)]
    assert "metrics.jsonl:3" in caplog.text
