"""scripts/study/study_v5_audit.py: study v5's verdicts held to its packs.

Hand-built packs whose counts are worked out in the comments: the search's engaged and reached updates from
per-step means, ρ moved over the engaged updates only, the floor, the detectable effect and the wide window's cost.
"""

import math

import pytest

from scripts.study import pack_study, study_v5_audit
from scripts.study.study_v5 import Run
from scripts.study.study_v5_stats import mde
from tests.helpers.packs import pack_record
from tests.helpers.scripts import markdown_table


def _record(arm: str, seed: int, accs: dict, search: dict | None = None) -> dict:
    """51 steps of 5 updates (on-policy: 1); ``search`` maps a step to (search_active, target_met, rho_before,
    rho_after)."""
    name = {"fixed": "grpo", "onpolicy": "grpo"}.get(arm, arm)
    window = {"fixed": [0.69, 2.05], "clip_higher": [0.8, 1.28]}.get(arm, [0.8, 1.2])
    cfg = {"algo": {"name": name, "bounds": {"ratio_low": window[0], "ratio_high": window[1]}}, "seed": seed,
           "learner": {"lr": 4e-4, "mini_batches_per_rollout": 1 if arm == "onpolicy" else 5},
           "train": {"prompts_per_step": 20}, "rollout": {"n": 8}}  # fmt: skip

    def metrics(step: int) -> dict:
        active, met, before, after = (search or {}).get(step, (0.0, 1.0, 0.45, 0.45))
        row = {"learner/updates": 5.0, "bapo/search_active": active, "bapo/target_met": met,
               "bapo/rho_before": before, "clip/rho": after, "clip/low": 0.6 + 0.3 * active,
               "clip/high": 1.2 + 1.8 * active, "learner/clip_frac_pos": 0.01, "learner/clip_frac_neg": 0.03,
               "learner/pos_tokens": 100.0, "learner/neg_tokens": 300.0, "policy/version": 5.0 * step}  # fmt: skip
        if arm == "onpolicy":
            row |= {"learner/updates": 1.0, "policy/version": float(step)}
        return row

    return pack_record(f"algo={arm},seed={seed}", cfg, accs, metrics)


# Step 1: 2 of 5 updates engaged (0.4), 3 met (0.6): both engaged ones unmet; rho moved 5 x (0.399 - 0.400) = -0.005
# over the step, -0.0025 per engaged update. Step 2: 3 engaged, 4 met: 1 unmet, so 2 of the 3 reached rho0;
# moved 5 x (0.406 - 0.400) = +0.03, +0.01 per engaged update. Every other step: none engaged (moved 0).
SEARCH = {1: (0.4, 0.6, 0.400, 0.399), 2: (0.6, 0.8, 0.400, 0.406)}


def test_search_counts_engaged_and_reached_updates_from_step_means():
    run = Run.from_record(_record("bapo", 1, {}, SEARCH))
    counts = study_v5_audit.search_counts(run)
    assert (counts["updates"], counts["engaged"], counts["unmet"]) == (250, 5, 3)  # 50 steps x 5; 2 + 3; 2 + 1
    assert counts["moved"] == pytest.approx(-0.005 + 0.03)
    assert counts["step_means"] == pytest.approx([-0.0025, 0.01])  # only steps with an engaged update
    # target_met alone would count the 245 updates that needed no search as reaching rho0: 247 of 250 "met"
    assert 250 - counts["unmet"] == 247 and counts["engaged"] - counts["unmet"] == 2


def test_power_is_the_mde_inverted():
    sd, n = 0.025, 20
    assert study_v5_audit.power(mde(sd, n), sd, n) == pytest.approx(0.80, abs=1e-9)
    # no effect: the chance of the upper tail alone, alpha / 2 = 0.05 / 6 / 2
    assert study_v5_audit.power(0.0, sd, n) == pytest.approx(0.05 / 12, rel=1e-6)
    assert study_v5_audit.power(0.01, sd, n) < study_v5_audit.power(0.02, sd, n) < study_v5_audit.power(0.03, sd, n)
    assert math.isnan(study_v5_audit.power(0.02, 0.0, n)) and math.isnan(study_v5_audit.power(0.02, sd, 1))


def test_a_runs_peak_is_its_earliest_highest_evaluation():
    def run(accs):
        return Run("r", {}, {s: {"eval/accuracy": a} for s, a in accs.items()}, True, "complete")

    assert study_v5_audit.peak_step(run({0: 0.1, 10: 0.1, 20: 0.05})) == 0  # a tie with step 0 is a peak at 0
    assert study_v5_audit.peak_step(run({0: 0.1, 10: 0.12, 20: 0.12})) == 10
    assert study_v5_audit.peak_step(run({})) is None


@pytest.fixture(scope="module")
def audit_text(tmp_path_factory):
    """Level L1 only, seeds 1-4 with base = 0.05 + 0.01 x seed: grpo ends at base, clip_higher at base + 0.004, bapo
    at base + d (d = +0.01, -0.01, +0.02, 0.00), the fixed window at base - 0.045; on-policy on seeds 1-2. Every run
    starts at 0.2, above all its later evaluations, except bapo's seed 4, which reaches 0.3 at step 10."""
    folder = tmp_path_factory.mktemp("v5")
    records = []
    for seed, d in zip((1, 2, 3, 4), (0.01, -0.01, 0.02, 0.0), strict=True):
        base = 0.05 + 0.01 * seed

        def accs(final):
            return {0: 0.2, 10: final + 0.02, 20: final + 0.01, 30: final, 40: final, 50: final}

        bapo = accs(base + d) | ({10: 0.3} if seed == 4 else {})
        records += [_record("grpo", seed, accs(base)), _record("clip_higher", seed, accs(base + 0.004)),
                    _record("bapo", seed, bapo, SEARCH), _record("fixed", seed, accs(base - 0.045))]  # fmt: skip
        if seed <= 2:
            records.append(_record("onpolicy", seed, accs(base + 0.1)))
    pack_study.write_pack("multirun/study_v5/L1", records, folder / "L1" / "runs.jsonl.gz")
    return study_v5_audit.audit(folder)


def test_the_search_table(audit_text):
    (row,) = markdown_table(audit_text, "| level | runs | updates | engaged |")
    # 4 runs x 250 updates; 4 x 5 engaged, 4 x 3 unmet: 8 of 20 reached
    assert (row["level"], row["runs"], row["updates"], row["engaged"]) == ("L1", "4", "1000", "20 (2.0%)")
    assert row["engaged that reached ρ0"] == "8 of 20 (40.00%)"
    assert row["ended unmet at the corner [0.9, 3.0]"] == "12 of 20"
    assert row["ρ moved, mean over engaged updates"] == "+5.0e-03"  # 4 x 0.025 / 20
    # bounds: steps 1-2 at 0.6 + 0.3 x (0.4, 0.6), the other 48 at 0.6: mean 0.6 + 0.3 x 1.0 / 50 = 0.606;
    # the switch at the unmet share 12 / 1000: 0.6 + 0.3 x 0.012 = 0.6036
    assert row["mean [c_low, c_high]"] == "[0.606, 1.236]"
    assert row["a switch between [0.6, 1.2] and [0.9, 3.0] at the unmet share"] == "[0.604, 1.222]"


def test_the_floor_table(audit_text):
    (row,) = markdown_table(audit_text, "| level | stale runs (4 arms) |")
    # finals: grpo 0.06-0.09, clip_higher 0.064-0.094, bapo 0.07, 0.06, 0.10, 0.09, fixed 0.015-0.045
    assert row["final accuracy: lowest, highest"] == "0.0150, 0.1000" and row["its range"] == "0.0850"
    assert row["final below 0.02"] == "1 of 16"  # the fixed window's seed 1
    assert row["highest accuracy at step 0"] == "15 of 16"  # bapo's seed 4 peaks at step 10 (0.2)


def test_the_detectable_effect_table(audit_text):
    rows = {r["contrast"]: r for r in markdown_table(audit_text, "| level | contrast | n | sd of differences |")}
    # bapo - grpo = (0.01, -0.01, 0.02, 0.00): mean 0.005, sd sqrt((0.005^2 + 0.015^2 + 0.015^2 + 0.005^2) / 3)
    sd = math.sqrt((0.005**2 + 0.015**2 + 0.015**2 + 0.005**2) / 3)
    row = rows["bapo − grpo"]
    assert row["sd of differences"] == f"{sd:.4f}" and row["MDE (80% power, alpha 0.05/6)"] == f"{mde(sd, 4):.3f}"
    # grpo's mean final (0.06 + 0.07 + 0.08 + 0.09) / 4 = 0.075; 4.7% of it
    assert row["the baseline's final accuracy"] == "0.075"
    assert row["the paper's +4.7% of it"] == f"{0.075 * 0.028 / 0.592:.4f}"


def test_the_wide_window_table(audit_text):
    rows = {r["contrast"]: r for r in markdown_table(audit_text, "| level | contrast | final (step 50)")}
    assert rows["grpo − fixed [0.69, 2.05]"]["final (step 50) [paired-t 95%]"] == "+0.045 [+0.045, +0.045], n=4"
    assert rows["clip_higher − fixed [0.69, 2.05]"]["final (step 50) [paired-t 95%]"].startswith("+0.049")
    # bapo - fixed = d + 0.045 = (0.055, 0.035, 0.065, 0.045): mean 0.050
    assert rows["bapo − fixed [0.69, 2.05]"]["final (step 50) [paired-t 95%]"].startswith("+0.050 [")
    # steps 10-50: final + (0.02, 0.01, 0, 0, 0) in both arms, the fixed window's 0.045 lower throughout
    assert rows["grpo − fixed [0.69, 2.05]"]["mean accuracy, steps 10-50 [paired-t 95%]"].startswith("+0.045")


def test_the_update_count_table(audit_text):
    rows = {r["arm"]: r for r in markdown_table(audit_text, "| level | arm | runs | updates a step |")}
    assert [rows["grpo"][k] for k in ("updates a step", "samples an update", "policy version at step 50")] == [
        "5", "32", "250"]  # fmt: skip
    assert [rows["grpo on-policy (1 update)"][k] for k in ("updates a step", "samples an update")] == ["1", "160"]


def test_a_missing_folder_is_one_line_and_exit_2(tmp_path, capsys):
    assert study_v5_audit.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "a.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: FileNotFoundError: not a folder:") and err.count("\n") == 1
    assert not (tmp_path / "a.md").exists()


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        study_v5_audit.main([str(tmp_path)])  # no --out
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: UsageError: the following arguments are required: --out") and err.count("\n") == 1
