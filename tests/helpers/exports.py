"""Exports of the tiny model for the tests that start from one: truncated, and carrying a run's config (the whole
export is conftest.py's ``export``)."""

import shutil
from pathlib import Path

from tests.helpers.paths import TINY


def truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def export_with_config(tmp_path: Path, max_new_tokens) -> Path:
    """A finished run's export as the loop writes it: the weights and tokenizer, and the run's resolved config."""
    export = tmp_path / "export"
    shutil.copytree(TINY, export)
    (export / "bapo_config.yaml").write_text(
        f"model:\n  max_new_tokens: 48\nrollout:\n  max_new_tokens: {max_new_tokens}\n"
    )
    return export
