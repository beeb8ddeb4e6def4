"""Atomic, complete checkpoints of a run, and the plain encoding they need.

A checkpoint is a folder ``<run>/checkpoints/step_000120/`` holding ``state.pt``
(everything an exact resume needs) and ``meta.json``. It is written under a
temporary name in the same folder, flushed to disk, and renamed into place, so a
crash mid-write leaves the previous checkpoints untouched and a half-written one
is never mistaken for a complete one. The newest ``keep`` are kept.

``state.pt`` holds only tensors and plain containers, and it is read back with
``torch.load(weights_only=True)``: no pickled classes. The loop's dataclasses
(samples and rollout batches in the buffer and the producer's queue) are encoded
as tagged dicts and rebuilt from a fixed list of known types, so a checkpoint can
never name something to import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from bapo.types import Problem, Prompt, RolloutBatch, Sample, ScoredSample

KNOWN_TYPES = {c.__name__: c for c in (Problem, Prompt, Sample, ScoredSample, RolloutBatch)}
STEP_DIR = re.compile(r"^step_(\d{6,})$")
TAG = "__dataclass__"


class CheckpointError(RuntimeError):
    pass


def to_plain(obj: Any) -> Any:
    """Encode known dataclasses (recursively) as tagged dicts; tensors and plain values pass through."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if KNOWN_TYPES.get(name) is not type(obj):
            raise TypeError(f"cannot checkpoint {type(obj).__qualname__}: not one of {sorted(KNOWN_TYPES)}")
        return {TAG: name} | {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_plain(v) for v in obj)
    return obj


def from_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        if TAG in obj:
            cls = KNOWN_TYPES.get(obj[TAG])
            if cls is None:
                raise CheckpointError(f"unknown record type {obj[TAG]!r} in checkpoint")
            return cls(**{k: from_plain(v) for k, v in obj.items() if k != TAG})
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(v) for v in obj)
    return obj


def rng_state_plain(state: tuple) -> tuple:
    """``random.Random.getstate()`` is already plain; numpy's legacy state has an array: make it a list."""
    return tuple(s.tolist() if hasattr(s, "tolist") else s for s in state)


def step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "state.pt").is_file() and (p / "meta.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(ckpt_dir: Path) -> Path | None:
    dirs = step_dirs(ckpt_dir)
    return dirs[-1][1] if dirs else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(tmp: Path) -> None:
    """An empty temporary folder for a checkpoint that several writers fill (ranks, DCP)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def write(path: Path, state: dict) -> None:
    """One file of a checkpoint: encoded, flushed and fsynced (its folder is renamed into place later)."""
    with open(path, "wb") as f:
        torch.save(to_plain(state), f)
        f.flush()
        os.fsync(f.fileno())


def save(
    ckpt_dir: Path, step: int, state: dict, *, keep: int, meta: dict | None = None, tmp: Path | None = None
) -> Path:
    """Write ``state`` as checkpoint ``step`` atomically, then keep only the newest ``keep``.

    ``tmp``: a folder from :func:`prepare` that other writers already filled; it becomes the checkpoint.
    """
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step_{step:06d}"
    if tmp is None:
        tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
        prepare(tmp)
    write(tmp / "state.pt", state)
    info = {"step": step, "time": time.time()} | (meta or {})
    with open(tmp / "meta.json", "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same step again (a resumed run re-saving): move the old one aside first
        old = ckpt_dir / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(ckpt_dir)
    for _, p in step_dirs(ckpt_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def clean_partial(ckpt_dir: Path) -> list[Path]:
    """Remove leftovers of interrupted writes (``.tmp-*`` / ``.old-*``); returns what was removed."""
    if not ckpt_dir.is_dir():
        return []
    gone = [p for p in ckpt_dir.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def load(path: Path) -> dict:
    """Read a checkpoint folder (or its ``state.pt``) with ``weights_only=True``."""
    path = Path(path)
    f = path / "state.pt" if path.is_dir() else path
    if not f.is_file():
        raise CheckpointError(f"{f}: no such checkpoint file")
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{f}: cannot be read ({type(e).__name__}: {e})") from e
    return from_plain(state)
