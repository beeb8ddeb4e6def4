"""The one error path of the entry points (``train.py``, ``eval.py``).

A run that cannot start, or stops for a reason the user can act on, prints one line,
``error: <Class>: <message>``, to stderr and exits with a status that says whose fault it was:
2 for bad input (a config key, a data file, a busy run folder), 1 for a run that failed
(a damaged checkpoint, a diverged update, a full disk). The message names the key, file and
line; a stack trace would only bury it. Anything else is a bug and keeps its traceback.

A start-up error leaves no run folder behind: when the folder held nothing but what Hydra
wrote at job start (``.hydra/`` and the job's log), it is removed again.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def user_errors() -> tuple[type[BaseException], ...]:
    """Bad input: exit status 2."""
    from bapo.config import ConfigError
    from bapo.rundir import RunFolderBusy

    return (ConfigError, RunFolderBusy)


def run_errors() -> tuple[type[BaseException], ...]:
    """A run that failed for a reason its message explains: exit status 1."""
    from bapo.checkpoint import CheckpointError
    from bapo.learner.learner import TrainingDiverged

    return (CheckpointError, TrainingDiverged)


def only_hydra_files(run_dir: Path) -> bool:
    """Nothing in the folder but what a start writes before the run's own files: Hydra's ``.hydra/`` and job
    log, and the run folder's lock (``bapo.rundir.LOCK_NAME``)."""
    from bapo.rundir import LOCK_NAME

    start = (".hydra", LOCK_NAME)
    return run_dir.is_dir() and all(p.name in start or p.suffix == ".log" for p in run_dir.iterdir())


def guarded(fn: Callable[[], T], run_dir: str | Path) -> T:
    """``fn()``, with the errors above turned into one line and an exit status (module docstring)."""
    run_dir = Path(run_dir)
    fresh = not run_dir.exists() or only_hydra_files(run_dir)
    user, failed = user_errors(), run_errors()
    try:
        return fn()
    except user + failed as e:
        if fresh and only_hydra_files(run_dir):  # a start-up error leaves no run folder behind
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, user) else 1)
