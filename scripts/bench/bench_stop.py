"""How long a stop takes, at a step longer than the launcher's grace: signal -> checkpoint written -> exit.

    python scripts/bench/bench_stop.py                 # the table of docs/gpu.md ("Stopping a run")
    python scripts/bench/bench_stop.py --grace 10 --launch plain --phase update --signal SIGUSR1

Each case starts the tiny model's run (``debug=smoke``, 2 steps) paced like a GPU step (tests/helpers/paced.py:
sleeps in the engine's decode steps and in each micro-batch's loss, no number changed; a generation call about 16 s,
an update about 14 s, from the phase the stop goes in), sends the signal in that phase, and reads the newest
checkpoint's write time and the launcher's exit. It prints, per case, the seconds from the signal to the checkpoint
and to the exit, the exit status, and whether the launcher had to SIGKILL a rank (its grace outlived), beside the
baseline: the time the paced phase would still have run to the step's end, which a stop that finishes its step
before saving waits for. Launches: ``one`` (one process), ``plain`` (``python train.py launcher.nproc_per_node=2``),
``torchrun`` (``--nproc_per_node=2 --shutdown-timeout=<grace>``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.helpers.paced import FROM, MICRO_S, PHASE, TOKEN_S, phase  # noqa: E402

PACE = {TOKEN_S: "0.4", MICRO_S: "3.5"}
RUN = ["debug=smoke", "train.steps=2", "eval.every=0", "eval.greedy=false", "learner.micro_batch_size=1",
       "checkpoint.every=0", "rollout.max_new_tokens=40", "rollout.engine=tests.helpers.paced:PacedHF",
       "algo.objective=tests.helpers.paced:objective"]  # fmt: skip
LAUNCH = {
    "one": [sys.executable, "train.py"],
    "plain": [sys.executable, "train.py", "learner=fsdp", "launcher.nproc_per_node=2"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout={grace}", "train.py",
                 "learner=fsdp"],
}  # fmt: skip
# (event the pacing starts at and the stop is sent in; seconds of that phase left to the step's end, paced)
PHASES = {"generation": ("generate 2", 16 + 2 * 14), "update": ("update 5", 14)}
# One process makes its updates of 8 rows in 8 micro-batches: its second update starts at loss call 9.
ONE_PROCESS = {"generation": ("generate 2", 16 + 2 * 28), "update": ("update 9", 28)}


def case(launch: str, where: str, sig: signal.Signals, grace: float) -> dict:
    event, left = (ONE_PROCESS if launch == "one" else {}).get(where, PHASES[where])
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, marks = Path(tmp) / "run", Path(tmp) / "phase"
        cmd = [c.format(grace=int(grace)) for c in LAUNCH[launch]]
        env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
        env |= PACE | {PHASE: str(marks), FROM: event}
        argv = [*cmd, *RUN, f"launcher.grace_s={grace}", f"hydra.run.dir={run_dir}"]
        p = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        name, count = event.split()
        while (now := phase(marks)) is None or now[0] != name or now[1] < int(count):
            if p.poll() is not None:
                raise SystemExit(f"error: the run ended before {event}:\n{p.stdout.read()[-3000:]}")
            time.sleep(0.1)
        time.sleep(1.0)
        sent = time.time()
        os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)  # Ctrl-C: the terminal's whole group
        out, _ = p.communicate(timeout=grace + 300)
        exited = time.time() - sent
        metas = sorted((run_dir / "checkpoints").glob("step_*/meta.json"))
        saved = max((json.loads(m.read_text())["time"] for m in metas), default=None)
    killed = "RankKilled" in out or "forcefully exiting" in out or "Unable to shutdown" in out
    return {"launch": launch, "phase": where, "signal": sig.name, "grace_s": grace,
            "checkpoint_s": None if saved is None or saved < sent else round(saved - sent, 1),
            "exit_s": round(exited, 1), "exit": p.returncode, "killed": killed,
            "baseline_s": left - 1}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grace", type=float, default=10.0)
    ap.add_argument("--launch", nargs="+", default=["one", "plain", "torchrun"], choices=sorted(LAUNCH))
    ap.add_argument("--phase", nargs="+", default=["generation", "update"], choices=sorted(PHASES))
    ap.add_argument("--signal", nargs="+", default=["SIGTERM"], choices=["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1"])
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"grace {args.grace:g} s; load average {load:.1f} on {os.cpu_count()} cores")
    print("| launch | phase | signal | signal -> checkpoint (s) | signal -> exit (s) | exit | a rank killed | "
          "the phase's rest to the step's end (s, baseline) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for launch in args.launch:
        for where in args.phase:
            for sig in args.signal:
                r = case(launch, where, signal.Signals[sig], args.grace)
                print(f"| {r['launch']} | {r['phase']} | {r['signal']} | {r['checkpoint_s']} | {r['exit_s']} | "
                      f"{r['exit']} | {'yes' if r['killed'] else 'no'} | {r['baseline_s']} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
