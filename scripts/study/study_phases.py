"""A study's clipping and search metrics by training phase, read from its pack (or sweep folder) alone.

    python scripts/study/study_phases.py docs/study/v4/runs.jsonl.gz --phases 0:30 30:50

report.py's tables read a run's end; a testbed whose regime fades (the rambling testbed's positive share is near
0.4 only for its first 20-30 steps) needs the same metrics over windows of steps. For each arm x staleness and
each window [a, b) of training steps, this prints the mean over the completed seeds of each run's mean over the
window of:

- ``rho before`` (``bapo/rho_before``: the positive share under the previous bounds, BAPO arms only) and ``rho``
  (``clip/rho``: under the bounds the update used; every arm logs it). An update with no advantage-carrying token
  logs rho = 1 by convention (nothing to search), so where many carry none (small batches, a low accuracy) these
  means lean towards 1;
- ``rho pooled``: sum P / (sum P + sum N) of ``clip/P`` and ``clip/N`` over the window's steps, the positive share
  of the window's updates taken together: updates without a signal add nothing to it;
- ``signal`` (``bapo/signal``, BAPO arms): the share of search units in which some token carried an advantage;
- ``engaged`` (``bapo/search_active``: the share of search units whose rho_before was under rho0, so the search
  moved the bounds: the paper's Fig. 8 implies at least about 47%);
- ``c_low``/``c_high`` (``clip/low``, ``clip/high``: the bounds the update used);
- ``clip+``/``clip-`` (``learner/clip_frac_pos``, ``learner/clip_frac_neg``: clipped share of tokens with positive
  and negative advantage), ``ratio max`` (``learner/ratio_max``) and ``truncated`` (``rollout/truncated``).

Markdown on stdout; nothing is written.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from scripts.study.report import _show, group_runs, load_runs  # noqa: E402

COLUMNS = {
    "rho before": "bapo/rho_before",
    "rho": "clip/rho",
    "rho pooled": "clip/P, clip/N",
    "signal": "bapo/signal",
    "engaged": "bapo/search_active",
    "c_low": "clip/low",
    "c_high": "clip/high",
    "clip+": "learner/clip_frac_pos",
    "clip-": "learner/clip_frac_neg",
    "ratio max": "learner/ratio_max",
    "truncated": "rollout/truncated",
}
POOLED = COLUMNS["rho pooled"]
P_KEY, N_KEY = "clip/P", "clip/N"


def window_mean(steps: dict[int, dict], key: str, start: int, stop: int) -> float | None:
    """The mean of ``key`` over the logged steps in [start, stop), or None when none logged it."""
    vals = [row[key] for s, row in steps.items() if start <= s < stop and isinstance(row.get(key), (int, float))]
    vals = [float(v) for v in vals if math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


def window_pooled_rho(steps: dict[int, dict], start: int, stop: int) -> float | None:
    """sum P / (sum P + sum N) of ``clip/P`` and ``clip/N`` over the logged steps in [start, stop); None when no
    step in the window logged both, or when they sum to 0 (no update carried a signal)."""
    p = n = 0.0
    seen = False
    for s, row in steps.items():
        a, b = row.get(P_KEY), row.get(N_KEY)
        if start <= s < stop and isinstance(a, (int, float)) and isinstance(b, (int, float)):
            if math.isfinite(float(a)) and math.isfinite(float(b)):
                p, n, seen = p + float(a), n + float(b), True
    return p / (p + n) if seen and p + n > 0 else None


def parse_phase(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--phases: {text!r} is not START:STOP (two integers, e.g. 0:30)") from None
    if not 0 <= a < b:
        raise SystemExit(f"--phases: {text!r} needs 0 <= START < STOP")
    return a, b


def table(source: Path, phases: list[tuple[int, int]]) -> str:
    name, runs = load_runs(source)
    groups = group_runs([r for r in runs if r.complete])
    head = ["algo", "staleness", "steps", "seeds", *COLUMNS]
    lines = [f"Sweep `{name}`: per-phase means over completed seeds", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + " --- |" * len(head))
    for (label, level), members in groups.items():
        for a, b in phases:
            cells = []
            for key in COLUMNS.values():
                if key == POOLED:
                    per_run = [m for m in (window_pooled_rho(r.steps, a, b) for r in members) if m is not None]
                else:
                    per_run = [m for m in (window_mean(r.steps, key, a, b) for r in members) if m is not None]
                cells.append(f"{sum(per_run) / len(per_run):.3f}" if per_run else "—")
            lines.append(f"| {label} | {_show(level)} | {a}-{b - 1} | {len(members)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="a study's pack (runs.jsonl.gz) or a multirun folder")
    parser.add_argument("--phases", nargs="+", default=["0:30", "30:50"], help="windows of steps, START:STOP")
    args = parser.parse_args(argv)
    if not args.sweep.exists():
        raise SystemExit(f"sweep: no {args.sweep}")
    print(table(args.sweep, [parse_phase(p) for p in args.phases]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
