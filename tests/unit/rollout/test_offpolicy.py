"""The off-policy schedule and the producer: the staleness bound under any speeds."""

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.experience.buffer import ReplayBuffer
from bapo.rollout.producer import Interrupted, Producer, batch_version, min_staleness, offer_weights
from tests.helpers.fakes import CursorMaker
from tests.helpers.samples import scored_group


class Maker(CursorMaker):
    """A batch maker from a function ``make(t, version, weights)``."""

    def __init__(self, fn):
        self.fn, self.cursor = fn, 0

    def make(self, t, version, weights):
        self.cursor += 1
        return self.fn(t, version, weights)


class FakeLearner:
    """What offer_weights reads of a learner: its version, live weights and a copy (counted)."""

    def __init__(self):
        self.version, self.copies, self.lives = 0, 0, 0

    def weights(self):
        self.lives += 1
        return {"v": torch.tensor(self.version)}

    def snapshot(self):
        self.copies += 1
        return {"v": torch.tensor(self.version)}


def bv(t, u, k, s, mode):
    return batch_version(t, updates_per_batch=u, max_staleness=k, sync_every=s, mode=mode)


def test_hand_computed_schedules():
    # U = 2 updates per batch, k = 1 (the minimum): batch t trains at versions 2t-2, 2t-1
    assert [bv(t, 2, 1, 1, "sync") for t in range(1, 5)] == [0, 2, 4, 6]
    assert [bv(t, 2, 1, 1, "admission") for t in range(1, 5)] == [0, 2, 4, 6]
    # k = 3: generated with the weights two versions older, so its last update sees staleness 3
    assert [bv(t, 2, 3, 1, "admission") for t in range(1, 5)] == [0, 0, 2, 4]
    assert [bv(t, 2, 3, 1, "sync") for t in range(1, 5)] == [0, 2, 4, 6]  # sync: k is only a bound
    # sync_every = 2, U = 1: the engine sees every other version; minimum k = 1
    assert [bv(t, 1, 1, 2, "sync") for t in range(1, 6)] == [0, 0, 2, 2, 4]
    assert [bv(t, 1, 1, 2, "admission") for t in range(1, 6)] == [0, 0, 2, 2, 4]
    assert [bv(t, 1, 4, 2, "admission") for t in range(1, 8)] == [0, 0, 0, 0, 0, 2, 2]  # batch t trains at t-1
    assert bv(3, 1, 0, 1, "drop") is None
    assert min_staleness(8, 1) == 7  # 2 epochs x 4 mini-batches (the example)


def test_k_below_the_minimum_is_refused():
    with pytest.raises(ValueError, match="max_staleness=6 < 7"):
        bv(1, 8, 6, 1, "admission")


@settings(max_examples=300)
@given(
    u=st.integers(1, 6),
    s=st.integers(1, 4),
    extra=st.integers(0, 8),
    t=st.integers(1, 60),
    mode=st.sampled_from(["sync", "admission"]),
)
def test_schedule_properties(u, s, extra, t, mode):
    k = min_staleness(u, s) + extra
    v = bv(t, u, k, s, mode)
    assert v % s == 0  # only synced versions ever reach the engine
    assert v <= (t - 1) * u  # the weights exist before batch t is needed
    assert t * u - 1 - v <= k  # the batch's last update is within the bound
    assert bv(t + 1, u, k, s, mode) >= v  # the engine never goes back in time
    assert bv(t, u, k, s, "admission") <= bv(t, u, k, s, "sync")  # admission runs ahead, never behind
    if extra == 0:
        assert bv(t, u, k, s, "admission") == bv(t, u, k, s, "sync")  # async at the minimum k is synchronous
    if s == 1 and t * u - 1 >= k:
        assert t * u - 1 - bv(t, u, k, 1, "admission") == k  # and above it, k is the realised staleness


def simulate(mode, u, k, s, steps, rng, batch_size=2):
    """A real Producer on its thread and a consumer that does what bapo.loop does, at random speeds.

    Each batch is one group of ``batch_size`` samples; returns the staleness of every sample in every
    update and the buffer's counters."""
    delays = [rng.random() * 2e-3 for _ in range(4 * steps + 8)]

    def make_batch(t, version, weights):
        assert int(weights["v"]) == version  # the snapshot the schedule asked for
        time.sleep(delays[t % len(delays)])
        return scored_group(t, version, batch_size)

    producer = Producer(
        Maker(make_batch),
        mode=mode,
        updates_per_batch=u,
        max_staleness=k,
        sync_every=s,
        ahead=3,
        last_batch=None if mode == "drop" else steps,
    )
    buf = ReplayBuffer(max_staleness=k, capacity=64)
    learner, seen = FakeLearner(), []
    offer_weights(producer, learner)
    producer.start()
    try:
        for _ in range(steps):
            item, _ = producer.take()
            buf.put(item)
            if mode == "drop":
                while (more := producer.try_take()) is not None:
                    buf.put(more)
            batch = buf.get(batch_size, learner.version, horizon=u - 1)
            while len(batch) < batch_size:
                more, _ = producer.take()
                buf.put(more)
                batch += buf.get(batch_size - len(batch), learner.version, horizon=u - 1)
            for j in range(u):
                stats = buf.check(batch, learner.version)  # raises StalenessError past k
                seen.append(int(stats["buffer/staleness_max"]))
                time.sleep(delays[(j + learner.version) % len(delays)] * rng.choice([0, 1, 3]))
                learner.version += 1
                offer_weights(producer, learner)
            producer.release(learner.version, keep_window=False)
    finally:
        producer.stop()
    return seen, buf


@settings(max_examples=25, deadline=None)
@given(
    u=st.integers(1, 3),
    s=st.integers(1, 2),
    extra=st.integers(0, 3),
    mode=st.sampled_from(["sync", "admission", "drop"]),
    seed=st.integers(0, 2**16),
)
def test_random_producer_and_consumer_speeds_never_exceed_k(u, s, extra, mode, seed):
    k = min_staleness(u, s) + extra
    seen, buf = simulate(mode, u, k, s, steps=6, rng=random.Random(seed))
    assert len(seen) == 6 * u and max(seen) <= k
    if mode != "drop":
        assert buf.dropped_stale == 0  # admission waits instead of wasting samples
        assert buf.dropped_capacity == 0


def test_admission_realises_k_and_drop_counts_what_it_throws_away():
    seen, _ = simulate("admission", 1, 3, 1, steps=8, rng=random.Random(0))
    assert seen == [0, 1, 2, 3, 3, 3, 3, 3]  # ramps up, then exactly k
    # drop: a fast producer gets ahead with old weights; the consumer is slow, so some batches go stale
    buf = ReplayBuffer(max_staleness=0, capacity=64)
    producer = Producer(
        Maker(lambda t, v, w: scored_group(t, v, 2)),
        mode="drop",
        updates_per_batch=1,
        max_staleness=0,
        sync_every=1,
        ahead=4,
    )
    producer.publish(0, {"v": torch.tensor(0)})
    producer.start()
    try:
        time.sleep(0.2)  # the producer fills its queue with version-0 batches
        version = 0
        for _ in range(3):
            item, _ = producer.take()
            buf.put(item)
            batch = buf.get(2, version)
            while not batch:
                more, _ = producer.take()
                buf.put(more)
                batch = buf.get(2, version)
            assert buf.check(batch, version)["buffer/staleness_max"] == 0
            version += 1
            producer.publish(version, {"v": torch.tensor(version)})
    finally:
        producer.stop()
    assert buf.dropped_stale > 0


def test_pause_quiesces_the_producer_between_batches():
    started, gate = threading.Event(), threading.Event()

    def slow(t, v, w):
        started.set()
        gate.wait(5)
        return t

    producer = Producer(Maker(slow), mode="drop", updates_per_batch=1, max_staleness=0, sync_every=1, ahead=8)
    producer.publish(0, {})
    producer.start()
    try:
        assert started.wait(5)
        done = threading.Event()
        threading.Thread(target=lambda: (producer.pause(), done.set()), daemon=True).start()
        assert not done.wait(0.2)  # mid-batch: pause waits for it to finish
        gate.set()
        assert done.wait(5)
        n = producer.queued()
        time.sleep(0.2)
        assert producer.queued() == n  # and nothing more is made while paused
        producer.resume()
        time.sleep(0.2)
        assert producer.queued() > n
    finally:
        producer.stop()


def test_a_failing_producer_surfaces_in_take():
    def boom(t, v, w):
        raise ValueError("engine exploded")

    producer = Producer(Maker(boom), mode="admission", updates_per_batch=1, max_staleness=0, sync_every=1)
    producer.publish(0, {})
    producer.start()
    with pytest.raises(RuntimeError, match="producer failed") as e:
        producer.take()
    assert "engine exploded" in str(e.value.__cause__)
    producer.stop()


def test_a_stop_request_wakes_a_consumer_waiting_for_a_batch(hang_guard):
    """A learner blocked in take() (the producer waits for weights that never come) must wake on a stop."""
    interrupt = threading.Event()
    producer = Producer(
        Maker(lambda t, v, w: t), mode="admission", updates_per_batch=1, max_staleness=0, sync_every=1,
        interrupt=interrupt,
    )  # fmt: skip
    producer.start()  # nothing published: the producer waits forever
    threading.Timer(0.3, interrupt.set).start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(Interrupted):
            producer.take()
    finally:
        producer.stop()
    assert time.perf_counter() - t0 < 5


def test_sync_snapshots_are_copies_whenever_a_later_batch_needs_them():
    """Sync mode at a step boundary may hand the engine the live weights only when the next batch is the one
    batch that asks for that version; with sync_every > updates per step two batches share a version."""
    # U = 2, s = 1: every version a batch asks for is asked for once, at a step boundary: no copy
    p = Producer(Maker(lambda t, v, w: t), mode="sync", updates_per_batch=2, max_staleness=1, sync_every=1)
    assert p.wants(0) and not p.needs_copy(0)
    # U = 1, s = 2: batches 1 and 2 both use version 0; batch 2 is made after update 1
    p = Producer(Maker(lambda t, v, w: t), mode="sync", updates_per_batch=1, max_staleness=1, sync_every=2)
    assert p.wants(0) and p.needs_copy(0)
    learner = FakeLearner()
    offer_weights(p, learner)
    assert learner.copies == 1 and learner.lives == 0
    item, _ = p.take()  # batch 1 at version 0
    learner.version = 1
    offer_weights(p, learner)  # version 1: no batch asks for it
    assert (learner.copies, learner.lives) == (1, 0)
    learner.weights()["v"].fill_(99)  # the learner moves on; the snapshot of version 0 must not
    assert int(p.snapshot(0)["v"]) == 0
    # async: always a copy
    a = Producer(Maker(lambda t, v, w: t), mode="admission", updates_per_batch=2, max_staleness=1, sync_every=1)
    assert a.needs_copy(0)


def test_state_dict_round_trip_keeps_the_queue_cursor_and_snapshots():
    p = Producer(Maker(lambda t, v, w: ("batch", t, v)), mode="admission", updates_per_batch=1, max_staleness=2,
                 sync_every=1)  # fmt: skip
    for v in (0, 1):
        p.publish(v, {"v": torch.tensor(v)})
    p.start()
    deadline = time.time() + 5
    while p.queued() < 4 and time.time() < deadline:  # batches 1-3 use version 0 (k = 2), batch 4 version 1
        time.sleep(0.01)
    p.pause()
    p.take()
    state = p.state_dict(live=1)
    p.stop()
    assert (
        state["consumed"] == 1
        and [b[1:] for b in state["pending"]] == [(2, 0), (3, 0), (4, 1)]
        and set(state["snapshots"]) == {0}
    )
    q = Producer(Maker(lambda t, v, w: ("batch", t, v)), mode="admission", updates_per_batch=1, max_staleness=2,
                 sync_every=1)  # fmt: skip
    q.load_state_dict(state)
    assert q.maker.cursor == state["maker"]["cursor"] and q.take()[0] == ("batch", 2, 0)
