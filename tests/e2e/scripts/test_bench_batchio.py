"""scripts/bench/bench_batchio.py --quick, run as a user would: the table, finite ratios, and a gather that loses
nothing.

The script's own identity checks are read from its output, and its dump of rank 0's gathered
batches (tuple path, tensor path and the source they were gathered from) is compared here
independently, token for token and log-prob for log-prob.
"""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "bench" / "bench_batchio.py"
STAGES = ("collate", "gather (2 ranks)", "checkpoint write", "checkpoint read", "checkpoint bytes")


def _load_bench():
    # scripts/ is not a package; load the file itself (a tests/unit/scripts package would shadow it)
    spec = importlib.util.spec_from_file_location("bapo_bench_batchio", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One --quick --critic run (every per-token field), with rank 0's gathered batches dumped."""
    dump = tmp_path_factory.mktemp("bench") / "gathered.pt"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--critic", "--dump", str(dump)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    # a failed identity check exits 1 after printing everything: each test below judges its own part
    assert "checks: " in proc.stdout and dump.is_file(), proc.stdout + proc.stderr
    return proc, torch.load(dump, weights_only=True)


def table(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if cells[0] in STAGES:
            rows[cells[0]] = cells[1:]
    return rows


def test_prints_the_table_with_finite_ratios(quick_run):
    stdout = quick_run[0].stdout
    assert "stage" in stdout and "ratio (before/after)" in stdout
    rows = table(stdout)
    assert list(rows) == list(STAGES)
    for stage, (before, after, ratio) in rows.items():
        b, a = (float(x.removesuffix(" MB")) for x in (before, after))
        r = float(ratio.removesuffix("x"))
        assert math.isfinite(r) and r > 0 and b > 0 and a > 0, (stage, before, after, ratio)
        assert r == pytest.approx(b / a, rel=0.01), (stage, before, after, ratio)  # 4 significant digits each


def test_every_identity_check_passed(quick_run):
    proc = quick_run[0]
    stdout = proc.stdout
    assert proc.returncode == 0, stdout + proc.stderr
    checks = next(line for line in stdout.splitlines() if line.startswith("checks: "))
    verdicts = dict(part.rsplit(": ", 1) for part in checks.removeprefix("checks: ").split("; "))
    assert set(verdicts.values()) == {"yes"}, checks
    names = set(verdicts)
    assert {
        "collated batches identical",
        "gathered batch == source (before)",
        "gathered batch == source (after)",
    } <= names
    assert {"checkpoint round trip (before)", "checkpoint round trip (after)"} <= names


def test_tensor_gather_equals_tuple_gather(quick_run):
    _, dump = quick_run
    before, after, source = dump["before"], dump["after"], dump["source"]
    # --quick is 4 prompts x 4 responses; both ranks' shares arrived (prompts 0, 2 from rank 0, then 1, 3)
    assert after["groups"].tolist() == [0] * 4 + [2] * 4 + [1] * 4 + [3] * 4
    assert int(after["lengths"].sum()) == after["tokens"].numel() > 16
    for key in ("lengths", "groups", "tokens", "logp"):
        assert torch.equal(after[key], before[key]), key  # token for token, log-prob for log-prob
        assert torch.equal(after[key], source[key]), key
    assert after["logp"].dtype == before["logp"].dtype == torch.float64
    assert (after["logp"] <= 0).all() and after["logp"].unique().numel() > 100  # real log-probs, not zeros
    assert after["texts"] == before["texts"] == source["texts"]
    assert all(t.endswith(" ∎") for t in after["texts"])  # non-ASCII text survived the UTF-8 round trip


def test_scale_is_lowered_to_what_fits_in_memory(monkeypatch):
    paper_tokens = 4096 * 8193 / 2  # the expected response tokens at scale 1
    need = paper_tokens * bench.BYTES_PER_TOKEN[False]
    monkeypatch.setattr(bench, "mem_available", lambda: int(need / 0.8 * 10))
    assert bench.fit_scale(bench.PAPER, 1.0, False) == (1.0, "")
    monkeypatch.setattr(bench, "mem_available", lambda: int(need / 0.8 / 4 * 1.001))  # a quarter of what scale 1 needs
    scale, why = bench.fit_scale(bench.PAPER, 1.0, False)
    assert scale == 0.25 and "running at scale 0.25" in why
    assert bench.fit_scale(bench.PAPER, 1.0, True)[0] < 0.25  # the critic's fields need more
