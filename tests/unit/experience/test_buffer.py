import pytest

from bapo.experience.buffer import ReplayBuffer, StalenessError
from tests.helpers.samples import scored_group


def test_fifo_serves_whole_groups_in_order():
    buf = ReplayBuffer(max_staleness=None, capacity=100)
    buf.put(scored_group(0, 0) + scored_group(1, 0) + scored_group(2, 0))
    got = buf.get(5, version=0)  # 2+2 fit, the third group of 2 would scored_group 6
    assert [s.sample.group for s in got] == [0, 0, 1, 1]
    assert len(buf) == 2


def test_stale_groups_are_dropped_and_counted():
    buf = ReplayBuffer(max_staleness=2, capacity=100)
    buf.put(scored_group(0, 0) + scored_group(1, 3))
    got = buf.get(10, version=3)  # group 0 has staleness 3 > 2
    assert {s.sample.version for s in got} == {3}
    assert buf.metrics()["buffer/dropped_stale"] == 2


def test_check_enforces_the_bound():
    buf = ReplayBuffer(max_staleness=1, capacity=100)
    s = scored_group(0, 0)
    assert buf.check(s, 1) == {
        "buffer/staleness_mean": 1.0,
        "buffer/staleness_max": 1.0,
        "buffer/staleness_hist/1": 2.0,
    }
    with pytest.raises(StalenessError, match="max_staleness=1"):
        buf.check(s, 2)


def test_capacity_evicts_oldest():
    buf = ReplayBuffer(max_staleness=None, capacity=4)
    buf.put(scored_group(0, 0) + scored_group(1, 0) + scored_group(2, 0))
    assert len(buf) == 4 and buf.metrics()["buffer/dropped_capacity"] == 2
    assert buf.get(10, 0)[0].sample.group == 1


def test_uniform_sampling_is_deterministic_under_seed():
    def order(seed):
        buf = ReplayBuffer(max_staleness=None, capacity=100, sampling="uniform", seed=seed)
        buf.put([s for g in range(6) for s in scored_group(g, 0)])
        return [s.sample.group for s in buf.get(6, 0)]

    assert order(1) == order(1)
    assert sorted(set(order(1))) != [0, 1, 2] or order(2) != order(1)


def test_state_roundtrip():
    buf = ReplayBuffer(max_staleness=3, capacity=100, sampling="uniform", seed=4)
    buf.put(scored_group(0, 0) + scored_group(1, 1) + scored_group(2, 1))
    state = buf.state_dict()
    a = buf.get(4, 1)
    buf2 = ReplayBuffer(max_staleness=3, capacity=100, sampling="uniform", seed=0)
    buf2.load_state_dict(state)
    assert buf2.get(4, 1) == a


def test_bad_args():
    with pytest.raises(ValueError, match="buffer.sampling"):
        ReplayBuffer(max_staleness=1, capacity=1, sampling="lifo")
    with pytest.raises(ValueError, match="buffer.max_staleness"):
        ReplayBuffer(max_staleness=-1, capacity=1)


def test_uniform_sampling_leaves_the_rest_in_order():
    """Before: a uniform draw reshuffled the whole buffer for good; what is not drawn keeps its FIFO order."""
    buf = ReplayBuffer(max_staleness=None, capacity=100, sampling="uniform", seed=3)
    for t in range(6):
        buf.put(scored_group(t, 0, 2))  # six groups of two, from batches 0..5
    drawn = buf.get(4, 0)
    left = [g[0].sample.prompt.problem.id for g in buf.groups]
    assert len(drawn) == 4 and left == sorted(left, key=lambda i: int(i.split("-")[0]))
    first = {s.sample.prompt.problem.id for s in drawn}
    assert not first & set(left)
