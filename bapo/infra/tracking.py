"""Metrics sinks: ``metrics.jsonl`` in the run folder (always) and wandb (optional,
offline unless configured otherwise). Each line of ``metrics.jsonl`` is one JSON
object with a ``step`` key, flushed as soon as it is written and fsynced before every
checkpoint (:meth:`MetricsLogger.sync`), so a checkpoint on disk never covers rows that
are not. A resumed run passes its wandb ``run_id`` so its steps continue the same wandb run.

On resume, :func:`truncate_metrics` keeps every intact row up to the checkpoint's step. A
damaged line (cut short by a crash or a power loss) is skipped and named, never a reason to
drop the rows after it; a step the checkpoint covers whose row is gone gets a marker row
``{"step": s, "metrics/lost": 1.0}`` and a warning, so the gap is visible in the file itself.
The run goes on: the checkpoint, not the metrics file, is what the resume continues from.

The run's log file (Hydra's ``train.log``) is what a post-mortem reads (``scripts/study/pack_study.py`` takes a failed
run's reason from it). With the progress bar on (``logger.progress``) the loop's step lines go to the terminal
only, above the bar; :class:`StepLog` then writes a step summary to the log file alone (never the terminal) every
``SUMMARY_EVERY`` steps or ``SUMMARY_EVERY_S`` seconds, whichever comes first, and the last step logged when the
metrics logger closes, on an error too."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo.infra.checks import ConfigError, choice, resumable

log = logging.getLogger(__name__)

LOST = "metrics/lost"  # the key of a marker row: this step's row was lost before a resume
SUMMARY_EVERY, SUMMARY_EVERY_S = 10, 60.0  # StepLog: a line every 10 steps, or once a minute on slow steps
# what a step summary shows: label -> (metrics, format); left out when the step did not log them all
SUMMARY = {
    "reward": (("reward/mean",), "{:.3f}"),
    "eval": (("eval/accuracy",), "{:.3f}"),
    "ent": (("learner/entropy",), "{:.3f}"),
    "gnorm": (("learner/grad_norm",), "{:.2f}"),
    "clip": (("clip/low", "clip/high"), "[{:.2f}, {:.2f}]"),
    "stale": (("buffer/staleness_mean",), "{:.1f}"),
    "s/step": (("time/step_s",), "{:.1f}"),
}


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
        # the run's config (passed for wandb) says whether a progress bar keeps the step lines off the log file
        progress = isinstance(config, dict) and (config.get("logger") or {}).get("progress") is True
        self.steps = StepLog() if progress else None
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
        if self.steps is not None:
            self.steps.note(step, metrics)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def sync(self) -> None:
        """Put every row logged so far on disk (the loop calls it before each checkpoint)."""
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self.steps is not None:  # the loop closes this on every exit: the last step reaches the log before the error
            self.steps.flush()
        if not self._f.closed:
            self.sync()
        self._f.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class StepLog:
    """Step summaries for the run's log file while a progress bar has the terminal (module docstring): a step's line
    is written when it is a multiple of ``every`` or ``seconds`` have passed since the last line written; any other
    step's line is held, and :meth:`flush` writes the last one held."""

    def __init__(
        self, every: int = SUMMARY_EVERY, seconds: float = SUMMARY_EVERY_S, clock: Callable[[], float] = time.monotonic
    ):
        self.every, self.seconds, self.clock = every, seconds, clock
        self.written_at = clock()
        self.held: str | None = None

    def note(self, step: int, metrics: dict[str, Any]) -> None:
        line = step_summary(step, metrics)
        if step % self.every == 0 or self.clock() - self.written_at >= self.seconds:
            self._write(line)
        else:
            self.held = line

    def flush(self) -> None:
        if self.held is not None:
            self._write(self.held)

    def _write(self, line: str) -> None:
        to_log_file(line)
        self.written_at, self.held = self.clock(), None


def step_summary(step: int, metrics: dict[str, Any]) -> str:
    """``step 20 | reward 0.312 | eval 0.250 | ent 0.812 | gnorm 1.20 | clip [0.80, 1.28] | stale 1.0 | s/step 3.1``."""
    parts = [f"step {step}"]
    for label, (keys, fmt) in SUMMARY.items():
        values = [metrics.get(k) for k in keys]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            parts.append(f"{label} {fmt.format(*values)}")
    return " | ".join(parts)


def to_log_file(message: str, level: int = logging.INFO) -> None:
    """``message`` to the process's log files (the root logger's file handlers: Hydra's ``<job>.log``), never to the
    terminal; nothing where no file handler is set up (a test, a script)."""
    record = log.makeRecord(log.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


def check_wandb(mode: str) -> None:
    """Refuse ``logger.mode=online`` without wandb credentials, before anything is loaded or written.

    Looks where wandb itself looks: ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, or a netrc entry
    (``$NETRC``, ``~/.netrc``, ``~/_netrc``) for the host of ``WANDB_BASE_URL`` (default api.wandb.ai).
    """
    if mode != "online" or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    import netrc
    from urllib.parse import urlparse

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
