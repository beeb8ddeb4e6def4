"""Turn a sweep folder, or a study's packed raw data, into a Markdown table and PNG plots.

    python scripts/study/report.py multirun/ablation_staleness [--out DIR] [--smooth K]
    python scripts/study/report.py docs/study/v4/runs.jsonl.gz --out docs/study/v4

Every folder under the sweep that holds `config.yaml`, `.hydra/config.yaml` or `metrics.jsonl` is a
run; a pack (`scripts/study/pack_study.py`, written at the end of `scripts/study/run_grid.py`) holds the same runs,
and the report made from it is the report made from the folder, byte for byte. Runs are pooled into cells (`group_runs`:
runs that differ in nothing but the seed), shown by algo x staleness, and written to DIR (default `<sweep>/report`,
or the pack's folder):

- `report.md`: one row per cell (algo x staleness, and any other key that differs) with final and best held-out
  accuracy, entropy at the end, grad-norm spikes and wall time (mean ± std over the completed seeds), a table of
  incomplete runs, and every unreadable metrics line as `file:line`;
- `curves_*.png`: eval accuracy, reward, entropy and grad norm over steps, one panel per staleness
  level, one line per algo (mean over seeds), a min-max band over seeds;
- `bapo_bounds.png`, `bapo_rho.png`: BAPO's ratio_low / ratio_high over training and the positive
  share rho before and after the bound search (the paper's Figs. 8 and 9);
- `clip_window.png`, `clip_by_sign.png`: every arm's clip window (`clip/low`, `clip/high`) and its
  clipped fractions by advantage sign (`learner/clip_frac_pos`, `learner/clip_frac_neg`);
- `acc_vs_samples.png`, `acc_vs_wall.png`: held-out accuracy against the samples consumed (the running
  sum of `buffer/served`) and against wall time (the running sum of `time/step_s`).

With `--intervals` (or whenever some group has two or more completed seeds) report.md also has:
- Student-t 95% intervals over seeds of final accuracy, best accuracy and final entropy (`t_interval`), each
  printed with its method and n (`0.142 [0.120, 0.164] t, n=10`);
- a paired comparison of every arm against `--reference` (default bapo) on the seeds both completed at
  the same staleness: the mean difference (arm − reference), its paired-t interval and p-value
  (`paired_t`), and the p-value adjusted by Holm-Bonferroni over the table's comparisons (`holm`);
- the pathology checks: entropy at the end over entropy at the start, the drop of accuracy from its
  peak, and the share of steps on which `bapo/rho_before` < rho0.

What the intervals may be read as:
- fewer than MIN_CLAIM_N seeds (or pairs): "n < 5: descriptive only"; no sentence reads a difference into them;
- a cell whose mean accuracy is under FLOOR_SHARE (fewer right answers than 2% of its `eval.n` x
  `data.heldout_size` samples) is marked `floor`; a comparison of two floor cells is not ranked;
- a paired row says one arm is above or below the reference only when its Holm-adjusted p is under 0.05.

Definitions (repeated in report.md):
- staleness: `staleness_of(cfg)`, followed by how it comes about (`staleness_via`) unless on-policy:
  `4 (5 epochs)` and `4 (5 mini-batches)` are separate groups. Under partial rollouts (`rollout.partial_budget`
  b of `rollout.max_new_tokens` L) a token may wait ceil(L / b) - 1 more steps for its response's last segment:
  `3 (partial 14/56)` is the oldest token's age. `buffer.max_staleness` is its own column.
- a cell: the runs whose configs differ in the seed alone (`cell_config`: every key but `seed`, the values
  composed from it and the bookkeeping keys `logger`, `resume`, `overwrite`), and whose arm labels agree. A cell is
  shown as its algo label and staleness; cells that share both are named by the keys that tell them apart,
  `bapo (learner.lr=0.001)`, and a paired comparison is made only between cells that agree on those keys.
- a run is complete when `final_metrics.json` exists. Incomplete runs (crashed, interrupted or still
  running) are left out of the statistics, counted in the `incomplete` column and listed by name, with the last
  `error:` line or exception of their logs; so are the runs `scripts/study/run_grid.py` queued or started that left
  no run folder (a start-up error removes the folder it made).
- grad-norm spike: a step whose `learner/grad_norm` exceeds 3x the median of all earlier steps'
  grad norms; steps with fewer than 5 earlier values are never counted.
- wall time: the sum of `time/step_s` (which includes that step's eval) plus step 0's `time/eval_s`.
- rows that repeat a step (a resumed run re-logs the steps after its checkpoint) are merged, the
  later value winning.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts/ is read as a namespace package, as gpu_check.py does
from bapo.infra.artifacts import ArtifactError  # noqa: E402
from scripts.study.pack_study import (  # noqa: E402
    PackError,
    UsageParser,
    read_folder,
    read_pack,
    read_run,
    record_steps,
    sweep_name,
)
from scripts.study.study_stats import (  # noqa: E402
    FLOOR_SHARE,
    LEVEL,
    MIN_CLAIM_N,
    Interval,
    holm,
    paired_t,
    t_interval,
)

SPIKE_FACTOR = 3.0
SPIKE_MIN_HISTORY = 5
CURVES = {
    "eval/accuracy": "held-out accuracy",
    "reward/mean": "reward",
    "learner/entropy": "entropy",
    "learner/grad_norm": "grad norm",
}
DASH = "—"


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
    return epochs * mini_batches * (1 + partial_lag(cfg)) - 1


def partial_lag(cfg: dict) -> int:
    """Steps a token may wait for its response's last segment under partial rollouts (`rollout.partial_budget` b
    of `rollout.max_new_tokens` L: ceil(L / b) - 1, as bapo.rollout.schedule.partial_lag); 0 without them."""
    b, cap = _as_int(cfg_get(cfg, "rollout.partial_budget")), _as_int(cfg_get(cfg, "rollout.max_new_tokens"))
    if b is None or cap is None or b >= cap:
        return 0
    return -(-cap // b) - 1


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
    if partial_lag(cfg):  # "partial 14/56": a budget of 14 of 56 tokens a step
        budget = f"partial {cfg_get(cfg, 'rollout.partial_budget')}/{cfg_get(cfg, 'rollout.max_new_tokens')}"
        reuse = f"{reuse}, {budget}" if reuse else budget
    if cfg_get(cfg, "train.async_rollout") is True:
        return f"async, {reuse}" if reuse else "async"
    return reuse or "on-policy"


class Level(NamedTuple):
    """A group of the report besides the algo: the staleness and how it comes about (`staleness_via`)."""

    staleness: int | None
    via: str


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


@dataclass
class Run:
    """One run as the report reads it, from a run folder or a pack's record (``scripts/study/pack_study.py``)."""

    name: str  # the folder relative to the sweep ("." when the sweep is the run)
    cfg: dict
    steps: dict[int, dict]
    complete: bool
    label: str
    problems: list[str]  # file names relative to the sweep
    exception: str | None = None  # "<log>: <last exception line>" of a run that is not complete
    checkpoint: bool = False
    overrides: tuple[str, ...] = ()
    folder: bool = True  # False: run_grid queued or started it, and it left no run folder
    cell: str = ""  # the name of its cell in the report (`group_runs`): the label, and what tells it apart
    apart: tuple[str, ...] = ()  # the config keys that tell its cell from the others of its label and staleness
    defining: dict[str, str] = field(default_factory=dict)  # its cell_config as group_runs compares it

    @classmethod
    def from_record(cls, record: dict) -> Run:
        cfg, overrides = record["config"], record.get("overrides", [])
        return cls(
            name=record["run"], cfg=cfg, steps=record_steps(record), complete=record["status"] == "complete",
            label=label_of(overrides, cfg), problems=list(record.get("problems", [])),
            exception=record.get("exception"), checkpoint=bool(record.get("checkpoint")),
            overrides=tuple(str(o) for o in overrides or []), folder=record.get("folder", True) is not False,
        )  # fmt: skip

    @property
    def staleness(self) -> int | None:
        return staleness_of(self.cfg)

    @property
    def level(self) -> Level:
        return Level(self.staleness, staleness_via(self.cfg))

    @property
    def seed(self):
        given = [o.split("=", 1)[1] for o in self.overrides if o.lstrip("+~").startswith("seed=")]
        return cfg_get(self.cfg, "seed", given[-1] if given else DASH)

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
        if not self.folder:
            return f"no run folder; {self.exception}" if self.exception else "no run folder"
        planned = _as_int(cfg_get(self.cfg, "train.steps")) or "?"
        done = max(self.steps) if self.steps else None
        text = f"incomplete at step {done} of {planned}" if done is not None else f"no metrics logged (of {planned})"
        text += "; resumable (checkpoints/)" if self.checkpoint else "; no checkpoint"
        return f"{text}; {self.exception}" if self.exception else text


def label_of(overrides: list[str], cfg: dict) -> str:
    """algo.name (the ``algo=`` override for a run without a config), plus any algo.* and algo/<group> command-line
    overrides (ablations keep the algo's name)."""
    given = [str(o).lstrip("+~") for o in overrides or []]
    chosen = [o[len("algo=") :] for o in given if o.startswith("algo=")]
    name = str(cfg_get(cfg, "algo.name", chosen[-1] if chosen else "?"))
    extra = [o[len("algo.") :] for o in given if o.startswith("algo.")]
    extra += [o[len("algo/") :] for o in given if o.startswith("algo/")]  # a sub-group: algo/correction=tis
    return f"{name}[{','.join(extra)}]" if extra else name


def load_run(run_dir: Path, sweep: Path | None = None) -> Run:
    """One run folder (file names in its problems relative to ``sweep``, default the folder's parent)."""
    return Run.from_record(read_run(run_dir, sweep))


def load_runs(source: Path) -> tuple[str, list[Run]]:
    """The sweep's name and its training runs, from a multirun folder or from a pack file."""
    if source.is_dir():
        name, records = sweep_name(source), read_folder(source)
    else:
        name, records = read_pack(source)
    return name, [Run.from_record(r) for r in records]


def _level_key(level: Level) -> tuple:
    return (level.staleness is None, level.staleness or 0, level.via)


BOOKKEEPING = ("logger", "resume", "overwrite")  # where a run's metrics go, how its folder starts: not what it computes


def cell_config(cfg: dict) -> dict[str, str]:
    """What defines a run's cell: every leaf of its config as ``dotted.key -> JSON``, less the seed (``seed``, and a
    ``*seed*`` key equal to it: a value composed from it, ``data.train_seed: ${seed}``) and the BOOKKEEPING keys."""
    seed = cfg.get("seed")
    out: dict[str, str] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                walk(value, dotted + ".")
            elif not (dotted == "seed" or ("seed" in str(key) and type(value) is type(seed) and value == seed)):
                out[dotted] = json.dumps(value, sort_keys=True)

    walk({k: v for k, v in cfg.items() if k not in BOOKKEEPING}, "")
    return out


def schema_drift(configs: list[dict[str, str]]) -> set[str]:
    """Keys that some configs lack and the others all give one value: a key the code of some runs did not have yet
    (or no longer had), not a setting anyone chose. (A key with two values somewhere is a setting: a run without
    it is a cell of its own.)"""
    keys = {k for c in configs for k in c}
    return {k for k in keys if any(k not in c for c in configs) and len({c[k] for c in configs if k in c}) == 1}


def group_runs(runs: list[Run]) -> dict[tuple[str, Level], list[Run]]:
    """The report's cells, (name, staleness) -> runs, sorted by staleness then name.

    Runs pool into one cell when their labels and their ``cell_config`` agree: they differ in the seed alone. An
    override of anything else (a learning rate, a model, a step budget) changes the config, and so the cell; how
    the override was spelled, or which launcher gave it, does not. A key that only some runs have (``schema_drift``)
    is not compared. A cell is named by its label; where several cells share a label and a staleness, each name
    adds the keys that tell them apart, ``bapo (learner.lr=0.001)``. Runs with no folder (``Run.folder``) are in no
    cell: the report lists them, and pools nothing with them."""
    placed = [r for r in runs if r.folder]
    configs = [cell_config(r.cfg) for r in placed]
    drift = schema_drift(configs)
    cells: dict[tuple, list[Run]] = {}
    for run, config in zip(placed, configs, strict=True):
        run.defining = {k: v for k, v in config.items() if k not in drift}
        cells.setdefault((run.label, tuple(sorted(run.defining.items()))), []).append(run)
    by_arm: dict[tuple[str, Level], list[list[Run]]] = {}
    for members in cells.values():
        by_arm.setdefault((members[0].label, members[0].level), []).append(members)
    groups: dict[tuple[str, Level], list[Run]] = {}
    for (label, level), arm in by_arm.items():
        values = [members[0].defining for members in arm]
        apart = sorted({k for v in values for k in v if len({other.get(k) for other in values}) > 1})
        for members, v in zip(arm, values, strict=True):
            name = f"{label} ({', '.join(f'{k}={_value(v.get(k))}' for k in apart)})" if apart else label
            for run in members:
                run.cell, run.apart = name, tuple(apart)
            groups[(name, level)] = members
    return dict(sorted(groups.items(), key=lambda kv: (_level_key(kv[0][1]), kv[0][0])))


def _value(encoded: str | None) -> str:
    """A config value as a cell's name shows it: strings bare, the rest as JSON; a dash for a key the run lacks."""
    if encoded is None:
        return DASH
    value = json.loads(encoded)
    return value if isinstance(value, str) else json.dumps(value)


def same_conditions(a: list[Run], b: list[Run]) -> bool:
    """Two cells of two arms compare like for like: they agree on every key outside ``algo`` that tells either apart
    from the other cells of its own arm (a learning rate swept for both arms pairs grpo at 1e-3 with bapo at 1e-3,
    never with bapo at 1e-5)."""
    keys = {k for k in (*a[0].apart, *b[0].apart) if not k.startswith("algo.")}
    return all(a[0].defining.get(k) == b[0].defining.get(k) for k in keys)


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


def eval_samples(runs: list[Run]) -> int | None:
    """Held-out samples behind one ``eval/accuracy`` of these runs: ``eval.n`` x ``data.heldout_size`` (the
    smallest, if the runs differ); None when the configs do not say."""
    sizes = [(_as_int(cfg_get(r.cfg, "eval.n")), _as_int(cfg_get(r.cfg, "data.heldout_size"))) for r in runs]
    sizes = [n * size for n, size in sizes if n and size]
    return min(sizes) if sizes else None


def at_floor(mean: float) -> bool:
    """Fewer right answers than FLOOR_SHARE of the samples: differences there are a handful of answers."""
    return math.isfinite(mean) and mean < FLOOR_SHARE


def _floor_mark(mean: float, samples: int | None) -> str:
    right = f"≈{mean * samples:.1f} of {samples} right" if samples else f"under {FLOOR_SHARE:.0%} right"
    return f"floor ({right})"


ACCURACY = ("final", "best", "greedy")  # the summary keys that are accuracies: the floor applies to them


def results_table(groups) -> list[str]:
    lines = [_row(COLUMNS), _row(["---"] * len(COLUMNS))]
    for (label, level), runs in groups.items():
        done = [r.summary() for r in runs if r.complete]
        stats = []
        for k, fmt in STATS.items():
            values = [s[k] for s in done if math.isfinite(s[k])]
            floor = k in ACCURACY and values and at_floor(float(np.mean(values)))
            stats.append(mean_std(values, fmt) + (" (floor)" if floor else ""))
        caps = "/".join(sorted({str(cfg_get(r.cfg, "buffer.max_staleness", "?")) for r in runs}))
        lines.append(_row([label, _show(level), caps, *stats, len(done), len(runs) - len(done)]))
    return lines


def _ci(stat: Interval, fmt: str = "{:.3f}", method: str = "t") -> str:
    """'mean [lo, hi] <method>, n=<n>'; 'mean (n=1)' for a single value (no interval from one seed); a dash
    for none."""
    if not math.isfinite(stat.mean):
        return DASH
    if stat.n < 2:
        return f"{fmt.format(stat.mean)} (n={stat.n})"
    return f"{fmt.format(stat.mean)} [{fmt.format(stat.lo)}, {fmt.format(stat.hi)}] {method}, n={stat.n}"


def _p(p: float) -> str:
    return DASH if not math.isfinite(p) else "<0.001" if p < 0.001 else f"{p:.3f}"


def interval_table(groups) -> list[str]:
    """Student-t intervals over the completed seeds of each algo x staleness; accuracy cells at the floor marked."""
    cols = ["algo", "staleness", "final acc", "best acc", "entropy (end)", "eval samples", "reading"]
    lines = [_row(cols), _row(["---"] * len(cols))]
    for (label, level), runs in groups.items():
        done = [r.summary() for r in runs if r.complete]
        samples = eval_samples([r for r in runs if r.complete])
        cells = []
        for k in ("final", "best", "entropy"):
            stat = t_interval([d[k] for d in done])
            floor = k in ACCURACY and at_floor(stat.mean)
            cells.append(_ci(stat) + (f", {_floor_mark(stat.mean, samples)}" if floor else ""))
        reading = f"n < {MIN_CLAIM_N}: descriptive only" if len(done) < MIN_CLAIM_N else DASH
        lines.append(_row([label, _show(level), *cells, samples or "?", reading]))
    return lines


def paired_rows(groups, reference: str) -> list[dict]:
    """Every comparison of the paired table: each arm minus ``reference`` in final and best accuracy, on the seeds
    both completed at the same staleness, with its raw p and (for those that enter the correction) Holm's."""
    rows = []
    for (label, level), runs in groups.items():
        refs = [g for (_, lv), g in groups.items() if lv == level and g[0].label == reference]
        ref = next((g for g in refs if same_conditions(runs, g)), None)
        if runs[0].label == reference or not ref:
            continue
        for key in ("final", "best"):
            arm = {r.seed: r.summary()[key] for r in runs if r.complete}
            base = {r.seed: r.summary()[key] for r in ref if r.complete}
            floor = all(at_floor(t_interval(list(side.values())).mean) for side in (arm, base))
            stat = paired_t(arm, base)
            rows.append({"level": level, "arm": label, "key": key, "stat": stat, "floor": floor,
                         "counted": stat.n >= MIN_CLAIM_N and not floor and math.isfinite(stat.p)})  # fmt: skip
    adjusted = holm([r["stat"].p if r["counted"] else math.nan for r in rows])
    for r, p in zip(rows, adjusted, strict=True):
        r["holm"] = p
    return rows


def _reading(r: dict, reference: str) -> str:
    if r["stat"].n == 0:
        return "no shared seeds"
    if r["stat"].n < MIN_CLAIM_N:
        return f"n < {MIN_CLAIM_N}: descriptive only"
    if r["floor"]:
        return "both at floor: not ranked"
    if not r["holm"] < 0.05:
        return "not separated"
    return f"{r['arm']} {'above' if r['stat'].mean > 0 else 'below'} {reference}"


def paired_table(rows: list[dict], reference: str) -> list[str]:
    """One row per comparison of :func:`paired_rows`."""
    cols = ["staleness", "arm", "metric", f"arm − {reference}", "p", "p (Holm)", "reading"]
    lines = [_row(cols), _row(["---"] * len(cols))]
    for r in rows:
        cell = _ci(r["stat"], "{:+.3f}", "paired t")
        metric = {"final": "final acc", "best": "best acc"}[r["key"]]
        lines.append(_row([_show(r["level"]), r["arm"], metric, cell, _p(r["stat"].p), _p(r["holm"]),
                           _reading(r, reference)]))  # fmt: skip
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


def _where(sweep: str, problem: str) -> str:
    """A problem's file name (relative to the sweep) as a path from where the sweep was read."""
    return f"{sweep}{problem[1:]}" if problem.startswith(".:") else f"{sweep}/{problem}"


def _interval_sections(groups, reference: str) -> list[str]:
    rows = paired_rows(groups, reference)
    m = sum(r["counted"] for r in rows)
    return [
        "## Intervals over seeds",
        "",
        f"Mean and Student-t {LEVEL:.0%} interval over the completed seeds (`t`: mean ± t · s / √n, s the sample "
        f"std; exact for normal seed-to-seed noise, somewhat narrow for skewed noise at small n), with n beside "
        f"each. Rows with fewer than {MIN_CLAIM_N} seeds are descriptive only. An accuracy cell whose mean is "
        f"under {FLOOR_SHARE:.0%} (fewer right answers than {FLOOR_SHARE:.0%} of its eval samples, `eval.n` × "
        "`data.heldout_size`) is marked `floor`: its differences are a handful of answers, and it is not ranked.",
        "",
        *interval_table(groups),
        "",
        f"## Paired against {reference}",
        "",
        f"Difference arm − {reference} on the seeds both completed at the same staleness (same seed: same "
        f"prompts, same initial weights): mean and paired-t {LEVEL:.0%} interval of the per-seed differences "
        "(unadjusted), and the two-sided p of a paired t test. "
        f"**{m} of the {len(rows)} comparisons below enter the correction** (those with at least {MIN_CLAIM_N} "
        "pairs and not both at the floor); `p (Holm)` is Holm-Bonferroni over those "
        f"{m}, and a reading names a direction only when it is under 0.05. Rows with fewer pairs are descriptive "
        "only, and a comparison of two floor cells is not ranked.",
        "",
        *paired_table(rows, reference),
        "",
    ]


def render(
    sweep: str, runs: list[Run], groups, plots: list[Path], out: Path, *, intervals: bool = False,
    reference: str = "bapo", smooth: int = 1,
) -> str:  # fmt: skip
    bad = [r for r in runs if not r.complete]
    failed = sum(r.exception is not None or not r.folder for r in bad)
    options = f"--reference {reference} --smooth {smooth}" + (" --intervals" if intervals else "")
    named = sorted({r.cell for g in groups.values() for r in g if r.apart})
    lines = [
        "# Sweep report",
        "",
        f"Sweep `{sweep}`: {len(runs)} runs, {len(runs) - len(bad)} complete, {len(bad)} incomplete"
        + (f" ({failed} failed or never started: listed under *Incomplete runs*)." if failed else "."),
        "",
        "Mean ± std (sample std) over the completed seeds of each algo × staleness. Staleness is "
        "`ppo_epochs × mini_batches_per_rollout − 1` (with `train.async_rollout`, `buffer.max_staleness`), "
        "and the parentheses say how it comes about: `4 (5 epochs)` fits each rollout batch 5 times, "
        "`4 (5 mini-batches)` splits it into 5 updates, `8 (async)` generates up to 8 versions ahead. "
        "Accuracy is `eval/accuracy` at the last eval step (final) and its maximum (best); entropy is the "
        f"last logged `learner/entropy`; a grad-norm spike is a step whose grad norm exceeds {SPIKE_FACTOR:g}× "
        f"the median of all earlier steps (from the {SPIKE_MIN_HISTORY + 1}th step on); wall time sums "
        f"`time/step_s`. An accuracy under {FLOOR_SHARE:.0%} is marked `(floor)`. Incomplete runs are not in the "
        "statistics; they are listed below.",
        "",
    ]
    if named:  # only then: a report whose cells are all alone at their algo x staleness reads as before
        lines += [
            "Runs are pooled only when they differ in the seed alone. Cells that share an algo and a staleness "
            "but differ in other keys are rows of their own, named by those keys: "
            + ", ".join(f"`{n}`" for n in named)
            + ".",
            "",
        ]
    lines += [
        f"Options: `{options}` (`scripts/study/report.py <sweep or pack> {options}` makes this report again).",
        "",
        "## Results",
        "",
        *results_table(groups),
        "",
    ]
    if intervals or any(sum(r.complete for r in g) >= 2 for g in groups.values()):
        lines += [
            *_interval_sections(groups, reference),
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
            level = _show(r.level) if r.folder else DASH
            lines.append(_row([f"`{r.name}`", r.cell or r.label, level, r.seed, r.status()]))
    else:
        lines.append("None.")
    problems = [_where(sweep, p) for r in runs for p in r.problems]
    if problems:
        lines += ["", "## Unreadable lines and files", "", *[f"- `{p}`" for p in problems]]
    if plots:
        lines += ["", "## Plots", "", *[f"![{p.stem}]({p.relative_to(out)})" for p in plots]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Bad input (a missing or empty folder, a damaged pack, a bad option) is one ``error:`` line and exit status 2,
    with nothing written."""
    parser = UsageParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep", type=Path, help="a multirun folder (or a single run folder), or a study's pack")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: <sweep>/report, or the pack's)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing mean over K >= 1 points in the plots")
    parser.add_argument("--intervals", action="store_true", help="interval, paired and pathology tables always")
    parser.add_argument("--reference", default="bapo", help="the arm the paired comparison is against")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"argument --smooth: must be at least 1 (1: no smoothing), got {args.smooth}")
    if not args.sweep.exists():
        return _error("FileNotFoundError", f"no such folder or pack: {args.sweep}")
    try:
        sweep, runs = load_runs(args.sweep)
    except (PackError, ArtifactError) as e:  # a damaged pack or one over its bounds; a sweep's log over its bound
        return _error(type(e).__name__, str(e))
    if not runs:
        return _error("FileNotFoundError", f"no runs under {args.sweep} (no config.yaml or metrics.jsonl)")
    out = args.out or (args.sweep / "report" if args.sweep.is_dir() else args.sweep.parent)
    blocked = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        return _error("NotADirectoryError", f"--out {out}: {blocked} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _error(type(e).__name__, f"--out {out}: {e.strerror}")
    groups = group_runs(runs)
    plots = plot_curves(groups, out, args.smooth) + plot_bapo(groups, out, args.smooth)
    plots += plot_clipping(groups, out, args.smooth) + plot_budget(groups, out)
    text = render(
        sweep, runs, groups, plots, out, intervals=args.intervals, reference=args.reference, smooth=args.smooth
    )
    (out / "report.md").write_text(text)
    for problem in (p for r in runs for p in r.problems):
        print(f"warning: {_where(sweep, problem)}", file=sys.stderr)
    for r in runs:
        if not r.complete and (r.exception is not None or not r.folder):
            print(f"failed: {r.name}: {r.status()}", file=sys.stderr)
    n_bad = sum(not r.complete for r in runs)
    print(f"{out / 'report.md'}: {len(runs)} runs ({n_bad} incomplete), {len(plots)} plots")
    return 0


def _error(kind: str, message: str) -> int:
    print(f"error: {kind}: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
