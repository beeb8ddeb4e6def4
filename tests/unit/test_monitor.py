"""The training-health monitor: the collapse and clip warnings fire once and their flags stay up; BAPO's
out-of-reach warning is a per-step flag whose warning repeats every ``target_every`` steps."""

import logging

import pytest

from bapo.monitor import Monitor


def make(**kw):
    args = dict(entropy_frac=0.5, entropy_window=3, clip_threshold=0.2, clip_patience=3, target_every=3)
    return Monitor(**(args | kw))


def warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "bapo.monitor"]


def test_entropy_collapse_warns_once_and_stays_flagged(caplog):
    mon = make()
    # reference = mean(1.0, 1.2, 0.8) = 1.0; the threshold is 0.5 x 1.0 = 0.5
    flags = [mon.observe({"learner/entropy": e})["monitor/entropy_collapse"] for e in (1.0, 1.2, 0.8, 0.6, 0.5)]
    assert flags == [0.0] * 5  # 0.5 is not below 0.5
    assert mon.entropy_ref == pytest.approx(1.0)
    with caplog.at_level(logging.WARNING):
        out = mon.observe({"learner/entropy": 0.4})
        assert out["monitor/entropy_collapse"] == 1.0 and out["monitor/entropy_ref"] == pytest.approx(1.0)
        assert mon.observe({"learner/entropy": 0.9})["monitor/entropy_collapse"] == 1.0  # stays up
        mon.observe({"learner/entropy": 0.1})
    assert len(warnings(caplog)) == 1 and "entropy collapse" in warnings(caplog)[0].getMessage()


def test_entropy_window_is_not_checked_against_itself():
    mon = make(entropy_window=2)
    assert mon.observe({"learner/entropy": 1.0})["monitor/entropy_collapse"] == 0.0
    # the window's own second value is low, but it is part of the reference, not a check
    assert mon.observe({"learner/entropy": 0.01})["monitor/entropy_collapse"] == 0.0
    assert mon.entropy_ref == pytest.approx(0.505)


def test_clip_saturation_needs_consecutive_updates(caplog):
    mon = make()
    rows = lambda *xs: [{"learner/clip_frac_high": x} for x in xs]  # noqa: E731
    assert mon.observe({}, rows(0.3, 0.3, 0.1))["monitor/clip_saturation"] == 0.0  # broken at 2
    assert mon.observe({}, rows(0.3, 0.2))["monitor/clip_saturation"] == 0.0  # 0.2 is not above 0.2
    assert mon.observe({}, rows(0.25, 0.9))["monitor/clip_saturation"] == 0.0  # run of 2
    with caplog.at_level(logging.WARNING):
        assert mon.observe({}, rows(0.21))["monitor/clip_saturation"] == 1.0  # the run spans steps: 3
        assert mon.observe({}, rows(0.0))["monitor/clip_saturation"] == 1.0  # stays up
        mon.observe({}, rows(*[0.9] * 5))
    assert len(warnings(caplog)) == 1 and "clip" in warnings(caplog)[0].getMessage()


def test_missing_metrics_are_ignored_and_state_round_trips():
    mon = make()
    assert mon.observe({}, [{}]) == {"monitor/entropy_collapse": 0.0, "monitor/clip_saturation": 0.0}
    mon.observe({"learner/entropy": 2.0}, [{"learner/clip_frac_high": 0.5}])
    other = make()
    other.load_state_dict(mon.state_dict())
    assert other.state_dict() == mon.state_dict()


def _search(engaged: bool, reached: bool, low=0.9, high=3.0) -> dict:
    """One update's row of BAPO's search (mini-batch scope): bapo/target_reached only where it engaged."""
    row = {"bapo/search_active": float(engaged), "clip/low": low, "clip/high": high, "clip/rho": 0.38}
    row |= {"bapo/beyond_bounds": 0.02}
    if engaged:
        row |= {"bapo/target_reached": float(reached), "bapo/rho_moved": 0.0001}
    return row


def test_target_out_of_reach_flags_each_step_and_warns_every_n_steps(caplog):
    mon = make(target_every=3)
    corner, fine, idle = _search(True, False), _search(True, True, 0.6, 1.4), _search(False, False, 0.6, 1.2)
    assert "monitor/target_out_of_reach" not in mon.observe({}, [{"learner/clip_frac_high": 0.0}])  # not BAPO
    with caplog.at_level(logging.WARNING):
        # 2 of 5 unmet is not most; 3 of 5 is
        assert mon.observe({}, [corner, corner, fine, idle, idle])["monitor/target_out_of_reach"] == 0.0
        flags = [mon.observe({}, [corner, corner, corner, fine, idle])["monitor/target_out_of_reach"]]
        flags += [mon.observe({}, [corner] * 5)["monitor/target_out_of_reach"] for _ in range(4)]
        flags += [mon.observe({}, [fine] * 5)["monitor/target_out_of_reach"]]
    assert flags == [1.0] * 5 + [0.0]
    said = [r.getMessage() for r in warnings(caplog)]
    assert len(said) == 2  # at the first of the five steps, then three steps later
    assert "out of reach" in said[0] and "[0.90, 3.00]" in said[0] and "3 of 5 updates" in said[0]
    # micro-batch scope: an update's row holds shares; 0.8 engaged of which a quarter reached -> 0.6 unmet each
    micro = {"bapo/search_active": 0.8, "bapo/target_reached": 0.25, "clip/low": 0.9, "clip/high": 3.0}
    assert make().observe({}, [micro])["monitor/target_out_of_reach"] == 1.0


def test_the_out_of_reach_warning_resumes_where_it_was():
    """A resumed run warns when the uninterrupted one would: the step of the last warning is checkpointed."""
    a, corner = make(target_every=4), [_search(True, False)] * 3
    for _ in range(2):
        a.observe({}, corner)
    b = make(target_every=4)
    b.load_state_dict(a.state_dict())
    for mon in (a, b):
        mon.observe({}, corner)
    assert a.state_dict() == b.state_dict() and a.target_warned == 1
    old = {k: v for k, v in a.state_dict().items() if k not in ("steps", "target_warned")}
    c = make()
    c.load_state_dict(old)  # a checkpoint from before the warning existed
    assert c.target_warned is None and c.steps == 0
