"""Run a sweep's grid a few runs at a time, in the order given, each where Hydra's sweeper would put it.

``python train.py -m`` runs a grid one run after another. On a small machine two runs side by side,
one thread each, finish a grid sooner, and an order (the most informative cells first) makes a
stopped study useful. Each run goes to ``<sweep dir>/<override_dirname>``, the folder name the sweeper
uses, so ``python train.py -m experiment=<name>`` and this script share finished runs both ways
(``resume: auto`` in the study configs). A run whose ``final_metrics.json`` exists is skipped.

    python scripts/run_grid.py study_v3 "algo=grpo learner.mini_batches_per_rollout=5" --seeds 1 2 3 4 5 --jobs 2

Each cell is a space-separated list of overrides; every cell runs once per seed. Each run's output goes to
``<sweep dir>/logs/<run>.log``, and each attempt adds a line to ``<sweep dir>/logs/grid.jsonl`` (run, exit
status, seconds). At the end the whole sweep folder, this grid's runs and any others in it, is packed into
``<sweep dir>/runs.jsonl.gz`` (``--pack`` elsewhere; ``scripts/pack_study.py``), the raw data a study commits and
``scripts/report.py`` reads.
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts/ is read as a namespace package, as gpu_check.py does
from scripts import pack_study  # noqa: E402


def sweep_dir(experiment: str) -> str:
    path = ROOT / "conf" / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise SystemExit(f"experiment: no {path.relative_to(ROOT)} (known: {known})")
    cfg = OmegaConf.load(path)
    found = OmegaConf.select(cfg, "hydra.sweep.dir")
    if found is None:
        raise SystemExit(f"conf/experiment/{experiment}.yaml sets no hydra.sweep.dir")
    return found


def run_one(experiment: str, overrides: list[str], root: Path, log_dir: Path) -> tuple[str, int, float]:
    # Hydra's override_dirname (key=value pairs sorted, joined by ','), with a group's '/' as '.' to stay one folder
    name = ",".join(sorted(overrides)).replace("/", ".")
    run_dir = root / name
    if (run_dir / "final_metrics.json").is_file():
        return name, 0, 0.0
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "train.py", f"experiment={experiment}", *overrides, f"hydra.run.dir='{run_dir}'"]
    t0 = time.time()
    with (log_dir / f"{name}.log").open("a") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    secs = time.time() - t0
    with (log_dir / pack_study.GRID_LOG).open("a") as f:  # one short line: appends from two threads stay whole
        f.write(json.dumps({"run": name, "rc": rc, "seconds": round(secs, 3)}) + "\n")
    return name, rc, secs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", help="a conf/experiment name with a hydra.sweep.dir")
    ap.add_argument("cells", nargs="+", help="overrides of one cell, space-separated, in a single argument")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--sweep-dir", help="instead of the experiment's hydra.sweep.dir (e.g. a control run)")
    ap.add_argument("--pack", type=Path, help="where to pack the sweep at the end (default <sweep dir>/runs.jsonl.gz)")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    root = ROOT / (args.sweep_dir or sweep_dir(args.experiment))
    log_dir = root / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs = [cell.split() + [f"seed={s}"] for s in args.seeds for cell in args.cells]  # seed-major: early seeds first
    where = root.relative_to(ROOT) if root.is_relative_to(ROOT) else root
    t0 = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        for name, rc, secs in pool.map(lambda o: run_one(args.experiment, o, root, log_dir), jobs):
            print(f"{'ok ' if rc == 0 else f'rc={rc}'} {secs:6.0f}s {where}/{name}", flush=True)
    print(f"grid: {len(jobs)} runs in {time.time() - t0:.0f}s", flush=True)
    pack = args.pack or root / "runs.jsonl.gz"
    records = pack_study.read_folder(root)
    pack_study.write_pack(str(where), records, pack)
    print(f"packed {len(records)} runs of {where} into {pack}", flush=True)


if __name__ == "__main__":
    main()
