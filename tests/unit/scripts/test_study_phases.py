"""scripts/study/study_phases.py: per-window means of a study's clipping and search metrics, read from a pack alone."""

import json

import pytest

from scripts.study import pack_study, study_phases


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


def test_pooled_rho_weighs_updates_by_their_mass_and_ignores_empty_ones():
    # step 1 carried no signal (P = N = 0, logged rho 1 by convention): the pooled share ignores it; the plain mean
    # of clip/rho does not. Steps 0-2: (1 + 3) / (1 + 3 + 3 + 1) = 0.5; the mean of rho is (0.25 + 1 + 0.75) / 3
    steps = {
        0: {"clip/P": 1.0, "clip/N": 3.0, "clip/rho": 0.25},
        1: {"clip/P": 0.0, "clip/N": 0.0, "clip/rho": 1.0},
        2: {"clip/P": 3.0, "clip/N": 1.0, "clip/rho": 0.75},
        3: {"clip/P": 2.0},  # N not logged: left out
    }
    assert study_phases.window_pooled_rho(steps, 0, 4) == pytest.approx(0.5)
    assert study_phases.window_mean(steps, "clip/rho", 0, 3) == pytest.approx(2 / 3)
    assert study_phases.window_pooled_rho(steps, 0, 1) == pytest.approx(0.25)
    assert study_phases.window_pooled_rho(steps, 1, 2) is None  # no signal in the window: no share
    assert study_phases.window_pooled_rho(steps, 3, 4) is None


def test_the_table_pools_rho_per_run_then_averages_over_seeds(tmp_path):
    rows1 = [{"step": 0, "clip/P": 1.0, "clip/N": 3.0, "bapo/signal": 1.0}, {"step": 1, "clip/P": 0.0, "clip/N": 0.0,
             "bapo/signal": 0.0}]  # fmt: skip
    rows2 = [{"step": 0, "clip/P": 2.0, "clip/N": 2.0, "bapo/signal": 0.5}, {"step": 1, "clip/P": 2.0, "clip/N": 0.0,
             "bapo/signal": 1.0}]  # fmt: skip
    pack = _pack(tmp_path, [(["algo=bapo", "seed=1"], rows1), (["algo=bapo", "seed=2"], rows2)])
    text = study_phases.table(pack, [(0, 2)])
    head = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
    line = next(ln for ln in text.splitlines() if ln.startswith("| bapo"))
    row = dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True))
    # seed 1: 1 / 4 = 0.25 (step 1 empty); seed 2: 4 / 6; mean (0.25 + 0.6667) / 2 = 0.4583; signal (0.5 + 0.75) / 2
    assert (row["rho pooled"], row["signal"]) == ("0.458", "0.625")
