"""Shared fixtures. Nothing here touches the network: hub look-ups are forced offline."""

import copy
import os
import random
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


@pytest.fixture()
def hang_guard():
    """Fail a test that blocks for more than 5 minutes instead of hanging the suite (SIGALRM, main thread).
    A hang, not a slow machine: the suite runs two workers on two cores, so a test may take several times its
    idle time."""
    import signal

    def fail(signum, frame):
        raise TimeoutError("hang guard: the test blocked for more than 300 s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(300)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def perturbed(model, scale=0.02, seed=1):
    """A deep copy of ``model`` with seeded Gaussian noise of std ``scale`` added to every parameter: other
    weights for an engine to load, reproducibly."""
    g = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return new
