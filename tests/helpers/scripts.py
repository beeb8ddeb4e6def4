"""The repository's scripts/ as the tests load them, and the Markdown tables their reports write."""

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT


def load_script(name: str):
    """scripts/<name>.py (``study/report``: scripts/study/report.py) as the module ``bapo_<last part>``. scripts/ is not
    a package, so the file itself is loaded (a tests/unit/scripts package would shadow it); the module is registered
    in sys.modules, as dataclasses need."""
    spec = importlib.util.spec_from_file_location(f"bapo_{name.rsplit('/', 1)[-1]}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def assert_measure_refuses_other_folders(measure_built, empty: Path, other: Path, built_by: str):
    """A model-building script's ``measure_built`` refuses a folder it did not write, naming why: ``empty`` has no
    build_info.json, and ``other`` was built by the script ``built_by``."""
    with pytest.raises(SystemExit, match="build_info.json not found"):
        measure_built(empty)
    with pytest.raises(SystemExit, match=built_by):
        measure_built(other)


def markdown_table(text: str, head: str) -> list[dict[str, str]]:
    """The rows of the Markdown table in ``text`` whose header line starts with ``head``, as dicts from the header's
    cells to the row's (stripped); the table ends at the first line that does not start with ``|``."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(head))
    cols = [c.strip() for c in lines[at].strip("|").split("|")]
    rows = []
    for ln in lines[at + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append(dict(zip(cols, (c.strip() for c in ln.strip("|").split("|")), strict=True)))
    return rows
