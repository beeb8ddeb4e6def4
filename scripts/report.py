"""Turn a sweep folder into a Markdown table and PNG plots.

    python scripts/report.py multirun/ablation_staleness [--out DIR] [--smooth K]

Every folder under the sweep that holds `config.yaml`, `.hydra/config.yaml` or `metrics.jsonl` is a
run. Runs are grouped by algo x staleness and written to DIR (default `<sweep>/report`):

- `report.md`: one row per algo x staleness with final and best held-out accuracy, entropy at the
  end, grad-norm spikes and wall time (mean ± std over the completed seeds), a table of incomplete
  runs, and every unreadable metrics line as `file:line`;
- `curves_*.png`: eval accuracy, reward, entropy and grad norm over steps, one panel per staleness
  level, one line per algo (mean over seeds), a min-max band over seeds;
- `bapo_bounds.png`, `bapo_rho.png`: BAPO's ratio_low / ratio_high over training and the positive
  share rho before and after the bound search (the paper's Figs. 8 and 9);
- `clip_window.png`, `clip_by_sign.png`: every arm's clip window (`clip/low`, `clip/high`) and its
  clipped fractions by advantage sign (`learner/clip_frac_pos`, `learner/clip_frac_neg`);
- `acc_vs_samples.png`, `acc_vs_wall.png`: held-out accuracy against the samples consumed (the running
  sum of `buffer/served`) and against wall time (the running sum of `time/step_s`).

With `--intervals` (or whenever some group has two or more completed seeds) report.md also has:
- bootstrap 95% intervals over seeds of final accuracy, best accuracy and final entropy (`bootstrap_ci`);
- a paired comparison of every arm against `--reference` (default bapo) on the seeds both completed at
  the same staleness: the mean difference (arm − reference) and its bootstrap interval (`paired_difference`);
- the pathology checks: entropy at the end over entropy at the start, the drop of accuracy from its
  peak, and the share of steps on which `bapo/rho_before` < rho0.

Definitions (repeated in report.md):
- staleness: `staleness_of(cfg)`, followed by how it comes about (`staleness_via`) unless on-policy:
  `4 (5 epochs)` and `4 (5 mini-batches)` are separate groups. `buffer.max_staleness` is its own column.
- a run is complete when `final_metrics.json` exists. Incomplete runs (crashed, interrupted or still
  running) are left out of the statistics, counted in the `incomplete` column and listed by name.
- grad-norm spike: a step whose `learner/grad_norm` exceeds 3x the median of all earlier steps'
  grad norms; steps with fewer than 5 earlier values are never counted.
- wall time: the sum of `time/step_s` (which includes that step's eval) plus step 0's `time/eval_s`.
- rows that repeat a step (a resumed run re-logs the steps after its checkpoint) are merged, the
  later value winning.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

SPIKE_FACTOR = 3.0
SPIKE_MIN_HISTORY = 5
CURVES = {
    "eval/accuracy": "held-out accuracy",
    "reward/mean": "reward",
    "learner/entropy": "entropy",
    "learner/grad_norm": "grad norm",
}
SKIP_DIRS = {".hydra", ".submitit", "checkpoints", "export", "wandb"}
DASH = "—"


# Metrics of runs written before the clip window moved to clip/*: read under their new names.
RENAMED = {"bapo/ratio_low": "clip/low", "bapo/ratio_high": "clip/high", "bapo/rho": "clip/rho"}


def bounds_kind(cfg: dict) -> str | None:
    """``algo.bounds.kind`` (``algo.bounds`` itself in configs written before the bounds became a sub-group)."""
    b = cfg_get(cfg, "algo.bounds")
    return b.get("kind") if isinstance(b, dict) else b


def rho_target(cfg: dict):
    return cfg_get(cfg, "algo.bounds.rho0", cfg_get(cfg, "algo.rho0"))


def cfg_get(cfg: dict, dotted: str, default=None):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _as_int(x) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str) and x.strip().lstrip("-").isdigit():
        return int(x)
    return None


def staleness_of(cfg: dict) -> int | None:
    """The staleness a sample can reach in an update: the group key of the report.

    With `train.async_rollout` the rollouts lag the learner, and `buffer.max_staleness` bounds the lag.
    Otherwise experience reuse alone sets it: ppo_epochs x mini_batches_per_rollout - 1.
    None when the keys it needs are missing.
    """
    if cfg_get(cfg, "train.async_rollout") is True:
        return _as_int(cfg_get(cfg, "buffer.max_staleness"))
    epochs = _as_int(cfg_get(cfg, "learner.ppo_epochs", 1))
    mini_batches = _as_int(cfg_get(cfg, "learner.mini_batches_per_rollout"))
    if epochs is None or mini_batches is None:
        return None
    return epochs * mini_batches - 1


def staleness_via(cfg: dict) -> str:
    """How samples get stale: "on-policy", or what makes them stale ("5 epochs", "5 mini-batches",
    "2 epochs × 3 mini-batches", "async", "async, 2 mini-batches"); "?" when the keys are missing.

    The same staleness reached two ways is two regimes (re-fitting one batch 5 times is not splitting it in 5),
    so the report groups runs by staleness and this together (`Level`).
    """
    epochs = _as_int(cfg_get(cfg, "learner.ppo_epochs", 1))
    mini_batches = _as_int(cfg_get(cfg, "learner.mini_batches_per_rollout"))
    if epochs is None or mini_batches is None:
        return "?"
    reuse = " × ".join(f"{n} {unit}" for n, unit in ((epochs, "epochs"), (mini_batches, "mini-batches")) if n > 1)
    if cfg_get(cfg, "train.async_rollout") is True:
        return f"async, {reuse}" if reuse else "async"
    return reuse or "on-policy"


class Level(NamedTuple):
    """A group of the report besides the algo: the staleness and how it comes about (`staleness_via`)."""

    staleness: int | None
    via: str


# ------------------------------------------------------------------------------------ statistics

EXACT_BOOTSTRAP_MAX_N = 7  # n^n resamples: 823,543 at n = 7; above it, n_boot Monte Carlo resamples


def bootstrap_ci(xs, *, level: float = 0.95, n_boot: int = 20_000, seed: int = 0) -> tuple[float, float, float]:
    """The mean of ``xs`` and a percentile bootstrap interval for it: ``(mean, lo, hi)``.

    For n <= EXACT_BOOTSTRAP_MAX_N the bootstrap distribution is enumerated exactly (all n^n ordered
    resamples, each equally likely), so the interval is a function of the data alone and can be checked by
    hand; above that, ``n_boot`` resamples drawn with ``seed``. The bounds are the (1 - level)/2 and
    (1 + level)/2 quantiles of the resampled means, each the smallest resampled mean whose cumulative share
    reaches that level (``numpy.quantile(method="inverted_cdf")``). Non-finite values are dropped; none left
    gives NaNs, and one value gives a zero-width interval (a single seed says nothing about the spread).
    """
    x = np.asarray([v for v in xs if math.isfinite(v)], dtype=float)
    n = len(x)
    if n == 0:
        return math.nan, math.nan, math.nan
    if n <= EXACT_BOOTSTRAP_MAX_N:
        idx = np.indices((n,) * n).reshape(n, -1)  # [n, n^n]: every ordered resample, one per column
        means = x[idx].mean(axis=0)
    else:
        idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
        means = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha], method="inverted_cdf")
    return float(x.mean()), float(lo), float(hi)


def paired_difference(arm: dict, reference: dict, **kw) -> tuple[float, float, float, int]:
    """Mean of ``arm[s] - reference[s]`` over the seeds s both have (finite), its bootstrap interval, and n.

    ``arm`` and ``reference`` map a seed to a value. Pairing by seed removes what the seed does to both runs
    alike (the same prompts, the same initial samples), so the interval is on the difference itself.
    """
    seeds = sorted(s for s in set(arm) & set(reference) if math.isfinite(arm[s]) and math.isfinite(reference[s]))
    mean, lo, hi = bootstrap_ci([arm[s] - reference[s] for s in seeds], **kw)
    return mean, lo, hi, len(seeds)


def count_spikes(values, factor: float = SPIKE_FACTOR, min_history: int = SPIKE_MIN_HISTORY) -> int:
    """Steps whose value exceeds `factor` x the median of all earlier (finite) values."""
    seen, spikes = [], 0
    for v in values:
        if not math.isfinite(v):
            continue
        if len(seen) >= min_history and v > factor * float(np.median(seen)):
            spikes += 1
        seen.append(v)
    return spikes


def parse_metrics(path: Path) -> tuple[dict[int, dict], list[str]]:
    """step -> merged metrics, and one `file:line: problem` per line that could not be used."""
    steps: dict[int, dict] = {}
    problems = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        where = f"{path}:{i}"
        if not line.strip():
            problems.append(f"{where}: empty line")
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{where}: unparseable JSON ({e.msg})")
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, bool) or not isinstance(step, int | float) or not float(step).is_integer():
            problems.append(f"{where}: no integer 'step'")
            continue
        values = {
            RENAMED.get(k, k): float(v)
            for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        values.pop("step")
        steps.setdefault(int(step), {}).update(values)
    return dict(sorted(steps.items())), problems


def _last_exception(path: Path) -> str | None:
    """The exception line of the last traceback in a log, if any."""
    lines = path.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if line.strip() and not line[0].isspace():
            return line.strip()[:120]
    return "traceback"


@dataclass
class Run:
    path: Path
    cfg: dict
    steps: dict[int, dict]
    final: dict | None
    label: str
    problems: list[str]

    @property
    def complete(self) -> bool:
        return self.final is not None

    @property
    def staleness(self) -> int | None:
        return staleness_of(self.cfg)

    @property
    def level(self) -> Level:
        return Level(self.staleness, staleness_via(self.cfg))

    @property
    def seed(self):
        return cfg_get(self.cfg, "seed", DASH)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        pts = [(s, m[key]) for s, m in self.steps.items() if key in m]
        return np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts], dtype=float)

    def last(self, key: str) -> float:
        _, y = self.series(key)
        return float(y[-1]) if len(y) else math.nan

    def summary(self) -> dict[str, float]:
        _, acc = self.series("eval/accuracy")
        _, grad_norm = self.series("learner/grad_norm")
        wall = sum(m.get("time/step_s", m.get("time/eval_s", 0.0)) for m in self.steps.values())
        return {
            "final": float(acc[-1]) if len(acc) else math.nan,
            "best": float(np.nanmax(acc)) if len(acc) else math.nan,
            "greedy": self.last("eval/accuracy_greedy"),
            "entropy": self.last("learner/entropy"),
            "spikes": float(count_spikes(grad_norm)),
            "wall_min": wall / 60,
        }

    def pathology(self) -> dict[str, float]:
        """What the pathology checks read: entropy at the start and at the end, the accuracy drop from its
        peak to the end, and the share of updates whose ``bapo/rho_before`` is below rho0, from
        ``bapo/search_active`` (runs logged before it: the share of steps whose mean is below; NaN for runs
        without the search)."""
        _, ent = self.series("learner/entropy")
        _, acc = self.series("eval/accuracy")
        _, rho = self.series("bapo/rho_before")
        _, active = self.series("bapo/search_active")  # per step: the share of its updates whose search moved
        rho0 = rho_target(self.cfg)
        if len(active):  # every step has the same number of updates: the mean over steps is the share of updates
            below = float(np.mean(active))
        else:  # runs from before the metric: steps whose mean rho_before is below rho0
            below = float(np.mean(rho < rho0)) if len(rho) and isinstance(rho0, int | float) else math.nan
        # the same share among the updates with a learning signal (an update whose every group is all right or
        # all wrong has no advantage, rho = 1 by convention, and nothing to search)
        _, signal = self.series("bapo/signal")
        below_signal = (
            float(np.sum(active) / np.sum(signal)) if len(signal) == len(active) and np.sum(signal) else math.nan
        )
        return {
            "entropy_start": float(ent[0]) if len(ent) else math.nan,
            "entropy_end": float(ent[-1]) if len(ent) else math.nan,
            "entropy_min": float(np.min(ent)) if len(ent) else math.nan,
            "acc_start": float(acc[0]) if len(acc) else math.nan,
            "acc_peak": float(np.max(acc)) if len(acc) else math.nan,
            "acc_final": float(acc[-1]) if len(acc) else math.nan,
            "rho_below_share": below,
            "rho_below_signal_share": below_signal,
        }

    def against(self, key: str, axis: str) -> tuple[np.ndarray, np.ndarray]:
        """``key`` against the samples consumed (``axis="samples"``, the running sum of ``buffer/served``) or
        the wall time in minutes (``axis="wall"``, step 0's eval time plus the running sum of ``time/step_s``)
        at the steps that logged ``key``."""
        per_step = "buffer/served" if axis == "samples" else "time/step_s"
        total, at = 0.0, {}
        for step, m in self.steps.items():
            total += m.get(per_step, m.get("time/eval_s", 0.0) if axis == "wall" and step == 0 else 0.0)
            at[step] = total / 60 if axis == "wall" else total
        x, y = self.series(key)
        return np.array([at[int(s)] for s in x], dtype=float), y

    def status(self) -> str:
        planned = _as_int(cfg_get(self.cfg, "train.steps")) or "?"
        done = max(self.steps) if self.steps else None
        text = f"incomplete at step {done} of {planned}" if done is not None else f"no metrics logged (of {planned})"
        text += "; resumable (checkpoints/)" if (self.path / "checkpoints").is_dir() else "; no checkpoint"
        for log in ("crash.txt", "train.log"):
            if (self.path / log).is_file() and (exc := _last_exception(self.path / log)):
                return f"{text}; {log}: {exc}"
        return text


def label_of(run_dir: Path, cfg: dict) -> str:
    """algo.name, plus any algo.* and algo/<group> command-line overrides (ablations keep the algo's name)."""
    name = str(cfg_get(cfg, "algo.name", "?"))
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
    except Exception:
        overrides = []
    given = [str(o).lstrip("+~") for o in overrides or []]
    extra = [o[len("algo.") :] for o in given if o.startswith("algo.")]
    extra += [o[len("algo/") :] for o in given if o.startswith("algo/")]  # a sub-group: algo/correction=tis
    return f"{name}[{','.join(extra)}]" if extra else name


def load_run(run_dir: Path) -> Run:
    problems: list[str] = []
    cfg: dict = {}
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        cfg_file = run_dir / ".hydra" / "config.yaml"  # written by Hydra before the job starts
    if cfg_file.is_file():
        try:
            cfg = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=False)
        except Exception as e:
            problems.append(f"{cfg_file}: unreadable config ({str(e).splitlines()[0]})")
    else:
        problems.append(f"{run_dir}: no config.yaml")
    steps: dict[int, dict] = {}
    if (run_dir / "metrics.jsonl").is_file():
        steps, bad = parse_metrics(run_dir / "metrics.jsonl")
        problems += bad
    final = None
    if (run_dir / "final_metrics.json").is_file():
        try:
            final = json.loads((run_dir / "final_metrics.json").read_text())
        except json.JSONDecodeError as e:
            problems.append(f"{run_dir / 'final_metrics.json'}: unparseable JSON ({e.msg})")
    return Run(run_dir, cfg if isinstance(cfg, dict) else {}, steps, final, label_of(run_dir, cfg), problems)


def find_runs(sweep: Path) -> list[Path]:
    found = set()
    for f in sweep.rglob("*"):
        if f.name not in ("config.yaml", "metrics.jsonl") or not f.is_file():
            continue
        d = f.parent.parent if f.parent.name == ".hydra" else f.parent
        if not SKIP_DIRS & set(d.relative_to(sweep).parts):
            found.add(d)
    return sorted(found)


def _level_key(level: Level) -> tuple:
    return (level.staleness is None, level.staleness or 0, level.via)


def group_runs(runs: list[Run]) -> dict[tuple[str, Level], list[Run]]:
    groups: dict[tuple[str, Level], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.label, run.level), []).append(run)
    return dict(sorted(groups.items(), key=lambda kv: (_level_key(kv[0][1]), kv[0][0])))


def mean_std(xs, fmt: str = "{:.3f}") -> str:
    """'m ± s' with the sample std (ddof=1); one value alone; a dash for none."""
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return DASH
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(float(np.mean(xs)))} ± {fmt.format(float(np.std(xs, ddof=1)))}"


def _show(level: Level) -> str:
    """'0' on-policy, '4 (5 epochs)', '8 (async)'; '?' for an unknown staleness."""
    head = "?" if level.staleness is None else str(level.staleness)
    return head if level.via == "on-policy" else f"{head} ({level.via})"


# ------------------------------------------------------------------------------------------- plots


def _band(runs: list[Run], key: str, smooth: int):
    """Steps, mean, min and max over the runs that logged `key` at each step."""
    per = [r.series(key) for r in runs]
    per = [(x, y) for x, y in per if len(x)]
    if not per:
        return None
    steps = np.array(sorted({s for x, _ in per for s in x}))
    col = {s: i for i, s in enumerate(steps)}
    mat = np.full((len(per), len(steps)), np.nan)
    for row, (x, y) in enumerate(per):
        if smooth > 1:  # trailing mean over the last `smooth` points
            y = np.array([np.nanmean(y[max(0, i - smooth + 1) : i + 1]) for i in range(len(y))])
        mat[row, [col[s] for s in x]] = y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step where every value is NaN
        return steps, np.nanmean(mat, 0), np.nanmin(mat, 0), np.nanmax(mat, 0)


def _draw(ax, runs, key, smooth, color, label, style="-") -> bool:
    band = _band(runs, key, smooth)
    if band is None:
        return False
    x, mean, lo, hi = band
    ax.plot(x, mean, style, color=color, label=label, lw=1.4, marker="o" if len(x) <= 25 else None, ms=3)
    if len(runs) > 1:
        ax.fill_between(x, lo, hi, color=color, alpha=0.15, lw=0)
    return True


def _label(name: str, runs: list[Run]) -> str:
    n_bad = sum(not r.complete for r in runs)
    return f"{name} (n={len(runs)}" + (f", {n_bad} incomplete)" if n_bad else ")")


def _panels(levels, title: str):
    fig, axes = plt.subplots(1, len(levels), figsize=(4.2 * len(levels), 3.4), squeeze=False, sharey=True)
    for ax, level in zip(axes[0], levels, strict=True):
        ax.set_title(f"staleness {_show(level)}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(title)
    return fig, axes[0]


def _save(fig, axes, path: Path, drew: bool) -> list[Path]:
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    if drew:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path] if drew else []


def plot_curves(groups, out: Path, smooth: int = 1) -> list[Path]:
    levels = sorted({lv for _, lv in groups}, key=_level_key)
    labels = sorted({lb for lb, _ in groups})
    color = {lb: f"C{i % 10}" for i, lb in enumerate(labels)}
    written = []
    for key, title in CURVES.items():
        fig, axes = _panels(levels, title)
        drew = False
        for ax, level in zip(axes, levels, strict=True):
            for lb in labels:
                if runs := groups.get((lb, level)):
                    drew |= _draw(ax, runs, key, smooth, color[lb], _label(lb, runs))
            if key == "learner/grad_norm" and ax.lines and all((ln.get_ydata() > 0).all() for ln in ax.lines):
                ax.set_yscale("log")
        written += _save(fig, axes, out / f"curves_{key.replace('/', '_')}.png", drew)
    return written


def plot_bapo(groups, out: Path, smooth: int = 1) -> list[Path]:
    """Figs. 8 and 9 of the paper: the searched bounds, and rho before/after the search."""
    bapo = {k: v for k, v in groups.items() if any(bounds_kind(r.cfg) == "bapo" for r in v)}
    bapo = {k: [r for r in v if bounds_kind(r.cfg) == "bapo"] for k, v in bapo.items()}
    if not bapo:
        return []
    levels = sorted({lv for _, lv in bapo}, key=_level_key)
    labels = sorted({lb for lb, _ in bapo})
    written = []
    figures = {
        "bapo_bounds.png": (
            "ratio bound",
            [("clip/high", "c_high", "-"), ("clip/low", "c_low", "--")],
        ),
        "bapo_rho.png": (
            "rho (positive share)",
            [("clip/rho", "after search", "-"), ("bapo/rho_before", "before", ":")],
        ),
    }
    for name, (title, lines) in figures.items():
        fig, axes = _panels(levels, title)
        drew = False
        for ax, level in zip(axes, levels, strict=True):
            targets = set()
            for i, lb in enumerate(labels):
                runs = bapo.get((lb, level), [])
                for key, what, style in lines:
                    drew |= bool(runs) and _draw(ax, runs, key, smooth, f"C{i}", f"{lb} {what}", style)
                targets |= {rho_target(r.cfg) for r in runs}
            for rho0 in sorted(t for t in targets if isinstance(t, int | float)) if name == "bapo_rho.png" else []:
                ax.axhline(rho0, color="grey", lw=0.8, ls="-.", label=f"target rho0={rho0}")
        written += _save(fig, axes, out / name, drew)
    return written


def plot_clipping(groups, out: Path, smooth: int = 1) -> list[Path]:
    """Every arm's clip window and its clipped fractions by advantage sign, one panel per staleness."""
    levels = sorted({lv for _, lv in groups}, key=_level_key)
    labels = sorted({lb for lb, _ in groups})
    color = {lb: f"C{i % 10}" for i, lb in enumerate(labels)}
    figures = {
        "clip_window.png": ("ratio bounds", [("clip/high", "high", "-"), ("clip/low", "low", "--")]),
        "clip_by_sign.png": (
            "clipped fraction",
            [("learner/clip_frac_pos", "A>0", "-"), ("learner/clip_frac_neg", "A<0", "--")],
        ),
    }
    written = []
    for name, (title, lines) in figures.items():
        fig, axes = _panels(levels, title)
        drew = False
        for ax, level in zip(axes, levels, strict=True):
            for lb in labels:
                for key, what, style in lines:
                    if runs := groups.get((lb, level)):
                        drew |= _draw(ax, runs, key, smooth, color[lb], f"{lb} {what}", style)
        written += _save(fig, axes, out / name, drew)
    return written


def plot_budget(groups, out: Path) -> list[Path]:
    """Held-out accuracy against the samples consumed and against wall time: one line per run."""
    levels = sorted({lv for _, lv in groups}, key=_level_key)
    labels = sorted({lb for lb, _ in groups})
    color = {lb: f"C{i % 10}" for i, lb in enumerate(labels)}
    written = []
    for axis, xlabel in (("samples", "samples consumed"), ("wall", "wall time (min)")):
        fig, axes = _panels(levels, "held-out accuracy")
        drew = False
        for ax, level in zip(axes, levels, strict=True):
            ax.set_xlabel(xlabel)
            for lb in labels:
                for i, run in enumerate(groups.get((lb, level), [])):
                    x, y = run.against("eval/accuracy", axis)
                    if len(x):
                        ax.plot(x, y, color=color[lb], lw=1, alpha=0.7, label=lb if i == 0 else None)
                        drew = True
        written += _save(fig, axes, out / f"acc_vs_{axis}.png", drew)
    return written


# ------------------------------------------------------------------------------------------ report

COLUMNS = (
    "algo|staleness|max_staleness|final acc|best acc|final greedy acc|entropy (end)|grad-norm spikes"
    "|wall time (min)|seeds|incomplete"
).split("|")
# summary key -> number format, in column order after max_staleness
STATS = {"final": "{:.3f}", "best": "{:.3f}", "greedy": "{:.3f}", "entropy": "{:.3f}", "spikes": "{:.1f}"}
STATS |= {"wall_min": "{:.1f}"}


def _row(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def results_table(groups) -> list[str]:
    lines = [_row(COLUMNS), _row(["---"] * len(COLUMNS))]
    for (label, level), runs in groups.items():
        done = [r.summary() for r in runs if r.complete]
        stats = [mean_std([s[k] for s in done], fmt) for k, fmt in STATS.items()]
        caps = "/".join(sorted({str(cfg_get(r.cfg, "buffer.max_staleness", "?")) for r in runs}))
        lines.append(_row([label, _show(level), caps, *stats, len(done), len(runs) - len(done)]))
    return lines


def _ci(stat: tuple[float, float, float], fmt: str = "{:.3f}", n: int = 2) -> str:
    """'mean [lo, hi]'; the mean alone for a single value (no interval from one seed); a dash for none."""
    mean, lo, hi = stat[:3]
    if not math.isfinite(mean):
        return DASH
    return fmt.format(mean) if n < 2 else f"{fmt.format(mean)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def interval_table(groups) -> list[str]:
    """Bootstrap 95% intervals over the completed seeds of each algo x staleness."""
    cols = ["algo", "staleness", "final acc [95% CI]", "best acc [95% CI]", "entropy (end) [95% CI]", "seeds"]
    lines = [_row(cols), _row(["---"] * len(cols))]
    for (label, level), runs in groups.items():
        done = [r.summary() for r in runs if r.complete]
        cells = [_ci(bootstrap_ci([d[k] for d in done]), n=len(done)) for k in ("final", "best", "entropy")]
        lines.append(_row([label, _show(level), *cells, len(done)]))
    return lines


def paired_table(groups, reference: str) -> list[str]:
    """Each arm minus ``reference`` on the seeds both completed at the same staleness."""
    cols = ["staleness", "arm", f"final acc − {reference} [95% CI]", f"best acc − {reference} [95% CI]", "pairs"]
    lines = [_row(cols), _row(["---"] * len(cols))]
    for (label, level), runs in groups.items():
        ref = groups.get((reference, level))
        if label == reference or not ref:
            continue
        cells = []
        for key in ("final", "best"):
            arm = {r.seed: r.summary()[key] for r in runs if r.complete}
            base = {r.seed: r.summary()[key] for r in ref if r.complete}
            mean, lo, hi, n = paired_difference(arm, base)
            cells.append(_ci((mean, lo, hi), "{:+.3f}", n))
        lines.append(_row([_show(level), label, *cells, n]))
    return lines


def pathology_table(groups) -> list[str]:
    """Per algo x staleness, means over completed seeds: entropy end/start, accuracy peak − final, rho < rho0."""
    cols = ["algo", "staleness", "entropy start → end (min)", "end/start", "acc start → peak → final",
            "peak − final", "updates with rho_before < rho0", "... of those with a signal"]  # fmt: skip
    lines = [_row(cols), _row(["---"] * len(cols))]
    for (label, level), runs in groups.items():
        p = [r.pathology() for r in runs if r.complete]
        if not p:
            continue
        m = {k: float(np.nanmean([d[k] for d in p])) if any(math.isfinite(d[k]) for d in p) else math.nan for k in p[0]}
        ratio = m["entropy_end"] / m["entropy_start"] if m["entropy_start"] else math.nan
        rho = DASH if not math.isfinite(m["rho_below_share"]) else f"{m['rho_below_share']:.0%}"
        lines.append(_row([
            label, _show(level),
            f"{m['entropy_start']:.3f} → {m['entropy_end']:.3f} ({m['entropy_min']:.3f})", f"{ratio:.2f}",
            f"{m['acc_start']:.3f} → {m['acc_peak']:.3f} → {m['acc_final']:.3f}",
            f"{m['acc_peak'] - m['acc_final']:.3f}", rho,
            DASH if not math.isfinite(m["rho_below_signal_share"]) else f"{m['rho_below_signal_share']:.0%}",
        ]))  # fmt: skip
    return lines


def render(
    sweep: Path, runs: list[Run], groups, plots: list[Path], out: Path, *, intervals: bool = False,
    reference: str = "bapo",
) -> str:  # fmt: skip
    bad = [r for r in runs if not r.complete]
    lines = [
        "# Sweep report",
        "",
        f"Sweep `{sweep}`: {len(runs)} runs, {len(runs) - len(bad)} complete, {len(bad)} incomplete.",
        "",
        "Mean ± std (sample std) over the completed seeds of each algo × staleness. Staleness is "
        "`ppo_epochs × mini_batches_per_rollout − 1` (with `train.async_rollout`, `buffer.max_staleness`), "
        "and the parentheses say how it comes about: `4 (5 epochs)` fits each rollout batch 5 times, "
        "`4 (5 mini-batches)` splits it into 5 updates, `8 (async)` generates up to 8 versions ahead. "
        "Accuracy is `eval/accuracy` at the last eval step (final) and its maximum (best); entropy is the "
        f"last logged `learner/entropy`; a grad-norm spike is a step whose grad norm exceeds {SPIKE_FACTOR:g}× "
        f"the median of all earlier steps (from the {SPIKE_MIN_HISTORY + 1}th step on); wall time sums "
        "`time/step_s`. Incomplete runs are not in the statistics; they are listed below.",
        "",
        "## Results",
        "",
        *results_table(groups),
        "",
    ]
    if intervals or any(sum(r.complete for r in g) >= 2 for g in groups.values()):
        lines += [
            "## Intervals over seeds",
            "",
            "Mean and percentile bootstrap 95% interval over the completed seeds (exact: every ordered resample "
            f"of up to {EXACT_BOOTSTRAP_MAX_N} seeds). With 3-5 seeds these intervals are wide and a little too "
            "narrow for their nominal level; read them as a guide, not a test.",
            "",
            *interval_table(groups),
            "",
            f"## Paired against {reference}",
            "",
            f"Difference arm − {reference} on the seeds both completed at the same staleness (same seed: same "
            "prompts, same initial weights), mean and bootstrap 95% interval of the per-seed differences. An "
            "interval that excludes 0 is a difference these seeds support.",
            "",
            *paired_table(groups, reference),
            "",
            "## Pathology checks",
            "",
            "Means over the completed seeds. Entropy is `learner/entropy` (nats per response token, per training "
            "step); accuracy is `eval/accuracy`. 'updates with rho_before < rho0' is the share of updates whose "
            "`bapo/rho_before` is below the run's rho0 (`bapo/search_active`; for runs logged before that "
            "metric, the share of steps whose mean `bapo/rho_before` is below). The last column counts only "
            "the updates with a learning signal (`bapo/signal`: some group neither all right nor all wrong).",
            "",
            *pathology_table(groups),
            "",
        ]
    lines += [
        "## Incomplete runs",
        "",
    ]
    if bad:
        lines += [_row(["run", "algo", "staleness", "seed", "status"]), _row(["---"] * 5)]
        for r in bad:
            name = str(r.path.relative_to(sweep)) if r.path != sweep else "."
            lines.append(_row([f"`{name}`", r.label, _show(r.level), r.seed, r.status()]))
    else:
        lines.append("None.")
    problems = [p for r in runs for p in r.problems]
    if problems:
        lines += ["", "## Unreadable lines and files", "", *[f"- `{p}`" for p in problems]]
    if plots:
        lines += ["", "## Plots", "", *[f"![{p.stem}]({p.relative_to(out)})" for p in plots]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep", type=Path, help="a multirun folder (or a single run folder)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: <sweep>/report)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing mean over K points in the plots")
    parser.add_argument("--intervals", action="store_true", help="interval, paired and pathology tables always")
    parser.add_argument("--reference", default="bapo", help="the arm the paired comparison is against")
    args = parser.parse_args(argv)
    if not args.sweep.is_dir():
        parser.error(f"not a folder: {args.sweep}")
    runs = [load_run(d) for d in find_runs(args.sweep)]
    runs = [r for r in runs if r.steps or r.final or not r.cfg or "train" in r.cfg]  # not eval.py's folders
    if not runs:
        print(f"no runs under {args.sweep} (no config.yaml or metrics.jsonl)", file=sys.stderr)
        return 1
    out = args.out or args.sweep / "report"
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    plots = plot_curves(groups, out, args.smooth) + plot_bapo(groups, out, args.smooth)
    plots += plot_clipping(groups, out, args.smooth) + plot_budget(groups, out)
    text = render(args.sweep, runs, groups, plots, out, intervals=args.intervals, reference=args.reference)
    (out / "report.md").write_text(text)
    for problem in (p for r in runs for p in r.problems):
        print(f"warning: {problem}", file=sys.stderr)
    n_bad = sum(not r.complete for r in runs)
    print(f"{out / 'report.md'}: {len(runs)} runs ({n_bad} incomplete), {len(plots)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
