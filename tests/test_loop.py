"""The real loop, end to end, on the shipped tiny model."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from bapo.loop import run

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = [
    "step",
    "reward/mean",
    "bapo/ratio_low",
    "bapo/ratio_high",
    "bapo/rho",
    "learner/entropy",
    "learner/grad_norm",
    "buffer/staleness_mean",
    "time/step_s",
]


def _cfg(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="config", overrides=["debug=smoke", *overrides])


@pytest.mark.parametrize("algo", ["bapo", "grpo"])
def test_smoke_run_trains_and_logs(tmp_path, algo):
    final = run(_cfg([f"algo={algo}", "learner.lr=1e-2"]), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    for r in rows[1:]:
        for k in REQUIRED:
            assert k in r and r[k] is not None and math.isfinite(r[k]), (k, r.get(k))
        assert r["learner/updates"] == 2 and r["buffer/staleness_max"] <= 1
    assert rows[-1]["policy/version"] == 6
    if algo == "grpo":
        assert {r["bapo/ratio_low"] for r in rows[1:]} == {0.8}
    # weights moved, and the export reloads through from_pretrained (safetensors)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "tiny-math")
    new = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert any(not torch.equal(a, b) for a, b in zip(base.parameters(), new.parameters(), strict=True))
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert final["policy/version"] == 6
    assert (tmp_path / "config.yaml").read_text().count("algo:") == 1


def test_same_seed_same_metrics(tmp_path):
    a = run(_cfg(["train.steps=2"]), tmp_path / "a")
    b = run(_cfg(["train.steps=2"]), tmp_path / "b")
    volatile = ("time/", "rollout/tokens_per_s", "reward/verify_s")
    assert {k: v for k, v in a.items() if not k.startswith(volatile)} == {
        k: v for k, v in b.items() if not k.startswith(volatile)
    }


def test_train_py_cli_fails_fast_on_bad_value(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "rollout.temperature=-1", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "rollout.temperature" in proc.stderr + proc.stdout


def test_train_py_cli_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "debug=smoke", "algo=grpo", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    assert (tmp_path / ".hydra" / "config.yaml").exists()
