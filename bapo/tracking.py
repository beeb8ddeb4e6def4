"""Metrics sinks: ``metrics.jsonl`` in the run folder (always) and wandb (optional,
offline unless configured otherwise). Each line of ``metrics.jsonl`` is one JSON
object with a ``step`` key, flushed as soon as it is written and fsynced before every
checkpoint (:meth:`MetricsLogger.sync`), so a checkpoint on disk never covers rows that
are not. A resumed run passes its wandb ``run_id`` so its steps continue the same wandb run.

On resume, :func:`truncate_metrics` keeps every intact row up to the checkpoint's step. A
damaged line (cut short by a crash or a power loss) is skipped and named, never a reason to
drop the rows after it; a step the checkpoint covers whose row is gone gets a marker row
``{"step": s, "metrics/lost": 1.0}`` and a warning, so the gap is visible in the file itself.
The run goes on: the checkpoint, not the metrics file, is what the resume continues from."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo.checks import choice, resumable

log = logging.getLogger(__name__)

LOST = "metrics/lost"  # the key of a marker row: this step's row was lost before a resume


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
        self._wandb = None
        if wandb and mode != "disabled":  # first: a wandb that cannot start leaves no metrics.jsonl behind
            import wandb as wb

            os.environ.setdefault("WANDB_SILENT", "true")
            try:
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
            except Exception as e:  # wandb's UsageError, CommError, a timeout: all mean "not this way"
                from bapo.config import ConfigError

                msg = str(e).strip().split("\n")[0]
                raise ConfigError(
                    f"logger.mode: wandb could not start (mode={mode}: {type(e).__name__}: {msg}); "
                    "use logger.mode=offline (sync later with wandb sync) or logger=none"
                ) from None
        self._f = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step} | {k: _clean(v) for k, v in sorted(metrics.items())}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def sync(self) -> None:
        """Put every row logged so far on disk (the loop calls it before each checkpoint)."""
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self.sync()
        self._f.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def check_wandb(mode: str) -> None:
    """Refuse ``logger.mode=online`` without wandb credentials, before anything is loaded or written.

    Looks where wandb itself looks: ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, or a netrc entry
    (``$NETRC``, ``~/.netrc``, ``~/_netrc``) for the host of ``WANDB_BASE_URL`` (default api.wandb.ai).
    """
    if mode != "online" or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    import netrc
    from urllib.parse import urlparse

    from bapo.config import ConfigError

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    env = os.environ.get("NETRC")
    files = [Path(env).expanduser()] if env else [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for f in files:
        if f.is_file():
            try:
                if netrc.netrc(f).authenticators(host) is not None:
                    return
            except (netrc.NetrcParseError, OSError):
                pass
            break  # wandb reads the first netrc file that exists, and only that one
    raise ConfigError(
        f"logger.mode: online needs wandb credentials for {host}: set WANDB_API_KEY, or run `wandb login` "
        f"(it writes {files[0]}); or use logger.mode=offline (sync later with `wandb sync`) or logger=none"
    )


class NullLogger:
    """What ranks other than 0 log to."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def _parse_row(line: str) -> dict | None:
    """One metrics line as a row, or None when it is damaged (not JSON, too deeply nested, or no int step)."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None
    ok = isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
    return row if ok else None


def truncate_metrics(run_dir: Path, source_run: Path | None, step: int) -> dict[str, Any]:
    """Make ``run_dir/metrics.jsonl`` the rows of ``source_run``'s up to ``step``, atomically; return the last row.

    ``source_run`` is the run the checkpoint belongs to (this one, or another run resumed from). Rows a killed
    run wrote after its checkpoint are dropped. A damaged line is skipped and named (file:line) with a warning;
    the rows after it are kept. Every step from 0 to ``step`` that has no intact row gets a marker row
    ``{"step": s, "metrics/lost": 1.0}`` in its place, named in a warning. Returns the last intact row kept,
    without its ``step``, or {} when there is none."""
    src = Path(source_run or run_dir) / "metrics.jsonl"
    rows: dict[int, str] = {}
    damaged: list[int] = []
    if src.is_file():
        for lineno, line in enumerate(src.read_text(errors="replace").splitlines(), 1):
            row = _parse_row(line)
            if row is None:
                if line.strip():
                    damaged.append(lineno)
            elif 0 <= row["step"] <= step:  # a marker row of an earlier resume is kept as it is
                rows[row["step"]] = line  # a step logged twice: the later line
    if damaged:
        where = ", ".join(f"{src}:{n}" for n in damaged[:5]) + (f", and {len(damaged) - 5} more" * (len(damaged) > 5))
        log.warning("metrics.jsonl: skipped %d damaged line(s): %s", len(damaged), where)
    lost = [s for s in range(step + 1) if s not in rows]
    if lost:
        log.warning(
            "metrics.jsonl: the rows of steps %s are missing although the checkpoint of step %d covers them "
            "(damaged, or not on disk when the run stopped); resuming with a marker row %r for each",
            _ranges(lost),
            step,
            LOST,
        )
    keep = [rows.get(s) or json.dumps({"step": s, LOST: 1.0}) for s in range(step + 1)]
    intact = (json.loads(rows[s]) for s in sorted(rows, reverse=True))
    last = next((r for r in intact if LOST not in r), {})
    tmp = Path(run_dir) / ".metrics.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(x + "\n" for x in keep))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(Path(run_dir) / "metrics.jsonl")
    fd = os.open(run_dir, os.O_RDONLY)  # the rename itself on disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {k: v for k, v in last.items() if k != "step"}


def _ranges(steps: list[int]) -> str:
    """[2, 3, 4, 9] -> '[2-4, 9]'."""
    out, start = [], None
    for i, s in enumerate(steps):
        start = s if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(str(s) if s == start else f"{start}-{s}")
            start = None
    return "[" + ", ".join(out) + "]"


# ----------------------------------------------------------------------------- config


@dataclass
class LoggerConfig:
    mode: str = resumable()  # wandb: offline | online | disabled (metrics.jsonl is always written)
    project: str = resumable()
    group: str | None = resumable()
    tags: list[str] = resumable()
    progress: bool = resumable()

    def __post_init__(self) -> None:
        choice(self.mode, "logger.mode", ("offline", "online", "disabled"))
