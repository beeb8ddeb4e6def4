"""The off-policy toolbox in the real loop: rollout corrections, decoupled PPO (exact and log-linear, with
async admission), overlong filtering, and DAPO's dynamic sampling, whose refills resume exactly."""

import json
import math

import pytest

from bapo.loop import run
from tests.helpers.config import smoke_cfg

pytestmark = pytest.mark.slow  # end to end: real runs of the loop

FAST = ["train.steps=2", "eval.every=0", "eval.greedy=false", "data.heldout_size=4"]
ASYNC = ["train.async_rollout=true", "reward.num_workers=1", "buffer.max_staleness=2"]
TIMING = ("time/", "reward/verify_s", "rollout/tokens_per_s", "buffer/consumer_wait_s", "buffer/producer_wait_s")


def rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def finite(r):
    return {k: v for k, v in r.items() if isinstance(v, float | int) and not math.isfinite(v)}


@pytest.mark.parametrize("corr", ["tis", "mis", "geo_reject"])
def test_rollout_corrections_run_and_the_hf_engine_needs_none(tmp_path, corr):
    # The HF engine and the learner share fp32 weights and kernels: pi / mu is 1 up to float noise, so the
    # correction's weights are 1 within 1e-4, nothing is truncated and the ESS is 1.
    run(smoke_cfg(["algo=grpo", f"algo/correction={corr}", "learner.old_logp=recompute", *FAST]), tmp_path)
    for r in rows(tmp_path)[1:]:
        assert not finite(r), finite(r)
        assert abs(r["correction/weight_mean"] - 1) < 1e-4 and abs(r["correction/weight_max"] - 1) < 1e-4
        assert r["correction/cut_frac"] == 0.0 and r["correction/ess"] > 1 - 1e-6
        assert 0 <= r["correction/kl_k3"] < 1e-8


def test_a_correction_without_recompute_is_refused_naming_both_keys(tmp_path):
    with pytest.raises(Exception, match="algo.correction.*learner.old_logp=recompute"):
        run(smoke_cfg(["algo/correction=tis", "learner.old_logp=rollout", *FAST]), tmp_path)


@pytest.mark.parametrize(
    "extra",
    [
        ["algo/correction=decoupled"],
        ["algo/correction=decoupled", *ASYNC],
        ["algo/correction=decoupled", "algo.correction.proximal=loglinear", *ASYNC],
        ["algo/correction=decoupled", "learner.old_logp=recompute", *ASYNC],
        ["algo/correction=decoupled", *ASYNC, "buffer.enforce=drop"],
    ],
    ids=["exact-sync", "exact-async", "loglinear-async", "exact-async-recompute", "exact-drop"],
)
def test_decoupled_ppo_runs_with_async_admission(tmp_path, extra):
    run(smoke_cfg(["algo=bapo", *FAST, "train.steps=3", *extra]), tmp_path)
    rs = rows(tmp_path)[1:]
    for r in rs:
        assert not finite(r), finite(r)
        assert "learner/approx_kl" in r  # the proximal -> current drift
    if "algo.correction.proximal=loglinear" not in extra:
        # behaviour -> proximal drift, logged separately; the first batch is generated at the proximal version
        assert all("decoupled/kl_k3" in r and r["decoupled/kl_k3"] >= 0 for r in rs)
        assert rs[0]["decoupled/kl_k3"] < 1e-8
        if "train.async_rollout=true" in extra:
            assert max(r["buffer/staleness_max"] for r in rs) >= 1


def test_overlong_filter_runs(tmp_path):
    # 3 new tokens at most: most responses are cut, and they carry no loss
    run(smoke_cfg(["algo=grpo", "algo.overlong_filter=true", "rollout.max_new_tokens=3", *FAST]), tmp_path)
    for r in rows(tmp_path)[1:]:
        assert not finite(r) and r["rollout/truncated"] > 0


@pytest.mark.parametrize("mode", [[], ASYNC], ids=["sync", "async"])
def test_filter_groups_refills_and_resumes_exactly(tmp_path, mode):
    over = ["algo.filter_groups=true", "eval.every=1", "eval.greedy=false", "data.heldout_size=4", *mode]
    run(smoke_cfg([*over, "train.steps=3"]), tmp_path / "straight")
    run(smoke_cfg([*over, "train.steps=2"]), tmp_path / "resumed")
    run(smoke_cfg([*over, "train.steps=3", "resume=auto"]), tmp_path / "resumed")
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    untimed = [[{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rs] for rs in (a, b)]
    assert untimed[0] == untimed[1]
    for r in a[1:]:
        assert {"filter/extra_rounds", "filter/dropped_groups", "filter/topped_up_groups"} <= set(r)
        assert r["learner/updates"] == 2  # every step holds the configured number of samples
    assert sum(r["filter/dropped_groups"] for r in a[1:]) > 0  # the tiny model gives all-equal groups
