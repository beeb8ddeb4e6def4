"""The run folder: one run owns it, and how a run starts in it is decided before anything is touched.

Order of a start (the loop wires it; nothing here reads the loop's state):

1. validate the composed config (``bapo.config.build``): a config error leaves no folder behind, because
   the folder is only created in step 2;
2. :meth:`RunFolder.open` creates the folder and takes an exclusive lock on it (``.lock``: an ``flock`` on an
   open descriptor, so a killed holder releases it with its process; the file names the holder for the
   error message only, so a stale file left by a dead run never blocks). ``train.py`` takes it first of all,
   before the config is validated (``bapo.entry.cli.guarded``): a start refused because another run holds the
   folder then leaves it exactly as it was; the loop's own open of the same folder shares that lock;
3. :func:`start_decision` decides fresh / resume-from-checkpoint / nothing-to-do, logs it in one line, and refuses
   a fresh start over another run's checkpoints or metrics unless ``overwrite=true``;
4. a resume compares the run's ``config.yaml`` with the new composition (:func:`resume_changes`): harmless
   keys are recorded (:func:`record_changes`), anything else is refused, still before any file is modified;
5. only then does the loop modify the folder (:meth:`RunFolder.clear` for an overwrite, config.yaml, ...).

Under torchrun the ranks share rank 0's folder: only rank 0 opens it and decides; the others follow its decision.
``flock`` works across hosts on NFSv4 (emulated with POSIX locks) and on Lustre mounted with ``-o flock``.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bapo.config import resumable_keys
from bapo.infra.artifacts import load_config, load_yaml
from bapo.infra.checks import ConfigError, UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
# What a previous run leaves in its folder; an overwrite removes all of it (Hydra's .hydra/ is Hydra's own).
RUN_FILES = (
    "checkpoints",
    "metrics.jsonl",
    ".metrics.jsonl.tmp",
    "final_metrics.json",
    "export",
    "config.yaml",
    "config_history.jsonl",
    "wandb_id.txt",
    "wandb",
)
# Any of these means another run's results are in the folder: a fresh start must not silently reuse it.
EVIDENCE = ("checkpoints", "metrics.jsonl", "final_metrics.json", "export")

# Keys a resume may change: none of them changes what the checkpoint means or what the run computes. A key
# ending in ".*" covers its whole group. The stage groups' keys are the schema fields marked ``resumable``
# (bapo.config.resumable_keys): memory and speed knobs whose result is the same loss up to float rounding
# (micro-batching, packing, activation checkpointing, CPU offload, the HF generation batch, vLLM's memory,
# eager, sleep and tensor-parallel settings, the attention kernel), the device, the divergence guard, the
# hardware placement, the reward pool's size and time limit, and the reporting groups. Everything else
# (model, algo, data, buffer, seed, learner.kind and optimiser, rollout.n and sampling, train.prompts_per_step
# / sync_every / async_rollout, reward shaping) is refused. data.path is refused even when only
# paths.data_dir moved it: the data cursor belongs to that file.
RESUMABLE = (*resumable_keys(), "resume", "overwrite", "paths.*", "hydra.*")


class RunFolderBusy(UserError, RuntimeError):
    """Another live process holds the run folder's lock."""


# ---------------------------------------------------------------------------------------------- the lock

_HELD: set[int] = set()  # lock descriptors of this process


_OPEN: dict[str, RunFolder] = {}  # folders this process holds, by real path: a second open shares the lock


def _close_held_in_child() -> None:
    # A forked child (a reward worker) would otherwise share the lock and keep it after the trainer is
    # killed. Closing the child's copy leaves the parent's lock in place: flock belongs to the open file.
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    _OPEN.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def _holder(lock: Path) -> str:
    """Who holds ``lock``, from its content (written by the holder right after it took the lock)."""
    for _ in range(20):  # the holder may be between taking the lock and writing its name
        try:
            info = json.loads(lock.read_text())
            return f"pid {info['pid']} on {info['host']}, since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            time.sleep(0.05)
    return "a process that did not write its name"


class RunFolder:
    """A run folder this process holds: created and locked by :meth:`open`, released by :meth:`close`.

    Use it as a context manager around everything the run does in the folder. ``lock_created``: this open
    created the lock file (the folder had none), so leaving the folder as it was means removing it again."""

    def __init__(
        self, path: Path, fd: int, created: bool, lock_created: bool, owner: bool = True, found: tuple | None = None
    ) -> None:
        self.path = path
        self.lock_path = path / LOCK_NAME
        self.lock_created = lock_created
        self._found = found  # a lock file that was there: (its content, atime_ns, mtime_ns), put back by discard
        self._fd: int | None = fd
        self._created = created
        self._owner = owner  # False: a second open in this process, which shares the first one's lock

    @classmethod
    def open(cls, path: str | Path) -> RunFolder:
        """Create ``path`` if needed and lock it; raises :class:`RunFolderBusy` (naming the holder) at once
        if another process holds it. A folder this process already holds is shared: the second handle's
        :meth:`close` leaves the lock to the first."""
        path = Path(path)
        held = _OPEN.get(os.path.realpath(path))
        if held is not None and held._fd is not None:
            return cls(path, held._fd, False, False, owner=False)
        created = not path.exists()
        while True:
            path.mkdir(parents=True, exist_ok=True)
            lock = path / LOCK_NAME
            try:  # not inherited across exec (PEP 446)
                fd, lock_created = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, lock_created = os.open(lock, os.O_RDWR), False
                except FileNotFoundError:  # its holder removed it meanwhile: try again
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                raise RunFolderBusy(
                    f"{path} is in use by another run: {_holder(lock)} (lock file {lock}). "
                    "Wait for it to finish or stop it; two runs in one folder would overwrite each other."
                ) from None
            try:
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # a closing holder removed the file we locked: lock the one at the path now
        found = None
        if not lock_created:  # a dead run's file: what it said, so that a refused start can put it back
            st = os.fstat(fd)
            found = (os.pread(fd, max(st.st_size, 1), 0), st.st_atime_ns, st.st_mtime_ns)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _HELD.add(fd)
        folder = cls(path, fd, created, lock_created, found=found)
        _OPEN[os.path.realpath(path)] = folder
        return folder

    def clear(self) -> list[Path]:
        """Remove a previous run's files (:data:`RUN_FILES`), for ``overwrite=true``; returns what went."""
        if self._fd is None:
            raise RuntimeError(f"{self.path}: clear() after close(): the folder is no longer held")
        gone = [self.path / n for n in RUN_FILES if (self.path / n).exists() or (self.path / n).is_symlink()]
        for p in gone:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        return gone

    def close(self, discard: bool = False) -> None:
        """Release the lock. A folder this open created and left holding nothing but the lock is removed.
        ``discard``: leave the lock file as this open found it (a refused start leaves the folder as it found it):
        removed if this open created it, else its old content and times put back. A shared handle (a second open
        in this process) only forgets the folder."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if not self._owner:
            return
        _OPEN.pop(os.path.realpath(self.path), None)
        try:
            if discard and self._found is not None:
                content, atime, mtime = self._found
                os.ftruncate(fd, 0)
                os.pwrite(fd, content, 0)
                os.utime(fd, ns=(atime, mtime))
            if (discard and self.lock_created) or (
                self._created and [p.name for p in self.path.iterdir()] == [LOCK_NAME]
            ):
                self.lock_path.unlink(missing_ok=True)  # still locked here: a concurrent opener sees the inode change
            if self._created and not any(self.path.iterdir()):
                try:
                    self.path.rmdir()
                except OSError:
                    pass  # something appeared meanwhile: the folder is in use after all
        finally:
            _HELD.discard(fd)
            os.close(fd)

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------- how a run starts


@dataclasses.dataclass(frozen=True)
class StartDecision:
    """What a start does in its run folder.

    ``kind``: ``fresh`` (train from step 0), ``resume`` (load ``checkpoint``) or ``complete`` (nothing to do).
    ``clear``: remove the previous run's files first (:meth:`RunFolder.clear`): ``overwrite=true``, or the
    metrics of an earlier attempt of this run that died before its first checkpoint (``resume=auto``).
    """

    kind: str
    checkpoint: Path | None = None
    clear: bool = False

    @property
    def source_run(self) -> Path | None:
        """The run folder the checkpoint belongs to (``<run>/checkpoints/step_N``): its config.yaml and
        metrics.jsonl are the ones to compare and restore."""
        return self.checkpoint.parent.parent if self.checkpoint is not None else None


def last_logged_step(run_dir: Path) -> int:
    """The step of metrics.jsonl's last line; -1 if there is none (or it was cut short)."""
    f = Path(run_dir) / "metrics.jsonl"
    lines = f.read_text().splitlines() if f.is_file() else []
    try:
        return int(json.loads(lines[-1])["step"]) if lines else -1
    except (ValueError, KeyError, TypeError, RecursionError):
        return -1


def _previous_run(run_dir: Path) -> list[str]:
    """The names in :data:`EVIDENCE` present in ``run_dir`` (an empty checkpoints/ does not count)."""
    found = []
    for name in EVIDENCE:
        p = run_dir / name
        if p.is_dir() and name == "checkpoints":
            if any(p.iterdir()):
                found.append(name + "/")
        elif p.exists():
            found.append(name + ("/" if p.is_dir() else ""))
    return found


def training_run_files(run_dir: str | Path) -> list[str]:
    """What in ``run_dir`` says a training run is there (:data:`EVIDENCE`, its ``config.yaml``, or Hydra's record of a
    training job: a ``.hydra/config.yaml`` with a ``train`` group); empty for anything else (eval.py's folders)."""
    run_dir = Path(run_dir)
    found = _previous_run(run_dir) + (["config.yaml"] if (run_dir / "config.yaml").is_file() else [])
    hydra = run_dir / ".hydra" / "config.yaml"
    if not found and hydra.is_file():
        try:
            record = load_yaml(hydra)
        except ConfigError:
            record = None
        if isinstance(record, dict) and "train" in record:
            found.append(".hydra/ (a training job's)")
    return found


def _refuse_reuse(run_dir: Path, found: list[str], why: str) -> ConfigError:
    return ConfigError(
        f"{why}, but {run_dir} holds another run ({', '.join(found)}). Continue that run with resume=auto "
        f"(hydra.run.dir={run_dir}), replace it with overwrite=true, or choose a new run folder."
    )


def start_decision(
    run_dir: str | Path,
    *,
    resume: str | None,
    overwrite: bool,
    steps: int,
    find_latest: Callable[[Path], Path | None] | None = None,
) -> StartDecision:
    """Decide how a run starts in ``run_dir`` (held with :class:`RunFolder`), log it in one line, touch nothing.

    ``resume``: null (fresh), ``auto`` (the newest checkpoint in this folder; fresh if there is none; nothing
    to do when final_metrics.json is there and metrics.jsonl reached ``steps``, the configured train.steps),
    or a path to a run folder (its newest checkpoint) or to a checkpoint folder (holding state.pt).
    ``find_latest(ckpt_dir)``: the checkpoint to resume from; default ``bapo.checkpoint.latest``.

    Raises ConfigError for a fresh start (or an import from another run) over another run's checkpoints or
    metrics without ``overwrite``, for a resume path without a checkpoint, and for ``overwrite`` combined with
    continuing this folder's own run (resume=auto, or a path inside it): that would delete what it resumes.
    """
    if find_latest is None:
        from bapo import checkpoint  # here, not at the top: the lock itself needs no torch import

        find_latest = checkpoint.latest
    run_dir = Path(run_dir)
    found = _previous_run(run_dir)
    if resume == "auto":
        if overwrite:
            raise ConfigError("resume=auto continues this run folder's run and overwrite=true deletes it: choose one")
        return _decide_auto(run_dir, found, steps, find_latest)
    if resume is not None:
        return _decide_path(run_dir, found, Path(resume), overwrite, find_latest)
    if found and not overwrite:
        raise _refuse_reuse(run_dir, found, "resume=null starts a fresh run")
    if found:
        log.info("%s: overwrite=true: removing the previous run (%s), starting fresh", run_dir, ", ".join(found))
    else:
        log.info("%s: starting fresh (resume=null)", run_dir)
    return StartDecision("fresh", clear=bool(found))


def _decide_auto(run_dir: Path, found: list[str], steps: int, find_latest: Callable) -> StartDecision:
    """resume=auto: nothing to do, the newest checkpoint here, or a fresh start over an earlier attempt's files."""
    if (run_dir / "final_metrics.json").is_file() and (last := last_logged_step(run_dir)) >= steps:
        log.info("%s is complete (final_metrics.json, step %d >= train.steps=%d): nothing to do", run_dir, last, steps)
        return StartDecision("complete")
    ckpt_dir = run_dir / "checkpoints"
    ckpt = find_latest(ckpt_dir)
    if ckpt is not None:
        log.info("%s: resume=auto: resuming from %s", run_dir, ckpt)
        return StartDecision("resume", checkpoint=Path(ckpt))
    # the same run's earlier attempt, killed before its first checkpoint (a re-queued job): start it again
    extra = f", removing the earlier attempt's {', '.join(found)}" if found else ""
    log.info("%s: resume=auto found no checkpoint in %s: starting fresh%s", run_dir, ckpt_dir, extra)
    return StartDecision("fresh", clear=bool(found))


def _decide_path(run_dir: Path, found: list[str], p: Path, overwrite: bool, find_latest: Callable) -> StartDecision:
    """resume=<path>: a checkpoint folder, or a run folder's newest checkpoint; of this run or another one."""
    ckpt = p if (p / "state.pt").is_file() else find_latest(p / "checkpoints")
    if ckpt is None:
        raise ConfigError(f"resume: no complete checkpoint in {p} (looked for state.pt and {p}/checkpoints/step_*)")
    ckpt = Path(ckpt)
    if ckpt.resolve().is_relative_to((run_dir / "checkpoints").resolve()):  # this folder's own run
        if overwrite:
            raise ConfigError(f"resume={p} is a checkpoint of {run_dir}, which overwrite=true would delete")
        log.info("%s: resuming from %s (resume=%s)", run_dir, ckpt, p)
        return StartDecision("resume", checkpoint=ckpt)
    if found and not overwrite:
        raise _refuse_reuse(run_dir, found, f"resume={p} continues another run in this folder")
    extra = f", after removing the previous run ({', '.join(found)}) (overwrite=true)" if found else ""
    log.info("%s: continuing the run of %s from %s%s", run_dir, ckpt.parent.parent, ckpt, extra)
    return StartDecision("resume", checkpoint=ckpt, clear=bool(found))


# ------------------------------------------------------------------------------- config changes on resume


class _Absent:
    """A key that one of the two configs does not have."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()


@dataclasses.dataclass(frozen=True)
class Change:
    """One config key that differs between a run's config.yaml (``old``) and the resuming config (``new``)."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def _flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values; lists and empty dicts are leaves."""
    if isinstance(cfg, dict) and cfg:
        out: dict[str, Any] = {}
        for k, v in cfg.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: cfg}


def resumable(key: str) -> bool:
    """Whether ``key`` may change on resume (:data:`RESUMABLE`)."""
    for pattern in RESUMABLE:
        group = pattern.removesuffix(".*")
        if key == pattern or (pattern.endswith(".*") and (key == group or key.startswith(group + "."))):
            return True
    return False


def resume_changes(saved_cfg: dict, new_cfg: dict) -> list[Change]:
    """The differences between a run's composed config (``saved_cfg``, its config.yaml) and the config it is
    resumed with, as plain nested dicts. Keys in :data:`RESUMABLE` come back as changes to record; any other
    difference raises ConfigError listing each such key with old -> new. Pure: reads and writes nothing."""
    old, new = _flatten(saved_cfg), _flatten(new_cfg)
    changes = [
        Change(k, old.get(k, ABSENT), new.get(k, ABSENT))
        for k in sorted(old.keys() | new.keys())
        if old.get(k, ABSENT) != new.get(k, ABSENT)
    ]
    refused = [c for c in changes if not resumable(c.key)]
    if refused:
        lines = "\n".join(f"  {c}" for c in refused)
        raise ConfigError(
            f"resume: the run was made with a different config; these keys cannot change on resume:\n{lines}\n"
            f"(keys that may change: {', '.join(RESUMABLE)}). Resume with the run's own values, or start a "
            "new run folder (or overwrite=true to replace this run)."
        )
    return changes


def saved_config(run_dir: str | Path) -> dict | None:
    """A run's config.yaml as a plain dict (``bapo.infra.artifacts``: read as data, never resolved, an interpolation
    in it refused naming the key); None if the run has none."""
    f = Path(run_dir) / "config.yaml"
    if not f.is_file():
        return None
    return load_config(f)


def record_changes(run_dir: str | Path, changes: list[Change], step: int) -> None:
    """Append the changes a resume at ``step`` made to ``<run>/config_history.jsonl`` (one line per resume;
    nothing when there are none)."""
    if not changes:
        return
    row = {
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "changes": [{"key": c.key, "old": c.old, "new": c.new} for c in changes],
    }
    with open(Path(run_dir) / "config_history.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=repr) + "\n")
        f.flush()
        os.fsync(f.fileno())
