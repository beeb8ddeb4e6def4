"""metrics.jsonl across a resume: every intact row up to the checkpoint's step is kept, a damaged line is
skipped, counted and named (file:line) instead of cutting the file there, a row the checkpoint covers but
the file lost is marked (``metrics/lost``) and warned about, and the file is on disk before each checkpoint."""

import json
import logging
import os
from pathlib import Path

from bapo.infra.tracking import LOST, MetricsLogger, truncate_metrics


def _write(run_dir: Path, lines: list[str], end: str = "\n") -> Path:
    f = run_dir / "metrics.jsonl"
    f.write_text("\n".join(lines) + end)
    return f


def _row(step: int) -> str:
    return json.dumps({"step": step, "reward/mean": step / 10})


def _steps(run_dir: Path) -> list[tuple[int, bool]]:
    """(step, lost?) of every row of run_dir/metrics.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], LOST in r) for r in rows]


def test_a_line_cut_in_the_middle_costs_only_its_own_row(tmp_path, caplog):
    """Before: the cut step-2 line ended the read, and a resume from step 6 kept steps 0 and 1 only."""
    lines = [_row(s) for s in range(8)]
    lines[2] = lines[2][:15]  # '{"step": 2, "re': cut short by a crash, the rows after it intact
    _write(tmp_path, lines)
    caplog.set_level(logging.WARNING)
    last = truncate_metrics(tmp_path, None, 6)
    assert _steps(tmp_path) == [(0, False), (1, False), (2, True), (3, False), (4, False), (5, False), (6, False)]
    assert last == {"reward/mean": 0.6}
    assert "metrics.jsonl:3" in caplog.text  # the damaged line, by number
    assert "[2]" in caplog.text  # the step the checkpoint covers and the file lost


def test_a_half_written_last_line_the_checkpoint_covers_is_marked_lost(tmp_path, caplog):
    """Power loss after the step-6 checkpoint: the metrics line of step 6 made it to disk only in part."""
    lines = [_row(s) for s in range(7)]
    lines[6] = lines[6][:10]
    _write(tmp_path, lines, end="")
    caplog.set_level(logging.WARNING)
    last = truncate_metrics(tmp_path, None, 6)
    assert _steps(tmp_path) == [(s, False) for s in range(6)] + [(6, True)]
    assert last == {"reward/mean": 0.5}  # the last intact row, not the marker
    assert "metrics.jsonl:7" in caplog.text and "[6]" in caplog.text


def test_rows_after_the_checkpoint_go_without_a_warning_about_lost_rows(tmp_path, caplog):
    """A kill after the checkpoint of step 6: steps 7 and 8 are redone by the resumed run."""
    _write(tmp_path, [_row(s) for s in range(9)])
    caplog.set_level(logging.WARNING)
    truncate_metrics(tmp_path, None, 6)
    assert _steps(tmp_path) == [(s, False) for s in range(7)]
    assert caplog.text == ""


def test_rows_that_are_json_but_not_rows_are_damaged_lines(tmp_path, caplog):
    _write(tmp_path, [_row(0), "[1, 2]", '{"no_step": 1}', '{"step": "one"}', "[" * 100_000, _row(1)])
    caplog.set_level(logging.WARNING)
    truncate_metrics(tmp_path, None, 1)
    assert _steps(tmp_path) == [(0, False), (1, False)]
    for n in (2, 3, 4, 5):
        assert f"metrics.jsonl:{n}" in caplog.text


def test_rows_are_taken_from_the_run_the_checkpoint_belongs_to(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    src.mkdir(), dst.mkdir()
    _write(src, [_row(s) for s in range(5)])
    _write(dst, [_row(0)])
    truncate_metrics(dst, src, 3)
    assert _steps(dst) == [(s, False) for s in range(4)]
    assert _steps(src) == [(s, False) for s in range(5)]  # the other run's file is not touched


def test_sync_puts_the_metrics_file_on_disk(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    logger = MetricsLogger(tmp_path)
    logger.log({"a": 1.0}, step=0)
    logger.sync()
    assert str(tmp_path / "metrics.jsonl") in synced
    logger.close()
