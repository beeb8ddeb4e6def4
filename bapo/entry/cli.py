"""The one error path of the entry points (``train.py``, ``eval.py``).

A run that cannot start, or stops for a reason the user can act on, prints one line,
``error: <Class>: <message>``, to stderr and exits with a status that says whose fault it was:
2 for bad input (a config key, a data file, a busy run folder, an override Hydra cannot apply,
a run folder that cannot be written), 1 for a run that failed (a damaged checkpoint, a diverged
update, a full disk). The message names the key, file and line; a stack trace would only bury it.
Anything else is a bug and keeps its traceback.

Two layers: :func:`hydra_entry` wraps the ``@hydra.main`` function and catches what Hydra raises
before the job starts (composition, override syntax, creating the run folder and its log file);
:func:`guarded` wraps the job itself.

A refused start leaves the run folder exactly as it found it. ``train.py`` takes the folder's lock
(``bapo.rundir.RunFolder``) before anything else, so a start refused because another run holds the
folder touches nothing in it. Hydra writes nothing there first: conf/config.yaml sets
``hydra.output_subdir: null``, and :func:`guarded` writes Hydra's record of the job (``.hydra/``) once
the lock is held. Hydra does create the folder and open the job's log (``train.log``) before the job;
the log is appended to, never rewritten. Holding the lock, a start that fails before the run wrote
anything (a config error, a refused resume) puts back what it changed: ``.hydra/`` as it was, the
log cut back to its length, the lock file removed if this start created it, and a folder that held
nothing before this start removed with the folders above it that became empty, up to ``outputs/`` or
``multirun/`` (Hydra's date folder), and that one too if this process made it. A run that failed after it
wrote its files keeps them, and its log ends with the error line (``scripts/study/pack_study.py`` reads it).

In a sweep (``train.py -m``) a failed cell does not end the sweep: its error line goes to stderr, to
the cell's log (the cell's folder keeps its ``.hydra/`` and log, so the failure stays visible), and to
the sweep's ``sweep_summary.jsonl`` (``bapo.entry.sweep``), and the next cell runs. ``eval.py`` holds its
folder the same way. A torchrun rank other than 0 holds nothing: its folder is removed when it holds
nothing but Hydra's files, and never when it holds a lock file. An error every rank raised at once (a full disk
while the ranks write a checkpoint together) is rank 0's line alone: the run ends in one line, as in one process.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bapo.infra.checks import error_line, fail

if TYPE_CHECKING:
    from bapo.entry.sweep import Cell
    from bapo.rundir import RunFolder

T = TypeVar("T")

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
RUN_ROOTS = ("outputs", "multirun")  # Hydra's default roots: empty folders below them are removed with a run's
HYDRA_DIR = ".hydra"  # Hydra's record of a job: config.yaml, hydra.yaml, overrides.yaml


def user_errors() -> tuple[type[BaseException], ...]:
    """Bad input: exit status 2 (``bapo.infra.checks.UserError``: a ConfigError, a data-file error, a busy folder)."""
    from bapo.infra.checks import UserError

    return (UserError,)


def run_errors() -> tuple[type[BaseException], ...]:
    """A run that failed for a reason its message explains: exit status 1 (``bapo.infra.checks.RunFailed``: a
    CheckpointError, TrainingDiverged, a WorkerError)."""
    from bapo.infra.checks import RunFailed

    return (RunFailed,)


def only_hydra_files(run_dir: Path) -> bool:
    """Nothing in the folder but what Hydra wrote at job start (.hydra/, the job's log): no run's lock file either."""
    return run_dir.is_dir() and all(p.name == HYDRA_DIR or p.suffix == ".log" for p in run_dir.iterdir())


def remove_run_folder(run_dir: Path) -> None:
    """Remove a start-up failure's run folder, and the folders above it that are left empty, up to (not including)
    ``outputs/`` or ``multirun/``. Outside those roots only the run folder itself goes."""
    shutil.rmtree(run_dir, ignore_errors=True)
    remove_empty_parents(run_dir)


_OWN_ENV: set[str] = set()  # variables hydra_entry set itself (own_env)
_NEW_ROOTS: set[Path] = set()  # ./outputs, ./multirun when this process began and they did not exist (hydra_entry)
_GIVEN_DIRS: dict[Path, tuple[int, int]] = {}  # hydra.run.dir=<existing folder> on the command line: its times before


def remove_empty_parents(run_dir: Path) -> None:
    """The folders above ``run_dir`` that are empty, up to ``outputs/`` or ``multirun/``: that one too when it is
    the working folder's and this process made it (it did not exist when :func:`hydra_entry` began)."""
    parents = list(run_dir.absolute().parents)
    root = next((i for i, p in enumerate(parents) if p.name in RUN_ROOTS), None)
    if root is not None and parents[root] in _NEW_ROOTS:
        root += 1
    for p in parents[: root or 0]:
        try:
            p.rmdir()  # only an empty folder
        except OSError:
            break


def guarded(
    fn: Callable[[], T],
    run_dir: str | Path,
    *,
    hold: bool = False,
    files: dict[str, str] | None = None,
    cell: Cell | None = None,
) -> T | None:
    """``fn()``, with the errors above turned into one line and an exit status (module docstring).

    ``hold`` (train.py, rank 0): take the run folder's lock first, then write ``files`` (``.hydra/<name>`` ->
    text: Hydra's record of the job, :func:`hydra_files`), and on a failure put the folder back as it was found
    (or keep the run's files if it wrote any). ``cell``: this job is a cell of a sweep; a failure is recorded in
    the sweep's summary and returns None instead of exiting, and so does a bug (with its traceback), so that the
    sweep goes on (in the rank 0 of a launched cell, the row is handed to the cell's job and the rank exits with
    the failure's status: :func:`_cell_failed`). Without ``hold`` (a torchrun rank other than 0): the folder is
    removed when it holds nothing but Hydra's files, never when it holds a lock file (rank 0's folder, or another
    run's)."""
    run_dir = Path(run_dir)
    if not hold:
        return _guarded_unheld(fn, run_dir)
    user, failed = user_errors(), run_errors()
    began, start = time.time(), None
    try:
        start = StartedFolder.take(run_dir, files or {})  # before anything: a busy folder is left as it was
        result = fn()
    except user + failed as e:
        status, line = (2 if isinstance(e, user) else 1), error_line(e)
        if start is not None:
            start.leave(line, keep_log=cell is not None)
        if cell is None:
            fail(e, status)
        print(line, file=sys.stderr)
        cell.record("failed", status, line, began)
        return _cell_failed(cell, status)
    except Exception as e:  # a bug: in a sweep, recorded with its traceback, and the next cell runs
        if cell is None:
            raise
        text = traceback.format_exc()
        print(text, end="", file=sys.stderr)
        if start is not None:
            start.leave(text.rstrip("\n"), keep_log=True)
        cell.record("failed", 1, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", began)
        return _cell_failed(cell, 1)
    except BaseException:  # a signal's exit, Ctrl-C: the run saved what it could; the lock goes with the process
        if start is not None:
            start.folder.close()
        raise
    start.folder.close()
    if cell is not None:
        stopped = isinstance(result, dict) and "stopped_by_signal" in result
        code = 128 + int(result["stopped_by_signal"]) if stopped else 0
        cell.record("stopped" if stopped else "complete", code, None, began)
    return result


def _cell_failed(cell: Cell, status: int) -> None:
    """After a failed cell's row is recorded: the next cell runs (None), or, in the rank 0 a cell's job launched
    (the row handed to the job), the rank exits with ``status``, so that the launcher stops the cell's other ranks
    (waiting for this one in the process group) and the job records the row."""
    if cell.handoff_to is not None:
        sys.exit(status)
    return None


def _guarded_unheld(fn: Callable[[], T], run_dir: Path) -> T:
    from bapo.infra.checks import raised_by_every_rank

    fresh = not run_dir.exists() or only_hydra_files(run_dir)
    user, failed = user_errors(), run_errors()
    try:
        return fn()
    except user + failed as e:
        if fresh and only_hydra_files(run_dir):  # a start-up error leaves no run folder behind
            remove_run_folder(run_dir)
        status = 2 if isinstance(e, user) else 1
        if raised_by_every_rank(e):
            _leave_the_line_to_rank_0()
        fail(e, status)


def _leave_the_line_to_rank_0(wait_s: float = 60.0) -> None:
    """An error every rank raised at once (a collective's failure, ``bapo.infra.checks.every_rank``): rank 0 prints
    the run's one line and exits with it, and its launcher (the plain launch, torchrun) then stops this rank with
    SIGTERM, whose default action ends it at once, without a second line. Where nothing stops it (SLURM's one task
    per rank), it says the line itself after ``wait_s``."""
    import signal

    from bapo.infra.stop import STOP_SIGNALS

    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    time.sleep(wait_s)


def unresolvable(e: BaseException) -> Exception:
    """OmegaConf's error for an interpolation that does not resolve (a key on itself, a missing key or environment
    variable, an unknown resolver), as one ConfigError naming the key."""
    from bapo.infra.checks import ConfigError

    key = getattr(e, "full_key", None) or "config"
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ConfigError(f"{key}: cannot be resolved ({why})")


def check_resolvable(cfg: Any) -> None:
    """Every interpolation of the composed config resolves (``train.steps=${train.steps}`` on the command line would
    otherwise be a traceback wherever the key is first read); :func:`unresolvable`'s ConfigError if one does not."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise unresolvable(e) from None


def refuse_training_run(run_dir: Path, script: str) -> None:
    """``eval.py ... hydra.run.dir=<a training run>``: one line, exit 2, the folder as it was. eval.py writes its own
    ``.hydra/`` record (and results) into its run folder, and a training run's ``.hydra/`` is the run's record
    (``scripts/study/pack_study.py`` labels a cell from it): evaluating beside a run is ``hydra.run.dir=<run>/eval``.
    The empty job log Hydra opened for this job goes, and the folder's times are put back when the command line named
    it (:func:`hydra_entry` noted them)."""
    from bapo.infra.checks import ConfigError
    from bapo.rundir import training_run_files

    found = training_run_files(run_dir)
    if not found:
        return
    for h in file_handlers(run_dir):
        h.close()
        logging.getLogger().removeHandler(h)
        log = Path(h.baseFilename)
        if log.is_file() and log.stat().st_size == 0:
            log.unlink()
    if (times := _GIVEN_DIRS.get(run_dir.absolute())) is not None:
        os.utime(run_dir, ns=times)
    fail(
        ConfigError(
            f"hydra.run.dir: {run_dir} holds a training run ({', '.join(found)}), whose record {script} would "
            f"replace; evaluate it into a folder of its own, e.g. hydra.run.dir={run_dir}/eval"
        ),
        2,
    )


def own_env() -> set[str]:
    """Variables this process set for itself (``HYDRA_FULL_ERROR`` by :func:`hydra_entry`): not for the ranks it
    launches, whose own entry sets them again (a user's own setting is passed on)."""
    return set(_OWN_ENV)


def hydra_files(cfg: Any) -> dict[str, str]:
    """What Hydra would write to ``<run>/.hydra/`` at job start (its ``output_subdir``), as name -> YAML text: the
    job's config ``cfg``, Hydra's config and the command line's overrides. Call it in the job, before ``cfg`` is
    edited; :func:`guarded` writes them once the run folder is held."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}, with the job's runtime filled in
    return {
        "config.yaml": OmegaConf.to_yaml(cfg),
        "hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
        "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task),
    }


# ----------------------------------------------------------------------------- a run folder held


@dataclasses.dataclass
class StartedFolder:
    """A run folder this process holds (``folder``), with what it held when the lock was taken: enough to put it
    back exactly after a start that fails before the run wrote anything."""

    folder: RunFolder
    entries: dict[str, tuple[bool, int, int]]  # every other entry: name -> (is a folder, size, mtime_ns)
    hydra: dict[str, tuple[bytes, int, int]] | None  # .hydra/<file> -> (content, atime_ns, mtime_ns); None: none
    hydra_times: tuple[int, int] | None  # .hydra/'s own (atime_ns, mtime_ns)
    logs: dict[Path, tuple[int, int, int]]  # the job's log files -> (size, atime_ns, mtime_ns)
    times: tuple[int, int] | None  # the folder's own (atime_ns, mtime_ns) before this start locked it
    new: bool  # the folder held nothing before this start (Hydra made it, and its empty log, for this process)

    @classmethod
    def take(cls, run_dir: Path, files: dict[str, str]) -> StartedFolder:
        """Lock ``run_dir`` (:class:`bapo.rundir.RunFolderBusy` at once if another process holds it: nothing is
        touched), note what it holds, then write ``files`` into ``.hydra/``."""
        from bapo.rundir import RunFolder

        try:
            st = run_dir.stat()  # before the lock file is made in it
            times = (st.st_atime_ns, st.st_mtime_ns)
        except FileNotFoundError:
            times = None
        folder = RunFolder.open(run_dir)
        try:
            logs = _job_logs(run_dir)
            hydra_dir = run_dir / HYDRA_DIR
            hydra, hydra_times = None, None
            if hydra_dir.is_dir():
                hydra, hd = {}, hydra_dir.stat()
                hydra_times = (hd.st_atime_ns, hd.st_mtime_ns)
                for f in sorted(hydra_dir.iterdir()):
                    if f.is_file():
                        st = f.stat()
                        hydra[f.name] = (f.read_bytes(), st.st_atime_ns, st.st_mtime_ns)
            log_state = {}
            for log in logs:
                if log.is_file():
                    ls = log.stat()
                    log_state[log] = (ls.st_size, ls.st_atime_ns, ls.st_mtime_ns)
            entries = _entries(run_dir, logs)
            new = folder.lock_created and not entries and hydra is None and all(v[0] == 0 for v in log_state.values())
            start = cls(folder, entries, hydra, hydra_times, log_state, times, new)
            if files:
                hydra_dir.mkdir(exist_ok=True)
                for name, text in files.items():
                    with open(hydra_dir / name, "w", encoding="utf-8") as f:  # in place: the folder's entries stay
                        f.write(text)
        except BaseException:
            folder.close(discard=True)
            raise
        return start

    @property
    def path(self) -> Path:
        return self.folder.path

    def untouched(self) -> bool:
        """The run wrote nothing: every entry but ``.hydra/``, the lock and the job's log is as it was found."""
        return _entries(self.path, list(self.logs)) == self.entries

    def leave(self, line: str, *, keep_log: bool) -> None:
        """Release the folder after a failure whose error is ``line``. A start that wrote nothing puts the folder
        back as it found it; with ``keep_log`` (a sweep's cell) its log keeps the line, and a folder this start
        made keeps ``.hydra/`` too, so the failed cell is there to see. A run that wrote its files keeps them, and
        its log ends with the line."""
        if not self.untouched():
            self._append(line)
            self.folder.close()
            return
        if self.new and not keep_log:
            self._remove()
            return
        if not self.new:
            self._restore_hydra()
        if keep_log:
            self._append(line)
        else:
            self._restore_logs()
        self.folder.close(discard=True)
        if not keep_log and self.times is not None:
            os.utime(self.path, ns=self.times)

    def _append(self, line: str) -> None:
        for h in file_handlers(self.path):
            h.flush()
            with open(h.baseFilename, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def _restore_hydra(self) -> None:
        hydra_dir = self.path / HYDRA_DIR
        if self.hydra is None:
            shutil.rmtree(hydra_dir, ignore_errors=True)
            return
        for f in hydra_dir.iterdir() if hydra_dir.is_dir() else ():
            if f.is_file() and f.name not in self.hydra:
                f.unlink()
        for name, (content, atime, mtime) in self.hydra.items():
            (hydra_dir / name).write_bytes(content)
            os.utime(hydra_dir / name, ns=(atime, mtime))
        if self.hydra_times is not None:
            os.utime(hydra_dir, ns=self.hydra_times)

    def _restore_logs(self) -> None:
        for h in file_handlers(self.path):
            h.flush()
        for log, (size, atime, mtime) in self.logs.items():
            os.truncate(log, size)
            os.utime(log, ns=(atime, mtime))

    def _remove(self) -> None:
        """Remove what this start made in a folder that held nothing before it: ``.hydra/``, the log, the lock
        (``close(discard=True)``), then the folder and the empty folders above it, if nothing else appeared."""
        shutil.rmtree(self.path / HYDRA_DIR, ignore_errors=True)
        for log in self.logs:
            log.unlink(missing_ok=True)
        self.folder.close(discard=True)
        try:
            self.path.rmdir()
        except OSError:
            return  # something appeared meanwhile: not ours to remove
        remove_empty_parents(self.path)


def _entries(run_dir: Path, logs: list[Path]) -> dict[str, tuple[bool, int, int]]:
    from bapo.rundir import LOCK_NAME

    skip = {HYDRA_DIR, LOCK_NAME, *(log.name for log in logs)}
    out = {}
    for p in run_dir.iterdir():
        if p.name not in skip:
            st = p.lstat()
            out[p.name] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def file_handlers(run_dir: Path) -> list[logging.FileHandler]:
    """The root logger's file handlers that write into ``run_dir`` (Hydra's job log, ``<job name>.log``)."""
    here = os.path.realpath(run_dir)
    return [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler) and os.path.dirname(os.path.realpath(h.baseFilename)) == here
    ]


def _job_logs(run_dir: Path) -> list[Path]:
    """The job's log files in ``run_dir``; a handler whose file another process's failed start removed (it held
    the folder then) opens the file at its path again, so this run's log is not written to a deleted file."""
    logs = []
    for h in file_handlers(run_dir):
        path = Path(h.baseFilename)
        try:
            same = h.stream is not None and os.fstat(h.stream.fileno()).st_ino == os.stat(path).st_ino
        except (FileNotFoundError, ValueError, OSError):
            same = False
        if not same:
            h.acquire()
            try:
                if h.stream is not None:
                    h.stream.close()
                h.stream = h._open()
            finally:
                h.release()
        logs.append(path)
    return logs


# ----------------------------------------------------------------------------- Hydra's own errors


def hydra_entry(main: Callable[[], Any]) -> Any:
    """Call a ``@hydra.main`` function with Hydra's start-up errors as one line each (module docstring).

    Hydra prints a bad override or a missing config option over several lines and a run folder it cannot
    create as a stack trace, then exits 1. Here it re-raises instead (``HYDRA_FULL_ERROR=1``) and the error is
    printed as ``error: <Class>: <message>``, exit 2, with a hint for a key that exists one group further
    down (``algo.contribution`` -> ``algo.bounds.contribution``). A full disk while the job runs is exit 1.
    With ``HYDRA_FULL_ERROR=1`` set by the user, every error keeps its full stack trace.
    """
    _NEW_ROOTS.update(p for p in (Path.cwd().absolute() / r for r in RUN_ROOTS) if not p.exists())
    for arg in sys.argv[1:]:  # a folder given by name: as it was before Hydra opened its job log in it
        if arg.startswith("hydra.run.dir=") and (given := Path(arg.split("=", 1)[1]).absolute()).is_dir():
            st = given.stat()
            _GIVEN_DIRS[given] = (st.st_atime_ns, st.st_mtime_ns)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return main()
    os.environ["HYDRA_FULL_ERROR"] = "1"
    _OWN_ENV.add("HYDRA_FULL_ERROR")
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    from bapo.infra.checks import unknown_option

    try:
        return main()
    except OmegaConfBaseException as e:  # an interpolation Hydra resolves itself (hydra.run.dir=${oc.env:NOPE})
        fail(unresolvable(e), 2)
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

    from bapo.infra.checks import did_you_mean

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
