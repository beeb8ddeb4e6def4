"""What a run's checkpoint holds, and how a run saves and restores it (a collective under torchrun).

The folder itself (written atomically, checksummed, verified on every read, pruned within the run's
lineage, a full disk or a failing rank made one plain error) is :mod:`bapo.infra.ckpt_folder`'s job. This module
fills it: :func:`save_run` writes the learner, each rank's rollout source, the loop's shared objects and
every RNG an exact resume needs; :func:`restore_run` reads them back, at another world size too where that
is possible. The files hold tensors and plain containers only (read with ``weights_only=True``): the loop's
records (the dataclasses of :mod:`bapo.samples`) are encoded as tagged dicts and rebuilt from a fixed list
of known types (:func:`to_plain`, :func:`from_plain`), so nothing a checkpoint holds can name a class to run.

The generic folder's names that callers use are importable from here too.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bapo.infra import ckpt_folder, dist
from bapo.infra.checks import require, resumable
from bapo.infra.ckpt_folder import (
    MANIFEST,
    CheckpointError,
    check_finite,
    clean_partial,
    is_enospc,
    latest,
    latest_intact,
    prepare,
    raise_together,
    read_meta,
    staged_folder,
    step_dirs,
    together,
    verify,
    verify_export,
    verify_part,
    write_manifest,
)
from bapo.samples import Problem, Prompt, RolloutBatch, Sample, ScoredSample

__all__ = ["MANIFEST", "CheckpointConfig", "CheckpointError", "check_finite", "clean_partial", "from_plain"]
__all__ += ["is_enospc", "latest", "latest_intact", "load", "prepare", "raise_together", "read_meta"]
__all__ += ["restore_run", "save_run", "staged_folder", "step_dirs", "to_plain", "together", "verify"]
__all__ += ["verify_export", "verify_part", "write", "write_manifest"]

KNOWN_TYPES = {c.__name__: c for c in (Problem, Prompt, Sample, ScoredSample, RolloutBatch)}
TAG = "__dataclass__"


# ---------------------------------------------------------------- the plain encoding of the loop's records


def _map_containers(obj: Any, fn) -> Any:
    """``obj`` with ``fn`` applied to each value of its dicts, lists and tuples (one level; ``fn`` recurses)."""
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fn(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(fn(v) for v in obj)
    return obj


def to_plain(obj: Any) -> Any:
    """Encode known dataclasses (recursively) as tagged dicts; tensors and plain values pass through."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if KNOWN_TYPES.get(name) is not type(obj):
            raise TypeError(f"cannot checkpoint {type(obj).__qualname__}: not one of {sorted(KNOWN_TYPES)}")
        return {TAG: name} | {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return _map_containers(obj, to_plain)


def from_plain(obj: Any) -> Any:
    """The inverse of :func:`to_plain`; a tag naming no known type is a CheckpointError."""
    if isinstance(obj, dict) and TAG in obj:
        cls = KNOWN_TYPES.get(obj[TAG])
        if cls is None:
            raise CheckpointError(f"unknown record type {obj[TAG]!r} in checkpoint")
        return cls(**{k: from_plain(v) for k, v in obj.items() if k != TAG})
    return _map_containers(obj, from_plain)


def write(path: Path, state: dict) -> None:
    """One file of a run's checkpoint, its records encoded (:func:`bapo.infra.ckpt_folder.write`)."""
    ckpt_folder.write(path, to_plain(state))


def load(path: Path, *, verify_checksum: bool = True) -> Any:
    """A checkpoint's ``state.pt`` (or one file of it), verified and decoded (:func:`bapo.infra.ckpt_folder.load`)."""
    return from_plain(ckpt_folder.load(path, verify_checksum=verify_checksum))


# ---------------------------------------------------------------- the run's checkpoint layout


def rng_state_plain(state: tuple) -> tuple:
    """``random.Random.getstate()`` is already plain; numpy's legacy state has an array: make it a list."""
    return tuple(s.tolist() if hasattr(s, "tolist") else s for s in state)


def capture_rng(loop_rng: random.Random) -> dict:
    """Every generator an exact resume needs: the loop's shuffler, python's, numpy's and torch's (CPU)."""
    return {
        "loop": loop_rng.getstate(),
        "python": random.getstate(),
        "numpy": rng_state_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: dict, loop_rng: random.Random) -> None:
    loop_rng.setstate(_rng_tuple(state["loop"]))
    random.setstate(_rng_tuple(state["python"]))
    name, key, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])


def _rng_tuple(st) -> tuple:
    return (st[0], tuple(st[1]), st[2])


def save_run(
    ckpt_dir: Path,
    step: int,
    *,
    learner: Any,
    source: Any,
    keep: int,
    lineage: str,
    loop_rng: random.Random,
    pending: dict | None = None,
    **shared: Any,
) -> Path:
    """Checkpoint a run at ``step`` (a collective under torchrun: every rank calls it). The layout:

    - ``state.pt`` (rank 0): the step, every object of ``shared`` by name (their ``state_dict()``: the buffer,
      the monitor), the RNG states (:func:`capture_rng`) and, for a run stopped inside step ``step + 1``,
      ``pending``: what the rest of that step needs (``bapo.loop.StepProgress``: its samples, the updates made);
    - ``producer_rank<r>.pt`` (each rank): the rollout source's state (``bapo.rollout.source``: its queue and data
      cursor); rank 0's also holds its weight snapshots (full copies, the same on every rank that holds that
      version: written once, read by every rank), without the snapshot of the learner's current version (restored
      from the model); another rank's file holds the snapshots rank 0 no longer (or not yet) holds: async
      producers pause between batches, not at the same batch, so one rank may still need a version rank 0 dropped;
    - ``learner/`` (the learner's ``save``): weights, AdamW, schedule, version; DCP shards under FSDP;
    - ``meta.json`` and ``manifest.json``, written last by :func:`bapo.infra.ckpt_folder.save`.

    A failure on any rank (a full disk) fails every rank, after the partial folder is removed.
    """
    tmp = ckpt_dir / f".tmp-step_{step:06d}"
    path = ckpt_dir / f"step_{step:06d}"
    with together(f"writing {path}", cleanup=tmp):
        if dist.is_main():
            prepare(tmp)
    with together(f"writing {path}", cleanup=tmp):
        state = source.state_dict(live=learner.version)
        at_zero = set(dist.broadcast_object(state.get("snapshot_versions", [])))
        if not dist.is_main():  # rank 0's file carries the versions it holds; this one, the rest it needs
            state["snapshots"] = {v: w for v, w in state.get("snapshots", {}).items() if v not in at_zero}
        write(tmp / f"producer_rank{dist.rank()}.pt", state)
    with together(f"writing {path}", cleanup=tmp):
        learner.save(tmp / "learner")  # under FSDP a collective that fails together by itself; then so does this
    with together(f"writing {path}", cleanup=tmp):
        if dist.is_main():
            state = {"step": step} | {k: v.state_dict() for k, v in shared.items()} | {"rng": capture_rng(loop_rng)}
            meta = {"version": learner.version, "world_size": dist.world_size()}
            if pending is not None:
                state["pending"] = pending
                meta["pending_updates"] = len(pending.get("updates", ()))
            ckpt_folder.save(ckpt_dir, step, to_plain(state), keep=keep, meta=meta, tmp=tmp, lineage=lineage)
    return path


def restore_run(
    path: Path, *, learner: Any, source: Any, loop_rng: random.Random, **shared: Any
) -> tuple[int, dict | None]:
    """Restore what :func:`save_run` wrote; returns the checkpoint's step and its ``pending`` (None for a
    checkpoint at a step's end). A collective under torchrun.

    Rank 0 verifies every file against the manifest first; every rank gets the verdict."""
    path = Path(path)
    with together(f"reading {path}"):
        if dist.is_main():
            verify(path)
    state = load(path)
    learner.load(path / "learner")
    source.load_state_dict(_producer_state(path, dist.rank()))
    for k, obj in shared.items():
        obj.load_state_dict(state[k])
    restore_rng(state["rng"], loop_rng)
    return int(state["step"]), state.get("pending")


def _producer_state(ckpt: Path, rank: int) -> dict:
    """This rank's producer state. At another world size (DCP reshards the model), a checkpoint
    whose producers held no batches ahead resumes from rank 0's (all ranks draw the same prompts)."""
    pfile = ckpt / f"producer_rank{rank}.pt"
    if pfile.is_file():
        state = load(pfile)
        own = state.get("snapshots") or {}
        need = [v for v in state.get("snapshot_versions", []) if v not in own]
        if rank != 0 and need:  # the snapshots rank 0 held too are in its file only
            snaps = load(ckpt / "producer_rank0.pt")["snapshots"]
            state["snapshots"] = {v: own[v] if v in own else snaps[v] for v in state["snapshot_versions"]}
        return state
    state = load(ckpt / "producer_rank0.pt")
    if state["pending"]:
        raise CheckpointError(
            f"{pfile}: missing; this checkpoint was written by a different number of ranks while the "
            "rollout producer had batches queued (async): resume it with the world size that wrote it"
        )
    return state


# ----------------------------------------------------------------------------- config


@dataclass
class CheckpointConfig:
    every: int = resumable()  # steps; 0 = only on a stop and at the end
    every_minutes: float = resumable()  # also once this long has passed since the last checkpoint; 0 = off
    keep: int = resumable()  # newest checkpoints of this run kept

    def __post_init__(self) -> None:
        require(self.every >= 0, "checkpoint.every", "must be >= 0")
        require(
            math.isfinite(self.every_minutes) and self.every_minutes >= 0,
            "checkpoint.every_minutes",
            f"must be >= 0 (0: off), got {self.every_minutes}",
        )
        require(self.keep >= 1, "checkpoint.keep", "must be >= 1")
