"""The first steps of `python train.py`: the default job must visibly learn.

The README's curve (seeds 1-3, 150 steps of 64 prompts) rises from about 0.43 to 0.63-0.67 held-out accuracy;
its first 20 steps already gain 10.5-12.8 points. This runs those 20 steps of the default config (BAPO, tiny
model, arithmetic) and asks for a gain of 5 points, well outside the evaluation's noise (800 samples). With the
learner broken the same run stays at or below step 0: `learner.lr=1e-12` gave -0.5 points, and the advantage's
sign flipped gave -41.
"""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bapo.loop import run

pytestmark = pytest.mark.slow  # about a minute on 2 cores

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


def short_default_run(run_dir: Path, *overrides: str) -> list[dict]:
    quiet = ["logger.mode=disabled", "logger.progress=false", "checkpoint.every=0"]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(
            config_name="config", overrides=[f"train.steps={STEPS}", f"eval.every={STEPS}", *quiet, *overrides]
        )
    run(cfg, run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/accuracy" in r]


def test_the_default_job_gains_five_points_in_twenty_steps(tmp_path):
    first, last = short_default_run(tmp_path)
    assert (first["step"], last["step"]) == (0, STEPS)
    assert 0.38 <= first["eval/accuracy"] <= 0.48, first["eval/accuracy"]  # the shipped model's starting point
    assert last["eval/accuracy"] >= first["eval/accuracy"] + 0.05, (first["eval/accuracy"], last["eval/accuracy"])
