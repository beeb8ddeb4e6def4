"""A run at a GPU's pace on a CPU: the HF engine and the clipped surrogate, slowed by sleeps that change no number.

A 7B step lasts 10-30 minutes; the tiny model's, a second. Behaviour that depends on time (a stop against the
launcher's grace, a time-based checkpoint) is only tested when the CPU step is as long, relative to the grace, as
the GPU's. These plug-ins give it that length, through the project's own seams (an engine and an objective named by
import path), and sleep only when the environment asks:

- ``rollout.engine=tests.helpers.paced:PacedHF``: the HF engine; each decode step of its model sleeps
  ``$BAPO_PACE_TOKEN_S`` seconds (a forward pre-hook on the engine's own copy of the model);
- ``algo.objective=tests.helpers.paced:objective``: the run's clipped surrogate (``algo.bounds``); each
  micro-batch's loss sleeps ``$BAPO_PACE_MICRO_S`` seconds.

And ``$BAPO_PACE_EXIT_S`` makes the process's own exit that long: the engine starts a non-daemon thread that sleeps
it, which a normal interpreter exit waits for, as a GPU rank's exit waits for its CUDA and NCCL teardown.

Each counts its events in this process (``generate <k>``: its k-th generation call; ``update <m>``: its m-th
micro-batch loss) and rank 0 writes the latest to ``$BAPO_PACE_PHASE``, so that a test sends its signal in the
phase it means to. ``$BAPO_PACE_FROM`` (``generate 2``, ``update 5``) holds the sleeps back until that event: the
run goes at full speed up to the phase a test stops it in, and at a GPU's pace from there on. Without the variables
they are the plain engine and objective: the same samples and the same metrics, so an unpaced run is the reference
of a paced one, and a paced run resumes unpaced.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

from bapo.algos.objective import OBJECTIVES
from bapo.engines.hf import HFRollout

TOKEN_S, MICRO_S, PHASE, FROM = "BAPO_PACE_TOKEN_S", "BAPO_PACE_MICRO_S", "BAPO_PACE_PHASE", "BAPO_PACE_FROM"
EXIT_S = "BAPO_PACE_EXIT_S"
_COUNTS = {"generate": 0, "update": 0}
_PACING = [False]


def _pace(var: str) -> float:
    """The sleep ``var`` asks for, once ``$BAPO_PACE_FROM``'s event has come (at once without it)."""
    if not _PACING[0]:
        spec = os.environ.get(FROM, "").split()
        _PACING[0] = not spec or _COUNTS.get(spec[0], 0) >= int(spec[1])
    return float(os.environ.get(var) or 0.0) if _PACING[0] else 0.0


def _mark(event: str) -> None:
    """Count an ``event`` of this process; rank 0 writes ``<event> <count>`` to ``$BAPO_PACE_PHASE``."""
    _COUNTS[event] += 1
    path = os.environ.get(PHASE)
    if path and os.environ.get("RANK", "0") == "0":
        tmp = Path(f"{path}.tmp-{os.getpid()}")
        tmp.write_text(f"{event} {_COUNTS[event]}\n")
        tmp.replace(path)


def phase(path: Path) -> tuple[str, int] | None:
    """What ``$BAPO_PACE_PHASE`` says: (event, count), or None before anything was written."""
    try:
        name, count = path.read_text().split()
        return name, int(count)
    except (OSError, ValueError):
        return None


class PacedHF(HFRollout):
    """The HF engine whose decode steps take ``$BAPO_PACE_TOKEN_S`` seconds each."""

    @classmethod
    def from_config(cls, cfg, ctx):
        engine = super().from_config(cfg, ctx)
        engine.model.register_forward_pre_hook(lambda module, args: time.sleep(_pace(TOKEN_S)))
        if float(os.environ.get(EXIT_S) or 0.0) > 0:  # the process's exit waits for this thread to end
            threading.Thread(target=time.sleep, args=(float(os.environ[EXIT_S]),), name="paced-exit").start()
        return engine

    def _generate(self, *args, **kwargs):
        _mark("generate")
        return super()._generate(*args, **kwargs)


def objective(algo):
    """The run's surrogate objective (``algo.objective=surrogate``'s), each micro-batch's loss ``$BAPO_PACE_MICRO_S``
    seconds long."""
    obj = OBJECTIVES["surrogate"](dataclasses.replace(algo, objective="surrogate"))
    loss = obj.loss

    def paced_loss(*args, **kwargs):
        _mark("update")
        time.sleep(_pace(MICRO_S))
        return loss(*args, **kwargs)

    return dataclasses.replace(obj, loss=paced_loss)
