"""The one error path of the entry points (``train.py``, ``eval.py``).

A run that cannot start, or stops for a reason the user can act on, prints one line,
``error: <Class>: <message>``, to stderr and exits with a status that says whose fault it was:
2 for bad input (a config key, a data file, a busy run folder, an override Hydra cannot apply,
a run folder that cannot be written), 1 for a run that failed (a damaged checkpoint, a diverged
update, a full disk). The message names the key, file and line; a stack trace would only bury it.
Anything else is a bug and keeps its traceback.

Two layers: :func:`hydra_entry` wraps the ``@hydra.main`` function and catches what Hydra raises
before the job starts (composition, override syntax, creating the run folder and its log file);
:func:`guarded` wraps the job itself. A start-up error leaves no run folder behind: when the folder
held nothing but what Hydra wrote at job start (``.hydra/``, the job's log) and the run folder's
lock, it is removed again, and so are the folders above it that became empty, up to ``outputs/``
(Hydra's date folder).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
RUN_ROOTS = ("outputs", "multirun")  # Hydra's default roots: empty folders below them are removed with a run's


def user_errors() -> tuple[type[BaseException], ...]:
    """Bad input: exit status 2. (A data-file error is a ``ConfigError``: it names the key that points at the file.)"""
    from bapo.checks import ConfigError
    from bapo.rundir import RunFolderBusy

    return (ConfigError, RunFolderBusy)


def run_errors() -> tuple[type[BaseException], ...]:
    """A run that failed for a reason its message explains: exit status 1 (a full disk is a CheckpointError)."""
    from bapo.checkpoint import CheckpointError
    from bapo.learner.learner import TrainingDiverged
    from bapo.workers import WorkerError

    return (CheckpointError, TrainingDiverged, WorkerError)


def only_hydra_files(run_dir: Path) -> bool:
    """Nothing in the folder but what Hydra wrote at job start (.hydra/, the job's log) and the run folder's lock."""
    from bapo.rundir import LOCK_NAME

    ok = (".hydra", LOCK_NAME)
    return run_dir.is_dir() and all(p.name in ok or p.suffix == ".log" for p in run_dir.iterdir())


def remove_run_folder(run_dir: Path) -> None:
    """Remove a start-up failure's run folder, and the folders above it that are left empty, up to (not including)
    ``outputs/`` or ``multirun/``. Outside those roots only the run folder itself goes."""
    shutil.rmtree(run_dir, ignore_errors=True)
    parents = list(run_dir.absolute().parents)
    root = next((i for i, p in enumerate(parents) if p.name in RUN_ROOTS), None)
    for p in parents[: root or 0]:
        try:
            p.rmdir()  # only an empty folder
        except OSError:
            break


def fail(e: BaseException, status: int, message: str | None = None) -> None:
    """Print ``error: <Class>: <message>`` (one line) to stderr and exit with ``status``."""
    text = " ".join((str(e) if message is None else message).split("\n")).strip()
    print(f"error: {type(e).__name__}: {text}", file=sys.stderr)
    sys.exit(status)


def guarded(fn: Callable[[], T], run_dir: str | Path) -> T:
    """``fn()``, with the errors above turned into one line and an exit status (module docstring)."""
    run_dir = Path(run_dir)
    fresh = not run_dir.exists() or only_hydra_files(run_dir)
    user, failed = user_errors(), run_errors()
    try:
        return fn()
    except user + failed as e:
        if fresh and only_hydra_files(run_dir):  # a start-up error leaves no run folder behind
            remove_run_folder(run_dir)
        fail(e, 2 if isinstance(e, user) else 1)


# ----------------------------------------------------------------------------- Hydra's own errors


def hydra_entry(main: Callable[[], Any]) -> Any:
    """Call a ``@hydra.main`` function with Hydra's start-up errors as one line each (module docstring).

    Hydra prints a bad override or a missing config option over several lines and a run folder it cannot
    create as a stack trace, then exits 1. Here it re-raises instead (``HYDRA_FULL_ERROR=1``) and the error is
    printed as ``error: <Class>: <message>``, exit 2, with a hint for a key that exists one group further
    down (``algo.contribution`` -> ``algo.bounds.contribution``). A full disk while the job runs is exit 1.
    With ``HYDRA_FULL_ERROR=1`` set by the user, every error keeps its full stack trace.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return main()
    os.environ["HYDRA_FULL_ERROR"] = "1"
    from hydra.errors import CompactHydraException

    from bapo.checks import unknown_option

    try:
        return main()
    except CompactHydraException as e:  # composition, override syntax, a missing group option
        if (unknown := unknown_option(e)) is not None:
            fail(unknown, 2)  # a mistyped option: its closest options
        hint = override_hint(e)
        text = compact_hydra_message(e, drop_append=bool(hint))
        fail(e, 2, f"{text.rstrip('.')}; {hint}" if hint else text)
    except (OSError, ValueError) as e:
        os_err = e if isinstance(e, OSError) else e.__cause__ or e.__context__
        if not isinstance(os_err, OSError) or os_err.errno not in FULL_DISK + NOT_WRITABLE:
            raise
        where = os_err.filename or "the run folder"
        if os_err.errno in FULL_DISK:
            fail(os_err, 1, f"no space left on device while writing {where}")
        fail(os_err, 2, f"cannot write {where}: {os_err.strerror} (choose a writable folder: hydra.run.dir=...)")


def compact_hydra_message(e: BaseException, drop_append: bool = False) -> str:
    """Hydra's message in one line: the option list of a missing config joined by commas, its search path dropped;
    ``drop_append``: without Hydra's advice to append the key (``+key=value``), when the key exists elsewhere."""
    lines = [x for x in str(e).split("\n") if not (drop_append and x.startswith("To append to your config"))]
    if "Config search path:" in lines:
        lines = lines[: lines.index("Config search path:")]
    items: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        if line.startswith("\t") and items:  # one option of a list Hydra prints one per line
            items[-1] += (" " if items[-1].endswith(":") else ", ") + line.strip()
        else:
            items.append(line.strip())
    return " ".join(x if x.endswith(".") else x + ";" for x in items).rstrip(";")


def override_hint(e: BaseException) -> str:
    """'did you mean algo.bounds.contribution=gradient?' for an override of a key that is not in its group but
    is in a sub-group of it; '' otherwise. Reads the group Hydra was overriding (the cause's ``parent_node``)."""
    cause = e.__cause__
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    full_key = getattr(cause, "full_key", None)
    if parent is None or not isinstance(key, str) or not full_key or not str(full_key).endswith(key):
        return ""
    from omegaconf import OmegaConf

    from bapo.checks import did_you_mean

    group = str(full_key)[: -len(key)].rstrip(".")
    try:
        tree = OmegaConf.to_container(parent, resolve=False)
    except Exception:
        return ""
    value = ""
    marker = f"+{full_key}="
    for line in str(e).split("\n"):
        if marker in line:
            value = "=" + line.split(marker, 1)[1].strip()
    hits = did_you_mean(group, key, tree)
    return "did you mean " + " or ".join(h + value for h in hits) + "?" if hits else ""
