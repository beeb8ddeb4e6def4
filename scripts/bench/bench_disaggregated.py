"""Disaggregated rollout against the colocated sync loop, on the same samples and updates, in one process.

    python scripts/bench/bench_disaggregated.py --steps 12
    python scripts/bench/bench_disaggregated.py --steps 12 --overrides learner.mini_batches_per_rollout=2

Two runs of ``train.py``'s loop (``bapo.loop.run``) with the same config:

1. **baseline**: today's sync mode, rollout in the learner's process, ``placement.learner_threads`` threads (2);
2. **disaggregated**: ``placement=disaggregated`` with one worker at one torch thread and the learner at one,
   async admission at ``buffer.max_staleness=k`` (2), so the worker makes batch t + 1 while the learner trains on t.

It prints, per run: training throughput (samples per second over steps 1..N, evaluation excluded), the share of
that wall time in which rollout and learning were both busy (rollout: the batch maker's calls, which in the
disaggregated run last as long as the worker's work on the batch; learning: the loop's ``learn``), the seconds
spent moving weights, and the realised staleness histogram; then the ratio of the two throughputs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from bapo import loop
from bapo.config import ROOT
from bapo.rollout import producer

TRAIN = ["logger.mode=disabled", "logger.progress=false", "eval.every=0", "checkpoint.every=0"]


def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def measure(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(iv))


def overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Seconds in which both interval sets are active."""
    total, ux, uy = 0.0, union(x), union(y)
    for a, b in ux:
        for c, d in uy:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def one(name: str, overrides: list[str], out: Path) -> dict:
    """Run the loop once, recording when batches were made and when the learner learned."""
    made: list[tuple[float, float]] = []
    learned: list[tuple[float, float]] = []
    real_learn, real_produce = loop.learn, producer.Producer._produce_one

    def learn(rc, s, samples):
        t0 = time.monotonic()
        try:
            return real_learn(rc, s, samples)
        finally:
            learned.append((t0, time.monotonic()))

    def produce(self):
        t0 = time.monotonic()
        try:
            return real_produce(self)
        finally:
            made.append((t0, time.monotonic()))

    loop.learn, producer.Producer._produce_one = learn, produce
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            cfg = compose(config_name="config", overrides=[*TRAIN, *overrides])
        loop.run(cfg, out / name)
    finally:
        loop.learn, producer.Producer._produce_one = real_learn, real_produce
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()][1:]
    # the window: from the first batch's start to the last update's end (the start's and the end's evaluations
    # fall outside it)
    start, end = min(a for a, _ in made), max(b for _, b in learned)
    made = [(max(a, start), min(b, end)) for a, b in made if a < end]
    wall = end - start
    samples = len(rows) * cfg.train.prompts_per_step * cfg.rollout.n
    hist: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("buffer/staleness_hist/"):
                hist[k.rsplit("/", 1)[1]] = hist.get(k.rsplit("/", 1)[1], 0.0) + v
    return {
        "name": name,
        "steps": len(rows),
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "rollout_busy": measure(made) / wall,
        "learner_busy": measure(learned) / wall,
        "both_busy": overlap(made, learned) / wall,
        "sync_s": sum(r.get("time/sync_s", 0.0) for r in rows),
        "staleness_hist": {k: hist[k] for k in sorted(hist, key=int)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--k", type=int, default=2, help="buffer.max_staleness of the disaggregated run")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the baseline's one process")
    p.add_argument("--learner-threads", type=int, default=1, help="torch threads of the disaggregated learner")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads of the worker")
    p.add_argument("--overrides", default="learner.mini_batches_per_rollout=1", help="comma-separated, for both runs")
    args = p.parse_args()
    common = [f"train.steps={args.steps}", *[o for o in args.overrides.split(",") if o]]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        one("warm-up", [*common, "train.steps=1"], out)  # imports, allocator and caches, outside the measurement
        base = one("sync-colocated", [*common, f"placement.learner_threads={args.threads}"], out)
        dis = one(
            "async-disaggregated",
            [
                *common,
                "placement=disaggregated",
                f"placement.learner_threads={args.learner_threads}",
                f"placement.worker_threads={args.worker_threads}",
                "train.async_rollout=true",
                f"buffer.max_staleness={args.k}",
            ],
            out,
        )
    head = ("steps", 5), ("wall s", 7), ("samples/s", 9), ("rollout", 7), ("learner", 7), ("both", 5), ("sync s", 6)
    print(f"{'run':<22} " + " ".join(f"{h:>{w}}" for h, w in head))
    for r in (base, dis):
        print(
            f"{r['name']:<22} {r['steps']:>5} {r['wall_s']:>7.1f} {r['samples_per_s']:>9.1f} {r['rollout_busy']:>7.0%} "
            f"{r['learner_busy']:>7.0%} {r['both_busy']:>5.0%} {r['sync_s']:>6.2f}   staleness {r['staleness_hist']}"
        )
    print(f"throughput ratio (disaggregated / sync): {dis['samples_per_s'] / base['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
