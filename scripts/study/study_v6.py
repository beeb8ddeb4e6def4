"""Study v6, BAPO when its target is out of reach: the plan's power table and the pre-registered analysis.

    python scripts/study/study_v6.py power docs/study/v5/L1/runs.jsonl.gz
    python scripts/study/study_v6.py analyse docs/study/v6/runs.jsonl.gz --out docs/study/v6/analysis.md

``power`` prints the minimum detectable effect of each planned contrast from study v5's level L1 (the same regime),
the table docs/study/v6/PLAN.md quotes. ``analyse`` writes the whole analysis file in the plan's order: manipulation
checks, the five primary tests with Holm, the verdicts and the corner reading, the secondaries. It regenerates byte
for byte from the pack (tests/golden/test_committed_studies.py).

Outcome of a run: its mean held-out accuracy over the evaluations after 50, 100, 150, 200 and 250 optimizer updates
(steps 10-50 of a 5-update arm, steps 50-250 of the on-policy arm: the step's ``policy/version``; step 0 is 0
updates). Everything else a run reports (clip shares, the search's reach) is over its steps, as study v5's.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts/ is read as a namespace package, as report.py does
from scripts.study.pack_study import PackError  # noqa: E402
from scripts.study.study_stats import holm, paired_t, t_interval  # noqa: E402
from scripts.study.study_v5 import DASH, Run, _ci, _f, _mean, _p, _pct, _row, cfg_get, load  # noqa: E402
from scripts.study.study_v5 import arm_of as v5_arm_of  # noqa: E402
from scripts.study.study_v5_stats import Contrast, fisher_exact, mde, sign_flip_p, verdict  # noqa: E402

ARMS = ("grpo", "bapo", "bapo_rho05", "corner", "loose_low", "onpolicy")
ARM_LABEL = {"grpo": "grpo [0.8, 1.2]", "bapo": "bapo, ρ0 = 0.4", "bapo_rho05": "bapo, ρ0 = 0.5",
             "corner": "grpo, corner [0.9, 3.0]", "loose_low": "grpo, loose low [0.69, 1.2]",
             "onpolicy": "grpo on-policy, 250 updates"}  # fmt: skip
WINDOWS = {(0.8, 1.2): "grpo", (0.9, 3.0): "corner", (0.69, 1.2): "loose_low"}
RHO0 = {0.4: "bapo", 0.5: "bapo_rho05"}
# The primary family: (treatment, reference), each read as "treatment minus reference" (PLAN.md).
PRIMARY = (("bapo", "grpo"), ("bapo_rho05", "grpo"), ("corner", "grpo"), ("loose_low", "grpo"),
           ("grpo", "onpolicy"))  # fmt: skip
ALPHA = 0.05  # Holm over the five
N_TESTS = len(PRIMARY)
MARGIN = 0.015  # INERT: the paired-t 90% interval inside (-0.015, +0.015)
EQUIVALENCE_LEVEL = 0.90
UPDATES_PER_STEP = 5  # the 5-update arms; the on-policy arm makes 1 a step
OUTCOME_UPDATES = (50, 100, 150, 200, 250)  # the evaluations the outcome averages
FINAL_UPDATES = 250
CLIP_STEPS = (1, 10)
SEARCH_STEPS = (1, 50)
ENGAGED_MIN = 0.5  # manipulation check 1: the rho0 = 0.5 arm's search engages on most updates
CLIP_WINDOW = (0.01, 0.04)  # manipulation check 3: GRPO's clip share, study v5 L1's window
PAPER_EFFECT = 0.028  # BAPO - clip-higher on AIME24 at staleness 4 with R1-Distill-Qwen-7B (62.0 - 59.2 points)


# ------------------------------------------------------------------------------------------- a run


def arm_of(cfg: dict) -> str | None:
    """The v6 arm a run's config is, or None (a run at another lr, staleness or window is no arm of this study)."""
    name = cfg_get(cfg, "algo.name")
    updates, lr = cfg_get(cfg, "learner.mini_batches_per_rollout"), cfg_get(cfg, "learner.lr")
    if lr is None or not math.isclose(float(lr), 4e-4):
        return None
    if name == "grpo" and updates == 1:
        size = (cfg_get(cfg, "train.prompts_per_step"), cfg_get(cfg, "train.steps"))
        return "onpolicy" if size == (4, 250) else None
    if updates != UPDATES_PER_STEP or cfg_get(cfg, "train.steps") != 50:
        return None
    if name == "grpo":
        window = (cfg_get(cfg, "algo.bounds.ratio_low"), cfg_get(cfg, "algo.bounds.ratio_high"))
        return WINDOWS.get(window)
    if name == "bapo":
        return RHO0.get(cfg_get(cfg, "algo.bounds.rho0"))
    return None


def updates_at(run: Run, step: int) -> int:
    """Optimizer updates made before the step's evaluation (step 0: none)."""
    return 0 if step == 0 else int(run.at("policy/version", step))


def accuracy_by_updates(run: Run) -> dict[int, float]:
    return {updates_at(run, s): a for s, a in run.accuracies().items()}


def outcome(run: Run) -> float:
    """The primary outcome: mean accuracy over the evaluations after ``OUTCOME_UPDATES`` (NaN if one is missing)."""
    acc = accuracy_by_updates(run)
    if not all(u in acc for u in OUTCOME_UPDATES):
        return math.nan
    return float(np.mean([acc[u] for u in OUTCOME_UPDATES]))


def search(run: Run) -> dict[str, float]:
    """What BAPO's search did over steps 1-50, per run: the share of updates it engaged on, and among those (each
    step's mean weighted by its engaged updates) the share that reached rho0 and how far it moved rho; the share of
    updates that ended at the path's end unmet; the tokens within the search's reach and beyond its bounds."""
    first, last = SEARCH_STEPS
    rows = [m for s, m in sorted(run.steps.items()) if first <= s <= last and "bapo/search_active" in m]
    active = [m["bapo/search_active"] for m in rows]
    engaged = [(m["bapo/search_active"], m) for m in rows if m["bapo/search_active"] > 0]
    weight = sum(a for a, _ in engaged)

    def among_engaged(key: str) -> float:
        have = [(a, m[key]) for a, m in engaged if key in m]
        w = sum(a for a, _ in have)
        return sum(a * v for a, v in have) / w if w > 0 else math.nan

    unmet = [m["bapo/search_active"] * (1 - m.get("bapo/target_reached", 1.0)) for m in rows]
    return {
        "engaged": _mean(active),
        "reached": among_engaged("bapo/target_reached") if weight > 0 else math.nan,
        "rho_moved": among_engaged("bapo/rho_moved") if weight > 0 else math.nan,
        "unmet": _mean(unmet),
        "reach": _mean([m.get("bapo/reach", math.nan) for m in rows]),
        "beyond": _mean([m.get("bapo/beyond_bounds", math.nan) for m in rows]),
        "c_low": _mean([m.get("clip/low", math.nan) for m in rows]),
        "c_high": _mean([m.get("clip/high", math.nan) for m in rows]),
    }


@dataclass
class Study:
    sweep: str
    runs: list[Run]

    def arm(self, arm: str) -> dict:
        """seed -> run of the complete runs of ``arm``."""
        return {r.seed: r for r in self.runs if r.complete and arm_of(r.cfg) == arm}

    def outcomes(self, arm: str) -> dict:
        return {seed: outcome(r) for seed, r in self.arm(arm).items()}


# ------------------------------------------------------------------------------------------- the analysis


def manipulation(study: Study) -> dict:
    """The plan's checks, read before any outcome."""
    grpo = [r.clip_share(*CLIP_STEPS)[0] for r in study.arm("grpo").values()]
    c = t_interval(grpo)
    clip_ok = math.isfinite(c.mean) and CLIP_WINDOW[0] <= c.mean <= CLIP_WINDOW[1]
    searches = {arm: [search(r) for r in study.arm(arm).values()] for arm in ("bapo", "bapo_rho05")}
    engaged05 = t_interval([s["engaged"] for s in searches["bapo_rho05"]])
    engage_ok = math.isfinite(engaged05.mean) and engaged05.mean > ENGAGED_MIN
    onpol = list(study.arm("onpolicy").values())
    stale_max = max((max(r.series("buffer/staleness_max"), default=math.nan) for r in onpol), default=math.nan)
    final = {updates_at(r, max(r.steps)) for r in onpol}
    onpol_ok = bool(onpol) and stale_max == 0 and final == {FINAL_UPDATES}
    return {"c": c, "clip_ok": clip_ok, "searches": searches, "engaged05": engaged05, "engage_ok": engage_ok,
            "onpol_stale_max": stale_max, "onpol_updates": sorted(final), "onpol_ok": onpol_ok}  # fmt: skip


def gate(treatment: str, reference: str, checks: dict) -> str | None:
    """Why a contrast carries no verdict (a failed manipulation check), or None."""
    if not checks["clip_ok"]:
        return "no verdict: GRPO's clip share is outside the L1 window"
    if "bapo_rho05" in (treatment, reference) and not checks["engage_ok"]:
        return "no verdict: the ρ0 = 0.5 arm's search did not engage on most updates"
    if "onpolicy" in (treatment, reference) and not checks["onpol_ok"]:
        return "no verdict: the on-policy arm is not at sample age 0 with 250 updates"
    return None


def primary(study: Study, checks: dict) -> list[dict]:
    rows = []
    for treat, ref in PRIMARY:
        a, b = study.outcomes(treat), study.outcomes(ref)
        seeds = sorted(s for s in set(a) & set(b) if math.isfinite(a[s]) and math.isfinite(b[s]))
        diffs = [a[s] - b[s] for s in seeds]
        sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.nan
        rows.append({"treat": treat, "ref": ref, "n": len(diffs), "ci95": paired_t(a, b),
                     "ci90": paired_t(a, b, level=EQUIVALENCE_LEVEL), "p": sign_flip_p(diffs) if diffs else math.nan,
                     "sd": sd, "mde": mde(sd, len(diffs), alpha=ALPHA / N_TESTS)})  # fmt: skip
    adjusted = holm([r["p"] if math.isfinite(r["p"]) else 1.0 for r in rows])  # a contrast with no pairs: p = 1
    for r, p in zip(rows, adjusted, strict=True):
        r["holm"] = p if r["n"] else math.nan
        no = gate(r["treat"], r["ref"], checks)
        if no is None and r["n"] < 2:
            no = "no verdict: fewer than 2 paired seeds"
        r["verdict"] = no or verdict([Contrast(r["ci95"].mean, r["holm"], r["ci90"])], alpha=ALPHA, margin=MARGIN)
    return rows


def corner_reading(rows: list[dict]) -> dict[str, str]:
    """For each BAPO arm, the plan's reading of 'is it the corner window's doing?' from the verdict words."""
    word = {r["treat"]: r["verdict"] for r in rows}
    out = {}
    for arm in ("bapo", "bapo_rho05"):
        mine, corner = word[arm], word["corner"]
        if mine not in ("HELPS", "HURTS"):
            out[arm] = "not read (this BAPO arm neither helps nor hurts)"
        elif corner == mine:
            out[arm] = f"the corner's doing: the corner window alone {mine.lower()} as well"
        elif corner == "INERT":
            out[arm] = "not the corner's doing: the corner window alone is INERT"
        else:
            out[arm] = f"unresolved: the corner window alone is {corner}"
    return out


def section_manipulation(checks: dict) -> list[str]:
    c, e = checks["c"], checks["engaged05"]
    share = f"{_pct(c.mean)} [{_pct(c.lo)}, {_pct(c.hi)}], n={c.n}" if math.isfinite(c.lo) else _pct(c.mean)
    cols = ["check", "measured", "required", "result"]
    lines = [_row(cols), _row(["---"] * len(cols))]
    lines.append(
        _row(
            [
                "1. the ρ0 = 0.5 arm's search engages, steps 1-50",
                f"{_ci(e, '{:.3f}')}, n={e.n}",
                f"mean share of updates > {ENGAGED_MIN}",
                "passes" if checks["engage_ok"] else "**fails**",
            ]
        )
    )
    lines.append(_row(["3. GRPO's clip share c, steps 1-10 (the L1 regime)", share,
                       f"in [{_pct(CLIP_WINDOW[0], 0)}, {_pct(CLIP_WINDOW[1], 0)}]",
                       "passes" if checks["clip_ok"] else "**fails**"]))  # fmt: skip
    lines.append(_row(["4. the on-policy arm: largest staleness, final update count",
                       f"{_f(checks['onpol_stale_max'], '{:.0f}')}, {checks['onpol_updates']}",
                       f"0 and [{FINAL_UPDATES}]", "passes" if checks["onpol_ok"] else "**fails**"]))  # fmt: skip
    cols = [
        "2. BAPO arm",
        "n",
        "updates engaged",
        "of those, reached ρ0",
        "ρ moved by the search (engaged)",
        "updates ending unmet",
        "mean c_low",
        "mean c_high",
        "tokens within reach",
        "tokens beyond the bounds",
    ]
    lines += ["", "Check 2, reported as it is (no pass or fail), over steps 1-50, mean [t 95%] over runs:", "",
              _row(cols), _row(["---"] * len(cols))]  # fmt: skip
    for arm, runs in checks["searches"].items():

        def ci(key, fmt="{:.3f}", runs=runs):
            return _ci(t_interval([s[key] for s in runs]), fmt)

        lines.append(_row([ARM_LABEL[arm], len(runs), ci("engaged"), ci("reached", "{:.4f}"),
                           ci("rho_moved", "{:+.5f}"), ci("unmet"), ci("c_low", "{:.3f}"), ci("c_high", "{:.3f}"),
                           ci("reach", "{:.4f}"), ci("beyond", "{:.4f}")]))  # fmt: skip
    return lines


def section_primary(rows: list[dict]) -> list[str]:
    cols = ["contrast", "n", "mean difference [paired-t 95%]", "paired-t 90%", "exact sign-flip p",
            f"Holm p (over {N_TESTS})", "sd of differences", f"MDE (80% power, alpha {ALPHA}/{N_TESTS})",
            "verdict"]  # fmt: skip
    lines = [_row(cols), _row(["---"] * len(cols))]
    for r in rows:
        lines.append(_row([
            f"{ARM_LABEL[r['treat']]} − {ARM_LABEL[r['ref']]}", r["n"], _ci(r["ci95"]), _ci(r["ci90"]), _p(r["p"]),
            _p(r["holm"]), _f(r["sd"], "{:.4f}"), _f(r["mde"]), f"**{r['verdict']}**",
        ]))  # fmt: skip
    return lines


def _summary(run: Run) -> dict:
    acc = accuracy_by_updates(run)
    start, final = acc.get(0, math.nan), acc.get(FINAL_UPDATES, math.nan)
    last = max(run.steps) if run.steps else 0
    ent1, ent_end = run.at("learner/entropy", 1), run.at("learner/entropy", last)
    return {
        "step0": start, "u50": acc.get(50, math.nan), "outcome": outcome(run), "final": final,
        "peak_minus_final": max(acc.values()) - final if acc else math.nan,
        "entropy_ratio": ent_end / ent1 if ent1 else math.nan,
        "collapsed": float(final < start / 2) if math.isfinite(final) and math.isfinite(start) else math.nan,
    }  # fmt: skip


SECONDARY = {"u50": "accuracy after 50 updates", "final": "accuracy after 250 updates (final)",
             "peak_minus_final": "peak − final", "entropy_ratio": "entropy last / first step"}  # fmt: skip
SECONDARY_CONTRASTS = (("bapo", "corner"), ("bapo_rho05", "corner"), ("bapo_rho05", "bapo"), ("corner", "loose_low"))


def section_secondary(study: Study) -> list[str]:
    cols = [
        "arm",
        "n",
        "step 0",
        "after 50 updates",
        "mean over 50-250 updates (the outcome)",
        "final",
        "peak − final",
        "entropy last / first",
        "clip share c, steps 1-10",
        "collapsed (final < ½ step 0)",
    ]
    out = ["### Arms (mean [Student-t 95%] over seeds)", "", _row(cols), _row(["---"] * len(cols))]
    summaries = {arm: {seed: _summary(r) for seed, r in study.arm(arm).items()} for arm in ARMS}
    for arm in ARMS:
        s = summaries[arm]
        if not s:
            continue

        def ci(key, fmt="{:.3f}", s=s):
            return _ci(t_interval([v[key] for v in s.values()]), fmt)

        c = _mean(r.clip_share(*CLIP_STEPS)[0] for r in study.arm(arm).values()) if arm != "onpolicy" else math.nan
        collapsed = sum(v["collapsed"] == 1 for v in s.values())
        out.append(_row([ARM_LABEL[arm], len(s), ci("step0"), ci("u50"), ci("outcome"), ci("final"),
                         ci("peak_minus_final"), ci("entropy_ratio", "{:.2f}"), _pct(c),
                         f"{collapsed} of {len(s)}"]))  # fmt: skip
    cols = ["contrast", "the outcome (paired-t 95%)", *SECONDARY.values()]
    out += ["", "### Paired contrasts (paired-t 95%, n pairs; the primary five's secondaries, then four more)", "",
            _row(cols), _row(["---"] * len(cols))]  # fmt: skip
    for treat, ref in (*PRIMARY, *SECONDARY_CONTRASTS):
        a, b = summaries[treat], summaries[ref]
        if not a or not b:
            continue
        cells = []
        for key in ("outcome", *SECONDARY):
            stat = paired_t({k: v[key] for k, v in a.items()}, {k: v[key] for k, v in b.items()})
            cells.append(f"{_ci(stat)}, n={stat.n}")
        out.append(_row([f"{ARM_LABEL[treat]} − {ARM_LABEL[ref]}", *cells]))
    cols = ["arm", "collapsed", "Fisher p against grpo"]
    out += ["", "### Collapse incidence (final < ½ of step 0; Fisher exact, two-sided)", "", _row(cols),
            _row(["---"] * len(cols))]  # fmt: skip
    counts = {arm: (sum(v["collapsed"] == 1 for v in s.values()), len(s)) for arm, s in summaries.items() if s}
    for arm, (k, n) in counts.items():
        p = DASH
        if arm != "grpo" and "grpo" in counts:
            g, m = counts["grpo"]
            p = _p(fisher_exact(k, n - k, g, m - g))
        out.append(_row([ARM_LABEL[arm], f"{k} of {n}", p]))
    cols = ["arm", "n", "c", "clipped A>0", "clipped A<0", "pooled ρ", "largest ratio (mean of runs)", "c_low",
            "c_high"]  # fmt: skip
    out += ["", "### Clipping by arm, steps 1-10 (means over runs)", "", _row(cols), _row(["---"] * len(cols))]
    for arm in ARMS:
        runs = list(study.arm(arm).values())
        if not runs or arm == "onpolicy":
            continue
        shares = [r.clip_share(*CLIP_STEPS) for r in runs]
        out.append(_row([
            ARM_LABEL[arm], len(runs), *[_pct(_mean(s[i] for s in shares)) for i in range(3)],
            _f(_mean(r.pooled_rho(*CLIP_STEPS) for r in runs)),
            _f(_mean(max(r.series("learner/ratio_max", *CLIP_STEPS), default=math.nan) for r in runs), "{:.2f}"),
            _f(_mean(_mean(r.series("clip/low", *CLIP_STEPS)) for r in runs), "{:.2f}"),
            _f(_mean(_mean(r.series("clip/high", *CLIP_STEPS)) for r in runs), "{:.2f}"),
        ]))  # fmt: skip
    return out


def analysis(pack: Path) -> str:
    sweep, runs = load(pack)
    study = Study(sweep, runs)
    checks = manipulation(study)
    rows = primary(study, checks)
    reading = corner_reading(rows)
    bad = [r for r in runs if not r.complete]
    counts = ", ".join(f"{arm} {len(study.arm(arm))}" for arm in ARMS)
    lines = [
        "# Study v6: the pre-registered analysis",
        "",
        "Made from the pack alone by `python scripts/study/study_v6.py analyse docs/study/v6/runs.jsonl.gz --out "
        "docs/study/v6/analysis.md`, in the order the plan ([PLAN.md](PLAN.md), committed before the grid's first "
        "run) fixes. Accuracy is held-out `eval/accuracy` (500 problems x 4 samples at T = 1); the outcome is a "
        "run's mean over the evaluations after 50, 100, 150, 200 and 250 optimizer updates; differences are paired "
        "by seed.",
        "",
        f"- `runs.jsonl.gz` (sweep `{sweep}`): {len(runs)} runs, {len(runs) - len(bad)} complete; complete per arm: "
        f"{counts}",
        *[f"  - not complete: `{r.name}` ({r.status})" for r in bad],
        *[f"  - not a study arm: `{r.name}`" for r in runs if arm_of(r.cfg) is None],
        "",
        "## 1. Manipulation checks (reported before any outcome)",
        "",
        "Checks 1, 3 and 4 gate the contrasts that need them (a failed one: that contrast is reported with no "
        "verdict); check 2 is reported as it is.",
        "",
        *section_manipulation(checks),
        "",
        "## 2. Primary: mean held-out accuracy over 50-250 updates",
        "",
        f"Exact two-sided sign-flip permutation p (all 2^n sign vectors), Holm over the {N_TESTS} tests at alpha "
        f"{ALPHA}; paired-t intervals beside them. Verdict of each contrast's first arm against its second: HELPS "
        f"(positive, Holm p < {ALPHA}), HURTS (negative, Holm p < {ALPHA}), INERT (90% interval inside "
        f"±{MARGIN}), INCONCLUSIVE otherwise. MDE: the difference a two-sided test at alpha {ALPHA}/{N_TESTS} "
        "detects with 80% power at this n and this spread.",
        "",
        *section_primary(rows),
        "",
        "## 3. Is it the corner window's doing? (the plan's reading of the verdicts)",
        "",
        *[f"- {ARM_LABEL[arm]}: {text}" for arm, text in reading.items()],
        "",
        "## 4. Secondary, descriptive (no claim)",
        "",
        *section_secondary(study),
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the plan's power


def power_table(v5_l1: Path) -> str:
    """Each planned contrast's MDE at n = 20 from study v5 L1's spread of the same outcome (the closest arms)."""
    _, runs = load(v5_l1)
    by: dict[str, dict] = {}
    for r in runs:
        if r.complete and v5_arm_of(r.cfg) is not None:
            acc = r.accuracies()
            by.setdefault(v5_arm_of(r.cfg), {})[r.seed] = _mean(acc.get(s, math.nan) for s in (10, 20, 30, 40, 50))
    pairs = [
        ("bapo − grpo (v5)", "bapo", "grpo", "bapo − grpo, bapo(ρ0 0.5) − grpo"),
        ("clip_higher − grpo (v5)", "clip_higher", "grpo", "a fixed window − grpo, the nearest"),
        ("fixed [0.69, 2.05] − grpo (v5)", "fixed", "grpo", "corner − grpo, loose low − grpo (wide windows)"),
    ]
    lines = [_row(["v5 L1 contrast", "n", "sd of paired differences", "MDE at n = 20, alpha 0.05/5, 80% power",
                   "power at the paper's +0.028", "stands in for"]), _row(["---"] * 6)]  # fmt: skip
    for label, a, b, use in pairs:
        seeds = sorted(set(by[a]) & set(by[b]))
        sd = float(np.std([by[a][s] - by[b][s] for s in seeds], ddof=1))
        lines.append(_row([label, len(seeds), f"{sd:.4f}", f"{mde(sd, 20, alpha=ALPHA / N_TESTS):.4f}",
                           _power(PAPER_EFFECT, sd, 20), use]))  # fmt: skip
    return "\n".join(lines)


def _power(effect: float, sd: float, n: int) -> str:
    """Power of the paired test at alpha 0.05/5 for ``effect`` (normal approximation of the t test's)."""
    from statistics import NormalDist

    z = NormalDist()
    crit = z.inv_cdf(1 - ALPHA / N_TESTS / 2)
    return f"{z.cdf(effect / (sd / math.sqrt(n)) - crit):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("power", help="the plan's MDE table from study v5 L1's pack")
    p.add_argument("pack", type=Path)
    a = sub.add_parser("analyse", help="the pre-registered analysis from the v6 pack")
    a.add_argument("pack", type=Path)
    a.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if not args.pack.is_file():
            raise FileNotFoundError(f"no pack {args.pack}")
        if args.command == "power":
            print(power_table(args.pack))
            return 0
        args.out.write_text(analysis(args.pack))
    except (PackError, FileNotFoundError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
