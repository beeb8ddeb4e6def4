"""The house's shape, enforced: every import runs down the floors below, stages never import each other, and only
build.py (the composition) and loop.py (the steps) wire them."""

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "bapo"
STAGES = {"data", "engines", "reward", "learner"}


def imported_bapo_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "bapo":  # from bapo import checkpoint, rundir
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bapo."):
            mods.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            mods |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bapo.")}
    return mods


def stage_of(path: Path) -> str | None:
    rel = path.relative_to(PKG)
    name = rel.parts[0].removesuffix(".py")
    return name if name in STAGES else None


def test_stages_do_not_import_each_other():
    for path in PKG.rglob("*.py"):
        stage = stage_of(path)
        if stage is None:
            continue
        others = imported_bapo_modules(path) & (STAGES - {stage})
        assert not others, f"{path.relative_to(PKG)} imports stage(s) {sorted(others)}"


def test_the_buffer_imports_no_stage():
    assert not imported_bapo_modules(PKG / "experience" / "buffer.py") & STAGES


def test_algos_is_pure_math():
    """bapo/algos/ imports only itself and bapo/infra/checks.py (ConfigError and the checks its schema uses)."""
    for path in (PKG / "algos").rglob("*.py"):
        mods = imported_bapo_modules(path) - {"algos", "infra"}
        assert not mods, f"{path.name} imports {mods}"
        src = path.read_text()
        assert "torch.distributed" not in src and "open(" not in src, path.name


def test_checks_imports_nothing_of_bapo():
    assert not imported_bapo_modules(PKG / "infra" / "checks.py")


def test_no_eval_of_model_output():
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"eval", "exec"}, f"{path.name}:{node.lineno}"


def imported_stage_code(path: Path) -> set[str]:
    """The stages whose code ``path`` imports; a stage's config schema (``bapo.<stage>.config``, a ``...Config``
    class) is not its code: bapo/config.py gathers every schema without wiring a stage."""
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bapo."):
            schema = node.module.endswith(".config") or all(a.name.endswith("Config") for a in node.names)
            mods |= set() if schema else {node.module.split(".")[1]}
        elif isinstance(node, ast.Import):
            mods |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bapo.")}
    return mods & STAGES


def test_build_and_loop_are_the_only_wiring():
    wiring = {p.name for p in PKG.rglob("*.py") if len(imported_stage_code(p)) >= 3}
    assert wiring == {"build.py", "loop.py"}, wiring


# The floors of bapo/, lowest first: a module may import its own folder and the floors strictly below its own, so no
# import runs back up and no two folders (or top-level modules) import each other. A new folder or top-level
# module is placed here, where its concept lives.
FLOORS = [
    {"infra"},  # checks, paths, dist, seeding, the checkpoint folder, tracking
    {"samples", "algos", "reward", "monitor"},
    {"data", "checkpoint"},
    {"modeling"},
    {"engines", "learner", "experience"},  # tokens out and weights in; the update; scoring and the buffer
    {"rollout"},  # what makes batches
    {"config"},  # every group's schema, gathered
    {"plan", "eval", "rundir"},
    {"build"},  # the composition
    {"loop"},  # the steps
    {"entry"},  # the command line, the launch, sweeps, the worker process
]
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def test_every_import_runs_down_the_floors():
    units = {p.relative_to(PKG).parts[0].removesuffix(".py") for p in PKG.rglob("*.py")} - {"__init__"}
    assert units <= FLOOR.keys(), f"place {sorted(units - FLOOR.keys())} on a floor of FLOORS"
    up = []
    for path in PKG.rglob("*.py"):
        unit = path.relative_to(PKG).parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        for other in imported_bapo_modules(path) - {unit}:
            if FLOOR[other] >= FLOOR[unit]:
                up.append(f"{path.relative_to(PKG)} -> {other}")
    assert not up, f"imports that run back up or sideways: {up}"


def test_the_loop_reads_top_to_bottom():
    """The loop's bodies (`run`; `train`, the run folder and the steps; `one_step`, one step's stages) each fit on a
    screen and a half (80 lines), define no nested function, and name no flag of the behaviour policy (they ask
    ``rc.behaviour``); the loop never names the learner's placement: FSDP is a strategy inside the learner."""
    src = (PKG / "loop.py").read_text()
    tree = ast.parse(src)
    bodies = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in ("run", "train", "one_step"):
        fn = bodies[name]
        assert fn.end_lineno - fn.lineno + 1 <= 80, (name, fn.end_lineno - fn.lineno + 1)
        nested = [n for n in ast.walk(fn) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)]
        assert nested == [fn], name
    assert "fsdp" not in src.lower()
    for flag in ("old_logp ==", "partial_budget is", "logp_check_share"):
        assert flag not in src, flag


def test_nothing_reaches_into_the_producer_or_the_mailbox():
    """The producer owns its queue, cursor and snapshots; only bapo/rollout/producer.py touches their fields."""
    for path in PKG.rglob("*.py"):
        if path.name == "producer.py":
            continue
        src = path.read_text()
        for private in ("._queue", "._snaps", "._next", "._consumed", ".mailbox."):
            assert private not in src, f"{path.relative_to(PKG)} touches {private}"


def test_one_config_system():
    """ConfigError and the check helpers are defined once, in bapo/infra/checks.py; training and evaluation use them."""
    helpers = {"ConfigError", "require", "_require", "choice", "_choice", "typed", "_typed", "variant", "_variant"}
    for path in PKG.rglob("*.py"):
        if path.name == "checks.py":
            continue
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        assert not defined & helpers, f"{path.relative_to(PKG)} defines {sorted(defined & helpers)}"


# ----------------------------------------------------------------------------- the tests' own shape

TESTS = PKG.parent / "tests"
# `from tests.x import ...`/`import tests.x` other than tests.helpers, and the bare module names pytest's rootdir
# insertion makes importable (`from conftest import`, `from test_strategy import`); in code or in a string that
# a subprocess runs
CROSS_IMPORT = re.compile(
    r"^\s*(?:from|import)\s+(?:tests\.(?!helpers\b)[\w.]+|tests\s+import|conftest\b|test_\w+\b)", re.MULTILINE
)


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers/ (issue 39): a test module, a worker script or a helper imports no
    test module and no conftest, so a test's tier is its folder alone and moving a test breaks no other."""
    found = [
        f"{path.relative_to(TESTS.parent)}:{src[: m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        for src in [path.read_text()]
        for m in CROSS_IMPORT.finditer(src)
    ]
    assert not found, "import these from tests/helpers/ instead:\n" + "\n".join(found)
