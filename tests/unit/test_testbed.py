"""The exploration testbeds (model=tiny_explore, tiny_longcot and tiny_ramble, data=mixops): what ships, and the
step-0 bands they promise.

Bands: held-out accuracy 10-25% (avg@8 at T = 1), pass@8 at least twice avg@8, and at least
0.3 nats of entropy per response token at step 0. tiny_longcot also promises what study v3 needs: its wrong
responses are longer than its right ones (docs/study/README.md). tiny_ramble promises what study v4 needs: the
gap lies within a problem's group (wrong responses at least 1.4x as long as right ones there) and GRPO's
positive share at step 0 is 0.38-0.42, as in the paper (docs/testbeds.md).
"""

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from bapo.data.tasks import MixedSpec, is_heldout, mixed_lines, mixed_problem
from scripts.build.common import encode_batch, token_balance
from tests.helpers.config import run_config
from tests.helpers.paths import ROOT
from tests.helpers.scripts import assert_measure_refuses_other_folders

ASSET = ROOT / "assets" / "tiny-explore"
LONGCOT = ROOT / "assets" / "tiny-longcot"
RAMBLE = ROOT / "assets" / "tiny-ramble"
HIGH_LR, LOW_LR = 1e-5, 1e-6  # study_v4_smollm2's two learning rates


@pytest.mark.parametrize("asset", [ASSET, LONGCOT, RAMBLE], ids=lambda p: p.name)
def test_asset_ships_model_tokenizer_task_and_build_info(asset):
    names = {p.name for p in asset.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "build_info.json"} <= names
    assert {"train.jsonl", "heldout.jsonl"} <= names
    size = sum(p.stat().st_size for p in asset.iterdir())
    assert size <= 20 * 2**20, f"{asset} is {size / 2**20:.1f} MB, over the 20 MB limit"
    info = json.loads((asset / "build_info.json").read_text())
    assert Path(info["built_by"]).name == "build_tiny_explore_model.py"  # built at scripts/ before its move to build/
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


def test_ramble_shares_the_task_and_its_gap_lies_within_groups():
    # the same problem files; about a third of the samples run to the cap, and in the groups a GRPO update sees
    # (both right and wrong answers) wrong responses are >= 1.4x as long as right ones, so rho is about 0.4
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (RAMBLE / name).read_bytes() == (ASSET / name).read_bytes()
    info = json.loads((RAMBLE / "build_info.json").read_text())
    assert info["args"]["ramble_share"] > 0 and info["args"]["long_share"] == 0
    bands = info["heldout_bands_T1_n8_first200"]
    assert 0.2 <= bands["truncated"] <= 0.4, bands
    assert bands["wrong_right_mixed"] >= 1.4 and 0.38 <= bands["grpo_rho"] <= 0.42, bands
    assert bands["mixed_groups"] >= 50, bands
    model = OmegaConf.load(ROOT / "conf" / "model" / "tiny_ramble.yaml")  # rambles run to the cap it was built for
    assert model.name_or_path == "assets/tiny-ramble" and model.max_new_tokens == info["args"]["max_new_tokens"]


def test_smollm2_ramble_warm_start_put_the_gap_within_groups():
    # study v4 on SmolLM2: the model (540 MB) stays out of the repository; its build_info.json is committed beside
    # the study. The gap targets are met (within-group ratio, rho, the ramble's share); avg@8 missed the 0.10 floor
    # (0.079: the early stop's 48-problem probe read 0.135), as docs/testbeds.md records
    info = json.loads((ROOT / "docs" / "study" / "v4_smollm2" / "build_info.json").read_text())
    assert Path(info["built_by"]).name == "warm_start_smollm2.py"  # built at scripts/ before its move to build/
    assert info["args"]["ramble_share"] > 0 and info["args"]["commute"]
    bands = info["heldout_bands_T1_n8_first200"]
    assert 0.2 <= bands["truncated"] <= 0.4, bands
    assert bands["wrong_right_mixed"] >= 1.4 and 0.38 <= bands["grpo_rho"] <= 0.42, bands
    assert bands["entropy_per_token"] >= 0.3 and bands["pass@8"] >= 2 * bands["avg@8"], bands
    assert 0.05 <= bands["avg@8"] <= 0.25, bands
    model = OmegaConf.load(
        ROOT / "conf" / "model" / "smollm2_135m_ramble.yaml"
    )  # rambles run to the cap it was built for
    assert (
        model.name_or_path.endswith("/smollm2-135m-ramble") and model.max_new_tokens == info["args"]["max_new_tokens"]
    )


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
    for lr in (None, LOW_LR):  # study v4 on SmolLM2: the rambling warm start at the headline cell, two lrs
        rc = run_config("experiment=study_v4_smollm2", "algo=bapo", *([f"learner.lr={lr}"] if lr else []))
        assert rc.model.name_or_path.endswith("/smollm2-135m-ramble") and rc.model.answer_fallback == "none"
        assert rc.sizes.max_reuse_staleness == 4 and rc.sizes.mini_batch_size == 8 and not rc.train.async_rollout
        assert (rc.algo.agg, rc.algo.advantage, rc.algo.norm_std) == ("token-mean", "grpo", True)
        assert rc.learner.lr == (lr or HIGH_LR)
    rc = run_config("experiment=study_v3_epochs", "algo=grpo")
    assert rc.model.name_or_path == "assets/tiny-longcot" and rc.train.steps == 80 and rc.learner.lr == 5e-4
    assert not rc.train.async_rollout and (rc.learner.ppo_epochs, rc.learner.mini_batches_per_rollout) == (5, 1)
    assert rc.buffer.max_staleness == 4 and rc.train.prompts_per_step == 20  # the other cells' sample budget
    for budget in (32, 64):  # partial rollouts (Fig. 12): 1/4 and 1/2 of max_new_tokens, within k = 3
        rc = run_config("experiment=study_v3_partial", "algo=grpo", f"rollout.partial_budget={budget}")
        assert rc.rollout.partial_budget == budget and rc.model.max_new_tokens == 128 and rc.train.steps == 80
        assert not rc.train.async_rollout and rc.buffer.max_staleness == 3 and rc.learner.mini_batches_per_rollout == 1
    for mb in (1, 2, 4, 5):  # study v4: 1, 2, 4, 5 updates per rollout batch = staleness (age) 0, 1, 3, 4
        rc = run_config("experiment=study_v4", "algo=grpo", f"learner.mini_batches_per_rollout={mb}")
        assert rc.model.name_or_path == "assets/tiny-ramble" and rc.model.max_new_tokens == 56
        assert rc.sizes.max_reuse_staleness == mb - 1 and rc.sizes.mini_batch_size == 160 // mb
        assert not rc.train.async_rollout and rc.buffer.max_staleness == 4 and rc.learner.lr == 1e-4
        assert (rc.algo.agg, rc.algo.advantage, rc.algo.norm_std) == ("token-mean", "grpo", True)  # as the paper
    micro = ["algo=bapo", "algo.bounds.scope=micro_batch", "learner.micro_batch_size=4"]  # the authors' search unit
    rc = run_config("experiment=study_v4", *micro, "learner.mini_batches_per_rollout=5")
    assert rc.algo.bounds.scope == "micro_batch" and rc.learner.micro_batch_size == 4 and rc.train.steps == 50
    rc = run_config("experiment=study_smollm2", "algo=bapo")  # the warm-started SmolLM2, async k = 8
    assert rc.model.name_or_path.endswith("/smollm2-135m-mixops") and rc.model.answer_fallback == "none"
    assert rc.train.async_rollout and rc.buffer.max_staleness == 8 and rc.learner.mini_batches_per_rollout == 1


def _build_script():
    from scripts.build import build_tiny_explore_model

    return build_tiny_explore_model


def test_token_balance_hand_values():
    balance = token_balance
    # group 1 (mixed): 1 right of 10 tokens, 3 wrong of 20. Rewards 1,0,0,0: mean 1/4, unbiased std 1/2, so
    # A = +3/2 and -1/2. P = 3/2 * 10 = 15, N = 1/2 * 60 = 30, rho = 15 / 45 = 1/3.
    # group 2: all wrong (A = 0), 5 tokens each: no part in the update, and not in the mixed lengths.
    out = balance([True, False, False, False] + [False] * 4, [10, 20, 20, 20, 5, 5, 5, 5], 4)
    assert out["mixed_groups"] == 1
    assert (out["mean_tokens_right_mixed"], out["mean_tokens_wrong_mixed"]) == (10, 20)
    assert out["wrong_right_mixed"] == 2.0  # rho = 1 / (1 + 2) in a single mixed group
    assert out["grpo_rho"] == pytest.approx(1 / 3, abs=1e-6)  # float32 advantages
    # equal lengths: advantages cancel per group, rho = 1/2 exactly, whatever the accuracy
    out = balance([True, True, False, False, True, False, False, False], [7] * 8, 4)
    assert out["mixed_groups"] == 2 and out["grpo_rho"] == pytest.approx(0.5, abs=1e-6)
    out = balance([False] * 4, [3, 4, 5, 6], 4)  # no mixed group: nothing to balance
    assert out["mixed_groups"] == 0 and math.isnan(out["grpo_rho"]) and math.isnan(out["mean_tokens_right_mixed"])
    assert math.isnan(out["wrong_right_mixed"])
    with pytest.raises(ValueError, match="groups of 4"):
        balance([True] * 6, [1] * 6, 4)


def _true_line(line: str) -> bool:
    m = re.fullmatch(r"(-?\d+)([-+*])(\d+)=(-?\d+)", line)
    a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
    return c == (a + b if op == "+" else a - b if op == "-" else a * b)


def test_mixed_lines_solves_the_given_expression_by_either_strategy():
    # 12 + 8 * 7 - 20: the product, then left to right (12+56=68, 68-20=48) or apart (12 and 56 | 20: 68-20=48)
    seen = set()
    for seed in range(20):
        lines, value = mixed_lines("12 + 8 * 7 - 20", random.Random(seed))
        assert value == 48 and lines[0] == "8*7=56" and lines[-1].endswith("=48")
        seen.add(tuple(lines))
    assert seen == {("8*7=56", "12+56=68", "68-20=48")}  # both strategies write these lines here
    lines, value = mixed_lines("3 - 4 * 5 + 6 - 7", random.Random(0))
    assert value == 3 - 20 + 6 - 7 and all(_true_line(line) for line in lines)
    strategies = {tuple(mixed_lines("3 - 4 * 5 + 6 - 7", random.Random(k))[0]) for k in range(20)}
    assert strategies == {("4*5=20", "3-20=-17", "-17+6=-11", "-11-7=-18"), ("4*5=20", "3+6=9", "20+7=27", "9-27=-18")}
    rng = random.Random(1)  # and the same value as mixed_problem's own solution, on its own draws
    for _ in range(200):
        expr, _, value = mixed_problem(rng, MixedSpec())
        lines, got = mixed_lines(expr, rng)
        assert got == value and all(_true_line(line) for line in lines), (expr, lines)
    with pytest.raises(ValueError, match="not a mixops expression"):
        mixed_lines("1 / 2", rng)


def test_ramble_never_answers_and_is_cut_at_the_cap_without_an_end_token():
    build = _build_script()
    rng = random.Random(0)
    text = build.ramble("12 + 8 * 7 - 20", ["8*7=56", "12+56=68", "68-20=48"], rng, min_chars=128, commuted=True)
    lines = text.split("\n")
    assert lines[:3] == ["8*7=56", "12+56=68", "68-20=48"] and len(text) >= 128
    assert build.is_ramble(text) and all(_true_line(line) for line in lines)
    assert {line for line in lines[3:]} <= {"8*7=56", "7*8=56", "12+56=68", "56+12=68", "68-20=48"}
    pairs = [build.sft_example(rng, 0.0, False, True, 0.5, 128) for _ in range(400)]
    share = sum(build.is_ramble(sol) for _, sol in pairs) / len(pairs)
    assert 0.42 < share < 0.58  # the share asked for, drawn alike for every problem
    tok = AutoTokenizer.from_pretrained(ASSET)
    x, m = build.encode_sft(tok, pairs[:32], 64)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for row, (_, sol) in enumerate(pairs[:32]):
        tokens = x[row][m[row].bool()].tolist()  # the solution's tokens, what the warm start fits
        if build.is_ramble(sol):
            assert len(tokens) == 64 and end not in tokens
        else:
            assert tokens[-1] == end and tokens.count(end) == 1
    plain = [build.sft_example(rng) for _ in range(32)]  # no ramble: exactly the other testbeds' encoding
    for a, b in zip(build.encode_sft(tok, plain, 64), encode_batch(tok, plain, "cpu"), strict=True):
        assert torch.equal(a, b)


def test_measure_refuses_a_folder_this_script_did_not_build(tmp_path):
    # tiny-math is another task's model: measuring it on mixops problems would print meaningless bands
    tiny_math = ROOT / "assets" / "tiny-math"
    assert_measure_refuses_other_folders(_build_script().measure_built, tmp_path, tiny_math, "build_tiny_model.py")
