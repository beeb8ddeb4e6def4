"""scripts/study_phases.py: per-window means of a study's clipping and search metrics, read from a pack alone."""

import json

import pytest

from scripts import pack_study, study_phases


def _pack(tmp_path, runs):
    """A pack of complete runs, each ``(overrides, rows)``, as pack_study writes one."""
    records = []
    for overrides, rows in runs:
        name = ",".join(overrides)
        cfg = {"algo": {"name": overrides[0].split("=")[1]}, "seed": 1,
               "learner": {"ppo_epochs": 1, "mini_batches_per_rollout": 2}, "train": {"steps": len(rows)}}  # fmt: skip
        cols = sorted({k for r in rows for k in r})
        metrics = {k: [r.get(k) for r in rows] for k in cols}
        record = {"run": name, "config": cfg, "overrides": overrides, "metrics": metrics, "status": "complete"}
        records.append(record | {"checkpoint": False, "exception": None, "problems": [], "wall_s": 1.0})
    out = tmp_path / "runs.jsonl.gz"
    pack_study.write_pack("multirun/toy", records, out)
    return out


def test_window_mean_averages_only_the_steps_inside_the_window_that_logged_the_key():
    steps = {0: {"clip/rho": 0.9}, 1: {"clip/rho": 0.2}, 2: {"clip/rho": 0.4}, 3: {}, 4: {"clip/rho": float("nan")}}
    assert study_phases.window_mean(steps, "clip/rho", 1, 5) == pytest.approx(0.3)  # (0.2 + 0.4) / 2
    assert study_phases.window_mean(steps, "clip/rho", 0, 1) == pytest.approx(0.9)
    assert study_phases.window_mean(steps, "clip/rho", 3, 4) is None


def test_the_table_is_the_mean_over_seeds_of_each_runs_window_mean(tmp_path):
    rows1 = [
        {"step": s, "clip/rho": r, "bapo/search_active": a} for s, (r, a) in enumerate([(0.4, 1), (0.5, 0), (0.6, 0)])
    ]
    rows2 = [
        {"step": s, "clip/rho": r, "bapo/search_active": a} for s, (r, a) in enumerate([(0.2, 1), (0.3, 1), (0.9, 0)])
    ]
    pack = _pack(tmp_path, [(["algo=bapo", "seed=1"], rows1), (["algo=bapo", "seed=2"], rows2)])
    text = study_phases.table(pack, [(0, 2), (2, 3)])
    lines = [ln for ln in text.splitlines() if ln.startswith("| bapo")]
    assert len(lines) == 2
    head = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
    first = dict(zip(head, (c.strip() for c in lines[0].strip("|").split("|")), strict=True))
    second = dict(zip(head, (c.strip() for c in lines[1].strip("|").split("|")), strict=True))
    # seed 1: rho (0.4+0.5)/2 = 0.45, engaged 0.5; seed 2: 0.25, 1.0 -> means 0.35 and 0.75
    assert (first["steps"], first["seeds"], first["rho"], first["engaged"]) == ("0-1", "2", "0.350", "0.750")
    assert (second["steps"], second["rho"], second["engaged"]) == ("2-2", "0.750", "0.000")
    assert first["c_low"] == "—"  # not logged: a dash, not a zero


def test_a_bad_phase_is_one_line_naming_the_option():
    with pytest.raises(SystemExit, match="--phases: '30-50' is not START:STOP"):
        study_phases.parse_phase("30-50")
    with pytest.raises(SystemExit, match="--phases: '5:5' needs 0 <= START < STOP"):
        study_phases.parse_phase("5:5")
    assert json.dumps(study_phases.parse_phase("0:30")) == "[0, 30]"
