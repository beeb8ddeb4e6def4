"""Shared fixtures, and the tiers: each test gets the marker of its folder (unit, contract, e2e, golden). Nothing
here touches the network: hub look-ups are forced offline. What tests share besides fixtures is in tests/helpers/."""

import builtins
import os
import random
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

from tests.helpers.guards import alarm_guard  # noqa: E402
from tests.helpers.paths import SHARED_DATA, TINY  # noqa: E402

# CI explores the same examples every run (a red CI then always reproduces); locally
# hypothesis keeps searching fresh ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# `make test-fast` runs two pytest-xdist workers on 2 cores: one intra-op thread each, so they do not fight
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


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
