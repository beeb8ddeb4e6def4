"""eval.py as users run it: every bad input is one line and exit status 2 with no run folder left behind
(real subprocesses), and data-parallel evaluation on two gloo ranks, each rank grading only its share."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.evaluation import PROMPTS, evaluate_all

pytestmark = pytest.mark.slow  # real processes: interpreter, torch and Hydra start-up each time

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")


def _eval_py(run_dir: Path, *args: str, launcher=(sys.executable,)) -> subprocess.CompletedProcess:
    cmd = [*launcher, "eval.py", *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def truncated_export(tmp_path_factory):
    from bapo.modeling import load_model, load_tokenizer

    folder = tmp_path_factory.mktemp("truncated")
    load_model(str(ROOT / "assets" / "tiny-math")).save_pretrained(folder)
    load_tokenizer(str(ROOT / "assets" / "tiny-math")).save_pretrained(folder)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)  # a copy cut short
    return folder


BAD = {
    "k=0": (["k=0"], "k: must be >= 1, got 0"),
    "top_p=2": (["top_p=2"], "top_p: must be in (0, 1], got 2"),
    "greedy_k4": (["temperature=0"], "k: greedy decoding (temperature=0) gives k equal samples"),
    "no_checkpoint": (["checkpoint=/nonexistent/run"], "checkpoint: /nonexistent/run does not exist"),
    "heldout": (["eval=heldout"], "eval: heldout is training's held-out config (conf/eval/heldout.yaml"),
    "no_data": (
        ["eval=aime24", "eval.aime24.path=/nonexistent/aime24.jsonl"],
        "eval.aime24.path: no such file: /nonexistent/aime24.jsonl",
    ),
    "truncated": ([], "checkpoint: {export}/model.safetensors is damaged or truncated"),
    # before: torch's RuntimeError traceback, and the run folder stayed
    "device_foo": (["device=foo"], "device: 'foo' is not a device (auto, cpu, cuda, cuda:N)"),
    # before: the tiny base model was evaluated, silently (make eval without RUN=)
    "empty_checkpoint": (["checkpoint="], "checkpoint: '' is not a path"),
}
if not __import__("torch").cuda.is_available():  # before: a CUDA traceback on a CPU machine, and the folder stayed
    BAD["device_cuda"] = (["device=cuda"], "device: 'cuda' but this torch build sees no CUDA device")


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2_with_no_folder_left(tmp_path, truncated_export, case):
    args, expected = BAD[case]
    if case == "truncated":
        args, expected = [f"checkpoint={truncated_export}"], expected.format(export=truncated_export)
    proc = _eval_py(tmp_path / "run", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: ConfigError: {expected}"), proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # a start-up error leaves no run folder behind


# ----------------------------------------------------------------------------- data-parallel


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    env = dict(ENV, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [*TORCHRUN, str(ROOT / "tests" / "e2e" / "eval_dp_worker.py"), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_each_rank_grades_its_own_share_only(two_ranks):
    """Rank 0 holds problems 0, 2, 4 (6 samples and the one pair of distinct answers, 0.5 and 1/2), rank 1
    problems 1 and 3 (4 samples); one process grades all 10 samples and the pair."""
    one = evaluate_all()
    assert (one["set_grades"], one["heldout_grades"]) == (10 + 1, 10)
    assert [r["dp"]["set_grades"] for r in two_ranks] == [6 + 1, 4]
    assert [r["dp"]["heldout_grades"] for r in two_ranks] == [6, 4]
    # one 2-rank tensor-parallel engine is one share: its first rank grades it, the other nothing
    assert [r["tp"]["set_grades"] for r in two_ranks] == [11, 0]
    assert [r["tp"]["heldout_grades"] for r in two_ranks] == [10, 0]
    # more shares than problems: an empty share grades nothing and still takes part in the gather
    assert [(r["one_prompt"]["set_grades"], r["one_prompt"]["heldout_grades"]) for r in two_ranks] == [(2, 2), (0, 0)]


@pytest.mark.parametrize("layout", ["dp", "tp", "one_prompt"])
def test_every_rank_ends_with_the_one_process_result(two_ranks, layout):
    if layout == "one_prompt":
        one = evaluate_all(prompts=PROMPTS[:1])
        assert all(r[layout][key] == one[key] for r in two_ranks for key in ("metrics", "samples", "heldout"))
        return
    one = evaluate_all()
    for rank, r in enumerate(two_ranks):
        got = r[layout]
        for key in ("metrics", "problems", "samples", "skipped", "heldout"):
            assert got[key] == one[key], (rank, key)
    assert one["metrics"]["maj@2"] == 0.8  # all but problem 3 (problem 4: 0.5, grouped with 1/2)
    assert [s["id"] for s in one["samples"]] == [p.problem.id for p in PROMPTS for _ in range(2)]
    if layout == "dp":  # each sample's share, seed and request index: the share that made it
        origin = two_ranks[0]["dp"]["origin"]
        assert [o[0] for o in origin] == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
        assert [o[2] for o in origin] == [0, 1, 0, 1, 2, 3, 2, 3, 4, 5]
        assert origin[0][1] != origin[2][1] and two_ranks[1]["dp"]["origin"] == origin


def test_torchrun_eval_py_of_a_finished_run(tmp_path, shared_data):
    """The user's command, shrunk: torchrun on 2 ranks evaluating a run folder as it was trained; rank 0
    writes the reports, the over-long prompts are skipped and counted."""
    from bapo.modeling import load_model, load_tokenizer
    from tests.helpers.evaluation import run_folder

    tiny = str(ROOT / "assets" / "tiny-math")
    run = run_folder(tmp_path / "run", load_model(tiny), load_tokenizer(tiny), "model.max_new_tokens=40")
    args = [f"checkpoint={run}", "eval=[aime24,arith]", "eval.limit=6", "k=2", "reward.num_workers=1"]
    proc = _eval_py(tmp_path / "eval", *args, launcher=TORCHRUN)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    # aime24's first 6 prompts: 421, 136, 375, 408, 173 and 204 tokens; 256 - 40 leaves 216
    assert [results["sets"][s]["n_skipped"] for s in ("aime24", "arith")] == [3, 0]
    assert results["config"]["max_new_tokens"] == 40 and results["config"]["from_run"]["max_new_tokens"] == 40
    rows = [json.loads(line) for line in (tmp_path / "eval" / "samples_aime24.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [i for i in ("aime24-I-02", "aime24-I-05", "aime24-I-06") for _ in range(2)]
    assert [r["share"] for r in rows] == [0, 0, 1, 1, 0, 0] and all(r["length"] <= 40 for r in rows)
    assert proc.stdout.count("results in") == 1  # rank 0 reports
