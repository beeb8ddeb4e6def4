"""The rollout-source seam: ``run()`` drives any :class:`~bapo.rollout.source.RolloutSource`.

A second source, written here in a few lines, replays the batches a first run took; the loop built with it
through the same ``run()`` trains to the same numbers, without generating a single rollout. Both runs choose
their source as a user would, by a placement named on the command line (``+placement.mode=package.module:Class``,
docs/extending.md): no file of bapo/ is patched.
"""

import contextlib
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bapo import loop
from bapo.rollout.placement import Colocated
from bapo.rollout.producer import Producer
from bapo.rollout.source import Interrupted, RolloutSource

ROOT = Path(__file__).resolve().parents[2]
VOLATILE = ("time/", "reward/verify_s", "rollout/tokens_per_s", "buffer/consumer_wait_s", "buffer/producer_wait_s")


def _cfg(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="config", overrides=["debug=smoke", *overrides])


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


class Recording:
    """The in-process producer, keeping every batch the loop takes from it."""

    def __init__(self, inner: Producer):
        self.inner, self.batches = inner, []

    def take(self):
        batch, waited = self.inner.take()
        self.batches.append(batch)
        return batch, waited

    def try_take(self):
        batch = self.inner.try_take()
        if batch is not None:
            self.batches.append(batch)
        return batch

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ReplaySource(RolloutSource):
    """A second RolloutSource: hands out recorded batches in order, lends an engine for evaluation. It subclasses
    the protocol, as docs/extending.md says a new source does, and keeps its no-op defaults (``try_take``,
    ``release``, ``take_wait_s``, ``requeue``)."""

    def __init__(self, batches, engine):
        self.batches, self.engine, self.taken, self.slept = list(batches), engine, 0, 0

    def start(self):
        pass

    def take(self):
        if self.taken == len(self.batches):
            raise Interrupted
        self.taken += 1
        return self.batches[self.taken - 1], 0.0

    def offer_weights(self, learner):
        pass  # the batches are made already

    def before_updates(self):
        self.slept += 1

    def snapshot(self, version):
        raise KeyError(version)

    @contextlib.contextmanager
    def borrow(self, learner):
        if self.engine.version != learner.version:
            self.engine.load_weights(learner.weights(), learner.version)
        yield self.engine

    @contextlib.contextmanager
    def paused(self):
        yield

    def state_dict(self, live=None, snapshots=True):
        return {"taken": self.taken}

    def load_state_dict(self, state):
        self.taken = state["taken"]

    def stop(self):
        pass


RECORDED: dict = {}  # what the placements below leave for the test to read


class RecordingPlacement(Colocated):
    """The colocated placement, its producer wrapped to keep every batch the loop takes."""

    def source(self, maker, engine, interrupt):
        RECORDED["source"] = Recording(super().source(maker, engine, interrupt))
        return RECORDED["source"]


class ReplayPlacement(Colocated):
    """Batches from the recording, the engine only lent for evaluation; the batch maker must never run."""

    def source(self, maker, engine, interrupt):
        maker.make = None  # every batch comes from the recording
        RECORDED["replay"] = ReplaySource(RECORDED["source"].batches, engine)
        return RECORDED["replay"]


def test_both_sources_meet_the_interface():
    assert isinstance(ReplaySource([], None), RolloutSource)
    p = Producer(None, mode="sync", updates_per_batch=1, max_staleness=0, sync_every=1)
    assert isinstance(p, RolloutSource)
    with pytest.raises(RuntimeError, match="without its engine"), p.borrow(None):
        pass


@pytest.mark.slow
def test_run_trains_the_same_from_a_replaying_source(tmp_path):
    """Run 1 takes its batches from the producer and records them; run 2 replays them through ``run()``: every
    metric but timings is equal, and run 2's engine made no rollout (it only evaluated)."""
    RECORDED.clear()
    here = __name__  # the placements are named by import path, as a user's own would be
    over = ["train.steps=2", "eval.every=1"]
    loop.run(_cfg([*over, f"+placement.mode={here}:RecordingPlacement"]), tmp_path / "live")
    assert [b.index for b in RECORDED["source"].batches] == [1, 2]
    loop.run(_cfg([*over, f"+placement.mode={here}:ReplayPlacement"]), tmp_path / "replay")
    live, replay = _rows(tmp_path / "live"), _rows(tmp_path / "replay")
    assert [r["step"] for r in replay] == [0, 1, 2]
    assert replay == live
    assert "eval/accuracy" in replay[2] and replay[2]["eval/version"] == replay[2]["policy/version"] == 4
    # told before each step's learner forwards twice: scoring (the mismatch check's forward) and the updates
    assert RECORDED["replay"].taken == 2 and RECORDED["replay"].slept == 4
