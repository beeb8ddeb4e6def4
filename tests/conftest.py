"""Shared fixtures. Nothing here touches the network: hub look-ups are forced offline."""

import builtins
import contextlib
import copy
import os
import random
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI explores the same examples every run (a red CI then always reproduces); locally
# hypothesis keeps searching fresh ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# `make test-fast` runs two pytest-xdist workers on 2 cores: one intra-op thread each, so they do not fight
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-math"
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_tok():
    from bapo.modeling import load_tokenizer

    return load_tokenizer(str(TINY))


@pytest.fixture()
def tiny_model():
    from bapo.modeling import load_model

    return load_model(str(TINY))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


def load_script(name: str):
    """scripts/<name>.py as the module ``bapo_<name>``. scripts/ is not a package, so the file itself is loaded (a
    tests/scripts package would shadow it); the module is registered in sys.modules, as dataclasses need."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bapo_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def assert_measure_refuses_other_folders(measure_built, empty: Path, other: Path, built_by: str):
    """A model-building script's ``measure_built`` refuses a folder it did not write, naming why: ``empty`` has no
    build_info.json, and ``other`` was built by the script ``built_by``."""
    with pytest.raises(SystemExit, match="build_info.json not found"):
        measure_built(empty)
    with pytest.raises(SystemExit, match=built_by):
        measure_built(other)


def compose(*overrides: str):
    """conf/config.yaml composed by Hydra with ``overrides``, as train.py would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run_config(*overrides: str, run_dir: str | Path = "/tmp/bapo-test-run"):
    """The typed config (``bapo.config.RunConfig``) of ``compose(*overrides)``."""
    from bapo.config import build

    return build(compose(*overrides), run_dir)


def learner_cfg(**fields):
    """The default ``learner=single`` group, typed, with ``fields`` replaced (``lr``, ``micro_batch_size``, ...)."""
    import dataclasses

    return dataclasses.replace(_default_learner(), **fields)


_LEARNER = []


def _default_learner():
    if not _LEARNER:
        _LEARNER.append(run_config("logger=none").learner)
    return _LEARNER[0]


@contextlib.contextmanager
def alarm_guard(seconds: int):
    """Raise TimeoutError once the block has run ``seconds`` (SIGALRM, main thread only), so that an endless loop or
    a blocked wait fails its test instead of hanging the suite."""

    def fail(signum, frame):
        raise TimeoutError(f"hang guard: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture()
def hang_guard():
    """Fail a test that blocks for more than 5 minutes instead of hanging the suite.
    A hang, not a slow machine: the suite runs two workers on two cores, so a test may take several times its
    idle time."""
    with alarm_guard(300):
        yield


@pytest.fixture()
def without_vllm(monkeypatch):
    """This test's interpreter as one without vLLM: importing vllm or any of its modules raises ImportError, and
    those already imported are out of sys.modules until the test ends."""
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    for mod in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, mod)


class CursorMaker:
    """The one-process part of a fake ``bapo.rollout.producer.BatchMaker``: gathering is the identity, and the state a
    checkpoint keeps is the prompt cursor. A fake adds ``make(t, version, weights)``, which moves the cursor."""

    cursor = 0

    def gather(self, item):
        return item

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]


def perturbed(model, scale=0.02, seed=1):
    """A deep copy of ``model`` with seeded Gaussian noise of std ``scale`` added to every parameter: other
    weights for an engine to load, reproducibly."""
    g = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return new
