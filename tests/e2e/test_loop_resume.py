"""The off-policy engine in the real loop: async at the minimum k is synchronous, resume is exact
after a real SIGKILL, SIGTERM saves and exits, and non-finite updates stop the run after M in a row."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bapo import checkpoint
from bapo.loop import TrainingDiverged, run
from tests.helpers.config import smoke_cfg
from tests.helpers.metrics import rows, untimed

pytestmark = pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "over",
    [
        ["learner.mini_batches_per_rollout=1", "buffer.max_staleness=0"],  # the k = 0
        ["learner.mini_batches_per_rollout=2", "buffer.max_staleness=1"],  # k = U - 1 with reuse
    ],
    ids=["k0", "k1-reuse"],
)
def test_async_at_the_minimum_k_equals_synchronous(tmp_path, over):
    common = ["train.steps=4", "checkpoint.every=0", *over]
    run(smoke_cfg(common), tmp_path / "sync")
    run(smoke_cfg([*common, "train.async_rollout=true"]), tmp_path / "async")
    sync, asyn = rows(tmp_path / "sync"), rows(tmp_path / "async")
    assert len(sync) == 5
    assert untimed(sync) == untimed(asyn)
    assert {r["buffer/staleness_max"] for r in sync[1:]} == {int(over[1][-1])}


def test_async_k_is_the_realised_staleness_and_recompute_uses_the_generating_version(tmp_path):
    # admission with k = 3 and U = 1: batch t is generated at version max(0, t - 4), so staleness ramps to 3.
    # recompute evaluates the learner's forward at that version (kept as a snapshot): with a large lr the
    # weights move a lot between versions, so only the right snapshot matches the engine's log-probs.
    over = [
        "train.steps=6",
        "train.async_rollout=true",
        "learner.mini_batches_per_rollout=1",
        "buffer.max_staleness=3",
        "learner.old_logp=recompute",
        "learner.lr=1e-2",
        "checkpoint.every=0",
    ]
    run(smoke_cfg(over), tmp_path)
    rs = rows(tmp_path)[1:]
    assert [r["buffer/staleness_max"] for r in rs] == [0, 1, 2, 3, 3, 3]
    assert [r["rollout/version"] for r in rs] == [0, 0, 0, 0, 1, 2]
    assert all(r["rollout/logp_mismatch_max"] < 1e-4 for r in rs)
    assert rs[-1]["buffer/staleness_hist/3"] == 16 and rs[-1]["buffer/staleness_hist/0"] == 0  # 4 prompts x 4
    assert all(r["buffer/dropped"] == 0 for r in rs)


def test_drop_mode_runs_within_the_bound(tmp_path):
    over = ["train.steps=4", "train.async_rollout=true", "buffer.enforce=drop", "buffer.max_staleness=2"]
    run(smoke_cfg([*over, "learner.mini_batches_per_rollout=1", "checkpoint.every=0"]), tmp_path)
    rs = rows(tmp_path)[1:]
    assert len(rs) == 4 and all(r["buffer/staleness_max"] <= 2 for r in rs)
    assert all("buffer/dropped" in r and "buffer/producer_wait_s" in r for r in rs)


def test_m_non_finite_updates_in_a_row_stop_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(float("nan")))
    with pytest.raises(TrainingDiverged, match=r"3 optimizer updates in a row.*max_consecutive_skips=3"):
        run(smoke_cfg(["learner.max_consecutive_skips=3", "train.steps=3"]), tmp_path)
    row = rows(tmp_path)[-1]  # step 1 (2 updates) was logged: the skips are counted, the run went on
    assert row["step"] == 1 and row["learner/skipped_updates"] == 2


def test_resume_auto_skips_a_completed_run(tmp_path):
    first = run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    again = run(smoke_cfg(["train.steps=1", "eval.every=0", "resume=auto"]), tmp_path)
    assert again == json.loads((tmp_path / "final_metrics.json").read_text())
    assert again["policy/version"] == first["policy/version"]
    assert (tmp_path / "metrics.jsonl").read_text() == before


# ----------------------------------------------------------------------------- real processes

TRAIN = [
    "debug=smoke",
    "train.steps=6",
    "eval.every=3",
    "checkpoint.every=1",
    "checkpoint.keep=2",
]


def launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "train.py", *TRAIN, *extra, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = p.communicate(timeout=timeout)
    return out


def wait_for_step(p: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    """Until metrics.jsonl has the line for ``step`` (the checkpoint for it may or may not be written yet)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        f = run_dir / "metrics.jsonl"
        if f.exists() and any(json.loads(x)["step"] >= step for x in f.read_text().splitlines() if x.endswith("}")):
            return
        assert p.poll() is None, finish(p)
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached")


PARTIAL = ["rollout.partial_budget=12", "buffer.max_staleness=7"]  # 4 segments at most: in flight across steps


@pytest.mark.parametrize(
    "mode",
    [[], ["train.async_rollout=true", "buffer.max_staleness=3"], PARTIAL, ["train.async_rollout=true", *PARTIAL]],
    ids=["sync", "async-k3", "partial-sync", "partial-async-k7"],
)
def test_sigkill_at_a_random_step_then_resume_gives_the_same_metrics(tmp_path, mode):
    full = launch(tmp_path / "full", *mode)
    out = finish(full)
    assert full.returncode == 0, out
    kill_at = random.Random(str(mode)).randint(2, 4)
    p = launch(tmp_path / "killed", *mode)
    wait_for_step(p, tmp_path / "killed", kill_at)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    saved = checkpoint.step_dirs(tmp_path / "killed" / "checkpoints")
    assert saved and saved[-1][0] <= kill_at  # killed after logging step kill_at: its checkpoint may be missing
    resumed = launch(tmp_path / "killed", *mode, "resume=auto")
    out = finish(resumed)
    assert resumed.returncode == 0, out
    assert f"resumed from {saved[-1][1]}" in out
    a, b = rows(tmp_path / "full"), rows(tmp_path / "killed")
    assert [r["step"] for r in b] == list(range(7))
    assert untimed(a) == untimed(b)
    k = int(next((m.split("=")[1] for m in reversed(mode) if m.startswith("buffer.max_staleness=")), 1))
    assert max(r["buffer/staleness_max"] for r in b[1:]) <= k
    if "rollout.partial_budget=12" in mode:  # responses were in flight at the kill, and resumed
        assert max(r["rollout/pool_groups"] for r in b[1:]) > 0
        assert max(r["buffer/token_staleness_max"] for r in b[1:]) <= k
    assert len(checkpoint.step_dirs(tmp_path / "killed" / "checkpoints")) == 2  # keep=2


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    p = launch(tmp_path, "train.steps=20", "checkpoint.every=0")
    wait_for_step(p, tmp_path, 1)
    p.send_signal(signal.SIGTERM)
    out = finish(p)
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM" in out and "resume=auto" in out
    saved = checkpoint.step_dirs(tmp_path / "checkpoints")
    last = rows(tmp_path)[-1]["step"]
    assert [s for s, _ in saved] == [last] and last < 20
    assert not (tmp_path / "final_metrics.json").exists()
    state = checkpoint.load(saved[-1][1])  # weights_only=True, verified against the manifest
    meta = checkpoint.read_meta(saved[-1][1])  # a stop inside the updates of step last + 1 saves the ones made
    assert state["step"] == last and meta["version"] == 2 * last + meta.get("pending_updates", 0)


def test_resume_auto_extends_a_finished_run_to_more_steps(tmp_path):
    run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path)
    run(smoke_cfg(["train.steps=2", "eval.every=0", "resume=auto"]), tmp_path)
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2]
    assert json.loads((tmp_path / "final_metrics.json").read_text())["policy/version"] == 4
    with pytest.raises(Exception, match="resume: no complete checkpoint"):
        run(smoke_cfg(["train.steps=1", f"resume={tmp_path / 'nowhere'}"]), tmp_path / "other")
