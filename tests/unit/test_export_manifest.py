"""A run's export carries a SHA-256 manifest, and loading it for training or evaluation checks it first: a truncated
or altered file is a CheckpointError naming the file, not a safetensors error that names nothing."""

import json
from pathlib import Path

import pytest

from bapo.checkpoint import MANIFEST, CheckpointError
from bapo.modeling import load_model, load_tokenizer
from tests.helpers.exports import TINY, truncate

ROOT = Path(__file__).resolve().parents[2]


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
