"""A run folder or export never decides to run code: eval.py takes ``model.trust_remote_code`` from its command line
only, never from the artifact's config (``config.yaml``, ``bapo_config.yaml``). The hostile export here maps
``AutoConfig`` and ``AutoModelForCausalLM`` to a ``modeling_evil.py`` in its folder (``config.json``'s ``auto_map``)
that writes a marker file when it is imported, and its ``bapo_config.yaml`` says ``trust_remote_code: true``."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "tiny-math"

EVIL = """
from pathlib import Path

Path({marker!r}).write_text("ran")  # what a hostile export would do instead

from transformers import LlamaConfig, LlamaForCausalLM


class EvilConfig(LlamaConfig):
    pass


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
"""


def hostile(folder: Path, marker: Path, *, run_folder: bool = False) -> Path:
    """The tiny model with an ``auto_map`` to its own code and a training config asking to trust it: an export
    (``bapo_config.yaml`` beside the weights) or, with ``run_folder``, a run folder (``config.yaml``, ``export/``)."""
    from tests.helpers.config import compose as compose_train

    weights = folder / "export" if run_folder else folder
    shutil.copytree(TINY, weights)
    config = json.loads((weights / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "modeling_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    (weights / "config.json").write_text(json.dumps(config))
    (weights / "modeling_evil.py").write_text(EVIL.format(marker=str(marker)))
    trained = OmegaConf.to_yaml(compose_train("debug=smoke", "model.trust_remote_code=true"), resolve=True)
    (folder / "config.yaml" if run_folder else weights / "bapo_config.yaml").write_text(trained)
    return folder


def _eval_cfg(overrides: list[str]):
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="eval_config", overrides=overrides)


@pytest.mark.parametrize("run_folder", [False, True], ids=["export", "run_folder"])
def test_the_artifacts_trust_remote_code_is_never_taken(tmp_path, caplog, run_folder):
    """Before: adopt_run took the run's whole model group, trust_remote_code included, and loading the export
    imported modeling_evil.py (the marker appeared)."""
    from bapo.eval.adopt import adopt_run
    from bapo.eval.job import build_job, model_context
    from bapo.modeling import load_tokenizer

    marker = tmp_path / "MARKER"
    folder = hostile(tmp_path / "shared", marker, run_folder=run_folder)
    over = ["eval=arith", f"checkpoint={folder}"]
    cfg = _eval_cfg(over)
    with caplog.at_level(logging.WARNING, logger="bapo.eval.adopt"):
        settings = adopt_run(cfg, over)
    job = build_job(cfg)
    assert job.model.trust_remote_code is False and "model.trust_remote_code" not in settings.taken
    assert settings.record()["not_from_run"] == {"model.trust_remote_code": True}
    assert "never decides that: model.trust_remote_code=false" in caplog.text
    assert job.model.dtype == "float32" and settings.taken["max_new_tokens"] == 48  # the rest: as trained
    # what eval.py then loads, with that setting: the folder's code is not imported
    path = str(settings.weights)
    load_tokenizer(path, trust_remote_code=job.model.trust_remote_code)
    assert model_context(path, trust_remote_code=job.model.trust_remote_code) == 256
    assert not marker.exists()
    # the command line, and only it, turns it on; that is logged beside the run's value
    over = [*over, "model.trust_remote_code=true"]
    cfg = _eval_cfg(over)
    settings = adopt_run(cfg, over)
    assert build_job(cfg).model.trust_remote_code is True
    assert settings.kept["model.trust_remote_code"] == (True, True) and settings.withheld == {}


@pytest.mark.slow  # two real eval.py processes
def test_eval_py_on_a_shared_export_runs_none_of_its_code_unless_told(tmp_path):
    marker = tmp_path / "MARKER"
    export = hostile(tmp_path / "export", marker)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")  # where transformers copies a folder's code to import it
    args = [sys.executable, "eval.py", f"checkpoint={export}", "eval=arith", "eval.limit=2", "k=1", "temperature=0"]

    p = subprocess.run([*args, f"hydra.run.dir={tmp_path / 'e1'}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not marker.exists()  # evaluated, as trained, without its code
    config = json.loads((tmp_path / "e1" / "results.json").read_text())["config"]
    assert config["model"]["trust_remote_code"] is False
    assert config["not_from_run"] == {"model.trust_remote_code": True}
    # model.trust_remote_code=true on the command line is the user's decision to trust it: transformers imports it
    p = subprocess.run(
        [*args, "model.trust_remote_code=true", f"hydra.run.dir={tmp_path / 'e2'}"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert marker.read_text() == "ran"
    config = json.loads((tmp_path / "e2" / "results.json").read_text())["config"]
    assert config["overridden"]["model.trust_remote_code"] == {"command_line": True, "run": True}
