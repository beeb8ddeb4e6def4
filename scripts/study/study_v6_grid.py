"""Run study v6's grid; a relaunch, in this session or a later one, reruns nothing that finished.

    python scripts/study/study_v6_grid.py --pack /work/main/docs/study/v6/runs.jsonl.gz --commit

Run it from a git worktree at the commit that holds the plan (docs/study/v6/README.md has the whole relaunch
command). It takes the 120 runs the plan asks for (six arms on seeds 21-40, ``ARMS``), drops those complete in the
pack (the committed one: the only record that outlives a session), and runs the rest through
``scripts/study/run_grid.py`` seed by seed (every arm of a seed before the next seed, so a stopped grid holds whole
seeds) into ``multirun/study_v6``. Every ``--every`` finished runs, and at the end, the folder's finished runs
(complete or failed) are merged into the pack, and with ``--commit`` the pack alone is committed in its checkout.

It checks, as study v5's driver does (and with its functions), that the code that runs is this checkout's: every
child gets PYTHONPATH=<this checkout>, a child started with ``python -P`` from / imports bapo from here, and the
checkout's tracked files are unmodified.
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts/ is read as a namespace package, as report.py does
from scripts.study.pack_study import read_folder, write_pack  # noqa: E402
from scripts.study.study_v5_grid import commit, merge, packed, preflight, run_name  # noqa: E402

EXPERIMENT = "study_v6"
SWEEP = "multirun/study_v6"  # the experiment's hydra.sweep.dir
ARMS = {  # arm -> run_grid cell, in the order a seed runs them (conf/experiment/study_v6.yaml)
    "grpo": "algo=grpo",
    "bapo": "algo=bapo",
    "bapo_rho05": "algo=bapo algo.bounds.rho0=0.5",
    "corner": "algo=grpo algo.bounds.ratio_low=0.9 algo.bounds.ratio_high=3.0",
    "loose_low": "algo=grpo algo.bounds.ratio_low=0.69 algo.bounds.ratio_high=1.2",
    "onpolicy": "algo=grpo learner.mini_batches_per_rollout=1 train.prompts_per_step=4 train.steps=250 "
    "eval.every=50 checkpoint.every=125",
}
SEEDS = range(21, 41)


def planned() -> list[tuple[int, str]]:
    """(seed, cell) of every run, seed-major, in ``ARMS``' order within a seed."""
    return [(seed, cell) for seed in SEEDS for cell in ARMS.values()]


def batches(done: set[str]) -> list[tuple[list[str], list[int]]]:
    """The runs not complete, as run_grid calls (cells, seeds): consecutive seeds that miss the same cells share one
    call, so a fresh grid is one call."""
    out: list[tuple[list[str], list[int]]] = []
    for seed in SEEDS:
        cells = [cell for s, cell in planned() if s == seed and run_name(cell, seed) not in done]
        if not cells:
            continue
        if out and out[-1][0] == cells and out[-1][1][-1] == seed - 1:
            out[-1][1].append(seed)
        else:
            out.append((cells, [seed]))
    return out


def update_pack(pack: Path) -> tuple[bool, set[str], int]:
    """Merge the sweep folder into the pack; (changed, names of the complete runs, number failed)."""
    sweep = ROOT / SWEEP
    records = merge(packed(pack), read_folder(sweep) if sweep.is_dir() else [])
    tmp = pack.with_name(pack.name + ".new")
    write_pack(SWEEP, records, tmp)
    changed = not pack.is_file() or gzip.decompress(tmp.read_bytes()) != gzip.decompress(pack.read_bytes())
    tmp.replace(pack) if changed else tmp.unlink()
    complete = {r["run"] for r in records if r["status"] == "complete"}
    return changed, complete, sum(r["status"] == "failed" for r in records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", type=Path, required=True, help="the committed pack, e.g. docs/study/v6/runs.jsonl.gz")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (run_grid --jobs)")
    ap.add_argument("--every", type=int, default=12, help="pack (and commit) after this many finished runs")
    ap.add_argument("--poll", type=float, default=60.0, help="seconds between looks at the sweep folder")
    ap.add_argument("--commit", action="store_true", help="commit each pack that changed, alone")
    ap.add_argument("--allow-dirty", action="store_true", help="run from a checkout with modified tracked files")
    args = ap.parse_args(argv)
    pack = args.pack.resolve()
    pack.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    head = preflight(env, args.allow_dirty)
    total = len(planned())

    def save(why: str) -> set[str]:
        changed, complete, failed = update_pack(pack)
        if changed:
            print(f"packed {len(complete)} complete, {failed} failed of {total} ({why})", flush=True)
            if args.commit:
                extra = f", {failed} failed" if failed else ""
                commit(pack, f"study v6: {len(complete)} of {total} runs packed{extra}\n\n{why}; grid at {head}")
        return complete

    done = save("before the grid starts")
    sweep = ROOT / SWEEP
    for cells, seeds in batches(done):
        cmd = [sys.executable, str(ROOT / "scripts" / "study" / "run_grid.py"), EXPERIMENT, *cells, "--seeds",
               *map(str, seeds), "--jobs", str(args.jobs)]  # fmt: skip
        print(f"{len(cells)} cells x seeds {seeds[0]}-{seeds[-1]}", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        while proc.poll() is None:
            time.sleep(args.poll)
            finished = {f.parent.name for f in sweep.glob("*/final_metrics.json")} if sweep.is_dir() else set()
            if len(finished - done) >= args.every:
                done = save("grid running")
        done = save("batch done")
        if proc.returncode != 0:
            raise SystemExit(f"error: run_grid exited with {proc.returncode}")
    save("grid done")
    print("grid done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
