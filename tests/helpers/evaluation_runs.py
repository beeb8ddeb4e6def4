"""Evaluation settings and the run folders an evaluation writes, as the evaluation tests check them."""

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tests.helpers.paths import ROOT

CONF = ROOT / "conf"


SAMPLE_FIELDS = {"id", "sample", "prompt", "response", "extracted", "gold", "correct", "length", "truncated"}
SAMPLE_FIELDS |= {"share", "seed", "request"}  # where each sample's randomness came from (data-parallel eval)


TINY_RUN = ["eval.limit=3", "k=2", "max_new_tokens=48"]


def _cfg(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name="eval_config", overrides=overrides)


def _check_run_folder(out: Path, sets: dict[str, int | tuple[int, int]], k: int) -> dict:
    """``sets``: name -> problems evaluated, or (evaluated, skipped as too long)."""
    results = json.loads((out / "results.json").read_text())
    assert set(results["sets"]) == set(sets) and results["config"]["k"] == k
    table = (out / "results.md").read_text()
    assert table.startswith("| set | n | skipped | k | avg@2 | pass@1 | pass@2 | maj@2 |")
    for name, n in sets.items():
        n, skipped = n if isinstance(n, tuple) else (n, 0)
        r = results["sets"][name]
        assert r["n_problems"] == n and r["k"] == k and len(r["problems"]) == n
        assert r["n_skipped"] == skipped and f"| {name} | {n} | {skipped} | {k} |" in table
        keys = {f"avg@{k}", *(f"pass@{j}" for j in (1, 2)), f"maj@{k}", "response_len", "truncated"}
        assert keys <= set(r["metrics"])
        for key, v in r["metrics"].items():
            assert math.isfinite(v) and (key == "response_len" or 0.0 <= v <= 1.0), (key, v)
        assert r["metrics"]["pass@1"] == pytest.approx(r["metrics"][f"avg@{k}"])
        lines = (out / f"samples_{name}.jsonl").read_text().splitlines()
        assert len(lines) == n * k
        assert all(set(json.loads(line)) == SAMPLE_FIELDS for line in lines)
    return results
