"""A hub set that is neither reachable nor cached, as users meet it on a compute node: train.py and eval.py end in
one ``error:`` line naming the set, the split and the ways to give it locally, exit status 2, no run folder left
behind, and quickly, with the offline flags set or without them where the hub does not answer. Also what the
paper's experiment trains on, as ``--cfg job`` prints it."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow  # real processes: interpreter, torch and Hydra start-up each time

SKYWORK = "Skywork/Skywork-OR1-RL-Data"


def env_for(tmp_path: Path, *, offline: bool, endpoint: str | None = None) -> dict:
    """An environment whose datasets cache is empty; offline flags set, or the hub at ``endpoint``."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")}
    env |= {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    if offline:
        env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


def run(entry: str, *args: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, entry, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    return proc, time.monotonic() - start


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]  # no retry lines, no traceback
    return lines[0]


def test_the_papers_set_offline_and_uncached_is_one_line_naming_it(tmp_path):
    proc, _ = run(
        "train.py", "data=skywork_or1", f"hydra.run.dir={tmp_path / 'r'}", env=env_for(tmp_path, offline=True)
    )
    line = one_error_line(proc)
    assert line.startswith(f"error: DataFileError: data.path: '{SKYWORK}' is not a local file or folder, and the hub")
    assert f"{SKYWORK} (split 'math') is neither reachable nor cached here" in line
    assert "data.path=<its folder>" in line and "HF_DATASETS_CACHE=<folder>" in line and "data=jsonl" in line
    assert not (tmp_path / "r").exists()


@pytest.fixture()
def silent_hub():
    """A hub endpoint that takes connections and never answers (a node behind a firewall that drops packets)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_without_the_offline_flags_a_hub_that_does_not_answer_fails_as_fast(tmp_path, silent_hub):
    """Before: datasets asked the silent hub again and again (10 s a try, 5 retries with back-off, a line each) after
    the model had loaded; now one request of 5 s, then the cache, then the same one line."""
    env = env_for(tmp_path, offline=False, endpoint=silent_hub)
    proc, seconds = run("train.py", "data=skywork_or1", f"hydra.run.dir={tmp_path / 'r'}", env=env)
    line = one_error_line(proc)
    assert (
        f"{SKYWORK} (split 'math') is neither reachable nor cached here (no answer from {silent_hub} within 5 s" in line
    )
    assert seconds < 45, seconds  # start-up and a 5 s probe; the retries alone took over a minute
    assert not (tmp_path / "r").exists()


def test_an_eval_set_given_as_a_hub_name_offline_is_one_line_naming_it(tmp_path):
    hub = ["eval=aime24", "eval.aime24.kind=hub", "eval.aime24.path=HuggingFaceH4/aime_2024", "eval.aime24.split=train"]
    proc, _ = run("eval.py", *hub, f"hydra.run.dir={tmp_path / 'e'}", env=env_for(tmp_path, offline=True))
    line = one_error_line(proc)
    assert line.startswith("error: ConfigError: eval.aime24.path: 'HuggingFaceH4/aime_2024' is not a local file")
    assert "HuggingFaceH4/aime_2024 (split 'train') is neither reachable nor cached here" in line
    assert "eval.aime24.path=<its folder>" in line and line.endswith(
        "eval.aime24.kind=jsonl eval.aime24.path=<file.jsonl>"
    )
    assert not (tmp_path / "e").exists()


def test_the_papers_experiment_shows_the_skywork_set(tmp_path):
    proc, _ = run("train.py", "experiment=paper_7b", "--cfg", "job", env=env_for(tmp_path, offline=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = proc.stdout[proc.stdout.index("\ndata:\n") :].split("\n\n")[0]
    assert f"  path: {SKYWORK}\n" in data and "  split: math\n" in data and "  kind: hub\n" in data
    assert "  answer_key: reward_model.ground_truth\n" in data
