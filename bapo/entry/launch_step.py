"""The launch (``bapo.entry.launch``) as the first step of ``train.py``'s and ``eval.py``'s job, before the run folder
is held: one rank goes on in this process; several are started, waited for, and the job ends as they ended (a
sweep's cell: its row). A refusal before any rank starts is one line, as :func:`bapo.entry.cli.guarded`'s."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bapo.entry.cli import (
    HYDRA_DIR,
    check_resolvable,
    file_handlers,
    hydra_files,
    only_hydra_files,
    own_env,
    remove_empty_parents,
    remove_run_folder,
    user_errors,
)
from bapo.infra.checks import error_line, fail

if TYPE_CHECKING:
    from bapo.entry.sweep import Cell


def launch_here(cfg: Any, hc: Any, script: str | Path, run_dir: Path, cell: Cell | None, entry: str) -> bool:
    """The launch (``bapo.entry.launch``) as a job's first step, before the run folder is held. One rank: the choice
    goes into ``cfg`` and this returns False (the run goes on in this process). Several: this job starts them (its
    overrides, ``run_dir`` pinned), waits, ends as the run ended (its exit status; a sweep's cell: its row) and
    returns True. It holds no lock: rank 0 does. A refusal before any rank starts is one line, as :func:`guarded`'s:
    exit 2 and the folder left as Hydra found it, or in a sweep the cell marked failed, its log saying why."""
    from bapo.entry import launch
    from bapo.entry.sweep import outcome_file

    began, run_dir = time.time(), Path(run_dir)
    fresh = not run_dir.exists() or only_hydra_files(run_dir)
    try:
        check_resolvable(cfg)  # the command line's interpolations, before anything reads the config
        stamped = None if cell is not None else launch.stamped_folder(hc)  # a sweep's cells: the sweep's folder
        how = launch.decide(cfg, hc.overrides.task, entry, run_dir, stamped=stamped)
    except user_errors() as e:
        line = error_line(e)
        if cell is None:
            if fresh and only_hydra_files(run_dir):
                remove_run_folder(run_dir)
            fail(e, 2)
        print(line, file=sys.stderr)
        _leave_cell(run_dir, hydra_files(cfg), line)
        cell.record("failed", 2, line, began)
        return True
    if not how.spawns:
        how.apply(cfg)
        return False
    handoff = outcome_file(cell) if cell is not None else None
    env = {k: None for k in own_env()} | ({} if cell is None else cell.handoff(handoff))  # None: not passed on
    env[launch.LAUNCHER_ENV] = str(os.getpid())  # the ranks die with this process (launch.watch_launcher)
    after = (
        ""
        if entry != "train"
        else "a relaunch of the sweep resumes it"
        if cell
        else (f"resume: the same command with resume=auto hydra.run.dir={run_dir}")
    )
    grace = float((cfg.get("launcher") or {}).get("grace_s") or 120.0)
    checkpoints = run_dir / "checkpoints" if entry == "train" else None
    outcome = launch.start(how, script, launch.rank_args(hc, run_dir, how), env, after=after, grace_s=grace,
                           checkpoints=checkpoints)  # fmt: skip
    if cell is None:
        if outcome.line and run_dir.is_dir() and not only_hydra_files(run_dir):
            _append_log(run_dir, outcome.line)  # the run's log ends with why it ended
        if not run_dir.exists():
            remove_empty_parents(run_dir)  # rank 0 removed a start-up failure's folder
        if outcome.code:
            sys.exit(outcome.code)
        return True
    row = _read_outcome(handoff)
    if outcome.line or row is None:
        stopped = outcome.code >= 128
        status = "complete" if outcome.code == 0 else "stopped" if stopped else "failed"
        error = outcome.line if outcome.line and outcome.line.startswith("error:") else None
        error = error or (None if outcome.code == 0 or stopped else f"error: the ranks exited {outcome.code}")
        row = {"status": status, "exit": outcome.code, "error": error}
        if outcome.line:
            _append_log(run_dir, outcome.line)
    cell.record(row["status"], row["exit"], row["error"], began)
    if row["status"] == "stopped":  # a signal stops the sweep, as in one process
        sys.exit(row["exit"])
    return True


def _leave_cell(run_dir: Path, files: dict[str, str], line: str) -> None:
    """A refused cell's folder: Hydra's record of the job and its log ending with ``line``, as :func:`guarded` leaves
    one (a sweep's failed cell stays visible)."""
    if not run_dir.is_dir():
        return
    (run_dir / HYDRA_DIR).mkdir(exist_ok=True)
    for name, text in files.items():
        (run_dir / HYDRA_DIR / name).write_text(text, encoding="utf-8")
    _append_log(run_dir, line)


def _append_log(run_dir: Path, line: str) -> None:
    for h in file_handlers(run_dir):
        h.flush()
        with open(h.baseFilename, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _read_outcome(path: Path | None) -> dict | None:
    """The row a launched cell's rank 0 wrote (``bapo.entry.sweep.Cell.record``), read once and removed."""
    import json

    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None
    finally:
        path.unlink(missing_ok=True)
