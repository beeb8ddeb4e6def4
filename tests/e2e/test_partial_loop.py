"""Partial rollouts (``rollout.partial_budget``) in the config and in the real loop."""

import json

import pytest

from bapo.config import ConfigError, check_combinations
from bapo.loop import run
from tests.helpers.config import run_config, smoke_cfg

SMOKE = ["debug=smoke", "train.steps=3", "eval.every=0", "checkpoint.every=0"]


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("budget", [0, -3])
def test_a_budget_below_one_token_is_refused_by_name(budget):
    with pytest.raises(ConfigError, match=r"^rollout\.partial_budget: must be null \(off\) or .*>= 1, got"):
        run_config("debug=smoke", f"rollout.partial_budget={budget}", "buffer.max_staleness=100")


@pytest.mark.parametrize("budget", [48, 100])
def test_a_budget_of_max_new_tokens_or_more_interrupts_nothing(budget):
    # debug=smoke: max_new_tokens 48. No response can exceed the budget, so partial rollouts stay off: no pool,
    # no segment lag in the staleness bound (reuse's 1 suffices), and the run is the plain run (slow test below).
    rc = run_config("debug=smoke", f"rollout.partial_budget={budget}", "buffer.max_staleness=1")
    assert rc.rollout.partial_budget is None and not rc.behaviour.per_token
    rc = run_config("debug=smoke", "rollout.partial_budget=47", "buffer.max_staleness=3")
    assert rc.rollout.partial_budget == rc.behaviour.partial_budget == 47 and rc.behaviour.per_token


@pytest.mark.slow
def test_a_run_whose_budget_holds_every_response_equals_the_plain_run(tmp_path):
    plain, whole = tmp_path / "plain", tmp_path / "whole"
    run(smoke_cfg(SMOKE), plain)
    run(smoke_cfg([*SMOKE, "rollout.partial_budget=48"]), whole)

    def strip(rs):  # every metric but the timings (seconds, and rates per second)
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]

    assert strip(rows(whole)) == strip(rows(plain))


def test_the_staleness_bound_counts_the_segments_a_response_may_wait_for():
    # 48 tokens in budgets of 12: up to 4 segments, so a first token is trained on up to 3 steps later; with
    # U = 2 updates a step that is 3 x 2 = 6 more than reuse's 1: buffer.max_staleness >= 7.
    over = ["debug=smoke", "rollout.partial_budget=12"]
    with pytest.raises(ConfigError, match=r"^buffer\.max_staleness: .*up to 4 segments.*must be >= 7 \(got 6\)"):
        run_config(*over, "buffer.max_staleness=6")
    assert run_config(*over, "buffer.max_staleness=7").rollout.partial_budget == 12
    # 25 tokens: ceil(48 / 25) = 2 segments, one step of lag: 1 + 2 = 3
    with pytest.raises(ConfigError, match=r"must be >= 3 \(got 2\)"):
        run_config("debug=smoke", "rollout.partial_budget=25", "buffer.max_staleness=2")


def test_combinations_partial_rollouts_cannot_serve_are_refused():
    ok = ["debug=smoke", "rollout.partial_budget=24", "buffer.max_staleness=3"]
    rc = run_config(*ok, "learner=fsdp")
    with pytest.raises(ConfigError, match=r"^rollout\.partial_budget: .*torchrun started 2 ranks"):
        check_combinations(rc, world=2)
    with pytest.raises(ConfigError, match=r"^algo\.filter_groups: "):
        run_config(*ok, "algo.filter_groups=true")
    with pytest.raises(ConfigError, match=r"^rollout\.decode: .*use rollout\.decode=lean"):
        run_config(*ok, "rollout.decode=generate")


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["train.async_rollout=true", "reward.num_workers=1"]], ids=["sync", "async"])
def test_a_run_with_a_budget_trains_on_whole_groups_within_the_token_bound(tmp_path, mode):
    k = 7
    run(smoke_cfg([*SMOKE, *mode, "rollout.partial_budget=12", f"buffer.max_staleness={k}"]), tmp_path)
    rs = rows(tmp_path)[1:]
    assert len(rs) == 3
    for r in rs:
        assert r["buffer/token_staleness_max"] <= k and r["buffer/staleness_max"] == r["buffer/token_staleness_max"]
        assert 0 <= r["buffer/token_staleness_mean"] <= r["buffer/token_staleness_max"]
        assert sum(r[f"buffer/token_staleness_hist/{s}"] for s in range(k + 1)) > 0
        assert r["rollout/segments_per_response"] >= 1 and 0 <= r["rollout/resumed_frac"] <= 1
        assert r["rollout/pool_groups"] <= 4  # 2 x prompts_per_step in the pool, the step's 4 out
    assert any(r["rollout/reprefill_tokens"] > 0 for r in rs) and any(r["rollout/resumed_frac"] > 0 for r in rs)
    assert max(r["buffer/token_staleness_max"] for r in rs) > max(r["buffer/staleness_max"] for r in rs[:1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["train.async_rollout=true", "reward.num_workers=1"]], ids=["sync", "async"])
def test_recompute_scores_every_token_with_the_weights_that_sampled_it(tmp_path, mode):
    # lr 1e-2 moves the weights a lot between versions: the engine's log-probs match the learner's recompute
    # only if each token is scored with its own version's snapshot (a copy, never the live weights).
    over = [*SMOKE, *mode, "rollout.partial_budget=12", "buffer.max_staleness=7", "learner.old_logp=recompute"]
    run(smoke_cfg([*over, "learner.lr=1e-2", "algo/correction=tis"]), tmp_path)
    rs = rows(tmp_path)[1:]
    assert max(r["buffer/token_staleness_max"] for r in rs) >= 2  # tokens of several versions were trained on
    assert all(r["rollout/logp_mismatch_max"] < 1e-4 for r in rs)
