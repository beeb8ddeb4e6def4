"""The real loop, end to end, on the shipped tiny model."""

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bapo.loop import run
from tests.helpers.config import smoke_cfg

pytestmark = pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = [
    "step",
    "reward/mean",
    "clip/low",
    "clip/high",
    "clip/rho",
    "learner/entropy",
    "learner/grad_norm",
    "buffer/staleness_mean",
    "time/step_s",
]


@pytest.mark.parametrize("algo", ["bapo", "grpo"])
def test_smoke_run_trains_and_logs(tmp_path, algo):
    final = run(smoke_cfg([f"algo={algo}", "learner.lr=1e-2"]), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    for r in rows[1:]:
        for k in REQUIRED:
            assert k in r and r[k] is not None and math.isfinite(r[k]), (k, r.get(k))
        assert r["learner/updates"] == 2 and r["buffer/staleness_max"] == 1  # the second update reuses the batch
    assert rows[-1]["policy/version"] == 6
    if algo == "grpo":
        assert {r["clip/low"] for r in rows[1:]} == {0.8}
    # weights moved, and the export reloads through from_pretrained (safetensors)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "tiny-math")
    new = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert any(not torch.equal(a, b) for a, b in zip(base.parameters(), new.parameters(), strict=True))
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert final["policy/version"] == 6
    assert (tmp_path / "config.yaml").read_text().count("algo:") == 1


def test_a_bapo_run_logs_what_its_search_reached_and_warns_when_out_of_reach(tmp_path, caplog):
    """rho0 = 0.95 is out of reach: every update's search runs to the corner [0.9, 3.0] unmet, and the run says so
    (the step's bapo/target_reached 0, monitor/target_out_of_reach 1, one warning naming the corner)."""
    over = ["algo=bapo", "algo.bounds.rho0=0.95", "learner.lr=1e-2", "train.steps=2", "eval.every=0"]
    with caplog.at_level(logging.WARNING, logger="bapo.monitor"):
        run(smoke_cfg(over), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    rows = [r for r in rows if r["bapo/signal"] == 1.0]  # a step whose groups all tie carries nothing to search
    assert rows
    for r in rows:
        assert r["bapo/search_active"] == 1.0 and r["bapo/target_reached"] == 0.0, r
        assert (r["clip/low"], r["clip/high"]) == (pytest.approx(0.9), pytest.approx(3.0))
        assert r["bapo/rho_moved"] == pytest.approx(r["clip/rho"] - r["bapo/rho_before"])
        assert 0.0 <= r["bapo/beyond_bounds"] <= r["bapo/reach"] <= 1.0
        assert r["monitor/target_out_of_reach"] == 1.0
    said = [x.getMessage() for x in caplog.records if x.name == "bapo.monitor"]
    assert len(said) == 1 and "out of reach" in said[0] and "[0.90, 3.00]" in said[0]


def test_overlong_penalty_shapes_reward_not_accuracy(tmp_path):
    # step 1 samples with the initial weights in both runs, so only the reward differs: with
    # rollout.max_new_tokens=48 and buffer 47, a response of L >= 1 tokens gets (48 - 47 - L) / 47
    over = ["train.steps=1", "eval.every=0", "eval.greedy=false", "data.heldout_size=4"]
    base = run(smoke_cfg(over), tmp_path / "base")
    pen = run(smoke_cfg([*over, "reward.overlong_buffer=47"]), tmp_path / "pen")
    assert pen["reward/accuracy"] == base["reward/accuracy"]
    assert pen["rollout/response_len"] == base["rollout/response_len"]
    expected = base["reward/mean"] + (1 - base["rollout/response_len"]) / 47
    assert pen["reward/mean"] == pytest.approx(expected) and pen["reward/mean"] < base["reward/mean"]


def test_training_eval_runs_eval_py_sets(tmp_path):
    over = ["train.steps=2", "eval.greedy=false", "data.heldout_size=4"]
    run(smoke_cfg([*over, "eval.sets=[arith]", "eval.sets_k=2", "eval.sets_limit=3"]), tmp_path)
    rows = _rows(tmp_path)
    keys = {"eval/arith/avg@2", "eval/arith/pass@1", "eval/arith/pass@2", "eval/arith/maj@2"}
    for r in (rows[0], rows[2]):  # at the start and at the end (eval.every=2)
        assert keys <= set(r) and all(0.0 <= r[k] <= 1.0 for k in keys), r
        assert r["eval/arith/pass@1"] == pytest.approx(r["eval/arith/avg@2"])
    assert not any(k.startswith("eval/arith/") for k in rows[1])


ALGOS = sorted(p.stem for p in (ROOT / "conf" / "algo").glob("*.yaml"))
ABLATION = ["algo.bounds.contribution=gradient", "algo.bounds.weight=none", "algo.bounds.scope=micro_batch"]
FAST = ["train.steps=2", "eval.every=0", "eval.greedy=false", "data.heldout_size=4"]


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "algo,extra",
    [(a, []) for a in ALGOS] + [("bapo", ABLATION), ("grpo", ["algo.kl_coef=0.05"])],
    ids=[*ALGOS, "bapo-ablations", "grpo-kl"],
)
def test_every_algo_runs_end_to_end(tmp_path, algo, extra):
    run(smoke_cfg([f"algo={algo}", *FAST, *extra]), tmp_path)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    required = [
        "clip/low",  # every algorithm's window and positive share, in one namespace
        "clip/high",
        "clip/rho",
        "learner/entropy",
        "learner/approx_kl",
        "learner/grad_norm",
        "learner/pos_token_frac",
        "learner/clip_frac_high",
        "learner/clip_frac_low",
        "learner/loss",
        "monitor/entropy_collapse",
        "monitor/clip_saturation",
    ]
    if algo in ("bapo", "bapo_recipe"):
        required += ["bapo/rho_before", "bapo/search_steps"]
    if algo == "eps_feedback":
        required += ["eps_feedback/eps", "eps_feedback/g", "eps_feedback/eps_next"]
    if "gae" in (tmp_path / "config.yaml").read_text():
        required += ["learner/value_loss", "learner/explained_var", "learner/value_clip_frac", "adv/value_mean"]
    if "algo.kl_coef=0.05" in extra:
        required += ["learner/kl_ref"]
    for r in rows[1:]:
        for k in required:
            assert k in r, k
        bad = {k: v for k, v in r.items() if isinstance(v, float | int | None) and not math.isfinite(v or 0.0)}
        assert not bad and None not in r.values(), bad
    if algo == "bapo_recipe":
        assert all(0.8 <= r["clip/low"] <= 0.95 and r["clip/high"] <= 2.0 for r in rows[1:])
    if algo == "clip_higher":
        assert {r["clip/high"] for r in rows[1:]} == {1.28}


def test_eps_feedback_eps_evolves_by_its_rule(tmp_path):
    # One update per step, so each row's eps_feedback/eps and eps_feedback/g are that update's own.
    run(smoke_cfg(["algo=eps_feedback", "learner.mini_batches_per_rollout=1", *FAST, "train.steps=3"]), tmp_path)
    rows = _rows(tmp_path)[1:]
    assert rows[0]["eps_feedback/eps"] == pytest.approx(0.2)
    for r in rows:
        eps, g = r["eps_feedback/eps"], r["eps_feedback/g"]
        expected = min(1.1 * eps, 0.5) if g > 1 else max(0.9 * eps, 0.1) if g < 0.5 else eps
        assert r["eps_feedback/eps_next"] == pytest.approx(expected)
    for prev, nxt in zip(rows, rows[1:], strict=False):
        assert nxt["eps_feedback/eps"] == pytest.approx(prev["eps_feedback/eps_next"])


def test_same_seed_same_metrics(tmp_path):
    a = run(smoke_cfg(["train.steps=2"]), tmp_path / "a")
    b = run(smoke_cfg(["train.steps=2"]), tmp_path / "b")
    volatile = ("time/", "rollout/tokens_per_s", "reward/verify_s")
    assert {k: v for k, v in a.items() if not k.startswith(volatile)} == {
        k: v for k, v in b.items() if not k.startswith(volatile)
    }


def test_train_py_cli_fails_fast_on_bad_value(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "rollout.temperature=-1", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "rollout.temperature" in proc.stderr + proc.stdout


def test_train_py_cli_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "debug=smoke", "algo=grpo", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    assert (tmp_path / ".hydra" / "config.yaml").exists()


def test_each_bapo_ablation_reaches_the_search(tmp_path):
    """Each ablation flag must change what the search sees on the same first batch (the same samples: the
    first step samples with the initial weights), not only run without error."""
    base = ["algo=bapo", "train.steps=1", "eval.every=0", "eval.greedy=false", "data.heldout_size=4"]
    base += ["learner.micro_batch_size=3"]  # several micro-batches per update, so that the scope matters
    run(smoke_cfg(base), tmp_path / "paper")
    ref = _rows(tmp_path / "paper")[1]
    for flag in ABLATION:
        name = flag.split(".")[-1].split("=")[0]
        run(smoke_cfg([*base, flag]), tmp_path / name)
        row = _rows(tmp_path / name)[1]
        assert row["rollout/response_len"] == ref["rollout/response_len"], flag  # the same samples
        assert row["bapo/rho_before"] != ref["bapo/rho_before"], flag  # measured another way
