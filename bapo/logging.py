"""Metrics sinks: ``metrics.jsonl`` in the run folder (always) and wandb (optional,
offline unless configured otherwise). Each line of ``metrics.jsonl`` is one JSON
object with a ``step`` key, flushed as soon as it is written. A resumed run passes
its wandb ``run_id`` so its steps continue the same wandb run."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb: bool = False,
        project: str = "bapo",
        mode: str = "offline",
        group: str | None = None,
        tags: list[str] | None = None,
        name: str | None = None,
        config: dict | None = None,
        run_id: str | None = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self._wandb = None
        if wandb and mode != "disabled":
            import wandb as wb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wb.init(
                project=project,
                mode=mode,
                group=group,
                tags=tags or None,
                name=name,
                dir=str(run_dir),
                config=config,
                reinit="finish_previous",
                id=run_id,
                resume="allow" if run_id else None,
            )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step} | {k: _clean(v) for k, v in sorted(metrics.items())}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._f.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class NullLogger:
    """What ranks other than 0 log to."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def truncate_metrics(run_dir: Path, source_run: Path | None, step: int) -> dict[str, Any]:
    """Make ``run_dir/metrics.jsonl`` the rows of ``source_run``'s up to ``step``, atomically; return the last row.

    Lines a killed run wrote after its checkpoint are dropped, and so is a line cut short by the kill
    (and anything after it). ``source_run`` is the run the checkpoint belongs to (this one, or another run
    resumed from); returns the last kept row without its ``step``, or {} when there is none."""
    src = Path(source_run or run_dir) / "metrics.jsonl"
    keep, last = [], {}
    if src.is_file():
        for line in src.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if row.get("step", 1 << 60) <= step:
                keep.append(line)
                last = {k: v for k, v in row.items() if k != "step"}
    tmp = Path(run_dir) / ".metrics.jsonl.tmp"
    tmp.write_text("".join(x + "\n" for x in keep))
    tmp.replace(Path(run_dir) / "metrics.jsonl")
    return last
