"""A stop that keeps the work, at a GPU's step length: the step is made longer than the launcher's grace.

A paper_7b step lasts 10-30 minutes and torch's elastic agent SIGKILLs ranks 30 s after it passes a stop on; a run
that finishes its step before it saves loses everything since its last checkpoint. Here the tiny model's step is
paced (tests/helpers/paced.py: sleeps in the engine's decode steps and in each micro-batch's loss, which change no
number) to about 4x ``launcher.grace_s``, and each stop is sent in the phase it names (the paced plug-ins write
theirs to a file). Every stop must end the run within the grace, leaving a checkpoint (the step's start, or the
updates made and what the step's rest needs), and the run resumed from it must equal the uninterrupted run metric
for metric. Launches: the plain ``python train.py`` launch of 2 ranks, torchrun, and a launched sweep cell; signals:
SIGTERM, SIGINT (Ctrl-C: the whole process group), SIGHUP and SIGUSR1; phases: generation, the updates, the step's
evaluation. And SIGKILL of everything after a time-based checkpoint loses at most that interval.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bapo import checkpoint
from tests.helpers.metrics import rows, untimed
from tests.helpers.paced import EXIT_S, FROM, MICRO_S, PHASE, TOKEN_S, phase
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow

# launcher.grace_s (torchrun: --shutdown-timeout); every paced phase below lasts longer. 20 s, not less: a stop
# waits for the micro-batch in flight (7 s paced), and the checkpoint took 3 s more when CI shared its 2 cores with
# a study grid (load 12).
GRACE = 20
# From the phase a stop goes in: a generation call 32 s (40 decode steps), an update 28 s (4 micro-batches a rank);
# and a paced rank's exit takes twice the grace (a GPU rank's CUDA and NCCL teardown): a stopped rank must leave
# without it once its checkpoint is saved (bapo.infra.stop.leave), or the launcher SIGKILLs it.
PACE = {TOKEN_S: "0.8", MICRO_S: "7", EXIT_S: str(2 * GRACE)}
RUN = [
    "debug=smoke",
    "learner=fsdp",
    "train.steps=2",
    "eval.every=0",  # the evaluation is the last step's (and step 0's)
    "eval.greedy=false",  # one generation call an evaluation
    "learner.micro_batch_size=1",  # 4 micro-batches a rank an update (8 samples over 2 ranks): a stop between two
    "checkpoint.every=0",
    "rollout.max_new_tokens=40",
    "rollout.engine=tests.helpers.paced:PacedHF",
    "algo.objective=tests.helpers.paced:objective",
    f"launcher.grace_s={GRACE}",
]
PLAIN = [sys.executable, "train.py", "launcher.nproc_per_node=2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--shutdown-timeout={GRACE}", "train.py"]  # fmt: skip


def _env(marks: Path | None, pace_from: str | None = None, pace: dict | None = None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    for k in (TOKEN_S, MICRO_S, PHASE, FROM, EXIT_S):
        env.pop(k, None)
    if marks is not None:
        env |= (pace or PACE) | {PHASE: str(marks)} | ({FROM: pace_from} if pace_from else {})
    return env


def start(cmd: list[str], run_dir: Path, *extra: str, marks: Path | None = None, pace_from: str | None = None,
          pace: dict | None = None) -> subprocess.Popen:  # fmt: skip
    """The command in its own process group (a terminal's Ctrl-C reaches the whole group), its output captured;
    paced from the event ``pace_from`` (tests/helpers/paced.py) when ``marks`` names the phase file."""
    return subprocess.Popen(
        [*cmd, *RUN, *extra, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=_env(marks, pace_from, pace),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def finish(p: subprocess.Popen, timeout: float = 900) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"did not end within {timeout} s:\n{out[-4000:]}") from None
    return out


def wait_phase(p: subprocess.Popen, file: Path, name: str, count: int, timeout: float = 600) -> None:
    """Until the paced plug-ins say they are in ``name`` at its ``count``-th event or later."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        now = phase(file)
        if now is not None and now[0] == name and now[1] >= count:
            return
        assert p.poll() is None, finish(p)
        time.sleep(0.1)
    raise TimeoutError(f"phase {name} {count} not reached (last: {phase(file)})")


def stop_in(
    p: subprocess.Popen, file: Path, name: str, count: int, sig: int, *, group: bool = False
) -> tuple[str, float]:
    """Send ``sig`` in the phase named, to the launcher (``group``: to its whole process group, as a terminal's
    Ctrl-C does); the output and the time (``time.time()``) the signal was sent."""
    wait_phase(p, file, name, count)
    time.sleep(1.0)  # inside the phase, not at its first instant
    sent = time.time()
    os.killpg(p.pid, sig) if group else p.send_signal(sig)
    out = finish(p, timeout=GRACE + 120)
    return out, sent


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it at once (a node lost): the launcher, its ranks (torch's agent puts
    each in a session of its own) and their workers."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(tree[-1])], capture_output=True, text=True).stdout
        todo += [int(k) for k in kids.split()]
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def saved(run_dir: Path) -> tuple[int, dict]:
    """The newest checkpoint's step and meta.json."""
    found = checkpoint.step_dirs(run_dir / "checkpoints")
    assert found, f"no checkpoint in {run_dir}"
    return found[-1][0], checkpoint.read_meta(found[-1][1])


def assert_stopped(out: str, sent: float, code: int, run_dir: Path, *, torchrun: bool = False) -> None:
    """Stopped by the signal, no rank killed, and the checkpoint written within the grace of the signal. (torchrun
    itself exits 1 after passing a signal on; the project's launch exits 128 + the signal, as one process does.)"""
    assert "RankKilled" not in out and "error:" not in out and "Unable to shutdown process" not in out, out[-4000:]
    assert "warning: a rank was still exiting" not in out, out[-4000:]  # killed after its save: a slow exit
    stops = {128 + s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)}
    assert code in (stops | {1} if torchrun else stops), (code, out[-3000:])
    took = saved(run_dir)[1]["time"] - sent
    assert 0 < took < GRACE, f"the checkpoint came {took:.1f} s after the signal (grace {GRACE} s):\n{out[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run: the same command unpaced (the sleeps change no number)."""
    run_dir = tmp_path_factory.mktemp("stops") / "reference"
    p = start(PLAIN, run_dir)
    out = finish(p)
    assert p.returncode == 0, out[-4000:]
    return untimed(rows(run_dir))


def test_plain_launch_sigterm_in_generation_then_sigusr1_in_the_updates(tmp_path, reference):
    run_dir, marks = tmp_path / "run", tmp_path / "phase"
    # SIGTERM while step 1's batch is generated (generation 1 is step 0's evaluation): the step's start is saved
    p = start(PLAIN, run_dir, marks=marks, pace_from="generate 2")
    out, sent = stop_in(p, marks, "generate", 2, signal.SIGTERM)
    assert_stopped(out, sent, p.returncode, run_dir)
    assert p.returncode == 128 + signal.SIGTERM
    step, meta = saved(run_dir)
    assert (step, meta["version"], meta.get("pending_updates", 0)) == (0, 0, 0)
    # resumed, SIGUSR1 (SLURM's warning) in step 1's second update: the first update is saved with the step's rest
    marks.unlink()
    p = start(PLAIN, run_dir, "resume=auto", marks=marks, pace_from="update 5")
    out, sent = stop_in(p, marks, "update", 5, signal.SIGUSR1)
    assert_stopped(out, sent, p.returncode, run_dir)
    assert p.returncode == 128 + signal.SIGUSR1
    step, meta = saved(run_dir)
    assert (step, meta["version"], meta["pending_updates"]) == (0, 1, 1)
    p = start(PLAIN, run_dir, "resume=auto")
    out = finish(p)
    assert p.returncode == 0, out[-4000:]
    assert "inside step 1 (1 updates made)" in out
    assert untimed(rows(run_dir)) == reference


def test_torchrun_sighup_in_the_updates_then_ctrl_c_in_the_evaluation(tmp_path, reference):
    run_dir, marks = tmp_path / "run", tmp_path / "phase"
    p = start(TORCHRUN, run_dir, marks=marks, pace_from="update 6")
    out, sent = stop_in(p, marks, "update", 6, signal.SIGHUP)  # step 1's 2nd update (loss calls 1-4, 5-8)
    assert_stopped(out, sent, p.returncode, run_dir, torchrun=True)
    step, meta = saved(run_dir)
    assert (step, meta["version"], meta["pending_updates"]) == (0, 1, 1)
    # resumed: step 1 ends, step 2 trains, and Ctrl-C (to the whole process group) comes in step 2's evaluation
    # (this process's generations: step 2's batch, then its evaluation)
    marks.unlink()
    p = start(TORCHRUN, run_dir, "resume=auto", marks=marks, pace_from="generate 2")
    out, sent = stop_in(p, marks, "generate", 2, signal.SIGINT, group=True)
    assert_stopped(out, sent, p.returncode, run_dir, torchrun=True)
    step, meta = saved(run_dir)
    assert (step, meta["version"], meta["pending_updates"]) == (1, 4, 2)  # step 2's updates made, its eval not
    p = start(TORCHRUN, run_dir, "resume=auto")
    out = finish(p)
    assert p.returncode == 0, out[-4000:]
    assert untimed(rows(run_dir)) == reference


def test_a_launched_sweep_cell_stopped_in_its_updates_resumes_on_relaunch(tmp_path, reference):
    sweep, marks = tmp_path / "sweep", tmp_path / "phase"
    cmd = [sys.executable, "train.py", "-m", "launcher.nproc_per_node=2", "seed=1", f"hydra.sweep.dir={sweep}",
           "hydra.sweep.subdir=cell"]  # fmt: skip
    p = subprocess.Popen(
        [*cmd, *RUN], cwd=ROOT, env=_env(marks, "update 5"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    out, sent = stop_in(p, marks, "update", 5, signal.SIGTERM)
    assert_stopped(out, sent, p.returncode, sweep / "cell")
    step, meta = saved(sweep / "cell")
    assert (step, meta["pending_updates"]) == (0, 1)
    summary = [json.loads(x) for x in (sweep / "sweep_summary.jsonl").read_text().splitlines()]
    assert summary[-1]["status"] == "stopped"
    again = subprocess.run([*cmd, *RUN, "resume=auto"], cwd=ROOT, env=_env(None), capture_output=True, text=True,
                           timeout=900)  # fmt: skip
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert untimed(rows(sweep / "cell")) == reference


def test_sigkill_after_a_time_based_checkpoint_loses_at_most_that_interval(tmp_path, reference):
    """checkpoint.every=0 and every_minutes: a checkpoint at the first step's end once the interval has passed; the
    whole process group SIGKILLed (a node lost) in step 2 resumes from it."""
    run_dir, marks = tmp_path / "run", tmp_path / "phase"
    light = {TOKEN_S: "0.1", MICRO_S: "0.5"}  # step 0's evaluation and step 1 take over 6 s: one checkpoint at step 1
    p = start(PLAIN, run_dir, "checkpoint.every_minutes=0.1", marks=marks, pace=light)
    wait_phase(p, marks, "update", 9)  # step 2's first update: step 1 ended in a checkpoint
    step, meta = saved(run_dir)
    assert step == 1 and meta["version"] == 2
    kill_tree(p.pid)
    finish(p)
    p = start(PLAIN, run_dir, "resume=auto")
    out = finish(p)
    assert p.returncode == 0, out[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000001'} at step 1" in out
    assert untimed(rows(run_dir)) == reference
