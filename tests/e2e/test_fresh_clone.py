"""A clone of the repository with nothing beside it (no ../shared/data, BAPO_DATA_DIR unset) evaluates on the
shipped sets: the user's command, run by eval.py in a temporary `git clone` of this checkout's HEAD."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow  # a clone, then eval.py's interpreter, torch and Hydra start-up

COMMAND = ["eval.py", "model=tiny", "eval=[aime24,aime25,math500]", "k=1", "eval.limit=2"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no HEAD to clone")
    dest = tmp_path_factory.mktemp("fresh") / "bapo"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True, capture_output=True, timeout=120)
    assert not (dest.parent / "shared").exists()
    return dest


def test_a_fresh_clone_evaluates_the_shipped_sets(clone, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("BAPO_DATA_DIR", "PYTHONPATH")}
    env |= {"PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"WANDB_MODE": "disabled"}
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, *COMMAND, f"hydra.run.dir={out}"], cwd=clone, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert set(report["sets"]) == {"aime24", "aime25", "math500"}
    for name, set_ in report["sets"].items():
        # the clone's own file, read by its relative path; the first two problems, over-long prompts counted
        assert report["config"]["eval"][name]["path"] == f"assets/evalsets/{name}.jsonl"
        assert set_["n_problems"] + set_["n_skipped"] == 2 and set_["n_problems"] >= 1, (name, set_)
    ids = {name: {json.loads(x)["id"] for x in (out / f"samples_{name}.jsonl").read_text().splitlines()}
           for name in report["sets"]}  # fmt: skip
    assert ids["aime24"] <= {"aime24-I-01", "aime24-I-02"} and ids["aime25"] <= {"aime25-I-01", "aime25-I-02"}
    assert ids["math500"] == {"test/precalculus/807.json", "test/intermediate_algebra/1994.json"}
