"""Run a sweep's grid a few runs at a time, in the order given, each where Hydra's sweeper would put it.

``python train.py -m`` runs a grid one run after another. On a small machine two runs side by side,
one thread each, finish a grid sooner, and an order (the most informative cells first) makes a
stopped study useful. Each run goes to ``<sweep dir>/<override_dirname>``, the folder name the sweeper
uses, so ``python train.py -m experiment=<name>`` and this script share finished runs both ways
(``resume: auto`` in the study configs). A run whose ``final_metrics.json`` exists is skipped.

    python scripts/study/run_grid.py study_v3 "algo=grpo learner.mini_batches_per_rollout=5" --seeds 1 2 3 4 5 --jobs 2

Each cell is a space-separated list of overrides; every cell runs once per seed. Each run's output goes to
``<sweep dir>/logs/<run>.log``. ``<sweep dir>/logs/grid.jsonl`` gets a line per run queued (run, overrides) and
a line per attempt (run, exit status, seconds, the ``error:`` line of a failed one). At the end the whole sweep
folder, this grid's runs and any others in it, is packed into ``<sweep dir>/runs.jsonl.gz`` (``--pack``
elsewhere; ``scripts/study/pack_study.py``), the raw data a study commits and ``scripts/study/report.py`` reads.

A bad cell does not stop the grid: every other run still runs. At the end each run of this grid without
``final_metrics.json`` is listed by name with its error line, and the exit status is 1. Bad input (an unknown
experiment, a bad option, a cell that is not ``key=value`` overrides) is one ``error:`` line and exit status 2,
before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts/ is read as a namespace package, as gpu_check.py does
from scripts.study import pack_study  # noqa: E402
from scripts.study.pack_study import usage_error  # noqa: E402


def sweep_dir(experiment: str, needed: bool = True) -> str | None:
    """The experiment's ``hydra.sweep.dir``; an unknown experiment (or one without it, when ``needed``) is bad input."""
    path = ROOT / "conf" / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        usage_error(f"experiment: no conf/experiment/{experiment}.yaml (known: {known})")
    found = OmegaConf.select(OmegaConf.load(path), "hydra.sweep.dir")
    if found is None and needed:
        usage_error(f"conf/experiment/{experiment}.yaml sets no hydra.sweep.dir (give --sweep-dir)")
    return found


def run_name(overrides: list[str]) -> str:
    """Hydra's override_dirname (key=value pairs sorted, joined by ','), a group's '/' as '.' to stay one folder."""
    return ",".join(sorted(overrides)).replace("/", ".")


def run_one(experiment: str, overrides: list[str], root: Path, log_dir: Path) -> tuple[str, int, float]:
    name = run_name(overrides)
    run_dir = root / name
    if (run_dir / "final_metrics.json").is_file():
        return name, 0, 0.0
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "train.py", f"experiment={experiment}", *overrides, f"hydra.run.dir='{run_dir}'"]
    log_path = log_dir / f"{name}.log"
    start = log_path.stat().st_size if log_path.is_file() else 0
    t0 = time.time()
    with log_path.open("a") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    secs = time.time() - t0
    row = {"run": name, "rc": rc, "seconds": round(secs, 3)}
    if rc != 0:
        row["error"] = attempt_error(log_path, start)
    with (log_dir / pack_study.GRID_LOG).open("a") as f:  # one short line: appends from two threads stay whole
        f.write(json.dumps(row) + "\n")
    return name, rc, secs


def attempt_error(log_path: Path, start: int) -> str | None:
    """The last ``error:`` line or exception of this attempt's part of the run's log (from byte ``start``)."""
    with log_path.open("rb") as f:
        f.seek(start)
        return pack_study.last_exception_in(f.read().decode(errors="replace"))


def build_parser() -> argparse.ArgumentParser:
    ap = pack_study.UsageParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", help="a conf/experiment name with a hydra.sweep.dir")
    ap.add_argument("cells", nargs="+", help="overrides of one cell, space-separated, in a single argument")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--sweep-dir", help="instead of the experiment's hydra.sweep.dir (e.g. a control run)")
    ap.add_argument("--pack", type=Path, help="where to pack the sweep at the end (default <sweep dir>/runs.jsonl.gz)")
    return ap


def check_args(args: argparse.Namespace) -> None:
    """Bad input, refused before anything is written (one ``error:`` line, exit status 2)."""
    if args.jobs < 1:
        usage_error(f"argument --jobs: must be at least 1, got {args.jobs}")
    for cell in args.cells:
        tokens = cell.split()
        if not tokens:
            usage_error("a cell is empty: give each cell's overrides, space-separated, in one argument")
        for token in tokens:
            if "=" not in token or token.startswith("="):
                usage_error(f"cell {cell!r}: {token!r} is not an override (key=value)")
            if token.lstrip("+~").split("=", 1)[0] in ("seed", "hydra.run.dir"):
                usage_error(f"cell {cell!r}: {token!r} is set by run_grid (seeds: --seeds)")
    names = [run_name(cell.split()) for cell in args.cells]
    if len(set(names)) < len(names):
        usage_error(f"a cell is given twice: {next(n for n in names if names.count(n) > 1)}")
    if len(set(args.seeds)) < len(args.seeds):
        usage_error(f"argument --seeds: a seed is given twice: {' '.join(map(str, args.seeds))}")


def check_compose(experiment: str, cells: list[str]) -> None:
    """Every cell composes (an unknown option such as algo=nosuch is refused before any run starts, as
    ``train.py -m`` refuses it): one ``error:`` line naming the cell."""
    from hydra.errors import HydraException

    from bapo.entry.plan import compose
    from bapo.infra.checks import ConfigError

    for cell in cells:
        try:
            compose([f"experiment={experiment}", *cell.split()])
        except (ConfigError, HydraException) as e:
            usage_error(f"cell {cell!r}: {str(e).strip().splitlines()[0]}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    default = sweep_dir(args.experiment, needed=not args.sweep_dir)
    check_compose(args.experiment, args.cells)
    root = ROOT / (args.sweep_dir or default)
    blocked = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        usage_error(f"the sweep folder {root} lies under {blocked}, which is a file")
    pack = args.pack or root / "runs.jsonl.gz"
    if pack.is_dir():
        usage_error(f"argument --pack: {pack} is a folder; give the file to write, e.g. {pack / 'runs.jsonl.gz'}")
    log_dir = root / "logs"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        usage_error(f"the sweep folder {root}: {e.strerror}")
    jobs = [cell.split() + [f"seed={s}"] for s in args.seeds for cell in args.cells]  # seed-major: early seeds first
    with (log_dir / pack_study.GRID_LOG).open("a") as f:  # the plan: a run that never starts is still listed
        f.writelines(json.dumps({"run": run_name(o), "overrides": o}) + "\n" for o in jobs)
    where = root.relative_to(ROOT) if root.is_relative_to(ROOT) else root
    t0 = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        for name, rc, secs in pool.map(lambda o: run_one(args.experiment, o, root, log_dir), jobs):
            print(f"{'ok ' if rc == 0 else f'rc={rc}'} {secs:6.0f}s {where}/{name}", flush=True)
    print(f"grid: {len(jobs)} runs in {time.time() - t0:.0f}s", flush=True)
    records = pack_study.read_folder(root)
    pack_study.write_pack(str(where), records, pack)
    print(f"packed {len(records)} runs of {where} into {pack}", flush=True)
    return report_failures(root, jobs, records)


def report_failures(root: Path, jobs: list[list[str]], records: list[dict]) -> int:
    """List each run of this grid that did not complete, with its error line; 1 if any did not, else 0."""
    by_name = {r["run"]: r for r in records}
    failed = []
    for name in dict.fromkeys(run_name(o) for o in jobs):
        record = by_name.get(name)
        if record is not None and record["status"] == "complete":
            continue
        why = (record or {}).get("exception") or "no error line in its logs"
        what = "no run folder" if record is None or record.get("folder") is False else "no final_metrics.json"
        failed.append(f"failed: {name}: {what}; {why}")
    for line in failed:
        print(line, file=sys.stderr, flush=True)
    if failed:
        print(f"grid: {len(failed)} of {len(jobs)} runs did not complete (logs in {root / 'logs'})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
