"""Study v5, the clip-intensity ladder: the pilot's table and the pre-registered analysis, from the packs alone.

    python scripts/study/study_v5.py pilot docs/study/v5/pilot/runs.jsonl.gz --out docs/study/v5/pilot/pilot.md
    python scripts/study/study_v5.py analyse docs/study/v5 --out docs/study/v5/analysis.md

``pilot`` writes the calibration table (clip intensity c(lr) of GRPO at 5 updates per batch, the health checks)
and the lrs it picks, between the markers of pilot.md (the prose around them is the author's). ``analyse``
reads ``<folder>/L1``, ``L2`` and ``L3``'s ``runs.jsonl.gz`` (a level not yet packed is reported as not run) and
writes the whole analysis file in the plan's order (docs/study/v5/PLAN.md): manipulation checks, the six
primary tests with Holm, the verdicts, the mechanism, the secondaries. Both regenerate byte for byte from the
packs (tests/golden/test_committed_studies.py).

Clip intensity c of a run: over steps 1-10, clipped advantage-carrying tokens over advantage-carrying tokens,

    c = sum_t (clip_frac_pos_t * pos_tokens_t + clip_frac_neg_t * neg_tokens_t) / sum_t (pos_tokens_t + neg_tokens_t)

from ``learner/clip_frac_pos``, ``learner/clip_frac_neg`` (each over its own sign's tokens) and
``learner/pos_tokens``, ``learner/neg_tokens`` (docs/metrics.md). A step's figures cover its 5 updates, the first
of which is on-policy (ratio 1, nothing clipped), so c is the clipped share over all updates of the stale run.
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
from scripts.study.pack_study import PackError, read_pack, record_steps  # noqa: E402
from scripts.study.study_stats import FLOOR_SHARE, holm, paired_t, t_interval  # noqa: E402
from scripts.study.study_v5_stats import (  # noqa: E402
    ALPHA,
    EQUIVALENCE,
    EQUIVALENCE_LEVEL,
    N_TESTS,
    Contrast,
    fisher_exact,
    mde,
    sign_flip_p,
    verdict,
)

LEVELS = ("L1", "L2", "L3")
TARGET = {"L1": 0.02, "L2": 0.06, "L3": 0.15}  # GRPO's stale clip share each level is chosen for
CLIP_STEPS = (1, 10)  # c's window, inclusive
FINAL_STEP = 50
FIXED_WINDOW = (0.69, 2.05)  # the paper's average BAPO bounds (Fig. 8)
ARMS = ("grpo", "clip_higher", "bapo", "fixed", "onpolicy")
ARM_LABEL = {"grpo": "grpo", "clip_higher": "clip_higher", "bapo": "bapo",
             "fixed": "grpo, window [0.69, 2.05]", "onpolicy": "grpo on-policy (1 update)"}  # fmt: skip
BASELINES = ("clip_higher", "grpo")  # the primary contrasts: bapo minus each
ENGAGED_MIN, C_HIGH_MIN = 0.25, 1.5  # BAPO's manipulation check, over steps 1-50
HEALTH_DROP = 0.02  # pilot: the on-policy run may not fall more than this below its step 0
# level -> why the plan does not run it (PLAN.md); a level without a pack and not listed here is still to come
NOT_RUN = {"L3": "not run: the pilot's highest healthy lr is L2's (6e-4), so L3 would repeat L2 run for run"}
BEGIN, END = "<!-- begin: scripts/study/study_v5.py pilot -->", "<!-- end: scripts/study/study_v5.py pilot -->"
DASH = "—"


# ------------------------------------------------------------------------------------------- a run


def cfg_get(cfg: dict, dotted: str, default=None):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def arm_of(cfg: dict) -> str | None:
    """The study arm a run's config is: on-policy GRPO (1 update a batch), GRPO with the fixed window, or the
    algorithm at 5 updates a batch; None for anything else."""
    name, updates = cfg_get(cfg, "algo.name"), cfg_get(cfg, "learner.mini_batches_per_rollout")
    window = (cfg_get(cfg, "algo.bounds.ratio_low"), cfg_get(cfg, "algo.bounds.ratio_high"))
    if name == "grpo" and updates == 1:
        return "onpolicy"
    if updates != 5:
        return None
    if name == "grpo" and window == FIXED_WINDOW:
        return "fixed"
    if name == "grpo" and window == (0.8, 1.2) or name in ("clip_higher", "bapo"):
        return name
    return None


@dataclass
class Run:
    name: str
    cfg: dict
    steps: dict[int, dict]
    complete: bool
    status: str

    @classmethod
    def from_record(cls, record: dict) -> Run:
        status = record["status"]
        if record.get("exception"):
            status += f": {record['exception']}"
        return cls(record["run"], record["config"], record_steps(record), record["status"] == "complete", status)

    @property
    def arm(self) -> str | None:
        return arm_of(self.cfg)

    @property
    def seed(self):
        return cfg_get(self.cfg, "seed")

    @property
    def lr(self) -> float:
        return float(cfg_get(self.cfg, "learner.lr", math.nan))

    def at(self, key: str, step: int) -> float:
        v = self.steps.get(step, {}).get(key)
        return float(v) if v is not None else math.nan

    def series(self, key: str, first: int = 0, last: int = 10**9) -> list[float]:
        return [float(m[key]) for s, m in sorted(self.steps.items()) if first <= s <= last and key in m]

    def accuracies(self) -> dict[int, float]:
        return {s: float(m["eval/accuracy"]) for s, m in sorted(self.steps.items()) if "eval/accuracy" in m}

    def clip_share(self, first: int = CLIP_STEPS[0], last: int = CLIP_STEPS[1]) -> tuple[float, float, float]:
        """(c, clipped share of A > 0 tokens, of A < 0 tokens) pooled over steps first..last (module docstring)."""
        cut_pos = cut_neg = n_pos = n_neg = 0.0
        for s, m in self.steps.items():
            keys = ("learner/clip_frac_pos", "learner/clip_frac_neg", "learner/pos_tokens", "learner/neg_tokens")
            if first <= s <= last and all(k in m for k in keys):
                cut_pos += m[keys[0]] * m[keys[2]]
                cut_neg += m[keys[1]] * m[keys[3]]
                n_pos, n_neg = n_pos + m[keys[2]], n_neg + m[keys[3]]

        def share(cut, n):
            return cut / n if n > 0 else math.nan

        return share(cut_pos + cut_neg, n_pos + n_neg), share(cut_pos, n_pos), share(cut_neg, n_neg)

    def pooled_rho(self, first: int, last: int) -> float:
        p = sum(m.get("clip/P", 0.0) for s, m in self.steps.items() if first <= s <= last)
        n = sum(m.get("clip/N", 0.0) for s, m in self.steps.items() if first <= s <= last)
        return p / (p + n) if p + n > 0 else math.nan


def load(pack: Path) -> tuple[str, list[Run]]:
    sweep, records = read_pack(pack)
    return sweep, [Run.from_record(r) for r in records]


def _mean(xs) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def _pct(x: float, digits: int = 2) -> str:
    return DASH if not math.isfinite(x) else f"{100 * x:.{digits}f}%"


def _f(x: float, fmt: str = "{:.3f}") -> str:
    return DASH if not math.isfinite(x) else fmt.format(x)


def _lr(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-") if math.isfinite(x) else DASH


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# ------------------------------------------------------------------------------------------- the pilot


def pilot_health(runs: list[Run]) -> dict:
    """One lr's pilot figures from its runs (GRPO at 5 updates and at 1, any seeds)."""
    stale = sorted((r for r in runs if r.complete and r.arm == "grpo"), key=lambda r: r.seed)
    onpol = sorted((r for r in runs if r.complete and r.arm == "onpolicy"), key=lambda r: r.seed)
    shares = [r.clip_share() for r in stale]
    drops = [min(a for s, a in r.accuracies().items() if s > 0) - r.accuracies()[0] for r in onpol]
    lows = [min(r.accuracies().values()) for r in stale]
    healthy = bool(stale and onpol and all(d >= -HEALTH_DROP for d in drops) and all(x >= FLOOR_SHARE for x in lows))
    return {"stale": stale, "onpolicy": onpol, "shares": shares, "c": _mean(s[0] for s in shares),
            "drops": drops, "lows": lows, "healthy": healthy}  # fmt: skip


def choose_levels(health: dict[float, dict]) -> dict[str, tuple[float, str]]:
    """Each level's lr: the healthy lr whose c is nearest its target on a log scale (c / target and target / c
    weigh alike: the manipulation check's window is [1/2, 2] x target), with a note where the pick is only the
    highest healthy lr (its c under the target) or misses the [1/2, 2] window."""
    healthy = {lr: h["c"] for lr, h in health.items() if h["healthy"] and h["c"] > 0}
    out = {}
    for level, target in TARGET.items():
        if not healthy:
            out[level] = (math.nan, "no healthy lr")
            continue
        lr = min(healthy, key=lambda x: (abs(math.log(healthy[x] / target)), x))
        notes = []
        if lr == max(healthy) and healthy[lr] < target:
            notes.append("the highest healthy lr (its c is under the target)")
        if not target / 2 <= healthy[lr] <= 2 * target:
            notes.append(f"c outside the check's window [{_pct(target / 2, 1)}, {_pct(2 * target, 0)}]")
        out[level] = (lr, "; ".join(notes))
    return out


def pilot_block(pack: Path) -> str:
    sweep, runs = load(pack)
    by_lr: dict[float, list[Run]] = {}
    for r in runs:
        by_lr.setdefault(r.lr, []).append(r)
    health = {lr: pilot_health(rs) for lr, rs in sorted(by_lr.items())}
    seeds = sorted({r.seed for r in runs})
    lines = [BEGIN, "", f"Pack `{sweep}`: {len(runs)} runs, {sum(r.complete for r in runs)} complete, seeds "
             f"{', '.join(map(str, seeds))}. Per seed (in seed order) unless a mean.", ""]  # fmt: skip
    cols = ["lr", "c, 5 updates, steps 1-10 (mean)", "c per seed", "clipped A>0 / A<0 (per seed)",
            "largest ratio, steps 1-10", "5 updates: accuracy at 0 / 10 / 20", "on-policy: accuracy at 0 / 10 / 20",
            "on-policy: lowest − step 0", "healthy"]  # fmt: skip
    lines += [_row(cols), _row(["---"] * len(cols))]
    for lr, h in health.items():

        def accs(r):
            return " / ".join(_f(a) for a in r.accuracies().values())

        ratio = [max(r.series("learner/ratio_max", *CLIP_STEPS), default=math.nan) for r in h["stale"]]
        lines.append(_row([
            _lr(lr), _pct(h["c"]), ", ".join(_pct(s[0]) for s in h["shares"]),
            ", ".join(f"{_pct(s[1])} / {_pct(s[2])}" for s in h["shares"]), ", ".join(_f(x, "{:.2f}") for x in ratio),
            "; ".join(accs(r) for r in h["stale"]), "; ".join(accs(r) for r in h["onpolicy"]),
            ", ".join(_f(d, "{:+.3f}") for d in h["drops"]), "yes" if h["healthy"] else "**no**",
        ]))  # fmt: skip
    lines += ["", "Choice (the healthy lr nearest each target on a log scale):", ""]
    for level, (lr, note) in choose_levels(health).items():
        c = health[lr]["c"] if lr in health else math.nan
        extra = f"; {note}" if note else ""
        lines.append(f"- **{level}** (target c = {_pct(TARGET[level], 0)}): lr **{_lr(lr)}**, c = {_pct(c)}{extra}")
    return "\n".join([*lines, "", END])


def write_pilot(pack: Path, out: Path) -> None:
    block = pilot_block(pack)
    text = out.read_text() if out.is_file() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + block + "\n"
    out.write_text(text)


# ------------------------------------------------------------------------------------------- the analysis


@dataclass
class Level:
    name: str
    sweep: str | None
    runs: list[Run]

    def arm(self, arm: str) -> dict:
        """seed -> run of the complete runs of ``arm``."""
        return {r.seed: r for r in self.runs if r.complete and r.arm == arm}

    @property
    def lr(self) -> float:
        lrs = sorted({r.lr for r in self.runs})
        return lrs[0] if len(lrs) == 1 else math.nan

    def final(self, arm: str, step: int = FINAL_STEP) -> dict:
        return {s: r.at("eval/accuracy", step) for s, r in self.arm(arm).items()}


def load_levels(folder: Path) -> list[Level]:
    out = []
    for name in LEVELS:
        pack = folder / name / "runs.jsonl.gz"
        if pack.is_file():
            sweep, runs = load(pack)
            out.append(Level(name, sweep, runs))
        else:
            out.append(Level(name, None, []))
    return out


def manipulation(level: Level) -> dict:
    """The plan's two manipulation checks on one level (section 1 of the analysis)."""
    target = TARGET[level.name]
    grpo = [r.clip_share()[0] for r in level.arm("grpo").values()]
    bapo = list(level.arm("bapo").values())
    engaged = [_mean(r.series("bapo/search_active", 1, FINAL_STEP)) for r in bapo]
    c_high = [_mean(r.series("clip/high", 1, FINAL_STEP)) for r in bapo]
    c = t_interval(grpo)
    clip_ok = math.isfinite(c.mean) and target / 2 <= c.mean <= 2 * target
    search_ok = bool(bapo) and _mean(engaged) >= ENGAGED_MIN and _mean(c_high) >= C_HIGH_MIN
    return {"c": c, "clip_ok": clip_ok, "engaged": t_interval(engaged), "c_high": t_interval(c_high),
            "search_ok": search_ok, "passed": clip_ok and search_ok}  # fmt: skip


def primary(levels: list[Level]) -> list[dict]:
    """The six tests: bapo minus each baseline at each level, on the seeds both completed; Holm over six, a
    level not run counting p = 1."""
    rows = []
    for level in levels:
        bapo = level.final("bapo")
        for base in BASELINES:
            other = level.final(base)
            seeds = sorted(s for s in set(bapo) & set(other) if math.isfinite(bapo[s]) and math.isfinite(other[s]))
            diffs = [bapo[s] - other[s] for s in seeds]
            ci95, ci90 = paired_t(bapo, other), paired_t(bapo, other, level=EQUIVALENCE_LEVEL)
            sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.nan
            p = sign_flip_p(diffs) if diffs else math.nan
            rows.append({"level": level.name, "base": base, "n": len(diffs), "ci95": ci95, "ci90": ci90, "p": p,
                         "sd": sd, "mde": mde(sd, len(diffs))})  # fmt: skip
    assert len(rows) == N_TESTS, rows
    adjusted = holm([r["p"] if math.isfinite(r["p"]) else 1.0 for r in rows])  # not run: p = 1
    for r, p in zip(rows, adjusted, strict=True):
        r["holm"] = p if r["n"] else math.nan
    return rows


def _ci(stat, fmt: str = "{:+.3f}") -> str:
    if not math.isfinite(stat.mean):
        return DASH
    if not math.isfinite(stat.lo):
        return f"{fmt.format(stat.mean)} (n={stat.n})"
    return f"{fmt.format(stat.mean)} [{fmt.format(stat.lo)}, {fmt.format(stat.hi)}]"


def _p(p: float) -> str:
    return DASH if not math.isfinite(p) else f"{p:.4f}" if p >= 0.0001 else f"{p:.1e}"


def section_manipulation(levels: list[Level], checks: dict) -> list[str]:
    cols = ["level", "lr", "grpo's clip share c, steps 1-10 (mean [t 95%], n)", "target [window]",
            "c in window", "bapo: updates engaged, steps 1-50", "bapo: mean c_high, steps 1-50", "search check",
            "reading"]  # fmt: skip
    lines = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        if not level.runs:
            lines.append(_row([level.name, DASH, "not run", *[DASH] * 5, NOT_RUN.get(level.name, "no data yet")]))
            continue
        m, t = checks[level.name], TARGET[level.name]
        c = m["c"]
        share = f"{_pct(c.mean)} [{_pct(c.lo)}, {_pct(c.hi)}], n={c.n}" if math.isfinite(c.lo) else _pct(c.mean)
        lines.append(_row([
            level.name, _lr(level.lr), share, f"{_pct(t, 0)} [{_pct(t / 2, 1)}, {_pct(2 * t, 0)}]",
            "yes" if m["clip_ok"] else "**no**", f"{_pct(m['engaged'].mean, 0)} (n={m['engaged'].n})",
            _f(m["c_high"].mean, "{:.2f}"), "yes" if m["search_ok"] else "**no**",
            "passes: carries a verdict" if m["passed"] else "**fails: reported apart, no verdict**",
        ]))  # fmt: skip
    return lines


def section_primary(rows: list[dict]) -> list[str]:
    cols = ["level", "contrast", "n", "mean difference [paired-t 95%]", "paired-t 90%", "exact sign-flip p",
            f"Holm p (over {N_TESTS})", "sd of differences", "MDE (80% power, alpha 0.05/6)"]  # fmt: skip
    lines = [_row(cols), _row(["---"] * len(cols))]
    for r in rows:
        lines.append(_row([
            r["level"], f"bapo − {r['base']}", r["n"], _ci(r["ci95"]), _ci(r["ci90"]), _p(r["p"]), _p(r["holm"]),
            _f(r["sd"], "{:.4f}"), _f(r["mde"]),
        ]))  # fmt: skip
    return lines


def level_verdicts(levels: list[Level], checks: dict, rows: list[dict]) -> dict[str, str]:
    out = {}
    for level in levels:
        mine = [r for r in rows if r["level"] == level.name]
        if not level.runs:
            out[level.name] = "not run"
        elif not checks[level.name]["passed"]:
            out[level.name] = "no verdict (manipulation check failed)"
        elif any(r["n"] == 0 for r in mine):
            out[level.name] = "no verdict (no paired seeds)"
        else:
            out[level.name] = verdict([Contrast(r["ci95"].mean, r["holm"], r["ci90"]) for r in mine])
    return out


def section_verdicts(levels, verdicts, rows) -> list[str]:
    cols = ["level", "lr", "verdict", "bapo − clip_higher [95%], Holm p", "bapo − grpo [95%], Holm p",
            "largest MDE of the two"]  # fmt: skip
    lines = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        mine = {r["base"]: r for r in rows if r["level"] == level.name}
        cells = [f"{_ci(mine[b]['ci95'])}, n={mine[b]['n']}, p={_p(mine[b]['holm'])}" for b in BASELINES]
        worst = max((mine[b]["mde"] for b in BASELINES if math.isfinite(mine[b]["mde"])), default=math.nan)
        lines.append(_row([level.name, _lr(level.lr), f"**{verdicts[level.name]}**", *cells, _f(worst)]))
    return lines


def section_mechanism(levels, verdicts) -> list[str]:
    cols = ["level", "n", "bapo − fixed window [paired-t 95%]", "paired-t 90%", "equivalent within ±0.02",
            "reading"]  # fmt: skip
    lines = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        bapo, fixed = level.final("bapo"), level.final("fixed")
        ci95, ci90 = paired_t(bapo, fixed), paired_t(bapo, fixed, level=EQUIVALENCE_LEVEL)
        equivalent = math.isfinite(ci90.lo) and -EQUIVALENCE < ci90.lo and ci90.hi < EQUIVALENCE
        if verdicts[level.name] not in ("HELPS", "HURTS"):
            reading = "not read (bapo neither helps nor hurts here)"
        elif equivalent:
            reading = "the window's width, not the adaptive search"
        else:
            reading = "not equivalent to the fixed window"
        lines.append(_row([level.name, ci95.n, _ci(ci95), _ci(ci90), "yes" if equivalent else "no", reading]))
    return lines


def _summary(run: Run) -> dict:
    acc = run.accuracies()
    later = [a for s, a in acc.items() if 10 <= s <= FINAL_STEP]
    start, final = acc.get(0, math.nan), acc.get(FINAL_STEP, math.nan)
    ent1, ent50 = run.at("learner/entropy", 1), run.at("learner/entropy", FINAL_STEP)
    return {
        "step0": start, "step10": acc.get(10, math.nan), "mean10_50": _mean(later), "final": final,
        "peak_minus_final": max(acc.values()) - final if acc else math.nan,
        "entropy_ratio": ent50 / ent1 if ent1 else math.nan,
        "truncated_1_10": _mean(run.series("rollout/truncated", *CLIP_STEPS)),
        "truncated_50": run.at("rollout/truncated", FINAL_STEP),
        "collapsed": float(final < start / 2) if math.isfinite(final) and math.isfinite(start) else math.nan,
    }  # fmt: skip


SECONDARY = {"step10": "accuracy at step 10", "mean10_50": "mean accuracy, steps 10-50",
             "peak_minus_final": "peak − final", "entropy_ratio": "entropy 50 / 1"}  # fmt: skip


def section_secondary(levels: list[Level]) -> list[str]:
    cols = ["level", "arm", "n", "step 0", "step 10", "mean 10-50", "final (step 50)", "peak − final",
            "entropy 50 / 1", "truncated, steps 1-10", "truncated, step 50", "clip share c, steps 1-10",
            "collapsed (final < ½ step 0)"]  # fmt: skip
    out = ["### Arms (mean [Student-t 95%] over seeds; c is each run's pooled share, then the mean)", "",
           _row(cols), _row(["---"] * len(cols))]  # fmt: skip
    for level in levels:
        for arm in ARMS:
            runs = level.arm(arm)
            if not runs:
                continue
            s = {seed: _summary(r) for seed, r in runs.items()}

            def ci(key, fmt="{:.3f}", s=s):
                return _ci(t_interval([v[key] for v in s.values()]), fmt)

            c = _mean(r.clip_share()[0] for r in runs.values())
            collapsed = sum(v["collapsed"] == 1 for v in s.values())
            out.append(_row([level.name, ARM_LABEL[arm], len(s), ci("step0"), ci("step10"), ci("mean10_50"),
                             ci("final"), ci("peak_minus_final"), ci("entropy_ratio", "{:.2f}"),
                             ci("truncated_1_10", "{:.2f}"), ci("truncated_50", "{:.2f}"), _pct(c),
                             f"{collapsed} of {len(s)}"]))  # fmt: skip
    cols = ["level", "contrast", *SECONDARY.values()]
    out += ["", "### Paired contrasts of the secondaries (paired-t 95%, n pairs)", "", _row(cols),
            _row(["---"] * len(cols))]  # fmt: skip
    for level in levels:
        summaries = {arm: {seed: _summary(r) for seed, r in level.arm(arm).items()} for arm in ARMS}
        for base in (*BASELINES, "fixed"):
            if not summaries["bapo"] or not summaries[base]:
                continue
            cells = []
            for key in SECONDARY:
                a = {seed: v[key] for seed, v in summaries["bapo"].items()}
                b = {seed: v[key] for seed, v in summaries[base].items()}
                stat = paired_t(a, b)
                cells.append(f"{_ci(stat)}, n={stat.n}")
            out.append(_row([level.name, f"bapo − {ARM_LABEL[base]}", *cells]))
    cols = ["level", "bapo collapsed", "clip_higher collapsed", "grpo collapsed", "Fisher p, bapo vs clip_higher",
            "Fisher p, bapo vs grpo"]  # fmt: skip
    out += ["", "### Collapse incidence (final < ½ of step 0; Fisher exact, two-sided)", "", _row(cols),
            _row(["---"] * len(cols))]  # fmt: skip
    for level in levels:
        counts = {}
        for arm in ("bapo", *BASELINES):
            s = [_summary(r)["collapsed"] for r in level.arm(arm).values()]
            counts[arm] = (sum(x == 1 for x in s), len(s))
        if not counts["bapo"][1]:
            continue
        ps = []
        for base in BASELINES:
            (a, n1), (c, n2) = counts["bapo"], counts[base]
            ps.append(_p(fisher_exact(a, n1 - a, c, n2 - c)) if n2 else DASH)
        out.append(_row([level.name, *[f"{k} of {n}" for k, n in (counts[a] for a in ("bapo", *BASELINES))], *ps]))
    cols = ["level", "final: grpo (5 updates) − grpo on-policy [paired-t 95%]", "n", "step 10", "mean 10-50"]
    out += ["", "### Staleness harm: grpo at 5 updates a batch minus on-policy grpo, paired by seed", "",
            _row(cols), _row(["---"] * len(cols))]  # fmt: skip
    for level in levels:
        stale = {seed: _summary(r) for seed, r in level.arm("grpo").items()}
        onpol = {seed: _summary(r) for seed, r in level.arm("onpolicy").items()}
        if not stale or not onpol:
            continue
        stats = [paired_t({k: v[key] for k, v in stale.items()}, {k: v[key] for k, v in onpol.items()})
                 for key in ("final", "step10", "mean10_50")]  # fmt: skip
        out.append(_row([level.name, _ci(stats[0]), stats[0].n, _ci(stats[1]), _ci(stats[2])]))
    return out


def section_clipping(levels: list[Level]) -> list[str]:
    cols = ["level", "arm", "n", "c", "clipped A>0", "clipped A<0", "pooled ρ", "largest ratio (mean of runs)",
            "c_low", "c_high"]  # fmt: skip
    out = [_row(cols), _row(["---"] * len(cols))]
    for level in levels:
        for arm in ARMS:
            runs = list(level.arm(arm).values())
            if not runs or arm == "onpolicy":
                continue
            shares = [r.clip_share() for r in runs]
            out.append(_row([
                level.name, ARM_LABEL[arm], len(runs), *[_pct(_mean(s[i] for s in shares)) for i in range(3)],
                _f(_mean(r.pooled_rho(*CLIP_STEPS) for r in runs)),
                _f(_mean(max(r.series("learner/ratio_max", *CLIP_STEPS), default=math.nan) for r in runs), "{:.2f}"),
                _f(_mean(_mean(r.series("clip/low", *CLIP_STEPS)) for r in runs), "{:.2f}"),
                _f(_mean(_mean(r.series("clip/high", *CLIP_STEPS)) for r in runs), "{:.2f}"),
            ]))  # fmt: skip
    return out


def analysis(folder: Path) -> str:
    levels = load_levels(folder)
    checks = {lv.name: manipulation(lv) for lv in levels if lv.runs}
    rows = primary(levels)
    verdicts = level_verdicts(levels, checks, rows)
    packs = []
    for lv in levels:
        if lv.sweep is None:
            packs.append(f"- {lv.name}: no pack ({NOT_RUN.get(lv.name, 'not run yet')})")
            continue
        bad = [r for r in lv.runs if not r.complete]
        packs.append(f"- {lv.name}: `{lv.name}/runs.jsonl.gz` (sweep `{lv.sweep}`, lr {_lr(lv.lr)}): "
                     f"{len(lv.runs)} runs, {len(lv.runs) - len(bad)} complete")  # fmt: skip
        packs += [f"  - not complete: `{r.name}` ({r.status})" for r in bad]
        packs += [f"  - not a study arm: `{r.name}`" for r in lv.runs if r.arm is None]
    lines = [
        "# Study v5: the pre-registered analysis",
        "",
        "Made from the packs alone by `python scripts/study/study_v5.py analyse docs/study/v5 --out "
        "docs/study/v5/analysis.md`, in the order the plan ([PLAN.md](PLAN.md), committed before the grid's "
        "first run) fixes. Accuracy is held-out `eval/accuracy` (500 problems x 4 samples at T = 1); "
        "differences are bapo minus the other arm, paired by seed.",
        "",
        *packs,
        "",
        "## 1. Manipulation checks (reported before any outcome)",
        "",
        f"GRPO's clip share c must lie within [½, 2] x its level's target; BAPO's search must engage on at least "
        f"{ENGAGED_MIN:.0%} of updates with a mean c_high of at least {C_HIGH_MIN}. A level that fails either is "
        "reported apart and carries no verdict.",
        "",
        *section_manipulation(levels, checks),
        "",
        "## 2. Primary: final held-out accuracy at step 50",
        "",
        f"Exact two-sided sign-flip permutation p (all 2^n sign vectors), Holm over the {N_TESTS} tests at alpha "
        f"{ALPHA} (a level not run counts p = 1); paired-t intervals beside them. MDE: the difference a two-sided "
        "test at alpha 0.05/6 detects with 80% power at this n and this spread.",
        "",
        *section_primary(rows),
        "",
        "## 3. Verdict per level",
        "",
        "HELPS: both contrasts positive and significant (Holm p < 0.05); HURTS: either negative and significant; "
        f"INERT: both 90% intervals inside ±{EQUIVALENCE}; INCONCLUSIVE otherwise.",
        "",
        *section_verdicts([lv for lv in levels], verdicts, rows),
        "",
        "## 4. Mechanism (no verdict power)",
        "",
        "Where bapo helps or hurts, is GRPO with the fixed window [0.69, 2.05] equivalent to it (90% interval "
        f"inside ±{EQUIVALENCE})? Then the effect is the window's width, not the adaptive search.",
        "",
        *section_mechanism(levels, verdicts),
        "",
        "## 5. Secondary, descriptive",
        "",
        *section_secondary(levels),
        "",
        "### Clipping by arm, steps 1-10 (means over runs)",
        "",
        *section_clipping(levels),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pilot", help="the calibration table and choice, between pilot.md's markers")
    p.add_argument("pack", type=Path)
    p.add_argument("--out", type=Path, required=True)
    a = sub.add_parser("analyse", help="the pre-registered analysis from <folder>/L1..L3/runs.jsonl.gz")
    a.add_argument("folder", type=Path)
    a.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "pilot":
            if not args.pack.is_file():
                raise FileNotFoundError(f"no pack {args.pack}")
            write_pilot(args.pack, args.out)
        else:
            if not args.folder.is_dir():
                raise FileNotFoundError(f"not a folder: {args.folder}")
            args.out.write_text(analysis(args.folder))
    except (PackError, FileNotFoundError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
