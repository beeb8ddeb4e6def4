"""scripts/gpu_check.py's vLLM part: skipped (and said so) without vLLM, run for real on CPU where vLLM is installed."""

import builtins
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_vllm_check_is_skipped_and_says_so_without_vllm(monkeypatch):
    real = builtins.__import__

    def no_vllm(name, *a, **k):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    args = gpu_check.parse_args(["--dry-run"])
    out = gpu_check.check_vllm(gpu_check.TINY_ARCH, torch.device("cpu"), args)
    assert out["ok"] and "vLLM not importable" in out["skipped"]
    assert gpu_check.headline({"vllm": out})["vllm"] == "skipped"


def test_headline_pulls_the_figures():
    summary = {"learner": {"mfu": 0.41, "tokens_per_s": 9.0}, "vllm": {"tokens_per_s": 7.0, "sync_s": 0.5}}
    h = gpu_check.headline(summary)
    assert h == {"mfu": 0.41, "learner_tokens_per_s": 9.0, "hf_rollout_tokens_per_s": None,
                 "vllm_tokens_per_s": 7.0, "vllm_sync_s": 0.5, "vllm": "ran"}  # fmt: skip


@pytest.mark.slow
def test_vllm_check_runs_on_cpu(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "summary.json"
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--only", "vllm", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    v = s["vllm"]
    assert v["ok"] and v["new_tokens"] > 0 and v["sync_s"] > 0 and s["headline"]["vllm_sync_s"] == v["sync_s"]
