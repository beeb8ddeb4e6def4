"""Every start-up failure of train.py is one line, ``error: <Class>: <message>``, naming the key (and the file),
exit status 2 for bad input, and leaves no run folder behind (nor Hydra's empty date folder above it).

The subprocess tests run the user's command; the in-process ones check the same errors where a subprocess
would only add start-up time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bapo.config import ConfigError
from bapo.data.loading import DataFileError
from bapo.learner import TrainingDiverged
from bapo.loop import run
from tests.helpers.config import smoke_cfg

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


def train(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=env or ENV, capture_output=True, text=True, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess, status: int = 2) -> str:
    """The error line of a failed start; asserts the exit status and that no stack trace was printed."""
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    return errors[0]


# ----------------------------------------------------------------------------- keys Hydra cannot apply


@pytest.mark.slow
def test_a_key_one_group_down_gets_a_hint_from_hydras_error(tmp_path):
    """Before: the README's ablation example failed with Hydra's 'Could not override' and no hint."""
    proc = train("algo=bapo", "algo.contribution=gradient", "algo.weight=none", f"hydra.run.dir={tmp_path / 'r'}")
    line = one_line_error(proc)
    assert line.startswith("error: ConfigCompositionException: Could not override 'algo.contribution'")
    assert line.endswith("did you mean algo.bounds.contribution=gradient?")
    assert not (tmp_path / "r").exists()


def test_an_appended_key_one_group_down_gets_the_hint_in_the_config_error(tmp_path):
    from tests.helpers.config import run_config

    with pytest.raises(ConfigError, match=r"^algo\.contribution: .*did you mean algo\.bounds\.contribution\?$"):
        run_config("+algo.contribution=gradient")
    with pytest.raises(ConfigError, match=r"did you mean data\.arith\.max_value\?$"):
        run_config("+data.max_value=20")
    with pytest.raises(ConfigError) as info:
        run_config("+algo.no_such_key=1")
    assert "did you mean" not in str(info.value)


@pytest.mark.slow
def test_a_missing_group_option_and_a_bad_override_are_one_line_each(tmp_path):
    line = one_line_error(train("algo=nosuch", f"hydra.run.dir={tmp_path / 'r'}"))
    assert "algo: 'nosuch' is not an option" in line and "bapo, bapo_recipe" in line and "search path" not in line
    line = one_line_error(train("algo.x=[", f"hydra.run.dir={tmp_path / 'r'}"))
    assert line.startswith("error: OverrideParseException: ")


@pytest.mark.slow
def test_a_config_error_removes_hydras_empty_date_folder_too(tmp_path):
    """Before: outputs/<date>/ stayed behind, empty, after every config error (and then outputs/ itself)."""
    one_line_error(train("rollout.temperature=-1", cwd=tmp_path))
    assert list(tmp_path.iterdir()) == []  # outputs/ too: this start made it


# ----------------------------------------------------------------------------- run folders


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder this process cannot write to: a read-only tmpfs as root (root ignores modes), else mode 0555."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"root, but cannot mount a read-only tmpfs: {proc.stderr.decode().strip()}")
    else:
        ro.chmod(0o555)
    return ro


@pytest.mark.slow
def test_a_read_only_output_folder_is_one_line(tmp_path):
    """Before: Hydra's stack trace from os.mkdir."""
    ro = _read_only_folder(tmp_path)
    try:
        line = one_line_error(train("debug=smoke", f"hydra.run.dir={ro / 'run'}"))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(ro)], check=False)
        else:
            ro.chmod(0o755)
    assert f"cannot write {ro / 'run'}" in line and "hydra.run.dir" in line


@pytest.mark.slow
def test_resume_from_a_path_without_a_checkpoint_leaves_no_run_folder(tmp_path):
    """Before: the ConfigError was one line, but the run folder (Hydra's files and the lock) stayed."""
    line = one_line_error(train("debug=smoke", "resume=/nonexistent", f"hydra.run.dir={tmp_path / 'r'}"))
    assert "resume: no complete checkpoint in /nonexistent" in line
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_missing_gguf_package_names_the_key(tmp_path):
    """Before: a RuntimeError traceback naming model.gguf_package (the key is model.gguf.package)."""
    env = dict(ENV, BAPO_CACHE=str(tmp_path / "cache"))
    line = one_line_error(
        train("model=smollm2_135m", "model.gguf.package=no_such_gguf_pkg", f"hydra.run.dir={tmp_path / 'r'}", env=env)
    )
    assert line.startswith("error: ConfigError: model.gguf.package: 'no_such_gguf_pkg' is not installed")
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- data files


@pytest.mark.slow
def test_a_missing_data_file_names_the_key_the_absolute_path_and_where_the_folder_came_from(tmp_path):
    """Before: a traceback, a run folder left behind, and no word of paths.data_dir or BAPO_DATA_DIR."""
    env = dict(ENV, BAPO_DATA_DIR=str(tmp_path / "nodata"))
    line = one_line_error(train("debug=smoke", "data=math", f"hydra.run.dir={tmp_path / 'r'}", env=env))
    assert line.startswith("error: DataFileError: data.path: ")
    assert str(tmp_path / "nodata" / "train_math.jsonl") in line
    assert "paths.data_dir" in line and "BAPO_DATA_DIR" in line
    # where the file comes from (data=math's missing_hint), and the hub sets that need none
    assert line.endswith("or train on a hub set, data=skywork_or1 (the paper's), data=dapo_math or data=deepscaler")
    assert "agentica-project/rllm (rllm/data/train/math/math.json and aime.json)" in line
    assert not (tmp_path / "r").exists()


def test_a_missing_file_error_says_where_the_file_comes_from_when_the_config_says(tmp_path):
    from bapo.data.loading import check_files
    from tests.helpers.config import run_config

    cfg = run_config("data=jsonl", f"data.path={tmp_path / 'train.jsonl'}", "data.missing_hint='get it from X'").data
    with pytest.raises(DataFileError, match=r"^data\.path: no such file: .*train\.jsonl; get it from X$"):
        check_files(cfg, str(tmp_path / "elsewhere"))
    cfg = run_config("data=math", f"paths.data_dir={tmp_path}").data  # under paths.data_dir: the folder, then the hint
    with pytest.raises(DataFileError, match=r"point BAPO_DATA_DIR or paths\.data_dir at the folder that holds it; "):
        check_files(cfg, str(tmp_path))


@pytest.mark.slow
def test_a_relative_missing_data_file_is_named_by_its_absolute_path(tmp_path):
    line = one_line_error(
        train("debug=smoke", "data=jsonl", "data.path=no/such.jsonl", f"hydra.run.dir={tmp_path / 'r'}")
    )
    assert "data.path: " in line and str(ROOT / "no" / "such.jsonl") in line
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "make,why",
    [
        (lambda p: p.mkdir(), "is a folder"),
        (lambda p: p.write_text(""), "is empty"),
        (lambda p: p.write_text('{"problem": 1}\nnot json\n'), "no valid rows"),
    ],
    ids=["folder", "empty", "all-bad"],
)
def test_a_data_file_that_cannot_serve_is_a_data_file_error_naming_it(tmp_path, make, why):
    f = tmp_path / "train.jsonl"
    make(f)
    with pytest.raises(DataFileError, match=f"^data.path: .*{f}.*{why}") as info:
        run(smoke_cfg(["data=jsonl", f"data.path={f}"]), tmp_path / "run")
    assert "\n" not in str(info.value)
    if why == "no valid rows":
        assert f"{f}:1" in str(info.value)  # the first bad row, by file and line


def test_a_hub_file_datasets_cannot_parse_or_a_name_it_cannot_find_names_the_key(tmp_path):
    from bapo.data.hub import load_hub

    f = tmp_path / "bad.jsonl"
    f.write_text('{"problem": "1+1?", "answer": "2"}\nnot json\n')
    with pytest.raises(DataFileError, match=f"^data.path: {f}: datasets could not load"):
        load_hub(str(f), split="train")
    with pytest.raises(DataFileError, match=r"^data\.path: 'no-such-org/no-such-set' is not a local file or folder"):
        load_hub("no-such-org/no-such-set", split="train")


@pytest.mark.slow
def test_a_prompt_limit_nothing_fits_under_names_the_key(tmp_path):
    proc = train("debug=smoke", "data.max_prompt_tokens=3", f"hydra.run.dir={tmp_path / 'r'}")
    line = one_line_error(proc)
    assert line.startswith("error: DataFileError: data.max_prompt_tokens: ") and "3 tokens" in line
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- wandb and divergence


@pytest.mark.slow
def test_online_logging_without_an_api_key_fails_before_anything_is_written(tmp_path):
    """Before: it failed after the model load and left an empty metrics.jsonl, so the same command was
    then refused ('holds another run')."""
    env = {k: v for k, v in ENV.items() if k not in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")}
    env |= {"NETRC": str(tmp_path / "no-netrc"), "HOME": str(tmp_path)}
    for _ in range(2):  # the same command again: the same error, not "holds another run"
        line = one_line_error(train("debug=smoke", "logger.mode=online", f"hydra.run.dir={tmp_path / 'r'}", env=env))
        assert line.startswith("error: ConfigError: logger.mode: online") and "WANDB_API_KEY" in line
        assert not (tmp_path / "r").exists()


def test_online_logging_with_a_netrc_entry_passes_the_check(tmp_path, monkeypatch):
    from bapo.infra.tracking import check_wandb

    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(netrc))
    check_wandb("online")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    with pytest.raises(ConfigError, match="wandb.example.org"):
        check_wandb("online")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_wandb("online")


def test_a_failing_wandb_init_leaves_no_metrics_file(tmp_path, monkeypatch):
    """Whatever makes wandb.init fail, metrics.jsonl is not created first: the folder holds no run to refuse."""
    import wandb

    from bapo.infra.tracking import MetricsLogger

    def broken(**kw):
        raise wandb.errors.UsageError("no network")

    monkeypatch.setattr(wandb, "init", broken)
    with pytest.raises(
        ConfigError, match=r"^logger\.mode: wandb could not start \(mode=online: UsageError: no network\)"
    ):
        MetricsLogger(tmp_path, wandb=True, mode="online")
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_divergence_before_the_first_checkpoint_says_there_is_none(tmp_path):
    """Before: 'the newest checkpoint is in <run>/checkpoints', a folder that did not exist."""
    with pytest.raises(TrainingDiverged) as info:
        run(smoke_cfg(["learner.lr=1e30", "train.steps=2", "checkpoint.every=5"]), tmp_path)
    msg = str(info.value)
    assert not list((tmp_path / "checkpoints").glob("step_*"))
    assert "the newest checkpoint is in" not in msg
    assert "no checkpoint was written before it diverged (checkpoint.every=5)" in msg
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0


@pytest.mark.slow
def test_divergence_after_a_checkpoint_names_the_newest_one(tmp_path, monkeypatch):
    from bapo.learner import Learner

    real = Learner.learn

    def learn(self, mb):
        if self.version >= 4:  # step 3's first update: steps 1 and 2 are checkpointed
            raise TrainingDiverged("the loss is not finite")
        return real(self, mb)

    monkeypatch.setattr(Learner, "learn", learn)
    with pytest.raises(TrainingDiverged) as info:
        run(smoke_cfg(["train.steps=3", "checkpoint.every=1", "eval.every=0"]), tmp_path)
    assert str(info.value).endswith(f"the newest checkpoint is {tmp_path / 'checkpoints' / 'step_000002'}")


@pytest.mark.parametrize(
    "err,status,text",
    [
        (
            OSError(28, "No space left on device", "/runs/r/metrics.jsonl"),
            1,
            "no space left on device while writing /runs/r/metrics.jsonl",
        ),
        (OSError(30, "Read-only file system", "/ro/run"), 2, "cannot write /ro/run: Read-only file system"),
        (PermissionError(13, "Permission denied", "/root/run"), 2, "cannot write /root/run: Permission denied"),
    ],
)
def test_hydra_entry_turns_file_system_errors_into_one_line(err, status, text, capsys, monkeypatch):
    from bapo.entry.cli import hydra_entry

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored (unset) after the test; hydra_entry sets it to 1

    def main():
        raise err

    with pytest.raises(SystemExit) as info:
        hydra_entry(main)
    assert info.value.code == status
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith("error: ") and text in line


def test_hydra_entry_leaves_other_errors_and_a_users_full_error_alone(monkeypatch):
    from bapo.entry.cli import hydra_entry

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored (unset) after the test; hydra_entry sets it to 1

    def bug():
        raise FileNotFoundError(2, "No such file or directory", "/a/bug")

    with pytest.raises(FileNotFoundError):  # not a file-system condition the user can fix: a bug keeps its trace
        hydra_entry(bug)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")

    def full():
        raise OSError(28, "No space left on device", "/x")

    with pytest.raises(OSError):
        hydra_entry(full)


# ------------------------------------------------------------------- a refused start leaves the folder as it was


def tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (and ``root``) with its mtime, and a file's content: what 'as it was' compares."""
    out = {".": (None, root.stat().st_mtime_ns)} if root.exists() else {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = (None if p.is_dir() else p.read_bytes(), p.lstat().st_mtime_ns)
    return out


@pytest.fixture()
def job_log():
    """Hydra's job log as the root logger's file handler (``<run>/train.log``, opened in append mode before the job,
    as Hydra's configure_log does); ``job_log(run_dir)`` installs it, and it is removed after the test."""
    import logging

    handlers = []

    def install(run_dir: Path) -> Path:
        run_dir.mkdir(parents=True, exist_ok=True)
        h = logging.FileHandler(run_dir / "train.log")
        logging.getLogger().addHandler(h)
        handlers.append(h)
        return run_dir / "train.log"

    yield install
    for h in handlers:
        logging.getLogger().removeHandler(h)
        h.close()


HYDRA_FILES = {"config.yaml": "seed: 2\n", "hydra.yaml": "hydra: {}\n", "overrides.yaml": "- seed=2\n"}


def _old_run(run_dir: Path) -> None:
    """A finished run's folder: its .hydra/, log, metrics and a dead holder's lock file, all dated in the past."""
    (run_dir / ".hydra").mkdir(parents=True)
    for name in HYDRA_FILES:
        (run_dir / ".hydra" / name).write_text(f"the old run's {name}\n")
    (run_dir / "train.log").write_text("the old run's log\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / ".lock").write_text('{"pid": 1, "host": "old", "since": "2020"}')
    for p in [*run_dir.rglob("*"), run_dir]:
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))


def _refuse(_=None):
    raise ConfigError("resume=null starts a fresh run, but the folder holds another run")


def test_a_refused_start_in_a_run_folder_puts_back_hydra_files_the_log_and_the_lock_file(tmp_path, job_log, capsys):
    """Before: the refused start's Hydra had rewritten .hydra/, and a start-up error deleted a folder holding only
    Hydra's files and the lock, a live run's included."""
    import logging

    from bapo.entry.cli import guarded

    run_dir = tmp_path / "run"
    _old_run(run_dir)
    before = tree(run_dir)
    job_log(run_dir)

    def start():
        logging.getLogger("bapo.test").warning("a line this start logged")
        _refuse()

    with pytest.raises(SystemExit) as info:
        guarded(start, run_dir, hold=True, files=HYDRA_FILES)
    assert info.value.code == 2 and capsys.readouterr().err.startswith("error: ConfigError: resume=null")
    assert tree(run_dir) == before  # every file's bytes and mtime, the folder's own mtime


def test_a_start_up_error_in_a_folder_hydra_made_for_it_removes_it_and_its_empty_parents(tmp_path, job_log):
    from bapo.entry.cli import guarded

    run_dir = tmp_path / "outputs" / "2026-12-05" / "10-00-00"
    job_log(run_dir)
    with pytest.raises(SystemExit):
        guarded(_refuse, run_dir, hold=True, files=HYDRA_FILES)
    assert list((tmp_path / "outputs").iterdir()) == []


def test_a_busy_folder_is_not_touched_and_a_failed_holder_never_removes_what_it_did_not_make(tmp_path, job_log):
    """Another process's lock: refused at once, nothing written; the folder (a live run's) keeps every file."""
    import fcntl

    from bapo.entry.cli import guarded
    from bapo.rundir import RunFolderBusy

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("- placement=disaggregated\n")
    (run_dir / "train.log").write_text("the live run's start-up\n")
    (run_dir / ".lock").write_text('{"pid": 1, "host": "h", "since": "now"}')
    fd = os.open(run_dir / ".lock", os.O_RDWR)  # a second open file description: another holder, for flock
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        before = tree(run_dir)
        job_log(run_dir)
        ran = []
        with pytest.raises(SystemExit) as info:
            guarded(lambda: ran.append(1), run_dir, hold=True, files=HYDRA_FILES)
        assert info.value.code == 2 and ran == []  # refused before the job ran
        assert tree(run_dir) == before
        with pytest.raises(RunFolderBusy):  # and still the holder's
            from bapo.rundir import RunFolder

            RunFolder.open(run_dir)
    finally:
        os.close(fd)


def test_a_run_that_wrote_its_files_keeps_them_and_its_log_ends_with_the_error_line(tmp_path, job_log, capsys):
    from bapo.entry.cli import guarded
    from bapo.rundir import RunFolder

    run_dir = tmp_path / "run"
    log = job_log(run_dir)

    def diverge():
        with RunFolder.open(run_dir) as folder:  # the loop's own open shares this process's lock
            (folder.path / "metrics.jsonl").write_text('{"step": 1}\n')
            raise TrainingDiverged("non-finite weights at step 1; no checkpoint was written yet")

    with pytest.raises(SystemExit) as info:
        guarded(diverge, run_dir, hold=True, files=HYDRA_FILES)
    assert info.value.code == 1
    line = capsys.readouterr().err.strip()
    assert log.read_text().splitlines()[-1] == line and line.startswith("error: TrainingDiverged: ")
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".lock", "metrics.jsonl", "train.log"]
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- seed=2\n"
    with RunFolder.open(run_dir):  # released
        pass


def test_a_sweep_cell_that_fails_is_recorded_and_returns(tmp_path, job_log, capsys):
    """Before: the cell's sys.exit escaped Hydra's job handling and ended the sweep."""
    from bapo.entry.cli import guarded
    from bapo.entry.sweep import SUMMARY, Cell, rows

    sweep_dir = tmp_path / "sweep"
    cell = Cell(sweep_dir, "learner.lr=-1", 1, ("learner.lr=-1",))
    log = job_log(sweep_dir / cell.name)
    assert guarded(_refuse, sweep_dir / cell.name, hold=True, files=HYDRA_FILES, cell=cell) is None
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: ConfigError: ") and "\n" not in line
    assert log.read_text() == line + "\n"  # the cell's own log says why
    assert sorted(p.name for p in (sweep_dir / cell.name).iterdir()) == [".hydra", "train.log"]  # no lock file
    (row,) = rows(sweep_dir)
    assert (row["cell"], row["status"], row["exit"], row["error"]) == ("learner.lr=-1", "failed", 2, line)

    def bug():
        raise KeyError("a bug")

    other = Cell(sweep_dir, "seed=2", 2, ("seed=2",))
    job_log(sweep_dir / other.name)
    assert guarded(bug, sweep_dir / other.name, hold=True, files=HYDRA_FILES, cell=other) is None
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err  # a bug keeps its traceback, and the sweep goes on
    assert "Traceback" in (sweep_dir / other.name / "train.log").read_text()
    assert [(r["status"], r["exit"]) for r in rows(sweep_dir)] == [("failed", 2), ("failed", 1)]
    ok = Cell(sweep_dir, "seed=3", 3, ("seed=3",))
    job_log(sweep_dir / ok.name)
    assert guarded(lambda: {"loss": 0.0}, sweep_dir / ok.name, hold=True, files=HYDRA_FILES, cell=ok) == {"loss": 0.0}
    assert rows(sweep_dir)[-1]["status"] == "complete" and (sweep_dir / SUMMARY).is_file()
