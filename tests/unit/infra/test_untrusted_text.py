"""Text from files parses with bounded recursion, and what cannot be parsed is named by file (and line).

A JSONL row nested 200,000 deep, a 5,000-digit integer, NaN and Infinity answers are each one skipped,
counted row with its file:line; deeply nested checkpoint metadata, run configs and metrics lines are refused
or skipped with the file named, never a RecursionError."""

import json
import logging

import pytest

from bapo import checkpoint, rundir
from bapo.checkpoint import CheckpointError
from bapo.config import ConfigError
from bapo.data.loading import LoadReport, load_jsonl
from bapo.infra.paths import exported_max_new_tokens

DEEP = "[" * 200_000 + "]" * 200_000


def _rows(tmp_path, *bad: str):
    f = tmp_path / "rows.jsonl"
    good = [json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(2)]
    f.write_text("\n".join([good[0], *bad, good[1]]) + "\n")
    return f


def test_a_row_nested_200000_deep_is_one_skipped_row(tmp_path, caplog):
    """Before: RecursionError from json.loads ended the whole load, naming no file and no line."""
    f = _rows(tmp_path, '{"problem": "x", "answer": ' + DEEP + "}", DEEP)
    report = LoadReport()
    caplog.set_level(logging.WARNING)
    assert [p.answer for p in load_jsonl(f, report=report)] == ["1", "2"]
    assert report.skipped == 2
    assert f"{f}:2: nested too deeply" in caplog.text and f"{f}:3: nested too deeply" in caplog.text


def test_a_5000_digit_integer_answer_is_skipped_naming_its_file_and_line(tmp_path, caplog):
    """Before: the skip message was Python's 'Exceeds the limit (4300 digits)' with no file:line."""
    f = _rows(tmp_path, '{"problem": "big", "answer": ' + "7" * 5000 + "}")
    caplog.set_level(logging.WARNING)
    assert len(load_jsonl(f)) == 2
    line = next(x for x in caplog.text.splitlines() if "rows.jsonl:2" in x)
    assert f"{f}:2: " in line and "4300" in line


@pytest.mark.parametrize("answer", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_an_answer_no_response_can_equal_is_skipped(tmp_path, caplog, answer):
    """Before: NaN was accepted as the label 'nan', which no grader ever matches."""
    f = _rows(tmp_path, '{"problem": "p", "answer": ' + answer + "}")
    report = LoadReport()
    caplog.set_level(logging.WARNING)
    assert [p.answer for p in load_jsonl(f, report=report)] == ["1", "2"]
    assert report.skipped == 1 and f"{f}:2: " in caplog.text


def test_an_empty_string_answer_is_skipped(tmp_path):
    report = LoadReport()
    load_jsonl(_rows(tmp_path, '{"problem": "p", "answer": "  "}'), report=report)
    assert report.skipped == 1


def test_a_deeply_nested_checkpoint_meta_or_manifest_is_refused_naming_the_file(tmp_path, caplog):
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match=f"^{ckpt / 'meta.json'}: unreadable"):
        checkpoint.read_meta(ckpt)
    (ckpt / "meta.json").write_text("{}")
    (ckpt / "state.pt").write_bytes(b"x")
    (ckpt / "manifest.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match=f"^{ckpt / 'manifest.json'}: unreadable"):
        checkpoint.verify(ckpt)


def test_a_deeply_nested_run_config_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "config.yaml").write_text("algo: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'config.yaml'}: cannot be read"):
        rundir.saved_config(tmp_path)


def test_a_deeply_nested_metrics_line_or_export_config_is_no_crash(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n' + DEEP + "\n")
    assert rundir.last_logged_step(tmp_path) == -1
    (tmp_path / "bapo_config.yaml").write_text("rollout: " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert exported_max_new_tokens(tmp_path) is None


@pytest.mark.parametrize("field", ["problem", "answer"])
def test_a_lone_surrogate_is_one_skipped_row_naming_its_file_and_line(tmp_path, caplog, field):
    """Before: JSON's "\\ud800" decoded to a string no tokenizer can encode: a TypeError (tokenizers) or a
    UnicodeEncodeError (a log, samples.jsonl) ended the run, where any malformed row is skipped with file:line."""
    row = {"problem": "What is 1 + 1?", "answer": "2"} | {field: "1 + 1 \ud800"}
    f = _rows(tmp_path, json.dumps(row))
    report = LoadReport()
    caplog.set_level(logging.WARNING)
    assert [p.answer for p in load_jsonl(f, report=report)] == ["1", "2"]
    assert report.skipped == 1
    assert f"{f}:2: field '{field}' holds a lone surrogate ('\\ud800' at character 7), which is not text" in caplog.text


def test_a_row_longer_than_the_bound_is_skipped_unread(tmp_path, caplog, monkeypatch):
    from bapo.data import loading

    monkeypatch.setattr(loading, "MAX_ROW_BYTES", 1000)
    f = _rows(tmp_path, json.dumps({"problem": "x" * 5000, "answer": "1"}))
    report = LoadReport()
    caplog.set_level(logging.WARNING)
    assert [p.answer for p in load_jsonl(f, report=report)] == ["1", "2"]
    assert report.skipped == 1 and f"{f}:2: longer than 1000 bytes: skipped" in caplog.text
