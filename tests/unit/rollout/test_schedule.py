"""The staleness schedule's pure functions, against hand-computed cases (``bapo.rollout.schedule``)."""

import pytest

from bapo.rollout.schedule import Schedule, batch_version


def test_asking_lists_the_batches_of_a_version_from_the_consumers_side():
    # admission, U = 1, k = 2, s = 1: v_t = max(0, t - 3), so batches 1-3 use version 0 and batch 4 version 1
    a = Schedule("admission", 1, 2, 1)
    assert a.asking(0, 0) == [(1, 0), (2, 0), (3, 0)]
    assert a.asking(1, 1) == [(2, 0), (3, 0), (4, 1)]  # one consumed: batch 1 no longer asks
    assert a.asking(5, 1) == []  # batch 6 asks for version 3
    assert Schedule("drop", 1, 2, 1).asking(0, 10) == []


def test_wants_and_needs_copy():
    # sync, U = 2, s = 1: batch t at version 2(t-1); only step boundaries are asked for, each by one batch
    s = Schedule("sync", 2, 1, 1)
    assert [s.wants(v, consumed=0) for v in range(3)] == [True, False, True]
    assert not s.needs_copy(0, consumed=0)  # batch 1 is made right now, before any update: live weights
    assert not s.needs_copy(2, consumed=1)
    assert s.needs_copy(1, consumed=0)  # mid-step
    # sync, U = 1, s = 2: batches 1 and 2 both use version 0; batch 2 is made after update 1, so a copy
    assert Schedule("sync", 1, 1, 2).needs_copy(0, consumed=0)
    assert Schedule("admission", 2, 1, 1).needs_copy(0, consumed=0)  # async: always a copy
    # drop: every synced version, none in between
    d = Schedule("drop", 1, 3, 2)
    assert [d.wants(v, consumed=7) for v in range(5)] == [True, False, True, False, True]


def test_release_floor():
    a = Schedule("admission", 1, 2, 1)
    # the learner at version 4, batch 6 next (version 3): versions below 3 go
    assert a.release_floor(6, 4, newest_held=4, keep_window=False) == 3
    # recompute keeps the window: a batch at staleness <= k = 2 may be at version 2
    assert a.release_floor(6, 4, newest_held=4, keep_window=True) == 2
    d = Schedule("drop", 1, 2, 1)  # drop: the next batch takes the newest held
    assert d.release_floor(9, 7, newest_held=6, keep_window=False) == 6
    assert d.release_floor(9, 7, newest_held=6, keep_window=True) == 5


def test_bad_mode_and_k_are_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        Schedule("eager", 1, 0, 1)
    with pytest.raises(ValueError, match="max_staleness=0 < 1"):
        Schedule("sync", 2, 0, 1)
    with pytest.raises(ValueError, match="mode must be one of"):  # the function checks what the class does
        batch_version(1, updates_per_batch=1, max_staleness=0, sync_every=1, mode="eager")
    with pytest.raises(ValueError, match=r"max_staleness=0 < 1 \(updates_per_batch=2, sync_every=1\)"):
        batch_version(1, updates_per_batch=2, max_staleness=0, sync_every=1, mode="sync")
