"""The training-health monitor: each warning fires once, and its flag stays up."""

import logging

import pytest

from bapo.monitor import Monitor


def make(**kw):
    args = dict(entropy_frac=0.5, entropy_window=3, clip_threshold=0.2, clip_patience=3)
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
