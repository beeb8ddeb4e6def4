"""scripts/build/warm_start_smollm2.py: the supervised warm start that brings a pretrained LM into the study's band
on mixops. SmolLM2 itself is not in CI, so the script is run end to end on the shipped
tiny-explore model as its base: the same code path (the product's prompt renderer, the loss mask, the early
stop, the atomic write, build_info.json and --measure)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.scripts import assert_measure_refuses_other_folders

SCRIPT = ROOT / "scripts" / "build" / "warm_start_smollm2.py"


def _script():
    spec = importlib.util.spec_from_file_location("warm_start_smollm2", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args, timeout=900):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_measure_refuses_a_folder_this_script_did_not_build(tmp_path):
    # the tiny testbeds were built by another script: their bands are that script's to re-measure
    explore = ROOT / "assets" / "tiny-explore"
    assert_measure_refuses_other_folders(_script().measure_built, tmp_path, explore, "build_tiny_explore_model.py")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--target", "0"], "--target"),
        (["--target", "1.5"], "--target"),
        (["--batch", "0"], "--batch"),
        (["--eval-every", "0"], "--eval-every"),
        (["--ramble-share", "1"], "--ramble-share"),
        (["--ramble-share", "-0.1"], "--ramble-share"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, named, tmp_path):
    proc = _run(*args, "--out", str(tmp_path / "m"), timeout=120)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr[-500:]
    assert not (tmp_path / "m").exists()


def test_sft_batch_rambles_run_to_the_cap_without_an_end_token():
    # the rambling warm start (study v4 on SmolLM2): a share of the solutions never box and are fitted cut at the
    # cap with no end token, so the model learns a mode that runs to max_new_tokens on any problem
    import random

    from transformers import AutoTokenizer

    from scripts.build.common import encode_batch

    mod, tok = _script(), AutoTokenizer.from_pretrained(ROOT / "assets" / "tiny-ramble")
    cap, end = 24, tok.convert_tokens_to_ids("<|im_end|>")
    x, m = mod.sft_batch(random.Random(3), tok, 64, max_new_tokens=cap, commute=True, ramble_share=0.5)
    rambles = 0
    for row, mask in zip(x.tolist(), m.tolist(), strict=True):
        sol = [t for t, k in zip(row, mask, strict=True) if k]
        if end in sol:
            assert sol[-1] == end and sol.count(end) == 1 and "\\boxed{" in tok.decode(sol)
        else:  # a ramble: exactly the cap, no box
            rambles += 1
            assert len(sol) == cap and "boxed" not in tok.decode(sol)
    assert 20 <= rambles <= 44  # half of 64, drawn
    # without a ramble share or commuted steps: the original warm start's draws and tensors, bit for bit
    rng = random.Random(3)
    pairs = []
    for _ in range(8):
        text, solution = mod.sft_problem(rng)
        pairs.append((mod.prompt_text(tok)(mod.Problem(id="", problem=text, answer="", source="mixops")), solution))
    want = encode_batch(tok, pairs, "cpu")
    got = mod.sft_batch(random.Random(3), tok, 8, max_new_tokens=cap)
    assert got[0].equal(want[0]) and got[1].equal(want[1])


def test_a_missing_base_is_named(tmp_path):
    proc = _run("--base", str(tmp_path / "nothing"), "--out", str(tmp_path / "m"), timeout=120)
    assert proc.returncode != 0 and "nothing" in proc.stderr and "convert it first" in proc.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_warm_start_writes_a_measured_model_and_measure_reproduces_it(tmp_path):
    out = tmp_path / "warm"
    args = [
        "--base",
        str(ROOT / "assets" / "tiny-explore"),
        "--out",
        str(out),
        "--max-steps",
        "3",
        "--eval-every",
        "1",
        "--probe",
        "4",
        "--target",
        "1.0",
        "--lr",
        "1e-3",
        "--batch",
        "4",
    ]
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--target 1.0 not reached in 3 steps" in proc.stdout
    info = json.loads((out / "build_info.json").read_text())
    assert info["built_by"] == "scripts/build/warm_start_smollm2.py" and info["sft_steps"] == 3
    assert [h["step"] for h in info["history"]] == [0, 1, 2, 3]
    losses = [h["loss"] for h in info["history"][1:]]
    assert all(loss > 0 for loss in losses)
    bands = info["heldout_bands_T1_n8_first200"]
    assert 0.0 <= bands["avg@8"] <= bands["pass@8"] <= 1.0 and bands["entropy_per_token"] > 0
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob(".tmp-*"))
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # readable by others as the umask allows, not 0700
    # the weights moved: the warm start trained the model it saved
    from safetensors.torch import load_file

    before, after = (
        load_file(ROOT / "assets" / "tiny-explore" / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert any(not before[k].equal(after[k]) for k in before)
    # --measure on the saved folder gives the same bands (same seed, same samples)
    again = _run("--measure", str(out))
    assert again.returncode == 0, again.stderr[-2000:]
    got = json.loads(again.stdout[again.stdout.index("{") :])
    assert (got["avg@8"], got["pass@8"]) == (bands["avg@8"], bands["pass@8"])
    assert got["entropy_per_token"] == pytest.approx(bands["entropy_per_token"], rel=1e-4)
