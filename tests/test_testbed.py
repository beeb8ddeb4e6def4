"""The exploration testbeds (model=tiny_explore and model=tiny_longcot, data=mixops): what ships, and the
step-0 bands they promise.

Bands: held-out accuracy 10-25% (avg@8 at T = 1), pass@8 at least twice avg@8, and at least
0.3 nats of entropy per response token at step 0. tiny_longcot also promises what study v3 needs: its wrong
responses are longer than its right ones (docs/study/README.md).
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bapo.tasks import is_heldout
from tests.conftest import ROOT, assert_measure_refuses_other_folders, run_config

ASSET = ROOT / "assets" / "tiny-explore"
LONGCOT = ROOT / "assets" / "tiny-longcot"


@pytest.mark.parametrize("asset", [ASSET, LONGCOT], ids=lambda p: p.name)
def test_asset_ships_model_tokenizer_task_and_build_info(asset):
    names = {p.name for p in asset.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "build_info.json"} <= names
    assert {"train.jsonl", "heldout.jsonl"} <= names
    size = sum(p.stat().st_size for p in asset.iterdir())
    assert size <= 20 * 2**20, f"{asset} is {size / 2**20:.1f} MB, over the 20 MB limit"
    info = json.loads((asset / "build_info.json").read_text())
    assert info["built_by"] == "scripts/build_tiny_explore_model.py"
    bands = info["heldout_bands_T1_n8_first200"]
    assert 0.10 <= bands["avg@8"] <= 0.25 and bands["pass@8"] >= 2 * bands["avg@8"]
    assert bands["entropy_per_token"] >= 0.3


def test_longcot_shares_the_task_and_fails_long():
    # the same mixops problem files (data=mixops reads assets/tiny-explore's), and wrong responses that are
    # at least 1.4x as long as right ones over all problems. Within the groups a GRPO update sees, the gap is
    # smaller (test_longcot_measure_reproduces_the_bands_and_the_grpo_balance)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (LONGCOT / name).read_bytes() == (ASSET / name).read_bytes()
    info = json.loads((LONGCOT / "build_info.json").read_text())
    assert info["args"]["long_share"] > 0
    bands = info["heldout_bands_T1_n8_first200"]
    assert bands["mean_tokens_wrong"] >= 1.4 * bands["mean_tokens_right"], bands


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
    rc = run_config("experiment=study_v3", "algo=grpo", "learner.mini_batches_per_rollout=5")
    assert rc.model.name_or_path == "assets/tiny-longcot" and rc.model.max_new_tokens == 128
    assert not rc.train.async_rollout and rc.buffer.max_staleness == 4
    rc = run_config("experiment=study_v3_async", "algo=bapo")
    assert rc.model.name_or_path == "assets/tiny-longcot" and rc.train.steps == 80 and rc.learner.lr == 5e-4
    assert rc.train.async_rollout and rc.buffer.max_staleness == 8 and rc.learner.mini_batches_per_rollout == 1
    rc = run_config("experiment=study_v3_epochs", "algo=grpo")
    assert rc.model.name_or_path == "assets/tiny-longcot" and rc.train.steps == 80 and rc.learner.lr == 5e-4
    assert not rc.train.async_rollout and (rc.learner.ppo_epochs, rc.learner.mini_batches_per_rollout) == (5, 1)
    assert rc.buffer.max_staleness == 4 and rc.train.prompts_per_step == 20  # the other cells' sample budget
    for budget in (32, 64):  # partial rollouts (Fig. 12): 1/4 and 1/2 of max_new_tokens, within k = 3
        rc = run_config("experiment=study_v3_partial", "algo=grpo", f"rollout.partial_budget={budget}")
        assert rc.rollout.partial_budget == budget and rc.model.max_new_tokens == 128 and rc.train.steps == 80
        assert not rc.train.async_rollout and rc.buffer.max_staleness == 3 and rc.learner.mini_batches_per_rollout == 1
    rc = run_config("experiment=study_smollm2", "algo=bapo")  # the warm-started SmolLM2, async k = 8
    assert rc.model.name_or_path.endswith("/smollm2-135m-mixops") and rc.model.answer_fallback == "none"
    assert rc.train.async_rollout and rc.buffer.max_staleness == 8 and rc.learner.mini_batches_per_rollout == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_explore", "tiny_longcot"])
def test_train_py_one_step_logs_step0_bands(tmp_path, model):
    """``python train.py model=<testbed> data=mixops train.steps=1``, with 8 samples per held-out problem."""
    cmd = [sys.executable, "train.py", f"model={model}", "data=mixops", "train.steps=1", "eval.n=8"]
    # one update per step: step 1's entropy is then measured on the step-0 weights' own samples, before any update
    cmd += [
        "learner.mini_batches_per_rollout=1",
        "eval.greedy=false",
        "logger.mode=disabled",
        f"hydra.run.dir={tmp_path}",
    ]
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


def _build_script():
    spec = importlib.util.spec_from_file_location("build_explore", ROOT / "scripts" / "build_tiny_explore_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_token_balance_hand_values():
    balance = _build_script().token_balance
    # group 1 (mixed): 1 right of 10 tokens, 3 wrong of 20. Rewards 1,0,0,0: mean 1/4, unbiased std 1/2, so
    # A = +3/2 and -1/2. P = 3/2 * 10 = 15, N = 1/2 * 60 = 30, rho = 15 / 45 = 1/3.
    # group 2: all wrong (A = 0), 5 tokens each: no part in the update, and not in the mixed lengths.
    out = balance([True, False, False, False] + [False] * 4, [10, 20, 20, 20, 5, 5, 5, 5], 4)
    assert out["mixed_groups"] == 1
    assert (out["mean_tokens_right_mixed"], out["mean_tokens_wrong_mixed"]) == (10, 20)
    assert out["grpo_rho"] == pytest.approx(1 / 3, abs=1e-6)  # float32 advantages
    # equal lengths: advantages cancel per group, rho = 1/2 exactly, whatever the accuracy
    out = balance([True, True, False, False, True, False, False, False], [7] * 8, 4)
    assert out["mixed_groups"] == 2 and out["grpo_rho"] == pytest.approx(0.5, abs=1e-6)
    out = balance([False] * 4, [3, 4, 5, 6], 4)  # no mixed group: nothing to balance
    assert out["mixed_groups"] == 0 and math.isnan(out["grpo_rho"]) and math.isnan(out["mean_tokens_right_mixed"])
    with pytest.raises(ValueError, match="groups of 4"):
        balance([True] * 6, [1] * 6, 4)


def test_measure_refuses_a_folder_this_script_did_not_build(tmp_path):
    # tiny-math is another task's model: measuring it on mixops problems would print meaningless bands
    tiny_math = ROOT / "assets" / "tiny-math"
    assert_measure_refuses_other_folders(_build_script().measure_built, tmp_path, tiny_math, "build_tiny_model.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("asset", "rho_range"), [(ASSET, (0.45, 0.55)), (LONGCOT, (0.4, 0.5))], ids=["explore", "longcot"]
)
def test_measure_reproduces_the_bands_and_the_grpo_balance(asset, rho_range):
    """``--measure`` on a shipped model gives build_info.json's bands again (same seed, same samples), and what
    a GRPO update sees at step 0. tiny_explore: right and wrong responses of a problem are as long, rho ~ 1/2.
    tiny_longcot: within mixed groups wrong responses are longer, but not enough for rho to fall below BAPO's
    rho0 = 0.4; most of its length gap lies between problems (docs/study/README.md: why the search seldom engages).
    """
    cmd = [sys.executable, "scripts/build_tiny_explore_model.py", "--measure", str(asset)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout[proc.stdout.index("{") :])
    built = json.loads((asset / "build_info.json").read_text())["heldout_bands_T1_n8_first200"]
    assert (got["avg@8"], got["pass@8"]) == (built["avg@8"], built["pass@8"])
    assert got["entropy_per_token"] == pytest.approx(built["entropy_per_token"], rel=1e-4)
    assert got["mixed_groups"] >= 50
    assert got["mean_tokens_right_mixed"] < got["mean_tokens_wrong_mixed"] < got["mean_tokens_wrong"]
    assert rho_range[0] < got["grpo_rho"] < rho_range[1], got
