"""scripts/study/run_grid.py: a failed cell is listed by name with its error line and makes the exit status 1, while the
other cells still run; bad input is one ``error:`` line, exit status 2, and nothing written."""

import gzip
import json
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.scripts import load_script

run_grid = load_script("study/run_grid")
report = load_script("study/report")


def tree(root) -> dict:
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


BAD = {
    "unknown experiment": ["study_dmeo", "algo=grpo"],
    "experiment without a sweep folder": ["paper_7b", "algo=grpo"],
    "--jobs 0": ["study_demo", "algo=grpo", "--jobs", "0"],
    "--jobs x": ["study_demo", "algo=grpo", "--jobs", "x"],
    "unknown flag": ["study_demo", "algo=grpo", "--colour"],
    "no cell": ["study_demo"],
    "a cell that is no override": ["study_demo", "algo"],
    "an empty cell": ["study_demo", " "],
    "a seed in a cell": ["study_demo", "algo=grpo seed=3"],
    "a cell twice": ["study_demo", "algo=grpo debug=smoke", "debug=smoke algo=grpo"],
    "a seed twice": ["study_demo", "algo=grpo", "--seeds", "1", "1"],
    "--pack a folder": ["study_demo", "algo=grpo", "--pack", "{tmp}"],
    "sweep folder under a file": ["study_demo", "algo=grpo", "--sweep-dir", "{tmp}/notes.txt/sweep"],
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_error_line_exit_2_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    (tmp_path / "notes.txt").write_text("a file\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in BAD[case]]
    if "--sweep-dir" not in argv and case != "experiment without a sweep folder":
        argv += ["--sweep-dir", str(tmp_path / "sweep")]
    monkeypatch.setattr(run_grid.subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_grid.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert tree(tmp_path) == before


def fake_train(cmd, cwd, env, stdout, stderr):
    """train.py as far as run_grid sees it: a good cell writes a complete run folder; ``learner.lr=-1`` fails at
    start-up with the entry point's one line and leaves no folder (bapo/entry/cli.py removes it)."""
    run_dir = ROOT / cmd[-1].split("=", 1)[1].strip("'")
    if "learner.lr=-1" in cmd:
        stdout.write("error: ConfigError: learner.lr: must be > 0, got -1.0\n")
        return subprocess.CompletedProcess(cmd, 2)
    run_dir.mkdir(parents=True)
    algo = next(a.split("=")[1] for a in cmd if a.startswith("algo="))
    seed = int(next(a.split("=")[1] for a in cmd if a.startswith("seed=")))
    cfg = {"algo": {"name": algo}, "learner": {"ppo_epochs": 1, "mini_batches_per_rollout": 1}, "seed": seed}
    (run_dir / "config.yaml").write_text(json.dumps(cfg | {"train": {"steps": 1}}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/accuracy": 0.5, "time/step_s": 1.0}) + "\n")
    (run_dir / "final_metrics.json").write_text("{}")
    return subprocess.CompletedProcess(cmd, 0)


def test_a_failed_cell_is_named_with_its_error_and_the_grid_exits_1(tmp_path, capsys, monkeypatch):
    """Today's run_grid exited 0 here and its pack held no trace of the failed cell (its folder was removed)."""
    monkeypatch.setattr(run_grid.subprocess, "run", fake_train)
    sweep = tmp_path / "sweep"
    cells = ["algo=grpo", "algo=grpo learner.lr=-1", "algo=bapo"]
    assert run_grid.main(["study_demo", *cells, "--seeds", "1", "--jobs", "1", "--sweep-dir", str(sweep)]) == 1
    out, err = capsys.readouterr()
    bad = "algo=grpo,learner.lr=-1,seed=1"
    assert f"rc=2      0s {sweep}/{bad}" in out and "ok" in out.split(bad)[1]  # the cell after it still ran
    assert f"failed: {bad}: no run folder; run_grid log: error: ConfigError: learner.lr: must be > 0" in err
    assert "grid: 1 of 3 runs did not complete" in err
    rows = [json.loads(x) for x in (sweep / "logs" / "grid.jsonl").read_text().splitlines()]
    assert rows[1] == {"run": bad, "overrides": ["algo=grpo", "learner.lr=-1", "seed=1"]}  # the plan, first
    attempt = next(r for r in rows if r["run"] == bad and "rc" in r)
    assert (attempt["rc"], attempt["error"]) == (2, "error: ConfigError: learner.lr: must be > 0, got -1.0")
    # the pack keeps the failed cell, and the report made from it lists it by name with its error line
    lines = gzip.decompress((sweep / "runs.jsonl.gz").read_bytes()).decode().splitlines()
    records = {r["run"]: r for r in map(json.loads, lines[1:])}
    assert (records[bad]["status"], records[bad]["folder"]) == ("failed", False)
    assert report.main([str(sweep / "runs.jsonl.gz")]) == 0
    md = (sweep / "report.md").read_text()
    assert "3 runs, 2 complete, 1 incomplete (1 failed or never started" in md
    row = f"| `{bad}` | grpo | — | 1 | no run folder; run_grid log: error: ConfigError: learner.lr: must be > 0"
    assert row in md
    # run again: the complete runs are skipped, the bad one fails again, and the exit status still says so
    assert run_grid.main(["study_demo", *cells, "--seeds", "1", "--sweep-dir", str(sweep)]) == 1


@pytest.mark.slow
def test_a_real_grid_with_a_bad_cell_runs_the_rest_and_says_so(tmp_path):
    """Through the real entry points: two smoke runs and a bad learning rate between them (about 50 s)."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "scripts/study/run_grid.py", "study_demo", "algo=grpo debug=smoke",
           "algo=grpo debug=smoke learner.lr=-1", "algo=bapo debug=smoke", "--seeds", "1", "--jobs", "1",
           "--sweep-dir", str(sweep)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bad = "algo=grpo,debug=smoke,learner.lr=-1,seed=1"
    # the failed start leaves no folder, or only Hydra's files and its log (bapo/entry/cli.py decides): either way it is
    # named with its error line
    line = next(x for x in proc.stderr.splitlines() if x.startswith(f"failed: {bad}: "))
    assert "error: ConfigError: learner.lr: must be > 0" in line, line
    for good in ("algo=grpo,debug=smoke,seed=1", "algo=bapo,debug=smoke,seed=1"):
        assert (sweep / good / "final_metrics.json").is_file(), good
    report_py = "scripts/study/report.py"
    proc = subprocess.run([sys.executable, report_py, str(sweep)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    md = (sweep / "report" / "report.md").read_text()
    row = next(x for x in md.splitlines() if x.startswith(f"| `{bad}` | grpo"))
    assert "error: ConfigError: learner.lr: must be > 0" in row, row
    assert "3 runs, 2 complete, 1 incomplete (1 failed" in md
