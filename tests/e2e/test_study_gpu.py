"""The GPU study's run (conf/experiment/study_gpu.yaml, docs/study/README.md "The GPU study on paper"), rehearsed on
CPU at toy size through train.py: one cell of its grid, ``python train.py experiment=study_gpu algo=bapo seed=1``,
with only size overrides, against a stand-in served under the model's hub id (``scripts/build/standin.py``, an HF
cache, ``HF_HUB_OFFLINE=1``) and a small ``train_math.jsonl`` where the study reads MATH train
(``$BAPO_DATA_DIR``); MATH-500 is the shipped file. The run takes the study's code path: the GPU placement's FSDP2
learner, π_old recomputed, 5 updates a rollout batch, BAPO's search logged with what it reached. Two variants:
vLLM, the study's engine (skipped where it is not installed), and HF (``rollout=hf``, the one other override).
"""

import json
import os
import subprocess

import pytest
import yaml

from tests.helpers.config import compose, differing_keys
from tests.helpers.metrics import rows
from tests.helpers.paths import ROOT
from tests.helpers.processes import python_for

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
CELL = ["experiment=study_gpu", "algo=bapo", "seed=1"]  # one run of `python train.py -m experiment=study_gpu`
SIZES = {
    "train.steps": "2",  # 100
    "train.prompts_per_step": "5",  # 40; one prompt's group an update, as 8 of them are on the GPU
    "rollout.n": "2",  # 8
    "model.max_new_tokens": "16",  # 2048
    "data.heldout_size": "2",  # MATH-500's 500
    "eval.n": "1",  # 4
    "checkpoint.every": "2",  # 50
}
# answers 1-3: what the stand-in learned to box at random, so rewards differ within a group and updates move
PROBLEMS = [(f"What is ${a} - {a - d}$?", str(d)) for a in range(6, 40) for d in (1, 2, 3)]


def sized() -> list[str]:
    return [f"{k}={v}" for k, v in SIZES.items()]


def variant(engine: str) -> list[str]:
    return [*CELL, *sized(), *(["rollout=hf"] if engine == "hf" else [])]


def test_the_rehearsal_changes_the_studys_run_in_sizes_only():
    assert differing_keys(compose(*CELL), compose(*CELL, *sized())) == set(SIZES)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The stand-in in an HF cache, MATH train's stand-in in the data folder, and the environment of the runs."""
    import torch

    from scripts.build.standin import write_standin

    base, threads = tmp_path_factory.mktemp("study_gpu"), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        write_standin(base / "hub", HUB_ID, boxed_answers="123")
    finally:
        torch.set_num_threads(threads)
    (base / "data").mkdir()
    lines = [json.dumps({"problem": p, "answer": a}) for p, a in PROBLEMS]
    (base / "data" / "train_math.jsonl").write_text("\n".join(lines) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    env |= {"HF_HUB_CACHE": str(base / "hub"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"BAPO_DATA_DIR": str(base / "data"), "WANDB_MODE": "offline", "WANDB_DIR": str(base)}
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {"base": base, "env": env}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_one_cell_of_the_gpu_study_runs_at_toy_size(world, engine):
    py, run_dir = python_for(engine), world["base"] / f"run-{engine}"
    cmd = [py, "train.py", *variant(engine), f"hydra.run.dir={run_dir}"]
    p = subprocess.run(cmd, cwd=ROOT, env=world["env"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-4000:]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["model"]["name_or_path"] == HUB_ID and cfg["learner"]["kind"] == "fsdp"
    assert cfg["data"]["path"] == str(world["base"] / "data" / "train_math.jsonl")
    got = rows(run_dir)
    assert [r["step"] for r in got] == [0, 1, 2] and got[-1]["policy/version"] == 10  # 2 steps x 5 updates
    assert {"eval/accuracy"} <= got[0].keys() and {"eval/accuracy"} <= got[-1].keys()
    for r in got[1:]:
        assert r["learner/updates"] == 5 and r["buffer/staleness_max"] == 4, r
        assert {"bapo/search_active", "bapo/reach", "bapo/beyond_bounds", "clip/low", "clip/high"} <= r.keys()
        if r["bapo/search_active"] > 0:  # what the search reached, among the updates where it engaged
            assert {"bapo/target_reached", "bapo/rho_moved"} <= r.keys(), sorted(r)
        # π_old recomputed: the learner's forward scores every response token of the step's 5 x 2 samples (a check
        # on a share of the rows, with π_old from the engine, would count fewer)
        assert r["rollout/logp_mismatch_tokens"] == round(r["rollout/response_len"] * 10), r
    assert any(r["learner/grad_norm"] > 0 for r in got[1:]), "no update had a signal"
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
