"""Colocated vLLM under torchrun: one engine per rank (external_launcher) on 2 gloo ranks, weights streamed from
FSDP2 shards, data-parallel evaluation. Runs in the vLLM venv (`.venv-vllm/bin/python -m pytest
tests/e2e/engines`); skips where vLLM is not installed. One torchrun launch per tensor-parallel size
(``vllm_colocated_worker.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
from tests.helpers.engines import tied_copy  # noqa: E402


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def results(request, tmp_path_factory):
    model = tmp_path_factory.mktemp("tied") / "model"
    tied_copy(model)  # tied: the CPU build's lm_head repack after a streamed reload is exercised too
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (ROOT / "assets" / "tiny-math" / f).exists():
            (model / f).write_bytes((ROOT / "assets" / "tiny-math" / f).read_bytes())
    out = tmp_path_factory.mktemp("out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(HERE / "vllm_colocated_worker.py"), str(out), str(model), str(request.param)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("check", ["colocated", "stream_sync", "eval_shared"])
def test_colocated_on_two_ranks(results, check):
    for rank, res in enumerate(results):
        ok, detail = res[check]
        assert ok, f"rank {rank}: {check} failed:\n{detail}"


@pytest.mark.slow  # end to end: the whole loop under torchrun
def test_loop_with_colocated_vllm_and_fsdp(tmp_path):
    """`torchrun --nproc_per_node=2 train.py learner=fsdp rollout=vllm`: meta-device load, one engine per rank,
    streamed syncs; recompute shows the engines sample with exactly the learner's weights at every step."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    cmd += ["learner=fsdp", "rollout=vllm", "rollout.enforce_eager=true", "debug=smoke", "learner.lr=1e-3"]
    cmd += ["train.steps=3", "learner.old_logp=recompute", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["rollout/logp_mismatch_max"] < 1e-4 for r in rows[1:]), [
        r.get("rollout/logp_mismatch_max") for r in rows
    ]
    assert rows[-1]["policy/version"] == 6 and "eval/accuracy" in rows[-1]
    assert (tmp_path / "export" / "model.safetensors").is_file()
