"""Hostile and damaged artifacts: the tiny model's export, each spoiled in one way a shared export or run folder could
be (issue 50's probe), for the artifact reader's unit tests and eval.py's end-to-end class of hostile artifacts.

Every builder takes a folder to create and returns the export (an HF folder carrying a run's ``bapo_config.yaml``).
:data:`EXPORTS` names them all, with what eval.py's one error line must name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from tests.helpers.paths import TINY

SECRET_VAR = "BAPO_TEST_SECRET"  # an evaluator's variable that no output may ever hold
SECRET = "hunter2-issue50-marker"


def trained_config() -> str:
    """The resolved config a finished debug run writes beside its export (``bapo_config.yaml``)."""
    from omegaconf import OmegaConf

    from tests.helpers.config import compose

    return OmegaConf.to_yaml(compose("debug=smoke"), resolve=True)


def export(folder: Path, config: str | None = None) -> Path:
    """The tiny model's export with a run's config (``config``, default :func:`trained_config`)."""
    shutil.copytree(TINY, folder)
    (folder / "bapo_config.yaml").write_text(trained_config() if config is None else config)
    return folder


def env_instruction(folder: Path) -> Path:
    """An instruction that would read the evaluator's environment if the config were resolved."""
    text = trained_config()
    line = next(x for x in text.splitlines() if x.strip().startswith("instruction:"))
    indent = line[: len(line) - len(line.lstrip())]
    bad = f"{indent}instruction: 'Answer. ${{oc.env:{SECRET_VAR}}}'"
    return export(folder, text.replace(line, bad, 1))


def alias_bomb(folder: Path) -> Path:
    """A kilobyte of YAML aliases that expands to 9^11 strings (a 'billion laughs')."""
    lines, prev = ['lol: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'], "a"
    for name in "bcdefghijk":
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
        prev = name
    return export(folder, "\n".join(lines) + "\n" + trained_config())


def with_file(name: str, text: str) -> Callable[[Path], Path]:
    """An export whose file ``name`` holds ``text`` (in place of the export's own, if it has one)."""

    def build(folder: Path) -> Path:
        out = export(folder)
        (out / name).write_text(text)
        return out

    return build


def template(source: str) -> Callable[[Path], Path]:
    """An export whose chat template is ``source``."""
    return with_file("chat_template.jinja", source)


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}hi"
HUGE_OUTPUT = "{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}"
RAISES = "{{ raise_exception('this template refuses every conversation') }}"
DUNDER = "{{ ''.__class__.__mro__[1].__subclasses__() }}"


def config_json(**fields) -> Callable[[Path], Path]:
    """An export whose config.json has ``fields`` replaced."""

    def build(folder: Path) -> Path:
        out = export(folder)
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config | fields))
        return out

    return build


def wrong_shape(folder: Path) -> Path:
    """One weight of another shape than config.json makes it."""
    import torch
    from safetensors.torch import load_file, save_file

    out = export(folder)
    weights = load_file(out / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 3)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def index_outside(folder: Path) -> Path:
    """A sharded index whose shard is a file outside the folder (there, and whole: only where it is is wrong)."""
    from safetensors import safe_open

    out = export(folder)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    outside = folder.parent / f"{folder.name}-shard.safetensors"
    (out / "model.safetensors").rename(outside)
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, f"../{outside.name}")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def generation_config(text: str) -> Callable[[Path], Path]:
    """An export whose generation_config.json holds ``text``."""
    return with_file("generation_config.json", text)


# name -> (builder, what eval.py's error line names)
EXPORTS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "env_interpolation": (
        env_instruction,
        "data.instruction: 'Answer. ${oc.env:BAPO_TEST_SECRET}' is an interpolation",
    ),
    "alias_bomb": (alias_bomb, "more than 64 aliases"),
    "template_loop": (template(LOOP), "rendering ran past"),
    "template_output": (template(HUGE_OUTPUT), "its chat template is refused"),
    "template_raises": (template(RAISES), "this template refuses every conversation"),
    "template_dunder": (template(DUNDER), "SecurityError"),
    "wrong_shape": (wrong_shape, "model.layers.0.mlp.up_proj.weight has shape [7, 3]"),
    "huge_dims": (config_json(hidden_size=1 << 20, intermediate_size=1 << 22), "config.json makes it"),
    "index_outside": (index_outside, "-shard.safetensors', which is not a file of"),
    "unknown_dtype": (config_json(dtype="float128", torch_dtype="float128"), "'float128' is not a dtype"),
    "generation_config_list": (generation_config("[1, 2]"), "generation_config.json: expected a JSON object"),
    "generation_config_broken": (generation_config('{"temperature": '), "generation_config.json:1: not JSON"),
}
