"""Study v6's analysis (scripts/study/study_v6.py) and its grid driver (scripts/study/study_v6_grid.py), on packs
built here with known answers: the arms from their configs, the outcome over update counts (the on-policy arm's
steps are 5x the others'), the search's mechanism figures by hand, the gates of the manipulation checks, and the
verdict words with the corner reading."""

import math
from pathlib import Path

import pytest

from scripts.study import pack_study, study_v6, study_v6_grid
from scripts.study.study_v5 import Run
from tests.helpers.packs import pack_record
from tests.helpers.scripts import markdown_table

ROOT = Path(__file__).resolve().parents[3]

CELL = {arm: cell for arm, cell in study_v6_grid.ARMS.items()}


def _cfg(arm: str, seed: int) -> dict:
    """The resolved config keys the analysis reads, as conf/experiment/study_v6.yaml composes each arm."""
    window = {"corner": [0.9, 3.0], "loose_low": [0.69, 1.2]}.get(arm, [0.8, 1.2])
    name = "bapo" if arm.startswith("bapo") else "grpo"
    onpol = arm == "onpolicy"
    return {"algo": {"name": name, "bounds": {"ratio_low": window[0], "ratio_high": window[1],
                                              "rho0": 0.5 if arm == "bapo_rho05" else 0.4}},
            "seed": seed, "learner": {"lr": 4e-4, "mini_batches_per_rollout": 1 if onpol else 5},
            "train": {"steps": 250 if onpol else 50, "prompts_per_step": 4 if onpol else 20}}  # fmt: skip


def _record(arm: str, seed: int, level: float, *, engaged=0.8, reached=0.0, clip=0.02, stale=0, status="complete"):
    """A pack record: accuracy `level` at every evaluation after step 0 (0.1 at step 0), evaluations every 50
    updates; BAPO rows with the given engagement and reach."""
    onpol = arm == "onpolicy"
    steps, per = (250, 1) if onpol else (50, 5)
    every = 50 if onpol else 10

    def metrics(step: int) -> dict:
        row = {"policy/version": float(step * per), "learner/clip_frac_pos": clip,
               "learner/clip_frac_neg": clip, "learner/pos_tokens": 100.0, "learner/neg_tokens": 300.0,
               "learner/entropy": 0.4, "clip/P": 1.0, "clip/N": 1.5, "learner/ratio_max": 2.0,
               "buffer/staleness_max": float(stale)}  # fmt: skip
        if arm.startswith("bapo"):
            row |= {"bapo/search_active": engaged, "clip/low": 0.9, "clip/high": 3.0, "bapo/reach": 0.03,
                    "bapo/beyond_bounds": 0.01}  # fmt: skip
            if engaged:
                row |= {"bapo/target_reached": reached, "bapo/rho_moved": 0.0002}
        return row

    accs = {step: 0.1 if step == 0 else level for step in range(0, steps + 1, every)}
    run = study_v6_grid.run_name(CELL[arm], seed)
    return pack_record(run, _cfg(arm, seed), accs, metrics, steps=steps, status=status)


def _pack(tmp: Path, effects: dict, **kw) -> Path:
    """20 seeds x 6 arms; arm accuracy = a seed's base (shared: paired) + the arm's effect + a small seed wobble."""
    records = []
    for seed in study_v6_grid.SEEDS:
        base = 0.09 + 0.01 * ((seed * 7) % 5 - 2)
        for arm in study_v6.ARMS:
            wobble = 0.002 * (((seed + len(arm)) * 13) % 7 - 3) / 3  # in [-0.002, 0.002], varies by seed and arm
            records.append(_record(arm, seed, base + effects.get(arm, 0.0) + wobble, **kw.get(arm, {})))
    out = tmp / "runs.jsonl.gz"
    pack_study.write_pack(study_v6_grid.SWEEP, records, out)
    return out


def test_arms_from_the_config():
    for arm in study_v6.ARMS:
        assert study_v6.arm_of(_cfg(arm, 21)) == arm
    other = _cfg("grpo", 21)
    other["learner"]["lr"] = 6e-4  # study v5's L2: not this study
    assert study_v6.arm_of(other) is None
    clip_higher = _cfg("grpo", 21)
    clip_higher["algo"]["bounds"]["ratio_high"] = 1.28
    assert study_v6.arm_of(clip_higher) is None


def test_the_outcome_is_over_update_counts():
    """A 5-update run's steps 10-50 and the on-policy run's steps 50-250 are the same five update counts."""
    stale = Run.from_record(_record("grpo", 21, 0.2))
    onpol = Run.from_record(_record("onpolicy", 21, 0.3))
    assert study_v6.accuracy_by_updates(stale) == {0: 0.1, 50: 0.2, 100: 0.2, 150: 0.2, 200: 0.2, 250: 0.2}
    assert study_v6.accuracy_by_updates(onpol) == {0: 0.1, 50: 0.3, 100: 0.3, 150: 0.3, 200: 0.3, 250: 0.3}
    assert study_v6.outcome(stale) == pytest.approx(0.2) and study_v6.outcome(onpol) == pytest.approx(0.3)
    rec = _record("grpo", 21, 0.2)
    rec["metrics"]["eval/accuracy"][30] = None  # one evaluation missing: no outcome
    assert math.isnan(study_v6.outcome(Run.from_record(rec)))


def test_the_search_figures_weight_each_step_by_its_engaged_updates():
    rec = _record("bapo", 21, 0.2, engaged=0.0)
    m = rec["metrics"]
    # step 1: 4 of 5 updates engaged, all reached; step 2: 1 of 5 engaged, none reached, rho moved 0.01
    m["bapo/search_active"][1], m["bapo/target_reached"] = 0.8, [None] * 51
    m["bapo/rho_moved"] = [None] * 51
    m["bapo/target_reached"][1], m["bapo/rho_moved"][1] = 1.0, 0.0
    m["bapo/search_active"][2], m["bapo/target_reached"][2], m["bapo/rho_moved"][2] = 0.2, 0.0, 0.01
    s = study_v6.search(Run.from_record(rec))
    assert s["engaged"] == pytest.approx(1.0 / 50)  # (0.8 + 0.2) / 50 steps
    assert s["reached"] == pytest.approx(0.8 / 1.0)  # (0.8 x 1 + 0.2 x 0) / (0.8 + 0.2)
    assert s["rho_moved"] == pytest.approx(0.2 * 0.01 / 1.0)
    assert s["unmet"] == pytest.approx(0.2 / 50)


def test_bapo_hurts_and_it_is_the_corners_doing(tmp_path):
    pack = _pack(tmp_path, {"bapo": -0.03, "bapo_rho05": -0.04, "corner": -0.05, "onpolicy": 0.05})
    text = study_v6.analysis(pack)
    rows = {r["contrast"]: r for r in markdown_table(text, "| contrast | n | mean difference")}
    assert len(rows) == 5 and all(r["n"] == "20" for r in rows.values())
    assert rows["bapo, ρ0 = 0.4 − grpo [0.8, 1.2]"]["verdict"] == "**HURTS**"
    assert rows["bapo, ρ0 = 0.5 − grpo [0.8, 1.2]"]["verdict"] == "**HURTS**"
    assert rows["grpo, corner [0.9, 3.0] − grpo [0.8, 1.2]"]["verdict"] == "**HURTS**"
    assert rows["grpo, loose low [0.69, 1.2] − grpo [0.8, 1.2]"]["verdict"] == "**INERT**"
    assert rows["grpo [0.8, 1.2] − grpo on-policy, 250 updates"]["verdict"] == "**HURTS**"
    assert rows["bapo, ρ0 = 0.4 − grpo [0.8, 1.2]"]["mean difference [paired-t 95%]"].startswith("-0.030")
    # every difference has one sign: the exact p is 2 / 2^20; Holm multiplies the smallest by 5
    assert rows["bapo, ρ0 = 0.4 − grpo [0.8, 1.2]"]["exact sign-flip p"] == f"{2 / 2**20:.1e}"
    assert "- bapo, ρ0 = 0.4: the corner's doing" in text
    checks = markdown_table(text, "| check |")
    assert [c["result"] for c in checks] == ["passes", "passes", "passes"]
    assert study_v6.analysis(pack) == text  # byte for byte from the pack


def test_failed_checks_take_the_verdicts_they_gate(tmp_path):
    """The rho0 = 0.5 arm that engages on 40% of updates, and an on-policy arm that is not at age 0."""
    pack = _pack(tmp_path, {"bapo": -0.03, "onpolicy": 0.05},
                 bapo_rho05={"engaged": 0.4}, onpolicy={"stale": 1})  # fmt: skip
    rows = {r["contrast"]: r for r in markdown_table(study_v6.analysis(pack), "| contrast | n | mean difference")}
    assert "no verdict: the ρ0 = 0.5 arm" in rows["bapo, ρ0 = 0.5 − grpo [0.8, 1.2]"]["verdict"]
    assert "no verdict: the on-policy arm" in rows["grpo [0.8, 1.2] − grpo on-policy, 250 updates"]["verdict"]
    assert rows["bapo, ρ0 = 0.4 − grpo [0.8, 1.2]"]["verdict"] == "**HURTS**"  # ungated
    pack = _pack(tmp_path, {}, grpo={"clip": 0.001})  # GRPO outside the L1 regime: nothing carries a verdict
    rows = markdown_table(study_v6.analysis(pack), "| contrast | n | mean difference")
    assert all("clip share is outside" in r["verdict"] for r in rows)


def test_corner_reading_from_the_words():
    def rows(**words):
        return [{"treat": t, "verdict": w} for t, w in words.items()]

    got = study_v6.corner_reading(rows(bapo="HELPS", bapo_rho05="HURTS", corner="INERT"))
    assert got["bapo"].startswith("not the corner's doing") and got["bapo_rho05"].startswith("not the corner's")
    got = study_v6.corner_reading(rows(bapo="INERT", bapo_rho05="HURTS", corner="INCONCLUSIVE"))
    assert got["bapo"].startswith("not read") and got["bapo_rho05"].startswith("unresolved")


def test_the_grid_plans_120_runs_seed_by_seed_and_skips_what_is_packed():
    plan = study_v6_grid.planned()
    assert len(plan) == 120 and [s for s, _ in plan[:6]] == [21] * 6 and plan[6][0] == 22
    assert study_v6_grid.batches(set()) == [(list(study_v6_grid.ARMS.values()), list(range(21, 41)))]
    done = {study_v6_grid.run_name(c, s) for s, c in plan if s <= 25}
    done.discard(study_v6_grid.run_name(study_v6_grid.ARMS["corner"], 23))
    got = study_v6_grid.batches(done)
    assert got == [([study_v6_grid.ARMS["corner"]], [23]), (list(study_v6_grid.ARMS.values()), list(range(26, 41)))]


def test_every_cell_composes_and_names_the_arm_it_is_meant_to_be():
    """Each driver cell, composed with the experiment as run_grid composes it, is the arm of its name."""
    from tests.helpers.config import compose

    for arm, cell in study_v6_grid.ARMS.items():
        cfg = compose("experiment=study_v6", *cell.split(), "seed=21")
        from omegaconf import OmegaConf

        assert study_v6.arm_of(OmegaConf.to_container(cfg, resolve=True)) == arm, arm
