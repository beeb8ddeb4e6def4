"""The exploration testbed (model=tiny_explore data=mixops): what ships, and the step-0 bands it promises.

Bands (issue 14): held-out accuracy 10-25% (avg@8 at T = 1), pass@8 at least twice avg@8, and at least
0.3 nats of entropy per response token at step 0.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bapo.data import is_heldout
from tests.conftest import ROOT, run_config

ASSET = ROOT / "assets" / "tiny-explore"


def test_asset_ships_model_tokenizer_task_and_build_info():
    names = {p.name for p in ASSET.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "build_info.json"} <= names
    assert {"train.jsonl", "heldout.jsonl"} <= names
    size = sum(p.stat().st_size for p in ASSET.iterdir())
    assert size <= 20 * 2**20, f"assets/tiny-explore is {size / 2**20:.1f} MB, over the 20 MB limit"
    info = json.loads((ASSET / "build_info.json").read_text())
    assert info["built_by"] == "scripts/build_tiny_explore_model.py"
    bands = info["heldout_bands_T1_n8_first200"]
    assert 0.10 <= bands["avg@8"] <= 0.25 and bands["pass@8"] >= 2 * bands["avg@8"]
    assert bands["entropy_per_token"] >= 0.3


def test_shipped_splits_do_not_overlap_and_answers_are_integers():
    read = lambda name: [json.loads(line) for line in (ASSET / name).read_text().splitlines()]  # noqa: E731
    train, held = read("train.jsonl"), read("heldout.jsonl")
    assert not {r["problem"] for r in train} & {r["problem"] for r in held}
    assert all(is_heldout(r["problem"], 0.1) for r in held[:50])
    assert all(r["answer"].lstrip("-").isdigit() for r in train[:200] + held)


def test_testbed_config_composes_with_every_staleness_of_the_study():
    rc = run_config("model=tiny_explore", "data=mixops")
    assert rc.model.name_or_path == "assets/tiny-explore" and rc.data.kind == "jsonl"
    rc = run_config("experiment=study_v2", "algo=grpo", "learner.mini_batches_per_rollout=5")
    assert rc.model.name_or_path == "assets/tiny-explore"
    rc = run_config("experiment=study_v2_async", "algo=bapo")
    assert rc.train.async_rollout and rc.buffer.max_staleness == 8


@pytest.mark.slow
def test_train_py_one_step_logs_step0_bands(tmp_path):
    """``python train.py model=tiny_explore data=mixops train.steps=1``, with 8 samples per held-out problem."""
    cmd = [sys.executable, "train.py", "model=tiny_explore", "data=mixops", "train.steps=1", "eval.n=8"]
    cmd += ["eval.greedy=false", "logger.mode=disabled", f"hydra.run.dir={tmp_path}"]
    # 200 problems x 8 samples take about a minute on an idle 2-core machine; the limit is a hang guard
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step0 = next(r for r in rows if r["step"] == 0)
    step1 = next(r for r in rows if r["step"] == 1)
    assert 0.10 <= step0["eval/accuracy"] <= 0.25, step0
    assert step0["eval/pass@8"] >= 2 * step0["eval/accuracy"], step0
    assert step1["learner/entropy"] >= 0.3, step1  # the first update's batch: sampled by the step-0 weights
    assert Path(tmp_path / "final_metrics.json").is_file()
