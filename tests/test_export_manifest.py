"""A run's export carries a SHA-256 manifest, and loading it for training or evaluation checks it first: a truncated
or altered file is a CheckpointError naming the file, not a safetensors error that names nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bapo.checkpoint import MANIFEST, CheckpointError
from bapo.learner import fsdp
from bapo.modeling import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-math"
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


@pytest.fixture()
def export(tmp_path, tiny_tok) -> Path:
    out = tmp_path / "export"
    fsdp.save_hf(load_model(str(TINY)), out, tokenizer=tiny_tok)
    return out


def truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def test_an_export_lists_every_file_in_its_manifest(export):
    manifest = json.loads((export / MANIFEST).read_text())
    listed = set(manifest["files"])
    assert listed == {p.name for p in export.iterdir()} - {MANIFEST}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= listed


def test_a_truncated_export_is_refused_naming_the_file(export):
    """Before: safetensors' 'Error while deserializing header: incomplete metadata', naming no file."""
    truncate(export / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"^{export / 'model.safetensors'}: truncated or altered"):
        load_model(str(export))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_tokenizer(str(export))  # the folder is checked whichever loader reads it first


def test_an_altered_tokenizer_is_refused_naming_it(export):
    f = export / "tokenizer.json"
    f.write_text(f.read_text().replace('"', "'", 1))
    with pytest.raises(CheckpointError, match=f"^{f}: "):
        load_tokenizer(str(export))


def test_files_added_beside_an_export_and_folders_without_a_manifest_load(export):
    (export / "bapo_config.yaml").write_text("model:\n  max_new_tokens: 48\n")
    (export / "README.md").write_text("my model\n")
    load_tokenizer(str(export))
    load_model(str(export))
    load_model(str(TINY))  # the shipped model has no manifest: nothing to check it against


@pytest.mark.slow
def test_train_py_on_a_truncated_export_is_one_line_naming_the_file(tmp_path):
    from bapo.loop import run
    from tests.helpers.config import smoke_cfg

    run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path / "first")
    export = tmp_path / "first" / "export"
    assert (export / MANIFEST).is_file()
    truncate(export / "model.safetensors")
    cmd = [sys.executable, "train.py", "debug=smoke", "model=hf", f"model.name_or_path={export}"]
    cmd += ["model.max_new_tokens=48", f"hydra.run.dir={tmp_path / 'second'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: CheckpointError: {export / 'model.safetensors'}: truncated or altered"), last
