"""Run folders held by real processes: a second run, a SIGKILLed holder, three starts on one folder."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bapo.rundir import (
    LOCK_NAME,
    RunFolder,
    RunFolderBusy,
    start_decision,
)

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))

# A run that holds the folder and appends to its open metrics.jsonl, like the loop; one more line on stdin's cue.
HOLDER = """
import json, sys
from bapo.rundir import RunFolder
with RunFolder.open(sys.argv[1]) as rf:
    m = open(rf.path / "metrics.jsonl", "a")
    m.write(json.dumps({"step": 0}) + "\\n"); m.flush()
    print("held", flush=True)
    sys.stdin.readline()
    m.write(json.dumps({"step": 1}) + "\\n"); m.flush()
"""
# A second launch told to replace whatever is there (the worst case: it would delete the first run's files).
INTRUDER = """
import sys
from bapo.rundir import RunFolder, start_decision
with RunFolder.open(sys.argv[1]) as rf:
    decision = start_decision(rf.path, resume=None, overwrite=True, steps=1, find_latest=lambda d: None)
    rf.clear()
    (rf.path / "metrics.jsonl").write_text("")
print("intruded")
"""
# Holds the folder until killed; with "fork", first forks a child that outlives it (a reward worker).
SLEEPER = """
import os, sys, time
from bapo.rundir import RunFolder
rf = RunFolder.open(sys.argv[1])
child = 0
if sys.argv[2] == "fork":
    child = os.fork()
    if child == 0:
        time.sleep(300)
        os._exit(0)
print(child, flush=True)
time.sleep(300)
"""


def launch(script: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", script, *map(str, args)]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# ------------------------------------------------------------------------------------- start_decision


def decide(caplog, run: Path, **kw) -> tuple:
    """start_decision's decision and its log lines."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bapo.rundir"):
        p = start_decision(run, **{"resume": None, "overwrite": False, "steps": 4} | kw)
    return p, [r.getMessage() for r in caplog.records if r.name == "bapo.rundir"]


# ------------------------------------------------------------------------------- train.py on a held folder

TRAIN_ENV = dict(ENV, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


def test_a_second_run_on_a_held_folder_exits_at_once_naming_the_holder_and_the_first_keeps_its_files(tmp_path):
    run = tmp_path / "run"
    first = launch(HOLDER, run)
    try:
        assert first.stdout.readline().strip() == "held"
        second = launch(INTRUDER, run)
        _, err = second.communicate(timeout=120)  # a hang guard: it must not wait for the first to finish
        assert second.returncode != 0
        assert first.poll() is None  # the first run is still going: the second did not wait for it
        assert "RunFolderBusy" in err and f"pid {first.pid} on {socket.gethostname()}, since " in err, err
        assert str(run) in err
        out, err = first.communicate("go\n", timeout=120)
        assert first.returncode == 0, err
    finally:
        first.kill()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0}, {"step": 1}]  # nothing of the first run's metrics was lost
    with RunFolder.open(run):  # released on exit
        pass


@pytest.mark.parametrize("child", ["none", "fork"])
def test_a_sigkilled_holder_releases_the_lock_and_its_stale_lock_file_does_not_block(tmp_path, child):
    """With "fork", the killed holder's forked child (still alive) must not keep the lock either."""
    run = tmp_path / "run"
    holder = launch(SLEEPER, run, child)
    grandchild = 0
    try:
        grandchild = int(holder.stdout.readline())
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid} "):
            RunFolder.open(run)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid  # the dead holder's stale file
        with RunFolder.open(run) as rf:
            assert json.loads(rf.lock_path.read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait(timeout=60)
        if grandchild:
            os.kill(grandchild, signal.SIGKILL)


@pytest.mark.slow
def test_three_starts_on_one_folder_one_runs_and_the_refused_touch_nothing(tmp_path):
    """The issue's sequence: a first start, and once it holds the folder (its lock and .hydra/ written, its model
    still loading) two more at once. Before: a start refused as busy removed the folder (it held only .hydra/,
    the log and the lock: the live run's start-up), its Hydra had rewritten the live run's .hydra/ first, and a
    third start then ran beside the first (metrics.jsonl rows 0,0,1,1,...)."""
    run, steps = tmp_path / "run", 6

    def start(seed: int) -> subprocess.Popen:
        cmd = [sys.executable, "train.py", "debug=smoke", f"train.steps={steps}", "eval.every=0", f"seed={seed}"]
        return subprocess.Popen(
            [*cmd, f"hydra.run.dir={run}"], cwd=ROOT, env=TRAIN_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    first = start(1)
    try:
        deadline = time.time() + 300
        held = [run / LOCK_NAME, run / ".hydra" / "overrides.yaml"]
        while not all(f.is_file() for f in held) and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the holder writes its name into the lock file right after taking it
        held = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (run / ".hydra").iterdir()}
        lock = (run / LOCK_NAME).read_bytes()
        others = [start(2), start(3)]  # at once, while the first starts up
        for p in others:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 2 and err.strip().splitlines() == [err.strip()], err[-3000:]
            assert err.startswith(f"error: RunFolderBusy: {run} is in use by another run: pid {first.pid} "), err
        assert first.poll() is None, "the first run had finished: the refusals were not tested against a live run"
        assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (run / ".hydra").iterdir()} == held
        assert (run / LOCK_NAME).read_bytes() == lock
        _, err = first.communicate(timeout=600)
        assert first.returncode == 0, err[-3000:]
    finally:
        first.kill()
        first.wait(timeout=60)
    rows = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(steps + 1))  # one run's steps, once each
    assert "seed=1" in (run / ".hydra" / "overrides.yaml").read_text()
    assert OmegaConf.load(run / "config.yaml").seed == 1
    log = (run / "train.log").read_text()
    assert log.count("starting fresh") == 1 and "error:" not in log and "Traceback" not in log
    assert (run / "final_metrics.json").is_file() and (run / "export" / "config.json").is_file()
