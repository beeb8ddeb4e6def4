"""The cost of partial rollouts: step time with ``rollout.partial_budget`` against whole responses, at equal samples.

Both runs train the same config for ``--steps`` steps in this process (sync mode, one after the other), each
emitting ``train.prompts_per_step x rollout.n`` finished responses a step; the only change is the budget (and
``buffer.max_staleness`` raised to the bound the budget needs, which in sync mode only bounds). Printed: the
median step, rollout and learner times of each, their ratios, and the tokens re-prefilled per step (the
prefixes of resumed responses, the price of continuing a response under new weights).

    python scripts/bench/bench_partial.py [--steps 4] [--budget-frac 0.25] [--threads 2]
        [--overrides model=tiny_longcot,data=mixops,train.prompts_per_step=20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/
from scripts.bench.harness import ROOT  # noqa: E402

KEYS = ("time/step_s", "time/rollout_s", "time/learner_s", "rollout/reprefill_tokens", "rollout/new_tokens")


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return hydra_compose(config_name="config", overrides=overrides)


def medians(overrides: list[str]) -> dict[str, float]:
    from bapo.loop import run

    with tempfile.TemporaryDirectory() as d:
        run(compose(overrides), d)
        lines = (Path(d) / "metrics.jsonl").read_text().splitlines()
        rows = [r for r in map(json.loads, lines) if r["step"] >= 2]  # step 1 warms the caches up
    return {k: statistics.median(r[k] for r in rows) for k in KEYS if k in rows[0]}  # partial-only keys: absent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-frac", type=float, default=0.25, help="budget as a share of rollout.max_new_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--overrides", default="", help="comma-separated Hydra overrides for both runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from bapo.config import build
    from bapo.rollout.schedule import partial_lag

    common = [x for x in args.overrides.split(",") if x]
    common += [f"train.steps={args.steps}", "eval.every=0", "checkpoint.every=0", "logger.mode=disabled"]
    common += ["logger.progress=false", "train.async_rollout=false"]
    rc = build(compose(common), "/tmp/bapo-bench-partial")
    L, u, s = rc.rollout.max_new_tokens, rc.sizes.updates_per_step, rc.train.sync_every
    budget = max(1, int(L * args.budget_frac))
    k = max(rc.buffer.max_staleness, u - 1 + s - 1 + partial_lag(L, budget) * u)
    whole = medians(common)
    part = medians([*common, f"rollout.partial_budget={budget}", f"buffer.max_staleness={k}"])
    print(f"rollout.max_new_tokens={L}, partial_budget={budget} ({args.budget_frac:g}), {args.steps} steps, "
          f"{rc.sizes.samples_per_step} samples a step, medians over steps 2..{args.steps}")  # fmt: skip
    print(f"{'':24s}{'whole':>10s}{'partial':>10s}{'ratio':>8s}")
    for key in KEYS:
        if key in whole:
            print(f"{key:24s}{whole[key]:10.2f}{part[key]:10.2f}{part[key] / whole[key]:8.2f}")
        else:
            print(f"{key:24s}{'-':>10s}{part[key]:10.0f}")


if __name__ == "__main__":
    main()
