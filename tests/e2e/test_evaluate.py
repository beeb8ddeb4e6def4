"""Evaluation end to end: eval.py in its own process, and a training run that skips over-long eval-set prompts."""

import json
import os
import subprocess
import sys

import pytest

from bapo.eval.job import build_job, load_evalset
from tests.helpers.evaluation_runs import TINY_RUN, _cfg, _check_run_folder
from tests.helpers.paths import ROOT

# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_eval_py_subprocess(tmp_path):
    out = tmp_path / "run"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "eval.py", "model=tiny", "eval=arith", *TINY_RUN, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _check_run_folder(out, {"arith": 3}, 2)
    assert results["sets"]["arith"]["metrics"]["avg@2"] > 0  # the tiny model does arithmetic


# ----------------------------------------------------------------------------- prompt length


@pytest.mark.slow
def test_training_skips_and_counts_over_long_eval_set_prompts(tmp_path, shared_data, tiny_tok):
    from bapo.data.loading import render_prompt
    from bapo.loop import run
    from tests.helpers.config import compose

    problems = load_evalset(build_job(_cfg(["eval=aime24"])).sets["aime24"], limit=8)
    too_long = sum(len(render_prompt(p, tiny_tok).ids) > 256 - 48 for p in problems)
    over = ["debug=smoke", "train.steps=1", "eval.every=0", "eval.greedy=false", "data.heldout_size=4"]
    run(compose(*over, "eval.sets=[aime24]", "eval.sets_k=2", "eval.sets_limit=8"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/aime24/skipped"] == too_long > 0 and rows[-1]["eval/aime24/skipped"] == too_long
