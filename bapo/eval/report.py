"""eval.py's reports: ``results.json`` (every set's metrics and per-problem rows, what was skipped, the config),
``results.md`` (a table, one row per set) and ``samples_<set>.jsonl`` (one row per sample)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from bapo.eval import passk as M
from bapo.eval.evaluate import SetResult


def write_samples(path: str | Path, samples: Sequence[dict]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for row in samples:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_results(run_dir: str | Path, results: Mapping[str, SetResult], *, k: int, config: dict) -> None:
    """``results.json`` (metrics and per-problem rows of every set, what was skipped, and the config) and
    ``results.md``."""
    run_dir = Path(run_dir)
    sets = {
        name: {"n_problems": len(r.problems), "n_skipped": r.skipped, "k": k, "metrics": r.metrics,
               "problems": r.problems}
        for name, r in results.items()
    }  # fmt: skip
    (run_dir / "results.json").write_text(json.dumps({"sets": sets, "config": config}, indent=2))
    (run_dir / "results.md").write_text(results_table(results, k=k))


def results_table(results: Mapping[str, SetResult], *, k: int) -> str:
    """A Markdown table, one row per set; accuracies and the truncation rate in percent. ``n`` counts the
    problems evaluated, ``skipped`` those left out because their prompt was over the limit."""
    cols = [f"avg@{k}", *(f"pass@{j}" for j in M.pass_ks(k)), f"maj@{k}"]
    lines = [
        "| set | n | skipped | k | " + " | ".join(cols) + " | len | trunc % |",
        "|---|---:|---:|---:|" + "---:|" * len(cols) + "---:|---:|",
    ]
    for name, r in results.items():
        acc = " | ".join(f"{100 * r.metrics[c]:.1f}" for c in cols)
        m = r.metrics
        lines.append(
            f"| {name} | {len(r.problems)} | {r.skipped} | {k} | {acc} | {m['response_len']:.0f} "
            f"| {100 * m['truncated']:.1f} |"
        )
    return "\n".join(lines) + "\n"
