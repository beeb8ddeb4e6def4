"""One property across the entry points (``train.py``, ``eval.py``, ``train.py ... --plan``,
``scripts/study/report.py``, ``scripts/study/run_grid.py``) and every class of bad input issue 37 found: stderr is one
line starting ``error: ``, the exit status is 2, and the file system is as it was (the working folder's tree, file by
file, and the repository's top level), so that a mistyped command costs nothing but the line that says what to fix.

Each case runs the entry point's own ``__main__`` in this process (``runpy``, ``sys.argv`` as typed, a fresh
working folder, stderr captured at the file descriptor): a process per case would spend most of its time importing
torch. :func:`test_the_property_holds_in_real_processes` runs one case per entry point as a real process, to show
that nothing here differs from the user's shell. A sweep is not a case: its failed cells each print their line and
the sweep adds one naming them (tests/e2e/test_train_sweep.py).

Issue 50 adds the class of hostile artifacts (:data:`HOSTILE`: every spoiled export of tests/helpers/hostile.py, a
gzip bomb of a study pack, eval.py into a training run's folder): each also ends within 30 s, and every case runs
with a marker variable set that no output may hold.
"""

from __future__ import annotations

import fcntl
import logging
import os
import runpy
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from tests.helpers import hostile

ROOT = Path(__file__).resolve().parents[2]
OTHER = "owned by another fix"  # issue 37's items fixed beside this file; flip when they land
GRID = ["--seeds", "1", "--sweep-dir", "{work}/sweep"]  # a grid's runs, if any, go to the working folder

# (entry, argv after the script, xfail reason or None). {bin} is a binary file, {held} a folder another process
# holds; train.py cases use Hydra's default run folder (outputs/<date>/<time>) under the working folder.
CASES: dict[str, tuple[str, list[str], str | None]] = {
    # ---- train.py
    "train/config_value": ("train.py", ["learner.lr=-1"], None),
    "train/override_syntax": ("train.py", ["algo.x=["], None),
    "train/unknown_experiment": ("train.py", ["experiment=paper_8b"], None),  # item 9
    "train/unknown_debug": ("train.py", ["debug=smok"], None),
    "train/seed_negative": ("train.py", ["seed=-1"], None),  # item 10
    "train/seed_too_big": ("train.py", [f"seed={2**32}"], None),
    "train/bool_2": ("train.py", ["train.async_rollout=2"], None),  # item 12
    "train/bool_packing_2": ("train.py", ["learner.packing=2"], None),
    "train/bool_trust_2": ("train.py", ["model.trust_remote_code=2"], None),
    "train/resume_nothing": ("train.py", ["resume=/nonexistent/run"], None),
    "train/busy_folder": ("train.py", ["hydra.run.dir={held}"], None),  # item 2
    # item 10 and item 15: checked before the model loads (transformers' "Loading weights" bar would come first)
    "train/vllm_server_missing": ("train.py", ["rollout=vllm_server"], None),
    "train/binary_data": ("train.py", ["data=jsonl", "data.path={bin}"], None),
    # ---- eval.py
    "eval/device_foo": ("eval.py", ["device=foo"], None),  # item 10
    "eval/device_cuda": ("eval.py", ["device=cuda"], None),
    "eval/empty_checkpoint": ("eval.py", ["checkpoint="], None),  # item 11
    "eval/missing_checkpoint": ("eval.py", ["checkpoint=/nonexistent/run"], None),
    "eval/k_0": ("eval.py", ["k=0"], None),
    "eval/unknown_model": ("eval.py", ["model=qwen7B"], None),  # item 9
    "eval/bool_trust_2": ("eval.py", ["model.trust_remote_code=2"], None),  # item 12
    "eval/busy_folder": ("eval.py", ["hydra.run.dir={held}"], None),  # two evals started in one second share one
    # ---- train.py --plan (item 7)
    "plan/unknown_experiment": ("train.py", ["experiment=paper_7B", "--plan"], None),
    "plan/gpu_memory_nan": ("train.py", ["--plan", "--gpu-memory", "nan"], None),
    "plan/gpu_memory_negative": ("train.py", ["--plan", "--gpu-memory", "-5"], None),
    "plan/gpu_memory_0": ("train.py", ["--plan", "--gpu-memory", "0"], None),
    "plan/hidden_size_0": ("train.py", ["model=qwen2.5_0.5b", "model.arch.hidden_size=0", "--plan"], None),
    "plan/layers_negative": ("train.py", ["model=qwen2.5_0.5b", "model.arch.num_hidden_layers=-4", "--plan"], None),
    # ---- scripts/study/report.py (items 4-6: its owner's; these are the inputs it refuses)
    "report/no_folder": ("scripts/study/report.py", ["/nonexistent/sweep"], None),
    "report/smooth_0": ("scripts/study/report.py", ["{empty}", "--smooth", "0"], None),
    # ---- scripts/study/run_grid.py
    "grid/unknown_experiment": ("scripts/study/run_grid.py", ["nosuch_experiment", "algo=grpo", *GRID], None),
    "grid/cell_not_overrides": ("scripts/study/run_grid.py", ["study_demo", "algo", *GRID], None),
    # a cell that does not compose is bad input known before any run (train.py -m refuses such a grid whole);
    # run_grid runs it and lists it failed, exit 1 (item 5's owner decides)
    "grid/unknown_option": ("scripts/study/run_grid.py", ["study_demo", "algo=nosuch", *GRID], None),
    # ---- issue 50, item 5: every input problem its probe found (before: 51-195 line tracebacks, a run folder left);
    # its data row with a lone surrogate is skipped and counted, not an error (tests/unit/infra/test_untrusted_text.py)
    "train/interp_self": ("train.py", ["train.steps=${train.steps}"], None),
    "train/interp_env": ("train.py", ["data.instruction=${oc.env:BAPO_NO_SUCH_VAR}"], None),
    "train/interp_missing": ("train.py", ["data.instruction=${no.such.key}"], None),
    "train/interp_resolver": ("train.py", ["data.instruction=${bapo_no_such_resolver:x}"], None),
    "train/interp_run_dir": ("train.py", ["hydra.run.dir=${oc.env:BAPO_NO_SUCH_VAR}"], None),
    "train/interp_host": ("train.py", ["placement=disaggregated", "placement.host=${oc.env:BAPO_NO_SUCH_VAR}"], None),
    "eval/interp_self": ("eval.py", ["k=${k}"], None),
    "train/rdzv_port": (
        "train.py",
        ["learner=fsdp", "launcher.nproc_per_node=2", "launcher.rdzv_endpoint=127.0.0.1:99999"],
        None,
    ),  # fmt: skip
    "train/objective_os_system": ("train.py", ["algo.objective=os:system"], None),
    "pack/out_under_a_file": ("scripts/study/pack_study.py", ["{sweep}", "--out", "{bin}/runs.jsonl.gz"], None),
    "pack/out_in_proc": ("scripts/study/pack_study.py", ["{sweep}", "--out", "/proc/bapo-runs.jsonl.gz"], None),
}

# issue 50: a shared export, run folder or pack is data. A case per hostile artifact of tests/helpers/hostile.py
# (item 1), a gzip bomb of a pack (item 2) and eval.py into a training run's folder (item 3); the workers' port
# (item 4) is no entry point's input: tests/e2e/test_disaggregated.py holds it.
EVAL = ["eval=arith", "eval.limit=2", "k=1", "temperature=0"]
HOSTILE: dict[str, tuple[str, list[str], str | None]] = {
    **{f"eval/export_{name}": ("eval.py", [f"checkpoint={{export:{name}}}", *EVAL], None) for name in hostile.EXPORTS},
    "eval/into_a_training_run": ("eval.py", ["checkpoint={run}", "hydra.run.dir={run}", *EVAL], None),
    "report/gzip_bomb": ("scripts/study/report.py", ["{bomb}"], None),
}
CASES |= HOSTILE

# what each bad input class's line must name (the key, the file, the option), beyond "error: "
NAMES = {
    "train/config_value": "learner.lr",
    "train/unknown_experiment": "paper_7b",
    "train/unknown_debug": "smoke",
    "train/seed_negative": "seed",
    "train/bool_2": "train.async_rollout",
    "train/busy_folder": "in use by another run",
    "eval/busy_folder": "in use by another run",
    "eval/device_foo": "device",
    "eval/device_cuda": "device",
    "eval/empty_checkpoint": "checkpoint",
    "eval/unknown_model": "qwen7b",
    "plan/unknown_experiment": "paper_7b",
    "report/no_folder": "/nonexistent/sweep",
    "grid/unknown_experiment": "nosuch_experiment",
    "train/interp_self": "train.steps: cannot be resolved (Recursive interpolation",
    "train/interp_env": "data.instruction: cannot be resolved",
    "train/interp_missing": "data.instruction: cannot be resolved (Interpolation key 'no.such.key' not found",
    "train/interp_resolver": "data.instruction: cannot be resolved (Unsupported interpolation type",
    "train/interp_run_dir": "hydra.run.dir: cannot be resolved",
    "train/interp_host": "placement.host: cannot be resolved",
    "eval/interp_self": "cannot be resolved (Recursive interpolation",
    "train/rdzv_port": "launcher.rdzv_endpoint: the port must be 0-65535",
    "train/objective_os_system": "algo.objective: 'os:system' is not a loss factory",
    "pack/out_under_a_file": "is a file, not a folder",
    "pack/out_in_proc": "--out /proc/bapo-runs.jsonl.gz",
    **{f"eval/export_{name}": says for name, (_, says) in hostile.EXPORTS.items()},
    "eval/into_a_training_run": "holds a training run",
    "report/gzip_bomb": "a line longer than 64 MiB: not a study pack",
}


def tree(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its mtime, and a file's bytes: what 'as it was' compares."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = (None if p.is_dir() else p.read_bytes(), p.lstat().st_mtime_ns)
    return out


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    """A fresh working folder with what the cases point at: a binary "data file", an empty folder, and a run
    folder another process holds (its lock taken through a second open file description, as another process
    would; its files those of a run that is starting up, its job log among them: Hydra opens the job's log before
    the job runs, and would leave an empty one in a folder that had none)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "binary.jsonl").write_bytes(bytes(range(256)) * 64)
    (work / "empty").mkdir()
    held = work / "held"
    (held / ".hydra").mkdir(parents=True)
    (held / ".hydra" / "overrides.yaml").write_text("- placement=disaggregated\n")
    for log in ("train.log", "eval.log"):  # the holder's job log (Hydra opens the one of its own job's name)
        (held / log).write_text("[...][bapo.rundir][INFO] - starting\n")
    (held / ".lock").write_text('{"pid": 1, "host": "elsewhere", "since": "2026-12-05T10:00:00+0000"}')
    fd = os.open(held / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    sweep = work / "sweep" / "algo=grpo,seed=1"
    sweep.mkdir(parents=True)
    (sweep / "config.yaml").write_text("algo: {name: grpo}\ntrain: {steps: 1}\n")
    (sweep / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    monkeypatch.chdir(work)
    monkeypatch.setenv(hostile.SECRET_VAR, hostile.SECRET)  # no output, of any case, may ever hold it
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # hydra_entry sets it for the process
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    root_logger = logging.getLogger()
    handlers, level = list(root_logger.handlers), root_logger.level
    yield work
    for h in root_logger.handlers:  # Hydra's job logging, configured by each case
        if h not in handlers:
            h.close()
    root_logger.handlers[:] = handlers
    root_logger.setLevel(level)
    os.close(fd)


def run_main(script: str, argv: list[str], monkeypatch) -> int:
    """Run ``script``'s ``__main__`` with ``argv`` as the process would; its exit status (a traceback is printed
    to stderr and counts 1, as Python does for an uncaught exception)."""
    path = ROOT / script
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message")
        return 1
    except Exception:  # noqa: BLE001 (the property: a bug's traceback fails it, with the traceback to read)
        traceback.print_exc()
        return 1
    return 0


def _args(argv: list[str], work: Path) -> list[str]:
    """``argv`` with its placeholders filled in; a hostile artifact a case names is built in ``work`` first."""
    fill = {"{bin}": str(work / "binary.jsonl"), "{held}": str(work / "held"), "{empty}": str(work / "empty")}
    fill |= {"{work}": str(work), "{sweep}": str(work / "sweep")}
    out = []
    for a in argv:
        if "{export:" in a:
            name = a.split("{export:", 1)[1].split("}", 1)[0]
            folder = hostile.EXPORTS[name][0](work / "exports" / name)
            a = a.replace(f"{{export:{name}}}", str(folder))
        if "{run}" in a and not (work / "run").exists():
            _training_run(work / "run")
        if "{bomb}" in a and not (work / "bomb.jsonl.gz").exists():
            _gzip_bomb(work / "bomb.jsonl.gz", 80 << 20)
        fill |= {"{run}": str(work / "run"), "{bomb}": str(work / "bomb.jsonl.gz")}
        for k, v in fill.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def _training_run(run: Path) -> None:
    """A finished training run's folder: its config, metrics, export and Hydra's record of its job."""
    hostile.export(run / "export")
    (run / "config.yaml").write_text(hostile.trained_config())
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    (run / "final_metrics.json").write_text("{}")
    (run / "train.log").write_text("[...] done\n")
    (run / ".hydra").mkdir()
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text(f"# the training job's {name}\n")


def _gzip_bomb(path: Path, unpacked: int) -> None:
    """A pack whose first line unpacks to ``unpacked`` bytes: 2 MB of gzip can hold 2 GB."""
    import gzip

    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as f:
        f.write(b'{"format": "bapo-study", "x": "')
        for _ in range(unpacked >> 20):
            f.write(b"a" * (1 << 20))
        f.write(b'"}\n')


def _params():
    for name, (script, argv, xfail) in CASES.items():
        marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
        if name == "eval/device_cuda":
            import torch

            marks.append(pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here"))
        yield pytest.param(name, script, argv, marks=marks, id=name)


@pytest.mark.parametrize("name,script,argv", list(_params()))
def test_bad_input_is_one_error_line_exit_2_and_leaves_the_file_system_as_it_was(
    name, script, argv, workdir, monkeypatch, capfd
):
    top = sorted(p.name for p in ROOT.iterdir())
    args = _args(argv, workdir)
    before = tree(workdir)
    capfd.readouterr()
    began = time.monotonic()
    code = run_main(script, args, monkeypatch)
    took = time.monotonic() - began
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}; stderr:\n{err[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr:\n{err[-3000:]}"
    assert name not in NAMES or NAMES[name] in lines[0], lines[0]
    assert tree(workdir) == before  # nothing made, changed or removed (Hydra's date folders included)
    assert sorted(p.name for p in ROOT.iterdir()) == top  # nor a stray outputs/ in the repository
    assert hostile.SECRET not in out + err  # the evaluator's environment, read into no output
    if name in HOSTILE:
        assert took < 30, f"{name} took {took:.0f} s"  # a hostile artifact costs seconds, never hangs


@pytest.mark.slow  # five real processes, one per entry point
def test_the_property_holds_in_real_processes(tmp_path):
    """The in-process runs above stand for the user's shell: the same for one case of each entry point."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    env.pop("HYDRA_FULL_ERROR", None)
    (tmp_path / "empty").mkdir()
    for name in ["train/seed_negative", "eval/device_foo", "plan/unknown_experiment", "report/no_folder"]:
        script, argv, _ = CASES[name]
        before = tree(tmp_path)
        p = subprocess.run(
            [sys.executable, str(ROOT / script), *_args(argv, tmp_path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, p.stderr[-3000:])
        assert tree(tmp_path) == before, name
    grid = ["scripts/study/run_grid.py", "nosuch_experiment", "algo=grpo", "--sweep-dir", str(tmp_path / "sweep")]
    p = subprocess.run([sys.executable, *grid], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # three real eval.py processes
@pytest.mark.parametrize("name", ["env_interpolation", "alias_bomb", "template_loop"])
def test_eval_py_on_a_hostile_export_ends_in_one_line_having_read_no_variable(tmp_path, name):
    """The user's shell: before, the first wrote the evaluator's variable into eval.log, results.json and the samples
    (exit 0), the other two ran past 150 s, the second printing nothing. Now each ends in one line (measured 3-11 s
    on the 2 shared cores, 20-24 s under a load average of 10-13); the cases above time each in-process run under
    30 s, and the limit here is a hang's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    env[hostile.SECRET_VAR] = hostile.SECRET
    env.pop("HYDRA_FULL_ERROR", None)
    export = hostile.EXPORTS[name][0](tmp_path / "export")
    before = tree(tmp_path)
    p = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"checkpoint={export}", *EVAL, f"hydra.run.dir={tmp_path / 'out'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and hostile.EXPORTS[name][1] in lines[0], p.stderr[-3000:]
    assert tree(tmp_path) == before
    written = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert not [f for f in written if hostile.SECRET.encode() in f.read_bytes()] and hostile.SECRET not in p.stdout


@pytest.mark.slow  # a gigabyte packed into 4.5 MB, and a real report.py
def test_report_py_on_a_gzip_bomb_is_one_line_within_2_gb_of_address_space(tmp_path):
    """Before: report.py unpacked the whole pack, decoded and split it (a 2 MB pack of 2 GB on one line took 4.3 GB
    and 39 s): within 2 GB of address space this one was a MemoryError traceback. Now a line at a time, bounded."""
    import resource

    pack = tmp_path / "runs.jsonl.gz"
    _gzip_bomb(pack, 1 << 30)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "study" / "report.py"), str(pack)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, preexec_fn=limit,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: PackError: {pack}:1: a line longer than 64 MiB: not a study pack"
    ], p.stderr[-3000:]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["runs.jsonl.gz"]  # no report folder
