"""Training from an export with HF defaults: a real run that names the key and the run's value."""

from pathlib import Path

import pytest

from bapo.config import ConfigError
from tests.helpers.exports import export_with_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_training_from_an_export_with_hf_defaults_names_the_key_and_the_runs_value(tmp_path):
    """Before: 'rollout.max_new_tokens: 512 leaves no room ...', naming neither model.max_new_tokens nor 48."""
    from bapo.loop import run
    from tests.helpers.config import smoke_cfg

    export = export_with_config(tmp_path, 48)
    with pytest.raises(ConfigError, match=r"^rollout\.max_new_tokens: 512 \(model\.max_new_tokens\).*=48 \(what"):
        run(smoke_cfg(["model=hf", f"model.name_or_path={export}"]), tmp_path / "run")
