"""Study v5's analysis (scripts/study/study_v5_stats.py, scripts/study/study_v5.py) and its grid driver
(scripts/study/study_v5_grid.py).

The statistics are checked against hand-computed values (the arithmetic in comments) and against independent
references written here: a plain loop over sign vectors, the exact null distribution by convolution of integer
differences, and Fisher's p by counting the subsets behind each table.
"""

import itertools
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from scripts.study import pack_study, study_v5, study_v5_grid
from scripts.study.study_stats import Interval
from scripts.study.study_v5_stats import (
    HELPS,
    HURTS,
    INCONCLUSIVE,
    INERT,
    Contrast,
    fisher_exact,
    mde,
    sign_flip_p,
    verdict,
)
from tests.helpers.packs import pack_record
from tests.helpers.scripts import markdown_table

ROOT = Path(__file__).resolve().parents[3]
V5 = ROOT / "docs" / "study" / "v5"


# ------------------------------------------------------------------------------------------- sign-flip


def _loop_p(diffs):
    """The sign-flip p by a plain loop over every sign vector (exact fractions: integer differences)."""
    observed = abs(sum(diffs))
    hits = sum(
        abs(sum(s * d for s, d in zip(signs, diffs, strict=True))) >= observed
        for signs in itertools.product((1, -1), repeat=len(diffs))
    )
    return hits / 2 ** len(diffs)


def _convolution_p(units):
    """The same p from the exact null distribution of sum s_i d_i for integer d_i, built by convolution."""
    dist = Counter({0: 1})
    for d in units:
        nxt = Counter()
        for total, ways in dist.items():
            nxt[total + d] += ways
            nxt[total - d] += ways
        dist = nxt
    observed = abs(sum(units))
    return sum(w for total, w in dist.items() if abs(total) >= observed) / 2 ** len(units)


def test_sign_flip_hand_values():
    # d = (1, 2, 3): the 8 sums are +-1 +-2 +-3 = 6, 4, 2, 0, 0, -2, -4, -6; |S| >= 6 twice: p = 2/8
    assert sign_flip_p([1, 2, 3]) == 0.25
    # d = (3, -1, 1), observed 3: sums 5, 3, 3, 1, -1, -3, -3, -5; |S| >= 3 six times: p = 6/8
    assert sign_flip_p([3, -1, 1]) == 0.75
    # five equal positive differences: only all-plus and all-minus reach |S| = 5: p = 2/32
    assert sign_flip_p([0.01] * 5) == 2 / 32
    # a zero observed sum: every vector ties or exceeds it
    assert sign_flip_p([0.02, -0.02]) == 1.0
    assert sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    # ties despite rounding: the all-minus vector's float sum of 0.01 x 20 is not bit-equal to the observed one
    assert sign_flip_p([0.01] * 20) == 2 / 2**20
    assert math.isnan(sign_flip_p([])) and math.isnan(sign_flip_p([math.nan]))


def test_sign_flip_equals_a_plain_loop():
    rng = random.Random(0)
    for n in range(1, 11):
        units = [rng.randint(-30, 30) for _ in range(n)]
        assert sign_flip_p([u / 2000 for u in units]) == pytest.approx(_loop_p(units), abs=0, rel=1e-15), units


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sign_flip_at_twenty_pairs_equals_the_exact_distribution(seed):
    """n = 20 (the study's): 2^20 vectors over 16 chunks, against the convolution of integer differences."""
    rng = random.Random(seed)
    # differences of two accuracies out of 2,000 samples, centred near +0.01 with a seed-to-seed sd of about 0.012
    units = [round(rng.gauss(20, 24)) for _ in range(20)]
    assert sign_flip_p([u / 2000 for u in units]) == _convolution_p(units)


# ------------------------------------------------------------------------------------------- Fisher


def _fisher_by_subsets(a, b, c, d):
    """Fisher's p by listing every way to pick the a + c 'collapsed' runs among all runs, rows fixed."""
    rows = [0] * (a + b) + [1] * (c + d)
    counts = Counter(sum(1 for i in pick if rows[i] == 0) for pick in itertools.combinations(range(len(rows)), a + c))
    total = sum(counts.values())
    return sum(k for x, k in counts.items() if k <= counts[a]) / total


def test_fisher_hand_values():
    # margins 4, 4 / 4, 4 (n = 8): weights C(4, x) C(4, 4 - x) = 1, 16, 36, 16, 1 over C(8, 4) = 70
    assert fisher_exact(3, 1, 1, 3) == pytest.approx(34 / 70)  # x = 3 (weight 16): 1 + 16 + 16 + 1
    assert fisher_exact(4, 0, 0, 4) == pytest.approx(2 / 70)
    assert fisher_exact(2, 2, 2, 2) == 1.0
    assert fisher_exact(0, 20, 0, 20) == 1.0  # nobody collapsed
    # 5 of 20 against 0 of 20: weights C(20, x) C(20, 5 - x) / C(40, 5); x = 5 and x = 0 are the two tails
    assert fisher_exact(5, 15, 0, 20) == pytest.approx(2 * math.comb(20, 5) / math.comb(40, 5))
    with pytest.raises(ValueError):
        fisher_exact(-1, 2, 3, 4)


def test_fisher_equals_counting_subsets():
    for table in [(1, 4, 3, 2), (0, 6, 4, 2), (2, 3, 2, 3), (5, 1, 0, 6), (3, 0, 1, 4), (0, 1, 5, 3)]:
        assert fisher_exact(*table) == pytest.approx(_fisher_by_subsets(*table), rel=1e-12), table


# ------------------------------------------------------------------------------------------- MDE, verdict


def test_mde_from_printed_t_quantiles():
    # t_{0.975, 19} = 2.093 and t_{0.80, 19} = 0.861 (printed tables): (2.093 + 0.861) * 0.02 / sqrt(20) = 0.01321
    assert mde(0.02, 20, alpha=0.05) == pytest.approx(0.013212, rel=2e-3)
    # the plan's alpha 0.05 / 6: t_{1 - 0.05/12, 19} = 2.9439 (Simpson's rule on the t density, bisected), so
    # (2.9439 + 0.8610) * 0.02 / sqrt(20) = 0.017016
    assert mde(0.02, 20) == pytest.approx(0.017016, rel=1e-3)
    assert mde(0.02, 20) > mde(0.02, 20, alpha=0.05) > mde(0.02, 40, alpha=0.05)
    assert math.isnan(mde(0.02, 1))


def _c(mean, p, lo, hi):
    return Contrast(mean, p, Interval(mean, lo, hi, 20, math.nan))


def test_verdict_words_in_the_plans_order():
    assert verdict([_c(0.03, 0.01, 0.02, 0.04), _c(0.04, 0.001, 0.03, 0.05)]) == HELPS
    # one positive and significant, the other not: not HELPS; its interval crosses the margin: INCONCLUSIVE
    assert verdict([_c(0.03, 0.01, 0.02, 0.04), _c(0.01, 0.3, -0.01, 0.03)]) == INCONCLUSIVE
    assert verdict([_c(-0.03, 0.02, -0.04, -0.02), _c(0.01, 0.3, -0.01, 0.03)]) == HURTS
    assert verdict([_c(0.03, 0.01, 0.02, 0.04), _c(-0.03, 0.01, -0.04, -0.02)]) == HURTS  # either negative
    assert verdict([_c(0.001, 0.9, -0.01, 0.012), _c(-0.002, 0.8, -0.015, 0.011)]) == INERT
    # significant but inside the margin, the other equivalent too: INERT
    assert verdict([_c(0.01, 0.01, 0.005, 0.015), _c(0.0, 1.0, -0.01, 0.01)]) == INERT
    assert verdict([_c(0.0, 1.0, -0.02, 0.01), _c(0.0, 1.0, -0.01, 0.01)]) == INCONCLUSIVE  # -0.02 is not inside
    assert verdict([_c(0.01, 0.06, 0.0, 0.03), _c(0.0, 1.0, -0.01, 0.01)]) == INCONCLUSIVE


# ------------------------------------------------------------------------------------------- reading runs


def _record(arm: str, seed: int, accs: dict, *, lr=5e-4, clip=0.06, engaged=0.4, c_high=2.0, status="complete"):
    """A pack record of one study arm: eval/accuracy at the given steps, the same clip fractions every step."""
    name = {"fixed": "grpo", "onpolicy": "grpo"}.get(arm, arm)
    window = {"fixed": [0.69, 2.05], "clip_higher": [0.8, 1.28]}.get(arm, [0.8, 1.2])
    cfg = {"algo": {"name": name, "bounds": {"ratio_low": window[0], "ratio_high": window[1]}}, "seed": seed,
           "learner": {"lr": lr, "mini_batches_per_rollout": 1 if arm == "onpolicy" else 5}}  # fmt: skip

    def metrics(step: int) -> dict:
        row = {"learner/clip_frac_pos": clip, "learner/clip_frac_neg": clip, "learner/pos_tokens": 100.0,
               "learner/neg_tokens": 300.0, "learner/entropy": 0.4 - step / 500, "rollout/truncated": 0.1,
               "clip/P": 1.0, "clip/N": 1.5, "learner/ratio_max": 2.0}  # fmt: skip
        if arm == "bapo":
            row |= {"bapo/search_active": engaged, "clip/high": c_high, "clip/low": 0.7}
        return row

    return pack_record(f"algo={arm},seed={seed}", cfg, accs, metrics, status=status)


def _accs(final: float, start: float = 0.12) -> dict:
    return {0: start, 10: start + 0.02, 20: final - 0.01, 30: final, 40: final, 50: final}


def _level(tmp: Path, level: str, bapo_gain: float, **kw) -> None:
    records = []
    for seed in range(1, 21):
        base = 0.20 + 0.01 * ((seed * 7) % 5 - 2)  # seed-to-seed spread shared by the arms (paired)
        for arm, final in (
            ("grpo", base),
            ("clip_higher", base),
            ("bapo", base + bapo_gain),
            ("fixed", base + bapo_gain),
        ):
            records.append(_record(arm, seed, _accs(final), **kw))
        if seed <= 10:
            records.append(_record("onpolicy", seed, _accs(base - 0.01), **kw))
    pack_study.write_pack(f"multirun/study_v5/{level}", records, tmp / level / "runs.jsonl.gz")


def test_arms_from_the_config():
    assert study_v5.arm_of(_record("fixed", 1, {})["config"]) == "fixed"
    assert study_v5.arm_of(_record("onpolicy", 1, {})["config"]) == "onpolicy"
    for arm in ("grpo", "clip_higher", "bapo"):
        assert study_v5.arm_of(_record(arm, 1, {})["config"]) == arm
    other = _record("grpo", 1, {})["config"] | {"learner": {"lr": 5e-4, "mini_batches_per_rollout": 4}}
    assert study_v5.arm_of(other) is None


def test_clip_share_pools_tokens_over_steps_one_to_ten():
    def row(pos_frac, pos, neg_frac, neg):
        return {"learner/clip_frac_pos": pos_frac, "learner/pos_tokens": pos,
                "learner/clip_frac_neg": neg_frac, "learner/neg_tokens": neg}  # fmt: skip

    steps = {0: {}, 1: row(0.1, 10, 0.2, 30), 2: row(0.0, 20, 0.05, 20), 11: row(1.0, 99, 1.0, 99)}
    run = study_v5.Run("r", {}, steps, True, "complete")
    c, pos, neg = run.clip_share()
    # clipped: 0.1*10 + 0.2*30 + 0 + 0.05*20 = 1 + 6 + 1 = 8 of 10 + 30 + 20 + 20 = 80 tokens; step 11 is outside
    assert c == pytest.approx(0.1) and pos == pytest.approx(1 / 30) and neg == pytest.approx(7 / 50)


def test_the_level_choice_is_the_nearest_healthy_lr_on_a_log_scale():
    pilot = [(2e-4, True, 0.009), (3e-4, True, 0.021), (5e-4, True, 0.045), (7e-4, True, 0.09), (1e-3, False, 0.3)]
    health = {lr: {"healthy": ok, "c": c} for lr, ok, c in pilot}
    chosen = study_v5.choose_levels(health)
    # 6%: |ln(4.5/6)| = 0.288 < |ln(9/6)| = 0.405; 15%: 1e-3 is unhealthy, so the highest healthy one, 7e-4
    assert {k: v[0] for k, v in chosen.items()} == {"L1": 3e-4, "L2": 5e-4, "L3": 7e-4}
    assert chosen["L1"][1] == "" and "highest healthy" in chosen["L3"][1] and "outside" not in chosen["L3"][1]


def test_analysis_of_a_level_that_helps_one_that_fails_its_check_and_one_not_run(tmp_path):
    _level(tmp_path, "L2", 0.05)  # bapo = fixed window = grpo + 0.05 on every seed
    _level(tmp_path, "L3", -0.05, lr=1e-3, clip=0.01)  # clips 1%: outside [7.5%, 30%]
    text = study_v5.analysis(tmp_path)
    checks = {r["level"]: r for r in markdown_table(text, "| level | lr | grpo's clip share")}
    assert checks["L2"]["c in window"] == "yes" and checks["L2"]["search check"] == "yes"
    assert (
        checks["L3"]["c in window"] == "**no**"
        and checks["L1"]["grpo's clip share c, steps 1-10 (mean [t 95%], n)"] == "not run"
    )
    primary = {(r["level"], r["contrast"]): r for r in markdown_table(text, "| level | contrast | n |")}
    row = primary[("L2", "bapo − grpo")]
    # 20 equal differences: only the all-plus and all-minus sign vectors reach |S|: p = 2 / 2^20 = 1.9e-06; Holm over
    # six with L1's two at p = 1 and L3's two at p = 2 / 2^20 too: the four smallest tie, 6p = 1.1e-05
    assert (row["n"], row["exact sign-flip p"], row["Holm p (over 6)"]) == ("20", "1.9e-06", "1.1e-05")
    assert row["mean difference [paired-t 95%]"] == "+0.050 [+0.050, +0.050]"
    assert primary[("L1", "bapo − grpo")]["n"] == "0" and primary[("L1", "bapo − grpo")]["Holm p (over 6)"] == "—"
    verdicts = {r["level"]: r["verdict"] for r in markdown_table(text, "| level | lr | verdict |")}
    assert verdicts == {"L1": "**not run**", "L2": "**HELPS**", "L3": "**no verdict (manipulation check failed)**"}
    mechanism = {r["level"]: r for r in markdown_table(text, "| level | n | bapo − fixed window")}
    assert mechanism["L2"]["reading"] == "the window's width, not the adaptive search"
    collapse = {r["level"]: r for r in markdown_table(text, "| level | bapo collapsed |")}
    assert collapse["L2"]["bapo collapsed"] == "0 of 20" and collapse["L2"]["Fisher p, bapo vs grpo"] == "1.0000"
    harm = {r["level"]: r for r in markdown_table(text, "| level | final: grpo (5 updates)")}
    assert harm["L2"]["n"] == "10" and harm["L2"]["final: grpo (5 updates) − grpo on-policy [paired-t 95%]"].startswith(
        "+0.010"
    )


def test_analysis_is_inert_when_the_arms_are_one_run_and_a_missing_seed_unpairs(tmp_path):
    _level(tmp_path, "L1", 0.0, lr=3e-4, clip=0.02)
    sweep, records = pack_study.read_pack(tmp_path / "L1" / "runs.jsonl.gz")
    kept = [r for r in records if r["run"] != "algo=bapo,seed=20"]
    pack_study.write_pack(sweep, kept, tmp_path / "L1" / "runs.jsonl.gz")
    text = study_v5.analysis(tmp_path)
    primary = {(r["level"], r["contrast"]): r for r in markdown_table(text, "| level | contrast | n |")}
    assert primary[("L1", "bapo − clip_higher")]["n"] == "19"
    assert primary[("L1", "bapo − clip_higher")]["exact sign-flip p"] == "1.0000"  # all differences 0
    assert {r["level"]: r["verdict"] for r in markdown_table(text, "| level | lr | verdict |")}["L1"] == "**INERT**"


# ------------------------------------------------------------------------------------------- the grid driver


def test_the_driver_plans_ninety_runs_a_level_seed_major():
    jobs = study_v5_grid.planned()
    assert len(jobs) == 4 * 20 + 10 == 90
    assert [s for s, _ in jobs] == sorted(s for s, _ in jobs)
    names = {study_v5_grid.run_name(c, s) for s, c in jobs}
    assert len(names) == 90
    assert "algo.bounds.ratio_high=2.05,algo.bounds.ratio_low=0.69,algo=grpo,seed=3" in names
    assert "algo=grpo,learner.mini_batches_per_rollout=1,seed=10" in names
    assert "algo=grpo,learner.mini_batches_per_rollout=1,seed=11" not in names


def test_a_relaunch_skips_what_the_pack_holds():
    fresh = study_v5_grid.batches(set())
    assert [(len(cells), seeds[0], seeds[-1]) for cells, seeds in fresh] == [(5, 1, 10), (4, 11, 20)]
    done = {study_v5_grid.run_name(c, s) for s, c in study_v5_grid.planned() if s <= 3}
    done.add(study_v5_grid.run_name("algo=bapo", 4))
    again = study_v5_grid.batches(done)
    assert [(len(cells), seeds) for cells, seeds in again][:2] == [(4, [4]), (5, list(range(5, 11)))]
    assert "algo=bapo" not in again[0][0]
    everything = {study_v5_grid.run_name(c, s) for s, c in study_v5_grid.planned()}
    assert study_v5_grid.batches(everything) == []


def test_a_pack_keeps_finished_runs_and_never_trades_complete_for_failed():
    old = {"a": {"run": "a", "status": "complete", "v": 1}, "b": {"run": "b", "status": "failed", "v": 1}}
    folder = [{"run": "a", "status": "failed", "v": 2}, {"run": "b", "status": "complete", "v": 2},
              {"run": "c", "status": "incomplete", "v": 2}, {"run": "d", "status": "complete", "v": 2}]  # fmt: skip
    merged = study_v5_grid.merge(old, folder)
    assert [(r["run"], r["status"], r["v"]) for r in merged] == [
        ("a", "complete", 1),
        ("b", "complete", 2),
        ("d", "complete", 2),
    ]


def test_the_driver_names_runs_as_run_grid_does(tmp_path):
    import unittest.mock as mock

    from scripts.study import run_grid

    seen = []

    class Done(Exception):
        pass

    def fake_run(cmd, **kw):
        seen.append(cmd)
        raise Done

    cell = study_v5_grid.CELLS["fixed"]
    with mock.patch.object(run_grid.subprocess, "run", fake_run), pytest.raises(Done):
        run_grid.run_one("study_v5", [*cell.split(), "seed=7"], Path("/nonexistent/sweep"), tmp_path)
    run_dir = next(a for a in seen[0] if a.startswith("hydra.run.dir="))
    assert run_dir == f"hydra.run.dir='/nonexistent/sweep/{study_v5_grid.run_name(cell, 7)}'"
