"""Training-health monitor: warns about entropy collapse, saturated positive clipping, and a BAPO
target the bound search cannot reach.

The first two failure modes are the ones BAPO is about (BAPO.md, "The problem"):

* ``monitor/entropy_collapse``: the mean of ``learner/entropy`` over the first
  ``entropy_window`` steps is the reference; the first later step whose entropy is
  below ``entropy_frac`` x reference logs one warning, and the flag is 1 from that
  step on (0 before).
* ``monitor/clip_saturation``: the first time the positive clip fraction
  (``learner/clip_frac_high``: A > 0 tokens with r > ratio_high) is above
  ``clip_threshold`` for ``clip_patience`` consecutive optimizer updates, one
  warning; the flag is 1 from then on.

* ``monitor/target_out_of_reach`` (runs whose bounds come from BAPO's search): 1 on a step where
  more than half of the updates ran the search to the end of its path without reaching rho0 (for
  the paper's search: the corner [b-, b+]; ``bapo/search_active`` and ``bapo/target_reached`` of
  each update), else 0. The first such step logs a warning with the bounds the search sat at, and
  a later one again once ``target_every`` steps (10) have passed since the last warning: where the
  search saturates, BAPO is a switch between two fixed windows, not a balance.

It reads the metrics the loop already has (the step's means and each update's
own row) and returns its flags as metrics. It only watches: nothing is changed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from bapo.infra.checks import require, resumable

log = logging.getLogger(__name__)

ENTROPY_KEY = "learner/entropy"
CLIP_KEY = "learner/clip_frac_high"
ACTIVE_KEY, REACHED_KEY = "bapo/search_active", "bapo/target_reached"


class Monitor:
    def __init__(
        self,
        *,
        entropy_frac: float,
        entropy_window: int,
        clip_threshold: float,
        clip_patience: int,
        target_every: int = 10,
    ):
        self.entropy_frac = entropy_frac
        self.entropy_window = entropy_window
        self.clip_threshold = clip_threshold
        self.clip_patience = clip_patience
        self.early_entropy: list[float] = []
        self.clip_run = 0  # consecutive updates above the threshold
        self.entropy_collapse = False
        self.clip_saturation = False
        self.target_every = target_every
        self.steps = 0  # steps observed
        self.target_warned: int | None = None  # the observed step of the last out-of-reach warning

    @property
    def entropy_ref(self) -> float | None:
        """Mean entropy over the first ``entropy_window`` steps, once they are seen."""
        if len(self.early_entropy) < self.entropy_window:
            return None
        return sum(self.early_entropy) / len(self.early_entropy)

    def observe(self, step_metrics: dict[str, float], updates: Sequence[dict[str, float]] = ()) -> dict[str, float]:
        """Feed one step (its mean metrics and its updates' rows); returns the monitor's metrics."""
        out = {}
        entropy = step_metrics.get(ENTROPY_KEY)
        if entropy is not None:
            ref = self.entropy_ref
            if ref is None:
                self.early_entropy.append(float(entropy))
            elif not self.entropy_collapse and entropy < self.entropy_frac * ref:
                self.entropy_collapse = True
                log.warning(
                    "entropy collapse: learner/entropy %.4g is below %.2g x %.4g (its mean over the first %d steps)",
                    entropy,
                    self.entropy_frac,
                    ref,
                    self.entropy_window,
                )
            if self.entropy_ref is not None:
                out["monitor/entropy_ref"] = self.entropy_ref
        for row in updates:
            clip = row.get(CLIP_KEY)
            if clip is None:
                continue
            self.clip_run = self.clip_run + 1 if clip > self.clip_threshold else 0
            if not self.clip_saturation and self.clip_run >= self.clip_patience:
                self.clip_saturation = True
                log.warning(
                    "positive clipping saturated: %s > %.2g for %d consecutive updates; "
                    "low-probability positive tokens are being kept out of the gradient",
                    CLIP_KEY,
                    self.clip_threshold,
                    self.clip_run,
                )
        out["monitor/entropy_collapse"] = float(self.entropy_collapse)
        out["monitor/clip_saturation"] = float(self.clip_saturation)
        self.steps += 1
        searched = [row for row in updates if ACTIVE_KEY in row]
        if searched:
            out["monitor/target_out_of_reach"] = float(self._target(searched))
        return out

    def _target(self, rows: Sequence[dict[str, float]]) -> bool:
        """Whether most of a step's updates ran BAPO's search to its end unmet; warns (rate-limited) if so."""
        # an update's share of search units that engaged and did not reach rho0 (0 or 1 at mini-batch scope)
        unmet = [row[ACTIVE_KEY] * (1.0 - row.get(REACHED_KEY, 1.0)) for row in rows]
        if sum(unmet) <= len(rows) / 2:
            return False
        if self.target_warned is None or self.steps - self.target_warned >= self.target_every:
            self.target_warned = self.steps
            sat = [row for row, u in zip(rows, unmet, strict=True) if u > 0]
            mean = lambda key: sum(r.get(key, float("nan")) for r in sat) / len(sat)  # noqa: E731
            log.warning(
                "BAPO's target is out of reach: on %d of %d updates the search ran to its end without reaching "
                "rho0; the bounds sit at [%.2f, %.2f], where rho is %.3f (moved %+.4f by the search) and %.1f%% of "
                "the advantage-carrying tokens lie beyond them. BAPO acts here as a switch between its starting "
                "window and this one (docs/metrics.md, bapo/target_reached)",
                len(sat),
                len(rows),
                mean("clip/low"),
                mean("clip/high"),
                mean("clip/rho"),
                mean("bapo/rho_moved"),
                100 * mean("bapo/beyond_bounds"),
            )
        return True

    def state_dict(self) -> dict:
        return {
            "early_entropy": list(self.early_entropy),
            "clip_run": self.clip_run,
            "entropy_collapse": self.entropy_collapse,
            "clip_saturation": self.clip_saturation,
            "steps": self.steps,
            "target_warned": self.target_warned,
        }

    def load_state_dict(self, state: dict) -> None:
        self.early_entropy = list(state["early_entropy"])
        self.clip_run = state["clip_run"]
        self.entropy_collapse = state["entropy_collapse"]
        self.clip_saturation = state["clip_saturation"]
        # checkpoints written before the out-of-reach warning have neither: it then warns afresh
        self.steps = int(state.get("steps", 0))
        self.target_warned = state.get("target_warned")


# ----------------------------------------------------------------------------- config


@dataclass
class MonitorConfig:
    """Training-health warnings (bapo/monitor.py)."""

    entropy_frac: float = resumable()
    entropy_window: int = resumable()
    clip_threshold: float = resumable()
    clip_patience: int = resumable()

    def __post_init__(self) -> None:
        require(0 < self.entropy_frac < 1, "monitor.entropy_frac", f"must be in (0, 1), got {self.entropy_frac}")
        require(self.entropy_window >= 1, "monitor.entropy_window", "must be >= 1")
        require(0 <= self.clip_threshold < 1, "monitor.clip_threshold", "must be in [0, 1)")
        require(self.clip_patience >= 1, "monitor.clip_patience", "must be >= 1")
