"""Sweeps end to end: a re-launched sweep skips its finished runs (resume=auto, the default in a sweep) and each
run folder stays its own; a failed cell is recorded and the sweep goes on; ``-m ... --cfg job`` composes each cell."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


def train(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)


def sweep(out: Path) -> str:
    p = train(
        "-m", "debug=smoke", "algo=bapo,grpo", "train.steps=1", "eval.every=0", "resume=auto", f"hydra.sweep.dir={out}"
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout + p.stderr


@pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)
def test_relaunched_sweep_skips_completed_runs(tmp_path):
    sweep(tmp_path)
    runs = sorted(p for p in tmp_path.iterdir() if (p / "final_metrics.json").exists())
    assert [p.name.split(",")[0] for p in runs] == ["algo=bapo", "algo=grpo"]  # folder name = the overrides
    before = {p: (p / "metrics.jsonl").read_text() for p in runs}
    out = sweep(tmp_path)
    assert out.count("nothing to do") == 2
    assert {p: (p / "metrics.jsonl").read_text() for p in runs} == before
    assert json.loads((runs[1] / "final_metrics.json").read_text())["clip/low"] == 0.8


GRID = ["-m", "debug=smoke", "train.steps=1", "eval.every=0", "learner.lr=1e-5,-1,2e-5,3e-5"]


@pytest.mark.slow
def test_a_bad_cell_is_marked_failed_and_the_sweep_goes_on_and_relaunches_as_documented(tmp_path):
    """Before: cell 2's one-line error called sys.exit inside the job, which ended the sweep: cells 3 and 4 never
    ran, and nothing but the terminal said so. And a relaunch without resume=auto refused every finished cell."""
    p = train(*GRID, f"hydra.sweep.dir={tmp_path}")
    assert p.returncode == 2, p.stderr[-3000:]  # every failure was bad input
    errors = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 2 and errors[0].startswith("error: ConfigError: learner.lr: must be > 0"), p.stderr[-3000:]
    assert (
        errors[1].startswith("error: SweepFailed: 1 of 4 cells failed: ")
        and "learner.lr=-1,train.steps=1 (exit 2)" in errors[1]
    )
    assert p.stderr.strip().splitlines()[-1] == errors[1] and "Traceback" not in p.stderr
    cells = {
        c: tmp_path / f"debug=smoke,eval.every=0,learner.lr={c},train.steps=1"
        for c in ("1e-05", "-1", "2e-05", "3e-05")
    }
    for lr in ("1e-05", "2e-05", "3e-05"):  # cells 1, 3 and 4 ran to the end
        assert (cells[lr] / "final_metrics.json").is_file(), lr
    bad = cells["-1"]
    assert (bad / "train.log").read_text() == errors[0] + "\n"  # the cell's own log says why
    assert sorted(x.name for x in bad.iterdir()) == [".hydra", "train.log"]
    assert yaml.safe_load((bad / ".hydra" / "overrides.yaml").read_text())[-1] == "learner.lr=-1"
    rows = [json.loads(x) for x in (tmp_path / "sweep_summary.jsonl").read_text().splitlines()]
    assert [(r["job"], r["status"], r["exit"]) for r in rows] == [
        (0, "complete", 0), (1, "failed", 2), (2, "complete", 0), (3, "complete", 0)
    ]  # fmt: skip
    assert rows[1]["error"] == errors[0] and rows[1]["cell"] == bad.name and len({r["launch"] for r in rows}) == 1
    # relaunched as docs/sweeps.md says, the same command: the finished cells are skipped, the bad one fails again
    before = {c: (d / "metrics.jsonl").read_text() for c, d in cells.items() if c != "-1"}
    p = train(*GRID, f"hydra.sweep.dir={tmp_path}")
    assert p.returncode == 2 and (p.stdout + p.stderr).count("nothing to do") == 3, p.stderr[-3000:]
    assert {c: (d / "metrics.jsonl").read_text() for c, d in cells.items() if c != "-1"} == before
    rows = [json.loads(x) for x in (tmp_path / "sweep_summary.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and [r["status"] for r in rows[4:]] == ["complete", "failed", "complete", "complete"]


def test_cfg_job_composes_every_cell_of_a_sweep(tmp_path):
    """Before: `train.py -m ... --cfg job` was Hydra's ValueError traceback (it refuses -m with --cfg)."""
    p = train("-m", "algo=bapo,grpo", "learner.lr=1e-5,2e-5", "--cfg", "job", f"hydra.sweep.dir={tmp_path / 's'}")
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    heads = [x for x in p.stdout.splitlines() if x.startswith("# cell ")]
    assert heads == [
        "# cell 1 of 4: algo=bapo learner.lr=1e-05",
        "# cell 2 of 4: algo=bapo learner.lr=2e-05",
        "# cell 3 of 4: algo=grpo learner.lr=1e-05",
        "# cell 4 of 4: algo=grpo learner.lr=2e-05",
    ]
    docs = [yaml.safe_load(part.split("\n", 1)[1]) for part in p.stdout.split("# cell ")[1:]]
    assert [(d["algo"]["name"], d["learner"]["lr"]) for d in docs] == [
        ("bapo", 1e-5), ("bapo", 2e-5), ("grpo", 1e-5), ("grpo", 2e-5)
    ]  # fmt: skip
    assert len(docs) == 4 and not (tmp_path / "s").exists()  # composing runs nothing and makes no folder
    # a named grid: its 27 cells; a bad cell is one line and nothing is printed
    p = train("-m", "experiment=ablation_staleness", "--cfg", "job")
    assert p.returncode == 0 and p.stdout.count("# cell ") == 27
    p = train("-m", "algo=bapo,nosuch", "--cfg", "job")
    assert p.returncode == 2 and p.stdout == "" and p.stderr.startswith("error: ") and len(p.stderr.splitlines()) == 1


def test_the_sweep_summary_reads_its_own_launch_and_says_whose_fault(tmp_path, monkeypatch, capsys):
    from omegaconf import OmegaConf

    from bapo.entry.sweep import LAUNCH_ENV, Cell, SweepSummary, summarize

    def cell(name: str, launch: str, status: str, code: int) -> None:
        monkeypatch.setenv(LAUNCH_ENV, launch)
        Cell(tmp_path, name, 0, (name,)).record(status, code, f"error: X: {name}" if code else None, 0.0)

    cell("a=1", "old", "failed", 1)  # an earlier launch's failure is not this one's
    cell("a=1", "new", "complete", 0)
    cell("a=2", "new", "failed", 2)
    assert summarize(tmp_path, "new")[0] == 2  # every failure was bad input
    cell("a=3", "new", "failed", 1)
    status, line = summarize(tmp_path, "new")
    assert status == 1 and line.startswith("2 of 3 cells failed: a=2 (exit 2), a=3 (exit 1)")
    assert summarize(tmp_path, "none") == (
        0,
        f"sweep {tmp_path}: 0 of 0 cells complete ({tmp_path}/sweep_summary.jsonl)",
    )
    (tmp_path / "sweep_summary.jsonl").open("a").write("not json\n")  # a torn line is skipped
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit) as info:
        SweepSummary().on_multirun_end(config)  # launch "new", from the environment
    assert info.value.code == 1
    assert capsys.readouterr().err.startswith("error: SweepFailed: 2 of 3 cells failed: ")
