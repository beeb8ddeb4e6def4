"""The testbeds through train.py: one step logs the step-0 bands, and measure reproduces them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import train_py

ASSET = ROOT / "assets" / "tiny-explore"
LONGCOT = ROOT / "assets" / "tiny-longcot"
RAMBLE = ROOT / "assets" / "tiny-ramble"
HIGH_LR, LOW_LR = 1e-5, 1e-6  # study_v4_smollm2's two learning rates


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_explore", "tiny_longcot", "tiny_ramble"])
def test_train_py_one_step_logs_step0_bands(tmp_path, model):
    """``python train.py model=<testbed> data=mixops train.steps=1``, with 8 samples per held-out problem."""
    args = [f"model={model}", "data=mixops", "train.steps=1", "eval.n=8"]
    # one update per step: step 1's entropy is then measured on the step-0 weights' own samples, before any update
    args += [
        "learner.mini_batches_per_rollout=1",
        "eval.greedy=false",
        "logger.mode=disabled",
        f"hydra.run.dir={tmp_path}",
    ]
    # 200 problems x 8 samples take about a minute on an idle 2-core machine; the limit is a hang guard
    train_py(*args, timeout=3600)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step0 = next(r for r in rows if r["step"] == 0)
    step1 = next(r for r in rows if r["step"] == 1)
    assert 0.10 <= step0["eval/accuracy"] <= 0.25, step0
    assert step0["eval/pass@8"] >= 2 * step0["eval/accuracy"], step0
    assert step1["learner/entropy"] >= 0.3, step1  # the first update's batch: sampled by the step-0 weights
    assert Path(tmp_path / "final_metrics.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("asset", "rho_range"),
    [(ASSET, (0.45, 0.55)), (LONGCOT, (0.4, 0.5)), (RAMBLE, (0.38, 0.42))],
    ids=["explore", "longcot", "ramble"],
)
def test_measure_reproduces_the_bands_and_the_grpo_balance(asset, rho_range):
    """``--measure`` on a shipped model gives build_info.json's bands again (same seed, same samples), and what
    a GRPO update sees at step 0. tiny_explore: right and wrong responses of a problem are as long, rho ~ 1/2.
    tiny_longcot: within mixed groups wrong responses are longer, but not enough for rho to fall below BAPO's
    rho0 = 0.4; most of its length gap lies between problems (docs/study/README.md: why the search seldom engages).
    tiny_ramble: a third of the samples run to the cap on every problem alike, so the gap lies within groups
    (>= 1.4x) and rho is 0.38-0.42, the paper's (docs/testbeds.md).
    """
    cmd = [sys.executable, "scripts/build/build_tiny_explore_model.py", "--measure", str(asset)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout[proc.stdout.index("{") :])
    built = json.loads((asset / "build_info.json").read_text())["heldout_bands_T1_n8_first200"]
    assert (got["avg@8"], got["pass@8"]) == (built["avg@8"], built["pass@8"])
    assert got["entropy_per_token"] == pytest.approx(built["entropy_per_token"], rel=1e-4)
    assert got["mixed_groups"] >= 50
    assert got["mean_tokens_right_mixed"] < got["mean_tokens_wrong_mixed"] < got["mean_tokens_wrong"]
    assert rho_range[0] < got["grpo_rho"] < rho_range[1], got
    for key in built.keys() & {"truncated", "mixed_groups", "wrong_right_mixed", "grpo_rho"}:  # newer builds only
        assert got[key] == pytest.approx(built[key], rel=1e-4), key
    if asset == RAMBLE:
        assert got["wrong_right_mixed"] >= 1.4 and 0.2 <= got["truncated"] <= 0.4, got
