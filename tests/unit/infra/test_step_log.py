"""The run's log file keeps what a post-mortem needs while a progress bar has the terminal: a step summary every
SUMMARY_EVERY steps or SUMMARY_EVERY_S seconds, and the last step logged, even when the run stops on an error
(bapo.infra.tracking.StepLog). Before, with ``logger.progress=true``, train.log had no step line at all."""

import logging

import pytest

from bapo.infra import tracking
from bapo.infra.tracking import MetricsLogger, StepLog, step_summary


@pytest.fixture()
def log_files(tmp_path):
    """A log file and a terminal on the root logger, as Hydra's job logging sets them up; their texts."""
    root = logging.getLogger()
    file = logging.FileHandler(tmp_path / "train.log")
    terminal_path = tmp_path / "terminal.txt"
    terminal = logging.StreamHandler(terminal_path.open("w"))
    for h in (file, terminal):
        h.setFormatter(logging.Formatter("%(name)s - %(message)s"))
        root.addHandler(h)

    def read() -> tuple[list[str], str]:
        file.flush()
        terminal.flush()
        return (tmp_path / "train.log").read_text().splitlines(), terminal_path.read_text()

    yield read
    for h in (file, terminal):
        root.removeHandler(h)
        h.close()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def steps_written(lines: list[str]) -> list[int]:
    return [int(x.split(" - step ")[1].split(" |")[0].split()[0]) for x in lines if " - step " in x]


def test_every_tenth_step_and_the_last_reach_the_log_file_only(log_files):
    clock = Clock()
    steps = StepLog(clock=clock)
    for step in range(26):  # 1 s a step
        steps.note(step, {"reward/mean": step / 100})
        clock.t += 1.0
    steps.flush()  # the logger closes: step 25, held, is written
    steps.flush()  # nothing held: nothing written twice
    lines, terminal = log_files()
    assert steps_written(lines) == [0, 10, 20, 25]
    assert terminal == ""


def test_slow_steps_are_written_once_a_minute(log_files):
    clock = Clock()
    steps = StepLog(clock=clock)
    for step, seconds in zip(range(1, 8), (20, 20, 25, 70, 5, 5, 59), strict=True):
        clock.t += seconds
        steps.note(step, {})
    # 20 + 20 + 25 = 65 s at step 3; step 4 took 70 s; steps 5-7 add 69 s since step 4's line
    assert steps_written(log_files()[0]) == [3, 4, 7]


def test_the_summary_names_what_the_step_logged():
    metrics = {"reward/mean": 0.3125, "eval/accuracy": 0.25, "learner/entropy": 0.8123, "learner/grad_norm": 1.204}
    metrics |= {"clip/low": 0.8, "clip/high": 1.28, "buffer/staleness_mean": 1.0, "time/step_s": 3.14}
    assert step_summary(20, metrics) == (
        "step 20 | reward 0.312 | eval 0.250 | ent 0.812 | gnorm 1.20 | clip [0.80, 1.28] | stale 1.0 | s/step 3.1"
    )
    assert step_summary(0, {"eval/accuracy": 0.5, "clip/low": 0.8}) == "step 0 | eval 0.500"  # half a window: out


def _logger(tmp_path, progress: bool) -> MetricsLogger:
    return MetricsLogger(tmp_path, config={"logger": {"progress": progress}, "seed": 1})


def test_with_the_progress_bar_the_metrics_logger_writes_the_summaries(tmp_path, log_files):
    logger = _logger(tmp_path, progress=True)
    for step in range(13):
        logger.log({"reward/mean": 0.5}, step=step)
    logger.close()
    assert steps_written(log_files()[0]) == [0, 10, 12]


def test_without_it_the_loops_own_step_lines_are_the_log_and_nothing_is_added(tmp_path, log_files):
    logger = _logger(tmp_path, progress=False)
    for step in range(13):
        logger.log({"reward/mean": 0.5}, step=step)
    logger.close()
    assert steps_written(log_files()[0]) == []


def test_a_run_that_fails_leaves_its_last_step_in_the_log(tmp_path, log_files):
    """The loop closes the metrics logger in a ``finally``: the step before the failure is written before the
    entry point's error line."""
    logger = _logger(tmp_path, progress=True)
    with pytest.raises(RuntimeError):
        try:
            for step in range(8):
                logger.log({"reward/mean": 0.5}, step=step)
            raise RuntimeError("boom")
        finally:
            logger.close()
    assert steps_written(log_files()[0]) == [0, 7]


def test_no_file_handler_no_output(tmp_path, capsys):
    tracking.to_log_file("step 1")  # a script or a test without Hydra's job logging: nowhere to write
    assert capsys.readouterr() == ("", "")
