"""Run study v5's grid level by level; a relaunch, in this session or a later one, reruns nothing that finished.

    python scripts/study/study_v5_grid.py --packs /work/main/docs/study/v5 --commit

Run it from a git worktree at the commit that holds the plan (docs/study/v5/README.md has the whole relaunch
command: the worktree, nice, nohup). For each level in the plan's order (L2, then L1) it takes the runs the plan
asks for (bapo, clip_higher, grpo and GRPO with the fixed window [0.69, 2.05] on seeds 1-20, on-policy GRPO on
seeds 1-10: 90 a level), drops those complete in the level's pack (``<packs>/<level>/runs.jsonl.gz``, the
committed one: the only record that outlives a session), and runs the rest through ``scripts/study/run_grid.py``
(seed-major, so a stopped level holds whole seeds) into the level's sweep folder (``conf/experiment/study_v5*.yaml``;
run_grid itself skips a run whose folder finished). Every ``--every`` finished runs, and at each level's end, the
finished runs of the folder (complete or failed) are merged into the pack, and with ``--commit`` the pack alone is
committed in its git checkout. A session that ends mid-grid loses the runs in flight and at most ``--every`` - 1
finished ones.

Before anything runs it checks that the code that runs is this checkout's: every child gets PYTHONPATH=<this
checkout> (train.py and its reward workers, which start with ``python -P`` and so would otherwise import the
venv's editable install), a child started that way from / must import bapo from here, and the checkout's tracked
files must be unmodified (the commit then says what ran).
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
from scripts.study.pack_study import read_folder, read_pack, write_pack  # noqa: E402

# The plan's order is L2, L3, L1 (a grid stopped early answers at L2 first). L3 is not run: the pilot's highest
# healthy lr is L2's, so L3 would repeat L2 run for run (docs/study/v5/PLAN.md).
ORDER = ("L2", "L1")
EXPERIMENT = {"L1": "study_v5_l1", "L2": "study_v5"}
SWEEP = {level: f"multirun/study_v5/{level}" for level in ORDER}  # each experiment's hydra.sweep.dir
CELLS = {  # arm -> run_grid cell (each experiment sets 5 updates a batch)
    "bapo": "algo=bapo",
    "clip_higher": "algo=clip_higher",
    "grpo": "algo=grpo",
    "fixed": "algo=grpo algo.bounds.ratio_low=0.69 algo.bounds.ratio_high=2.05",
    "onpolicy": "algo=grpo learner.mini_batches_per_rollout=1",
}
SEEDS = {arm: range(1, 11) if arm == "onpolicy" else range(1, 21) for arm in CELLS}
FINISHED = ("complete", "failed")  # what a pack keeps; an incomplete run (in flight) waits for the next pack


def run_name(cell: str, seed: int) -> str:
    """The run's folder under the sweep, as scripts/study/run_grid.py names it (Hydra's override_dirname)."""
    return ",".join(sorted([*cell.split(), f"seed={seed}"])).replace("/", ".")


def planned() -> list[tuple[int, str]]:
    """(seed, cell) of every run of a level, seed-major, the primary arms first within a seed."""
    return [(seed, cell) for seed in range(1, 21) for arm, cell in CELLS.items() if seed in SEEDS[arm]]


def packed(pack: Path) -> dict[str, dict]:
    """run name -> record of the finished runs in a pack (none when there is no pack yet)."""
    if not pack.is_file():
        return {}
    return {r["run"]: r for r in read_pack(pack)[1] if r["status"] in FINISHED}


def batches(done: set[str]) -> list[tuple[list[str], list[int]]]:
    """The runs not complete, as run_grid calls (cells, seeds): consecutive seeds that miss the same cells share
    one call, so a fresh level is two calls (5 arms on seeds 1-10, 4 on 11-20)."""
    out: list[tuple[list[str], list[int]]] = []
    for seed in range(1, 21):
        cells = [cell for s, cell in planned() if s == seed and run_name(cell, seed) not in done]
        if not cells:
            continue
        if out and out[-1][0] == cells and out[-1][1][-1] == seed - 1:
            out[-1][1].append(seed)
        else:
            out.append((cells, [seed]))
    return out


def merge(old: dict[str, dict], folder: list[dict]) -> list[dict]:
    """The pack's records: the old pack's, replaced by the folder's finished runs (a complete record is never
    replaced by a failed one), in name order."""
    out = dict(old)
    for r in folder:
        if r["status"] in FINISHED and not (
            r["status"] == "failed" and out.get(r["run"], {}).get("status") == "complete"
        ):
            out[r["run"]] = r
    return [out[k] for k in sorted(out)]


def update_pack(level: str, pack: Path) -> tuple[bool, set[str], int]:
    """Merge the level's folder into its pack; (changed, names of the complete runs, number failed)."""
    sweep = ROOT / SWEEP[level]
    records = merge(packed(pack), read_folder(sweep) if sweep.is_dir() else [])
    tmp = pack.with_name(pack.name + ".new")
    write_pack(SWEEP[level], records, tmp)
    changed = not pack.is_file() or gzip.decompress(tmp.read_bytes()) != gzip.decompress(pack.read_bytes())
    tmp.replace(pack) if changed else tmp.unlink()
    complete = {r["run"] for r in records if r["status"] == "complete"}
    return changed, complete, sum(r["status"] == "failed" for r in records)


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def commit(pack: Path, message: str) -> None:
    """Commit the pack alone in its checkout, waiting out another agent's index.lock."""
    repo = Path(git(pack.parent, "rev-parse", "--show-toplevel").stdout.strip())
    rel = pack.resolve().relative_to(repo.resolve()).as_posix()
    for _ in range(20):
        added = git(repo, "add", "--", rel)
        done = added.returncode == 0 and git(repo, "commit", "-q", "-m", message, "--", rel)
        if done and done.returncode == 0:
            return
        err = (added.stderr + (done.stderr if done else "")).strip()
        if "index.lock" not in err:
            print(f"warning: commit of {rel} failed: {err}", flush=True)
            return
        time.sleep(3)
    print(f"warning: commit of {rel} gave up after 20 tries (index.lock)", flush=True)


def preflight(env: dict, allow_dirty: bool) -> str:
    """This checkout's commit, after checking that a child imports bapo from here (module docstring)."""
    probe = [sys.executable, "-P", "-c", "import bapo; print(bapo.__file__)"]
    where = subprocess.run(probe, cwd="/", env=env, capture_output=True, text=True).stdout.strip()
    if not where.startswith(str(ROOT / "bapo") + os.sep):
        raise SystemExit(f"error: a child imports bapo from {where or '?'}, not from {ROOT}")
    dirty = git(ROOT, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty and not allow_dirty:
        raise SystemExit(f"error: {ROOT} has modified tracked files (the grid runs from a commit):\n{dirty}")
    head = git(ROOT, "rev-parse", "--short", "HEAD").stdout.strip()
    print(f"bapo from {where}; checkout {ROOT} at {head}" + (" (modified)" if dirty else ""), flush=True)
    return head


def run_level(level: str, args, env: dict, head: str) -> None:
    pack = args.packs / level / "runs.jsonl.gz"
    pack.parent.mkdir(parents=True, exist_ok=True)
    sweep = ROOT / SWEEP[level]
    total = len(planned())

    def save(why: str) -> set[str]:
        changed, complete, failed = update_pack(level, pack)
        if changed:
            print(f"{level}: packed {len(complete)} complete, {failed} failed of {total} ({why})", flush=True)
            if args.commit:
                extra = f", {failed} failed" if failed else ""
                commit(pack, f"study v5 {level}: {len(complete)} of {total} runs packed{extra} ({why}; grid at {head})")
        return complete

    done = save("before the level starts")
    for cells, seeds in batches(done):
        cmd = [sys.executable, str(ROOT / "scripts" / "study" / "run_grid.py"), EXPERIMENT[level], *cells, "--seeds",
               *map(str, seeds), "--jobs", str(args.jobs)]  # fmt: skip
        print(f"{level}: {len(cells)} cells x seeds {seeds[0]}-{seeds[-1]}", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        while proc.poll() is None:
            time.sleep(args.poll)
            finished = {f.parent.name for f in sweep.glob("*/final_metrics.json")} if sweep.is_dir() else set()
            if len(finished - done) >= args.every:
                done = save("grid running")
        done = save("batch done")
        if proc.returncode != 0:
            raise SystemExit(f"error: run_grid exited with {proc.returncode} on {level}")
    save("level done")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packs", type=Path, required=True, help="the committed packs' folder, e.g. docs/study/v5")
    ap.add_argument("--levels", nargs="+", default=list(ORDER), choices=ORDER, help="in this order")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (run_grid --jobs)")
    ap.add_argument("--every", type=int, default=20, help="pack (and commit) after this many finished runs")
    ap.add_argument("--poll", type=float, default=60.0, help="seconds between looks at the sweep folder")
    ap.add_argument("--commit", action="store_true", help="commit each pack that changed, alone")
    ap.add_argument("--allow-dirty", action="store_true", help="run from a checkout with modified tracked files")
    args = ap.parse_args(argv)
    args.packs = args.packs.resolve()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    head = preflight(env, args.allow_dirty)
    for level in args.levels:
        run_level(level, args, env, head)
    print("grid done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
