"""Atomic, verified checkpoint folders: written whole or not at all, checked on every read.

This module knows nothing of what a run saves (that is :mod:`bapo.checkpoint`); it keeps folders safe.

A checkpoint is a folder ``<dir>/step_000120/`` holding ``state.pt``, ``meta.json``, whatever else its
writers put there (ranks, DCP) and, written last, ``manifest.json``: the SHA-256 and size of every other
file. The folder is written under a temporary name in the same folder (:func:`prepare`, :func:`write`),
flushed to disk and renamed into place (:func:`save`), so a crash mid-write leaves the previous
checkpoints untouched and a half-written one is never mistaken for a complete one. A full disk on the
way is a :class:`CheckpointError` that says so, after the partial folder is removed; under torchrun a
failure on any rank fails every rank (:func:`raise_together`). :func:`staged_folder` gives any other
folder (an HF export) the same write-then-rename.

Reading is verified: :func:`load` checks the file it reads against the manifest and
:func:`latest_intact` skips (with a warning) a newest checkpoint that was truncated or bit-flipped after
it was written. The manifest catches damage, not an attacker (who can rewrite it too); what keeps a
hostile file from running code is that :func:`load` reads with ``torch.load(weights_only=True)``: tensors
and plain containers only, never a class.

Lineage. ``meta.json`` records the writer's lineage id (one training run, kept across its resumes) and a
write sequence number. Pruning keeps the newest ``keep`` of the writer's own lineage by write order, not by
step number, and never touches another lineage's folders: a fresh run started in an old run's folder
neither deletes its own new checkpoints (lower steps) nor the old run's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bapo.infra import dist
from bapo.infra.checks import RunFailed, every_rank

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{6,})$")
TMP_DIR = re.compile(r"^\.tmp-step_\d{6,}")  # a checkpoint being written (save() and the run's writer name it so)
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "bapo-checkpoint-manifest/1"


class CheckpointError(RunFailed, RuntimeError):
    """A checkpoint that cannot be written or read as it should (a full disk, a damaged or hostile file)."""


# ---------------------------------------------------------------- finding checkpoints


def step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoints (``state.pt`` and ``meta.json`` present), lowest step first."""
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "state.pt").is_file() and (p / "meta.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_meta(path: Path) -> dict:
    """A checkpoint's ``meta.json`` (step, time, seq, lineage and the caller's fields)."""
    f = Path(path) / "meta.json"
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f}: not a JSON object")
    return meta


def _recency(meta: dict, step: int) -> tuple:
    # Written before seq existed: older than every sequenced one, in step order among themselves.
    seq = meta.get("seq")
    return (seq if isinstance(seq, int) else -1, step)


def _by_recency(ckpt_dir: Path, lineage: str | None, warn: bool = False) -> list[tuple[Path, dict]]:
    """``step_*`` folders with a readable meta.json, newest write first, of ``lineage`` only when given."""
    rows = []
    folders = [p for p in ckpt_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)] if ckpt_dir.is_dir() else []
    for p in folders:
        step = int(STEP_DIR.match(p.name).group(1))
        try:
            meta = read_meta(p)
        except CheckpointError as e:
            if warn:
                log.warning("skipping checkpoint %s: %s", p, e)
            continue
        if lineage is None or meta.get("lineage") == lineage:
            rows.append((_recency(meta, step), p, meta))
    return [(p, meta) for _, p, meta in sorted(rows, key=lambda r: r[0], reverse=True)]


def latest(ckpt_dir: Path, lineage: str | None = None) -> Path | None:
    """The most recently written complete-looking checkpoint (of ``lineage`` when given), unverified."""
    rows = [p for p, _ in _by_recency(ckpt_dir, lineage) if (p / "state.pt").is_file()]
    return rows[0] if rows else None


def written_since(ckpt_dir: Path, since: float) -> Path | None:
    """The newest complete-looking checkpoint whose meta.json time is ``since`` (``time.time()``) or later, unverified
    (a step folder appears whole, by rename): what a stop saved before its rank was killed, for the launcher's line."""
    newest = latest(ckpt_dir)
    try:
        written = read_meta(newest).get("time") if newest is not None else None
    except CheckpointError:
        return None
    return newest if isinstance(written, int | float) and written >= since else None


def latest_intact(ckpt_dir: Path, lineage: str | None = None) -> Path | None:
    """The most recently written checkpoint that passes :func:`verify`, skipping damaged ones with a warning.

    None when the folder holds no checkpoint at all. When it holds some but every one is
    damaged, raises :class:`CheckpointError` listing why: starting over silently would throw a run away.
    """
    rows = _by_recency(ckpt_dir, lineage, warn=True)
    why = []
    for p, _ in rows:
        try:
            verify(p)
            return p
        except CheckpointError as e:
            log.warning("skipping damaged checkpoint %s: %s", p.name, e)
            why.append(f"{p.name}: {e}")
    if why:
        raise CheckpointError(f"no intact checkpoint in {ckpt_dir}: " + "; ".join(why))
    return None


def clean_partial(ckpt_dir: Path) -> list[Path]:
    """Remove leftovers of interrupted writes (``.tmp-*`` / ``.old-*``); returns what was removed."""
    if not ckpt_dir.is_dir():
        return []
    gone = [p for p in ckpt_dir.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


# ---------------------------------------------------------------- checksums


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: Path) -> list[str]:
    """Every file under ``root`` (relative, '/'-separated, sorted), except the manifest itself."""
    out = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()]
    return sorted(x for x in out if x != MANIFEST)


def write_manifest(root: Path) -> None:
    """Record the SHA-256 and size of every file under ``root`` in ``root/manifest.json`` (fsynced)."""
    files = {rel: {"sha256": _sha256(root / rel), "bytes": (root / rel).stat().st_size} for rel in _files(root)}
    _write_json(root / MANIFEST, {"format": MANIFEST_FORMAT, "files": files})


# What verify() last saw for a file: (dev, inode, size, mtime_ns, ctime_ns) -> sha256. Lets the loop
# call latest_intact() and then load() without hashing a large checkpoint twice; any write changes ctime.
_verified: dict[str, tuple[tuple, str]] = {}
_verified_lock = threading.Lock()


def _digest(path: Path) -> str:
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _verified_lock:
        hit = _verified.get(str(path))
    if hit is not None and hit[0] == key:
        return hit[1]
    digest = _sha256(path)
    with _verified_lock:
        _verified[str(path)] = (key, digest)
    return digest


def _read_manifest(root: Path) -> dict[str, dict]:
    f = root / MANIFEST
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (an unfinished write, or a checkpoint older than checksums)")
    try:
        manifest = json.loads(f.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply to parse
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{f}: not a {MANIFEST_FORMAT} manifest")
    for rel, entry in files.items():
        parts = rel.split("/")
        safe = rel and not rel.startswith("/") and all(x not in ("", ".", "..") for x in parts)
        ok = isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)
        if not (safe and ok):
            raise CheckpointError(f"{f}: bad entry {rel!r}")
    return files


def verify(ckpt_path: Path, only: Path | None = None, *, extra_ok: bool = False) -> None:
    """Check every file of checkpoint folder ``ckpt_path`` against its manifest; raise CheckpointError naming
    the first missing, truncated, altered or unlisted file.

    ``only``: a file or sub-folder of the checkpoint; then only what lies under it is checked.
    ``extra_ok``: files the manifest does not list are allowed (an export, where users add a README or a
    run's config beside the weights); the listed ones are still checked.
    """
    root = Path(ckpt_path)
    files = _read_manifest(root)
    scope = "" if only is None else Path(only).relative_to(root).as_posix()

    def inside(rel: str) -> bool:
        return not scope or scope == "." or rel == scope or rel.startswith(scope + "/")

    for rel in sorted(x for x in files if inside(x)):
        f, want = root / rel, files[rel]
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in {root / MANIFEST})")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{f}: truncated or altered: {size} bytes, the manifest says {want['bytes']}")
        if _digest(f) != want["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch (the file changed after it was written)")
    scanned = _files(root) if only is None or Path(only).is_dir() else [scope]
    extra = [rel for rel in scanned if inside(rel) and rel not in files]
    if extra and not extra_ok:
        raise CheckpointError(f"{root / extra[0]}: not in {root / MANIFEST} (not written with this checkpoint)")
    if scope and not any(inside(rel) for rel in files):
        raise CheckpointError(f"{root / scope}: not in {root / MANIFEST}")


def verify_part(path: Path) -> None:
    """Verify one file or sub-folder of a checkpoint against the manifest of the checkpoint around it
    (``path`` itself, or up to two folders up)."""
    path = Path(path)
    root = next((p for p in (path, path.parent, path.parent.parent) if (p / MANIFEST).is_file()), None)
    if root is None:
        raise CheckpointError(f"{path}: no {MANIFEST} in it or the two folders above to verify it against")
    verify(root, only=path)


# ---------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):  # files before the folders that hold them
        if p.is_dir():
            _fsync_dir(p)
        elif p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def is_enospc(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was caused by, a full disk (also inside DCP's per-rank CheckpointException)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if not isinstance(e, OSError) and "(os error 28)" in str(e):  # Rust writers (safetensors) say it so
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return False


def partial_root(path: Path) -> Path:
    """The temporary folder a write to ``path`` belongs to: the checkpoint being written around it
    (``.tmp-step_*``, at most two levels up), else ``path`` itself."""
    path = Path(path)
    return next((p for p in (path, path.parent, path.parent.parent) if TMP_DIR.match(p.name)), path)


def discard_partial(path: Path) -> Path:
    """Remove what a failed write to ``path`` left (:func:`partial_root`); returns what was removed."""
    target = partial_root(path)
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)
    return target


def full_disk_error(path: Path, exc: BaseException) -> CheckpointError:
    """Remove the partial write around ``path`` and say plainly why it failed."""
    gone = discard_partial(path)
    return CheckpointError(f"no space left on device while writing {gone} (removed the partial write)")


def prepare(tmp: Path) -> None:
    """An empty temporary folder for a checkpoint that several writers fill (ranks, DCP)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def write(path: Path, state: Any) -> None:
    """One file of a checkpoint (tensors and plain containers), flushed and fsynced; its folder is renamed into
    place later.

    A full disk is a CheckpointError, after the partial write is removed. ``torch.save``'s zip writer
    reports it as a ``RuntimeError`` ("enforce fail at inline_container.cc") whose context is the OSError."""
    try:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        if is_enospc(e):
            raise full_disk_error(path, e) from e
        raise


def save(
    ckpt_dir: Path,
    step: int,
    state: dict,
    *,
    keep: int,
    meta: dict | None = None,
    tmp: Path | None = None,
    lineage: str | None = None,
) -> Path:
    """Write ``state`` as checkpoint ``step`` atomically, then keep only the newest ``keep`` of ``lineage``.

    ``tmp``: a folder from :func:`prepare` that other writers already filled; it becomes the checkpoint.
    ``lineage``: the run's id (kept across resumes). A folder of the same step from another lineage is
    never replaced: that raises CheckpointError and leaves it as it was.
    """
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step_{step:06d}"
    if tmp is None:
        tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
        prepare(tmp)
    try:
        if final.exists() and (other := _lineage_of(final, default=lineage)) != lineage:
            raise CheckpointError(
                f"{final}: belongs to lineage {other!r}, this run is {lineage!r}; refusing to replace another "
                "run's checkpoint (start a fresh run in a new folder, or continue that one with resume=auto)"
            )
        write(tmp / "state.pt", state)
        seqs = [m["seq"] for _, m in _by_recency(ckpt_dir, None) if isinstance(m.get("seq"), int)]
        seq = 1 + max(seqs, default=0)
        info = {"step": step, "time": time.time(), "seq": seq, "lineage": lineage} | (meta or {})
        _write_json(tmp / "meta.json", info)
        write_manifest(tmp)  # last: a folder with a valid manifest is complete
        _fsync_tree(tmp)
        _rename_into_place(tmp, final)  # the same step again: a resumed run re-saving it
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:
        if is_enospc(e):
            raise full_disk_error(tmp, e) from e
        raise
    prune(ckpt_dir, keep=keep, lineage=lineage)
    return final


def _rename_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final`` and flush the rename. An existing ``final`` is moved aside
    first and removed after, so ``final`` always names a complete folder (a ``.old-*`` left by a crash in between
    is removed by :func:`clean_partial`)."""
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(final.parent)


def _lineage_of(path: Path, default: str | None) -> str | None:
    try:
        return read_meta(path).get("lineage")
    except CheckpointError:  # no one can resume a folder without its meta.json: anyone may replace it
        return default


def prune(ckpt_dir: Path, *, keep: int, lineage: str | None) -> list[Path]:
    """Delete all but the ``keep`` most recently written checkpoints of ``lineage``; returns the deleted."""
    if keep <= 0:
        return []
    mine = [p for p, m in _by_recency(ckpt_dir, None) if m.get("lineage") == lineage]
    for p in mine[keep:]:
        shutil.rmtree(p, ignore_errors=True)
    return mine[keep:]


@contextlib.contextmanager
def staged_folder(out: Path, *, manifest: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out`` to fill; on success it replaces ``out`` atomically.

    Everything in it gets the permissions the user's umask gives a new folder or file: ``tempfile.mkdtemp``
    (0700) and safetensors (0600 files) would hide an export from the rest of a shared cluster. On failure
    the folder is removed; a full disk becomes a CheckpointError that says so. ``manifest``: record the
    SHA-256 and size of every file in ``manifest.json`` (an export: :func:`verify_export` checks it on load).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp, 0o777)  # the umask applies: this mode is the one to give everything inside
    try:
        yield tmp
        if manifest:
            write_manifest(tmp)
        dir_mode = tmp.stat().st_mode & 0o777
        for p in tmp.rglob("*"):
            if not p.is_symlink():
                p.chmod(dir_mode if p.is_dir() else dir_mode & 0o666)
        _fsync_tree(tmp)
        _rename_into_place(tmp, out)
    except Exception as e:
        if is_enospc(e):
            raise full_disk_error(tmp, e) from e
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- reading


def verify_export(folder: str | Path) -> None:
    """Check a model folder that carries a manifest (a run's ``export/``) before anything reads it: a truncated
    or altered weight file is a CheckpointError naming it, not a safetensors error that names nothing. A
    folder without a manifest (a hub download, an older export) is left to its loader; files added beside
    the listed ones are allowed."""
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        verify(folder, extra_ok=True)


def load(path: Path, *, verify_checksum: bool = True) -> Any:
    """Read a checkpoint folder's ``state.pt`` (or one file of it) with ``weights_only=True``: tensors and plain
    containers, never a class.

    The file is first checked against the manifest of its checkpoint (:func:`verify_part`; cheap after
    :func:`verify` of the same folder). ``verify_checksum=False`` reads a file outside any checkpoint.
    """
    path = Path(path)
    f = path / "state.pt" if path.is_dir() else path
    if not f.is_file():
        raise CheckpointError(f"{f}: no such checkpoint file")
    if verify_checksum:
        verify_part(f)
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{f}: cannot be read ({type(e).__name__}: {e})") from e


def check_finite(state_dict: Any, where: str) -> None:
    """Raise CheckpointError naming the first tensor of ``state_dict`` (nested dicts/lists) with a NaN or inf.

    A sharded (DTensor) entry is checked on this rank's shard only: under FSDP the ranks must agree on the result.
    """

    def walk(obj: Any, name: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.to_local() if hasattr(obj, "to_local") else obj
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise CheckpointError(f"{where}: {name} has {bad} non-finite value(s) of {t.numel()}")
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{name}.{i}" if name else str(i))

    walk(state_dict, "")


# ---------------------------------------------------------------- several ranks


def raise_together(err: BaseException | None, doing: str, cleanup: Path | None = None) -> None:
    """Make a failure on any rank a failure on every rank, so that no rank is left waiting in a collective.

    ``doing``: "writing <folder>" or "reading <folder>", for the message. ``cleanup``: a partial write
    that rank 0 removes on failure. A full disk on any rank becomes CheckpointError("no space left on
    device while writing <folder>"); otherwise a failing rank re-raises its own error, the others a
    CheckpointError naming that rank. Without a process group it just re-raises ``err``. What it raises is
    marked as raised by every rank (:func:`bapo.infra.checks.every_rank`): rank 0's line is the run's.
    """
    full = err is not None and is_enospc(err)
    mine = None if err is None else "ENOSPC" if full else f"{type(err).__name__}: {str(err).strip()[-2000:]}"
    msgs = dist.all_gather_object(mine)
    failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if not failed:
        return
    if cleanup is not None and dist.is_main():
        discard_partial(cleanup)
    if any(m == "ENOSPC" for _, m in failed):
        gone = "" if cleanup is None else " (removed the partial write)"
        raise every_rank(CheckpointError(f"no space left on device while {doing}{gone}")) from err
    if err is not None:
        raise every_rank(err)
    rank, msg = failed[0]
    raise every_rank(CheckpointError(f"{doing} failed on rank {rank}: {msg}"))


@contextlib.contextmanager
def together(doing: str, cleanup: Path | None = None) -> Iterator[None]:
    """Run the block on every rank, then :func:`raise_together` with what it raised (an ``Exception``), if
    anything: a collective, so every rank enters it."""
    err = None
    try:
        yield
    except Exception as e:
        err = e
    raise_together(err, doing, cleanup)
