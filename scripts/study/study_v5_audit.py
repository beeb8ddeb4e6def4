"""Study v5's verdicts held to its packs: what BAPO's search reached, what the outcome's floor and spread let a
verdict mean, and what the fixed wide window cost each arm. docs/study/README.md quotes it.

    python scripts/study/study_v5_audit.py docs/study/v5 --out docs/study/v5/audit.md

Made from the committed packs alone, after the pre-registered analysis (analysis.md) and apart from it: nothing here
carries a verdict. A pack holds each step's metrics as means over the step's 5 updates, so:

- **Counts of updates are exact** where a metric is 0 or 1 per update: a step's engaged updates (the search moved the
  bounds) are 5 x ``bapo/search_active``, and its updates that ended short of ρ0 are 5 x (1 − ``bapo/target_met``)
  (an update that needed no search counts as met, and one that engaged either meets ρ0 or ends at its path's end,
  the corner [0.9, 3.0]). So the engaged updates that reached ρ0 are engaged − unmet, per step.
- **ρ moved** (ρ at the chosen bounds minus ρ at the base bounds [0.6, 1.2]): a step's sum over its updates is 5 x
  (``clip/rho`` − ``bapo/rho_before``), and an update whose search did not engage kept its base bounds, so the sum
  is over the engaged updates alone: its mean over them is exact. The largest single move is not in the pack; the
  largest step mean over engaged updates is a lower bound of it.
- **The bounds' reach** (the advantage-carrying tokens some pair of bounds in the search's ranges treats
  differently, ``bapo/reach`` in later runs) is not in the pack. GRPO's clipped share at [0.8, 1.2] counts its
  positive side exactly (A > 0 with r > 1.2, the lowest c_high) and the negative side's tokens below 0.8 (the reach
  counts those below 0.9, the highest c_low).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts/ is read as a namespace package, as report.py does
from scripts.study.pack_study import PackError, UsageParser  # noqa: E402
from scripts.study.study_stats import FLOOR_SHARE, paired_t, t_abs_cdf, t_quantile  # noqa: E402
from scripts.study.study_v5 import ARM_LABEL, DASH, FINAL_STEP, Level, Run, cfg_get, load_levels  # noqa: E402
from scripts.study.study_v5_stats import ALPHA, EQUIVALENCE, N_TESTS, mde  # noqa: E402

SEARCH_STEPS = (1, FINAL_STEP)  # the manipulation check's window
BASE, CORNER = (0.6, 1.2), (0.9, 3.0)  # Algorithm 1's bounds before any search step and at the end of its path
STALE = ("grpo", "clip_higher", "bapo", "fixed")  # the arms at 5 updates a batch
PAPER_GAIN = 0.028  # BAPO - clip-higher, AIME24 at staleness 4 (the paper: 62.0 against 59.2 points)
PAPER_RELATIVE = PAPER_GAIN / 0.592  # the same gain relative to clip-higher's accuracy: +4.7%
POWER_ALPHA = ALPHA / N_TESTS  # the first step of Holm over v5's six tests, as its MDE


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _f(x: float, fmt: str = "{:.3f}") -> str:
    return DASH if not math.isfinite(x) else fmt.format(x)


def _ci(stat) -> str:
    if not math.isfinite(stat.lo):
        return DASH
    return f"{stat.mean:+.3f} [{stat.lo:+.3f}, {stat.hi:+.3f}]"


# ------------------------------------------------------------------------------------------- the search


def search_counts(run: Run, first: int = SEARCH_STEPS[0], last: int = SEARCH_STEPS[1]) -> dict:
    """One bapo run's updates over steps first..last: counted (module docstring), with ρ moved summed over the
    engaged updates and each step's mean move over its engaged updates."""
    out = {"updates": 0, "engaged": 0, "unmet": 0, "moved": 0.0, "step_means": []}
    for step, m in sorted(run.steps.items()):
        keys = ("learner/updates", "bapo/search_active", "bapo/target_met", "clip/rho", "bapo/rho_before")
        if not first <= step <= last or not all(k in m for k in keys):
            continue
        n = m["learner/updates"]
        engaged, unmet = round(n * m["bapo/search_active"]), round(n * (1 - m["bapo/target_met"]))
        moved = n * (m["clip/rho"] - m["bapo/rho_before"])
        out["updates"] += round(n)
        out["engaged"] += engaged
        out["unmet"] += unmet
        out["moved"] += moved
        if engaged:
            out["step_means"].append(moved / engaged)
    return out


def _bounds(run: Run) -> tuple[float, float]:
    lows, highs = run.series("clip/low", *SEARCH_STEPS), run.series("clip/high", *SEARCH_STEPS)
    return float(np.mean(lows)) if lows else math.nan, float(np.mean(highs)) if highs else math.nan


def _spread(xs: list[float]) -> str:
    if not xs:
        return DASH
    p1, p99 = np.percentile(xs, [1, 99])
    return f"{p1:+.4f} to {p99:+.4f}; {min(xs):+.4f}, {max(xs):+.4f}"


def section_search(levels: list[Level]) -> list[str]:
    cols = ["level", "runs", "updates", "engaged", "engaged, per run", "engaged that reached ρ0",
            "ended unmet at the corner [0.9, 3.0]", "ρ moved, mean over engaged updates",
            "ρ moved, step means over engaged updates: 1st-99th percentile; lowest, highest", "mean [c_low, c_high]",
            "a switch between [0.6, 1.2] and [0.9, 3.0] at the unmet share"]  # fmt: skip
    out = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        runs = list(level.arm("bapo").values())
        if not runs:
            continue
        counts = [search_counts(r) for r in runs]
        updates, engaged = sum(c["updates"] for c in counts), sum(c["engaged"] for c in counts)
        unmet = sum(c["unmet"] for c in counts)
        per_run = [c["engaged"] / c["updates"] for c in counts if c["updates"]]
        steps = [x for c in counts for x in c["step_means"]]
        bounds = [_bounds(r) for r in runs]
        low, high = float(np.mean([b[0] for b in bounds])), float(np.mean([b[1] for b in bounds]))
        u = unmet / updates if updates else math.nan
        switch = (BASE[0] + u * (CORNER[0] - BASE[0]), BASE[1] + u * (CORNER[1] - BASE[1]))
        out.append(_row([
            level.name, len(runs), updates, f"{engaged} ({engaged / updates:.1%})" if updates else DASH,
            f"{min(per_run):.0%}-{max(per_run):.0%}" if per_run else DASH,
            f"{engaged - unmet} of {engaged} ({(engaged - unmet) / engaged:.2%})" if engaged else DASH,
            f"{unmet} of {engaged}" if engaged else DASH,
            _f(sum(c["moved"] for c in counts) / engaged, "{:+.1e}") if engaged else DASH,
            _spread(steps),
            f"[{low:.3f}, {high:.3f}]", f"[{switch[0]:.3f}, {switch[1]:.3f}]",
        ]))  # fmt: skip
    return out


def section_reach(levels: list[Level]) -> list[str]:
    cols = ["level", "arm", "n", "clipped, A > 0, steps 1-50", "clipped, A < 0, steps 1-50",
            "clipped advantage-carrying tokens, steps 1-10", "steps 1-50"]  # fmt: skip
    out = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        for arm in STALE:
            runs = list(level.arm(arm).values())
            if not runs:
                continue
            early = [r.clip_share()[0] for r in runs]
            whole = [r.clip_share(*SEARCH_STEPS) for r in runs]

            def pct(xs) -> str:
                return f"{100 * float(np.mean(xs)):.2f}%"

            out.append(_row([level.name, ARM_LABEL[arm], len(runs), pct([w[1] for w in whole]),
                             pct([w[2] for w in whole]), pct(early), pct([w[0] for w in whole])]))  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------- the outcome


def peak_step(run: Run) -> int | None:
    """The earliest step at which a run's held-out accuracy is highest (None without an evaluation)."""
    acc = run.accuracies()
    return max(acc, key=lambda s: (acc[s], -s)) if acc else None


def section_floor(levels: list[Level]) -> list[str]:
    cols = ["level", "stale runs (4 arms)", "final accuracy: lowest, highest", "its range",
            f"final below {FLOOR_SHARE}", "highest accuracy at step 0", "equivalence margin (INERT)"]  # fmt: skip
    out = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        runs = [r for arm in STALE for r in level.arm(arm).values()]
        finals = [f for f in (r.at("eval/accuracy", FINAL_STEP) for r in runs) if math.isfinite(f)]
        if not finals:
            continue
        low, high = min(finals), max(finals)
        out.append(_row([level.name, len(runs), f"{low:.4f}, {high:.4f}", f"{high - low:.4f}",
                         f"{sum(f < FLOOR_SHARE for f in finals)} of {len(finals)}",
                         f"{sum(peak_step(r) == 0 for r in runs)} of {len(runs)}",
                         f"±{EQUIVALENCE} (width {2 * EQUIVALENCE})"]))  # fmt: skip
    return out


def power(effect: float, sd: float, n: int, *, alpha: float = POWER_ALPHA) -> float:
    """The chance a two-sided paired test at ``alpha`` detects a true mean difference ``effect``, in the t
    approximation that :func:`study_v5_stats.mde` inverts: F_{n-1}(effect / (sd / sqrt(n)) - t_{1-alpha/2, n-1}),
    F the t distribution's CDF (so an effect equal to the MDE has power 0.80)."""
    if n < 2 or not (math.isfinite(sd) and sd > 0):
        return math.nan
    x = effect / (sd / math.sqrt(n)) - t_quantile(1 - alpha / 2, n - 1)
    return 0.5 + math.copysign(0.5 * t_abs_cdf(x, n - 1), x)


def section_detectable(levels: list[Level]) -> list[str]:
    cols = ["level", "contrast", "n", "sd of differences", "MDE (80% power, alpha 0.05/6)",
            f"power at the paper's +{PAPER_GAIN}", "the baseline's final accuracy",
            f"the paper's +{PAPER_RELATIVE:.1%} of it", "MDE over that"]  # fmt: skip
    out = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        bapo = level.final("bapo")
        for base in ("clip_higher", "grpo"):
            other = level.final(base)
            seeds = sorted(s for s in set(bapo) & set(other) if math.isfinite(bapo[s]) and math.isfinite(other[s]))
            if len(seeds) < 2:
                continue
            sd = float(np.std([bapo[s] - other[s] for s in seeds], ddof=1))
            m, base_acc = mde(sd, len(seeds)), float(np.mean([other[s] for s in seeds]))
            relative = PAPER_RELATIVE * base_acc
            out.append(_row([level.name, f"bapo − {base}", len(seeds), f"{sd:.4f}", f"{m:.3f}",
                             f"{power(PAPER_GAIN, sd, len(seeds)):.2f}", f"{base_acc:.3f}", f"{relative:.4f}",
                             f"{m / relative:.1f}x"]))  # fmt: skip
    return out


def _mean_10_50(run: Run) -> float:
    later = [a for s, a in run.accuracies().items() if 10 <= s <= FINAL_STEP]
    return float(np.mean(later)) if later else math.nan


def section_window(levels: list[Level]) -> list[str]:
    cols = ["level", "contrast", "final (step 50) [paired-t 95%]", "mean accuracy, steps 10-50 [paired-t 95%]"]
    out = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        fixed = level.arm("fixed")
        if not fixed:
            continue
        for arm in ("bapo", "grpo", "clip_higher"):
            runs = level.arm(arm)
            final = paired_t(level.final(arm), level.final("fixed"))
            mean = paired_t({s: _mean_10_50(r) for s, r in runs.items()}, {s: _mean_10_50(r) for s, r in fixed.items()})
            out.append(_row([level.name, f"{arm} − fixed [0.69, 2.05]", f"{_ci(final)}, n={final.n}",
                             f"{_ci(mean)}, n={mean.n}"]))  # fmt: skip
    return out


def section_updates(levels: list[Level]) -> list[str]:
    cols = ["level", "arm", "runs", "updates a step", "samples an update", "policy version at step 50"]
    out = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        for arm in ("grpo", "onpolicy"):
            runs = list(level.arm(arm).values())
            if not runs:
                continue
            per_step = sorted({r.at("learner/updates", 1) for r in runs})
            samples = sorted({_samples_per_update(r) for r in runs})
            versions = sorted({r.at("policy/version", FINAL_STEP) for r in runs})
            out.append(_row([level.name, ARM_LABEL[arm], len(runs), ", ".join(f"{x:.0f}" for x in per_step),
                             ", ".join(f"{x:.0f}" for x in samples),
                             ", ".join(f"{x:.0f}" for x in versions)]))  # fmt: skip
    return out


def _samples_per_update(run: Run) -> float:
    """From the run's config: a step's samples (prompts x samples a prompt) over its updates."""
    prompts, n = cfg_get(run.cfg, "train.prompts_per_step"), cfg_get(run.cfg, "rollout.n")
    updates = cfg_get(run.cfg, "learner.mini_batches_per_rollout")
    return prompts * n / updates if prompts and n and updates else math.nan


# ------------------------------------------------------------------------------------------- the file


def audit(folder: Path) -> str:
    levels = [lv for lv in load_levels(folder) if lv.runs]
    lines = [
        "# Study v5's verdicts held to its packs",
        "",
        "Made from the packs alone by `python scripts/study/study_v5_audit.py docs/study/v5 --out "
        "docs/study/v5/audit.md`, after the pre-registered analysis ([analysis.md](analysis.md)) and apart from it: "
        "no figure here carries a verdict. The packs hold each step's metrics as means over its 5 updates; the "
        "script's docstring says what that lets it count exactly and what it cannot see.",
        "",
        "## 1. What BAPO's search reached (the bapo arm, steps 1-50)",
        "",
        "Engaged: the update's ρ at the base bounds [0.6, 1.2] was below ρ0 = 0.4, so the search moved the bounds. "
        "An engaged update that does not reach ρ0 ends at the corner [0.9, 3.0]. ρ moved: ρ at the chosen bounds "
        "minus ρ at the base bounds (under the paper's loss-value measure, raising c_low lowers ρ).",
        "",
        *section_search(levels),
        "",
        "## 2. What the bounds can act on: clipped shares by arm",
        "",
        "Only a token beyond a bound is treated differently by another bound. GRPO's clipped A > 0 share is the "
        "positive side of the bounds' reach exactly (r > 1.2); its A < 0 share counts r < 0.8, the reach r < 0.9.",
        "",
        *section_reach(levels),
        "",
        "## 3. The outcome's floor (final held-out accuracy of the four arms at 5 updates a batch)",
        "",
        *section_floor(levels),
        "",
        "## 4. What the primary test can detect",
        "",
        f"The paper's gain of BAPO over clip-higher at staleness 4 (AIME24): +{PAPER_GAIN} absolute, "
        f"+{PAPER_RELATIVE:.1%} relative. Power: of the two-sided paired test at alpha 0.05/6 (t approximation).",
        "",
        *section_detectable(levels),
        "",
        "## 5. The fixed window [0.69, 2.05] against every arm (exploratory: the plan reads it only under HELPS "
        "or HURTS)",
        "",
        *section_window(levels),
        "",
        "## 6. What the staleness contrast compares",
        "",
        *section_updates(levels),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="study v5's folder: <folder>/L1, L2's runs.jsonl.gz")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if not args.folder.is_dir():
            raise FileNotFoundError(f"not a folder: {args.folder}")
        text = audit(args.folder)
        args.out.write_text(text)
    except (PackError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
