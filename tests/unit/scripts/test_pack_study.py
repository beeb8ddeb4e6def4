"""A study's packed raw data: what a pack keeps, that packing is deterministic, that the report made from a pack
is the report made from the folder, and that every committed study report regenerates from its committed pack."""

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from scripts.study import pack_study

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("bapo_report_pack", ROOT / "scripts" / "study" / "report.py")
report = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = report
spec.loader.exec_module(report)


def _run(root: Path, name: str, *, rows: list, complete: bool = True, cfg: dict | None = None) -> Path:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    algo, seed = name.split(",")[0].split("=")[1], int(name.rsplit("=", 1)[1])
    ablation = ["algo.rho0=0.5"] if algo == "bapo" else []  # an ablation: its label keeps the override
    (d / ".hydra" / "overrides.yaml").write_text(json.dumps([f"algo={algo}", *ablation, f"seed={seed}"]))
    cfg = cfg or {"algo": {"name": algo}, "learner": {"ppo_epochs": 1, "mini_batches_per_rollout": 2},
                  "train": {"steps": 3}, "seed": seed, "eval": {"n": 2}, "data": {"heldout_size": 50}}  # fmt: skip
    (d / "config.yaml").write_text(json.dumps(cfg))
    (d / "metrics.jsonl").write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    if complete:
        (d / "final_metrics.json").write_text("{}")
    return d


def _rows(acc: float, *, steps: int = 3) -> list:
    rows = [{"step": 0, "eval/accuracy": 0.0, "time/eval_s": 2.0}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "learner/entropy": 0.5 / s, "learner/grad_norm": 1.0, "time/step_s": 3.0 + s / 7,
                     "reward/mean": acc, "bapo/ratio_high": 1.5, "buffer/served": 8})  # fmt: skip
    rows[-1]["eval/accuracy"] = acc
    return rows


@pytest.fixture()
def sweep(tmp_path):
    root = tmp_path / "multirun" / "study"
    for seed, acc in ((1, 0.3), (2, 0.35)):
        _run(root, f"algo=bapo,seed={seed}", rows=_rows(acc))
        _run(root, f"algo=grpo,seed={seed}", rows=_rows(acc - 0.1))
    # a resumed run logged steps 2-3 twice (the later wins), and has one damaged line
    rows = _rows(0.2)
    rows[2:2] = [json.dumps({"step": 2, "reward/mean": 0.9}) + "\n", '{"step": 3, "rew\n']
    _run(root, "algo=grpo,seed=3", rows=rows + [json.dumps({"step": 3, "reward/mean": 0.4})])
    # a failure: the entry point's one-line error in run_grid's log of it
    _run(root, "algo=bapo,seed=3", rows=_rows(0.2, steps=1), complete=False)
    (root / "logs").mkdir()
    (root / "logs" / "algo=bapo,seed=3.log").write_text("step 1 ...\nerror: TrainingDiverged: loss is nan at step 2\n")
    grid = [{"run": "algo=bapo,seed=1", "rc": 0, "seconds": 40.5}, {"run": "algo=bapo,seed=3", "rc": 1, "seconds": 7}]
    grid.append({"run": "algo=bapo,seed=1", "rc": 0, "seconds": 1.5})  # a second attempt: the times add up
    (root / "logs" / "grid.jsonl").write_text("".join(json.dumps(g) + "\n" for g in grid))
    return root


def test_pack_keeps_config_metrics_status_and_times(sweep, tmp_path):
    out = tmp_path / "runs.jsonl.gz"
    assert pack_study.main([str(sweep), "--out", str(out)]) == 0
    lines = gzip.decompress(out.read_bytes()).decode().splitlines()
    header, records = json.loads(lines[0]), {r["run"]: r for r in map(json.loads, lines[1:])}
    assert header == {"format": "bapo-study", "version": 1, "sweep": str(sweep), "runs": 6}
    assert sorted(records) == [f"algo={a},seed={s}" for a in ("bapo", "grpo") for s in (1, 2, 3)]
    ok = records["algo=bapo,seed=1"]
    assert ok["config"]["eval"] == {"n": 2} and ok["overrides"] == ["algo=bapo", "algo.rho0=0.5", "seed=1"]
    assert (ok["status"], ok["exception"], ok["checkpoint"], ok["process_s"]) == ("complete", None, False, 42.0)
    # wall: step 0's eval (2 s) + steps 1-3 at 3 + s/7 s
    assert ok["wall_s"] == pytest.approx(2.0 + 9.0 + 6 / 7)
    m = ok["metrics"]
    assert m["step"] == [0, 1, 2, 3] and m["eval/accuracy"] == [0.0, None, None, 0.3]
    assert m["learner/entropy"] == [None, 0.5, 0.25, 0.5 / 3]  # full precision
    assert m["clip/high"] == [None, 1.5, 1.5, 1.5] and "bapo/ratio_high" not in m  # under its current name
    failed = records["algo=bapo,seed=3"]
    assert (failed["status"], failed["process_s"]) == ("failed", 7.0)
    assert failed["exception"] == "run_grid log: error: TrainingDiverged: loss is nan at step 2"
    resumed = records["algo=grpo,seed=3"]
    assert resumed["metrics"]["reward/mean"] == [None, 0.2, 0.2, 0.4]  # step 3 logged again: the later wins
    assert resumed["problems"] == ["algo=grpo,seed=3/metrics.jsonl:4: unparseable JSON (Unterminated string "
                                   "starting at)"]  # fmt: skip
    assert records["algo=grpo,seed=1"]["process_s"] is None  # not run by run_grid


def test_repack_is_byte_identical(sweep, tmp_path):
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "b" / "runs.jsonl.gz"
    assert pack_study.main([str(sweep), "--out", str(a)]) == 0
    assert pack_study.main([str(sweep), "--out", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes()[4:8] == b"\0\0\0\0"  # gzip mtime 0


def test_report_from_pack_equals_report_from_folder(sweep, tmp_path):
    pack = tmp_path / "pack" / "runs.jsonl.gz"
    assert pack_study.main([str(sweep), "--out", str(pack)]) == 0
    assert report.main([str(sweep), "--out", str(tmp_path / "from_folder"), "--reference", "grpo"]) == 0
    assert report.main([str(pack), "--reference", "grpo"]) == 0  # default out: the pack's folder
    folder_md = (tmp_path / "from_folder" / "report.md").read_text()
    assert (tmp_path / "pack" / "report.md").read_text() == folder_md
    # what the report reads from the pack is what each run's metrics.jsonl says, zeros and all
    _, runs = report.load_runs(pack)
    for run in runs:
        assert run.steps == pack_study.parse_metrics(sweep / run.name / "metrics.jsonl")[0], run.name
    assert runs[0].steps[0] == {"eval/accuracy": 0.0, "time/eval_s": 2.0}
    # and it is a report of these runs: the failure, the damaged line, the label with its algo override
    assert "run_grid log: error: TrainingDiverged" in folder_md and "metrics.jsonl:4: unparseable JSON" in folder_md
    assert "| bapo[rho0=0.5] |" in folder_md
    plots = sorted(p.name for p in (tmp_path / "pack").glob("*.png"))
    assert plots == sorted(p.name for p in (tmp_path / "from_folder").glob("*.png")) and plots


def test_runs_run_grid_queued_that_left_no_folder_are_packed_and_reported(sweep, tmp_path):
    """A start-up error removes its run folder, and an interrupted grid never starts the rest: run_grid's plan and
    log still name them, and the pack and the report list them (today's pack had no trace of either)."""
    bad, later = "algo=grpo,learner.lr=-1,seed=1", "algo=grpo,learner.lr=-1,seed=2"
    with (sweep / "logs" / "grid.jsonl").open("a") as f:
        for name in (bad, later):
            f.write(json.dumps({"run": name, "overrides": ["algo=grpo", "learner.lr=-1", f"seed={name[-1]}"]}) + "\n")
        f.write("not json\n" + json.dumps({"run": bad, "rc": 2, "seconds": 3.5}) + "\n")
    (sweep / "logs" / f"{bad}.log").write_text("error: ConfigError: learner.lr: must be > 0, got -1.0\n")
    records = {r["run"]: r for r in pack_study.read_folder(sweep)}
    assert list(records)[-2:] == [bad, later]  # after the folders, by name
    assert {k: records[bad][k] for k in ("status", "exception", "folder", "process_s", "config", "overrides")} == {
        "status": "failed", "exception": "run_grid log: error: ConfigError: learner.lr: must be > 0, got -1.0",
        "folder": False, "process_s": 3.5, "config": {}, "overrides": ["algo=grpo", "learner.lr=-1", "seed=1"],
    }  # fmt: skip
    assert (records[later]["status"], records[later]["exception"]) == ("incomplete", pack_study.NEVER_STARTED)
    assert "folder" not in records["algo=bapo,seed=1"]  # a run with a folder: the record as before
    pack = tmp_path / "pack" / "runs.jsonl.gz"
    assert pack_study.main([str(sweep), "--out", str(pack)]) == 0
    assert report.main([str(sweep), "--out", str(tmp_path / "from_folder")]) == 0
    assert report.main([str(pack)]) == 0
    md = (tmp_path / "pack" / "report.md").read_text()
    assert md == (tmp_path / "from_folder" / "report.md").read_text()
    assert f"| `{bad}` | grpo | — | 1 | no run folder; run_grid log: error: ConfigError: learner.lr: must be > 0" in md
    assert f"| `{later}` | grpo | — | 2 | no run folder; run_grid: queued, never started |" in md
    assert "8 runs, 5 complete, 3 incomplete (3 failed or never started" in md


def test_failed_cells_of_train_py_m_are_read_from_the_sweep_summary(sweep, tmp_path):
    """``python train.py -m`` records each cell in ``sweep_summary.jsonl`` (bapo/entry/sweep.py): a failed cell
    without a folder is listed from it, and one whose folder's logs name nothing takes its line."""
    quiet = "algo=grpo,seed=2"  # complete in the fixture: make it a failure whose own logs say nothing
    (sweep / quiet / "final_metrics.json").unlink()
    rows = [
        {"cell": "algo=grpo,learner.lr=-1,seed=1", "overrides": ["algo=grpo", "learner.lr=-1", "seed=1"],
         "status": "failed", "exit": 2, "error": "error: ConfigError: learner.lr: must be > 0, got -1.0"},
        {"cell": quiet, "overrides": ["algo=grpo", "seed=2"], "status": "failed", "exit": 1,
         "error": "RuntimeError: boom"},
        {"cell": "algo=bapo,seed=9", "overrides": ["algo=bapo", "seed=9"], "status": "failed", "exit": 2,
         "error": "error: ConfigError: x"},
        {"cell": "algo=bapo,seed=9", "overrides": ["algo=bapo", "seed=9"], "status": "complete", "exit": 0,
         "error": None},  # relaunched and complete (its folder since removed): not a failure
    ]  # fmt: skip
    (sweep / "sweep_summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cell": "cut')
    records = {r["run"]: r for r in pack_study.read_folder(sweep)}
    bad = records["algo=grpo,learner.lr=-1,seed=1"]
    assert (bad["status"], bad["folder"], bad["overrides"]) == (
        "failed",
        False,
        ["algo=grpo", "learner.lr=-1", "seed=1"],
    )
    assert bad["exception"] == "sweep summary: error: ConfigError: learner.lr: must be > 0, got -1.0"
    assert (records[quiet]["status"], records[quiet]["exception"]) == ("failed", "sweep summary: RuntimeError: boom")
    assert "algo=bapo,seed=9" not in records
    assert report.main([str(sweep), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| `algo=grpo,learner.lr=-1,seed=1` | grpo | — | 1 | no run folder; sweep summary: error: ConfigError" in md


def test_a_config_hydra_wrote_unresolved_reads_as_the_finished_runs_do(tmp_path):
    """A run that died before writing config.yaml has only Hydra's .hydra/config.yaml, interpolations and all."""
    d = tmp_path / "run" / ".hydra"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("seed: 3\ndata:\n  train_seed: ${seed}\nlogger:\n  tags: ['seed=${seed}']\n")
    assert pack_study.read_run(d.parent)["config"] == {
        "seed": 3,
        "data": {"train_seed": 3},
        "logger": {"tags": ["seed=3"]},
    }
    # a resolver this process does not have (Hydra's own, such as now, may be registered by another test): as written
    (d / "config.yaml").write_text("seed: 3\nx: ${bapo_no_such_resolver:%Y}\n")
    assert pack_study.read_run(d.parent)["config"] == {"seed": 3, "x": "${bapo_no_such_resolver:%Y}"}


def test_bad_packs_fail_with_file_and_line(tmp_path, capsys):
    not_gzip = tmp_path / "a.jsonl.gz"
    not_gzip.write_text("{}")
    with pytest.raises(pack_study.PackError, match="a.jsonl.gz: not a gzip'd study pack"):
        pack_study.read_pack(not_gzip)
    other = tmp_path / "b.jsonl.gz"
    other.write_bytes(gzip.compress(b'{"x": 1}\n'))
    with pytest.raises(pack_study.PackError, match=r"b.jsonl.gz:1: not a study pack"):
        pack_study.read_pack(other)
    short = tmp_path / "c.jsonl.gz"
    header = {"format": "bapo-study", "version": 1, "sweep": "s", "runs": 2}
    short.write_bytes(gzip.compress((json.dumps(header) + '\n{"run": "x"}\n').encode()))
    with pytest.raises(pack_study.PackError, match="header counts 2 runs, the file holds 1"):
        pack_study.read_pack(short)
    header["runs"] = 1
    short.write_bytes(gzip.compress((json.dumps(header) + '\n{"run": "x"}\n').encode()))
    with pytest.raises(pack_study.PackError, match="c.jsonl.gz:2: a run without config, status, metrics"):
        pack_study.read_pack(short)
    assert report.main([str(short)]) == 2
    assert capsys.readouterr().err.startswith("error: PackError: ")


def test_repeated_steps_merge_later_wins(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "a": 1.0, "b": 2.0}, {"step": 2, "a": 5.0}, {"step": 1, "a": 3.0}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"a": 1}\n')
    steps, problems = pack_study.parse_metrics(path)
    assert steps == {1: {"a": 3.0, "b": 2.0}, 2: {"a": 5.0}}
    assert problems == [f"{path}:4: no integer 'step'"]


def test_last_exception_reads_tracebacks_and_one_line_errors(tmp_path):
    log = tmp_path / "x.log"
    log.write_text('Traceback (most recent call last):\n  File "x.py", line 1\nKeyError: a\n\nerror: ConfigError: b\n')
    assert pack_study.last_exception(log) == "error: ConfigError: b"  # the later of the two
    log.write_text("error: ConfigError: b\nTraceback (most recent call last):\n  File ...\nValueError: c\n")
    assert pack_study.last_exception(log) == "ValueError: c"
    log.write_text("step 3 ok\n")
    assert pack_study.last_exception(log) is None


def _bomb(path, unpacked: int) -> None:
    """A pack whose first line is ``unpacked`` bytes of one character: a few hundred KB compressed."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as f:
        f.write(b'{"format": "bapo-study", "x": "')
        for _ in range(unpacked >> 20):
            f.write(b"a" * (1 << 20))
        f.write(b'"}\n')


def test_a_gzip_bomb_is_one_error_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """Before: read_pack unpacked all of it into memory (a 2 MB pack of 2 GB on one line: 4.3 GB resident and 39 s,
    a MemoryError under 3 GB), then split and parsed it. Now it reads a line at a time, each line and the whole
    bounded (the bounds made smaller here, to keep the test short)."""
    monkeypatch.setattr(pack_study, "MAX_PACK_LINE", 4 << 20)
    pack = tmp_path / "runs.jsonl.gz"
    _bomb(pack, 64 << 20)
    assert pack.stat().st_size < 1 << 20
    with pytest.raises(pack_study.PackError, match=r"runs.jsonl.gz:1: a line longer than 4 MiB: not a study pack"):
        pack_study.read_pack(pack)
    assert report.main([str(pack)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: PackError: {pack}:1: a line longer than 4 MiB")
    monkeypatch.setattr(pack_study, "MAX_PACK", 8 << 20)
    many = tmp_path / "many.jsonl.gz"  # short lines, too many of them
    header = {"format": "bapo-study", "version": 1, "sweep": "s", "runs": 1}
    with gzip.open(many, "wb", compresslevel=1) as f:
        f.write((json.dumps(header) + "\n").encode())
        for _ in range(12):
            f.write(b"[" + b"0," * (1 << 19) + b"0]\n")
    with pytest.raises(
        pack_study.PackError, match=r"many.jsonl.gz: more than 8 MiB, .* \(a study pack unpacks to a few"
    ):
        pack_study.read_pack(many)


def test_a_runs_config_that_interpolates_is_a_problem_and_reads_no_variable(tmp_path, monkeypatch):
    """Before: pack_study resolved it (OmegaConf): the pack, and the report made from it, held the variable."""
    monkeypatch.setenv("BAPO_TEST_SECRET", "hunter2-issue50-marker")
    run = _run(tmp_path / "sweep", "algo=bapo,seed=1", rows=_rows(0.3))
    (run / "config.yaml").write_text("algo: {name: bapo}\nlogger: {note: '${oc.env:BAPO_TEST_SECRET}'}\n")
    record = pack_study.read_run(run)
    assert record["config"] == {}
    assert record["problems"] == [
        "algo=bapo,seed=1/config.yaml: unreadable config (logger.note: '${oc.env:BAPO_TEST_SECRET}' is an "
        "interpolation, never resolved here: the loop writes a run's config resolved, and an interpolation could read "
        "this machine's environment)"
    ]
    (run / "config.yaml").unlink()  # a run that died early: Hydra's own record, references resolved, no resolver run
    (run / ".hydra" / "config.yaml").write_text("seed: 1\nalgo: {name: bapo}\nx: '${oc.env:BAPO_TEST_SECRET}'\n")
    assert pack_study.read_run(run)["config"] == {
        "seed": 1,
        "algo": {"name": "bapo"},
        "x": "${oc.env:BAPO_TEST_SECRET}",
    }


def test_long_and_huge_metrics_and_logs_are_bounded(tmp_path, monkeypatch):
    run = _run(tmp_path / "sweep", "algo=bapo,seed=1", rows=_rows(0.3))
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "x": "' + "y" * (2 << 20) + '"}\n')
    record = pack_study.read_run(run)
    assert record["metrics"]["step"] == [0, 1, 2, 3]
    assert record["problems"] == ["algo=bapo,seed=1/metrics.jsonl:5: longer than 1 MiB: skipped"]
    monkeypatch.setattr(pack_study, "MAX_METRICS", 1000)
    record = pack_study.read_run(run)
    assert record["metrics"]["step"] == [] and record["problems"] == [
        "algo=bapo,seed=1/metrics.jsonl: more than 1000 bytes, more than this file ever holds: not read"
    ]
    log = run / "train.log"  # a crash at the end of a long log: only its tail is read
    log.write_text("x" * (3 << 20) + "\nerror: TrainingDiverged: loss is nan at step 2\n")
    (run / "final_metrics.json").unlink()
    assert pack_study.read_run(run)["exception"] == "train.log: error: TrainingDiverged: loss is nan at step 2"


@pytest.mark.parametrize("where", ["file", "read_only", "proc"])
def test_an_unwritable_out_is_one_error_line_and_leaves_nothing(sweep, tmp_path, capsys, where):
    """Before: pack_study.py --out to an unwritable place ended in a PermissionError or NotADirectoryError traceback."""
    if where == "file":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "runs.jsonl.gz"
    elif where == "read_only":
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        out = tmp_path / "ro" / "runs.jsonl.gz"
        if os.access(tmp_path / "ro", os.W_OK):
            pytest.skip("this user writes into a read-only folder (root)")
    else:
        out = Path("/proc/bapo-runs.jsonl.gz")
    assert pack_study.main([str(sweep), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"--out {out}:" in err[0], err
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
