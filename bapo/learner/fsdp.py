"""FSDP2 for the policy: sharding, full weights out (rollout sync, HF export), sharded DCP checkpoints.

:func:`wrap` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer
and then to the root, after which the model trains under the ordinary
:class:`bapo.learner.Learner` (built *after* wrapping, so AdamW holds the sharded
parameters) with ``reduce_sum=bapo.infra.dist.reduce_sum`` and
``reduce_max=bapo.infra.dist.reduce_max``.

Gradient scaling. The learner normalises the loss by *global* totals (tokens,
sequences of the mini-batch over all ranks, all-reduced through ``reduce_sum``), so
each rank's loss is its share of the global loss and the global gradient is the
*sum* of the ranks' gradients. FSDP2 averages by default; :func:`wrap` switches it
to a plain sum (divide factor 1, sum-only collectives), which works on gloo and NCCL.

Mixed precision: bf16 parameters for compute with fp32 gradient reduction on GPU
(load the model in fp32: those are the master weights AdamW updates), fp32
throughout on CPU. Activation checkpointing is HF's (non-reentrant) on each decoder
layer. CPU offload is FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients
and optimizer state live on the CPU; useful on GPU only).

Checkpoints are torch.distributed.checkpoint (DCP) folders: every rank writes its shard,
and a load reshards, so a run can resume at another world size. DCP itself would
unpickle on load (its ``.metadata`` with ``pickle.load``, non-tensor entries with
``torch.load(weights_only=False)``), so a checkpoint could run code. Here DCP holds
tensors only; the learner's small non-tensor state (optimizer hyper-parameters, LR
schedule, skip count, eps_feedback's eps) goes to ``plain.pt`` beside it, read with
``weights_only=True``; and ``.metadata`` is read by :class:`MetadataUnpickler`, which
admits DCP's own metadata classes and nothing else, then checked (file names, no
transforms, no non-tensor entries) before DCP sees it. Inside a checkpoint folder the
files are also checked against its manifest (:mod:`bapo.infra.ckpt_folder`), and the loaded
tensors must be finite. Every failure is a CheckpointError raised on all ranks together.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from bapo.infra import ckpt_folder
from bapo.infra.ckpt_folder import CheckpointError
from bapo.learner.config import MIXED_PRECISION
from bapo.learner.weights import StreamedWeights, write_dtype, write_extra


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers`` for Llama, Qwen2, Mistral...)."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return list(layers)
    raise ValueError(f"{type(model).__name__}: found no decoder layers (base_model.layers / .h / .blocks)")


def wrap(
    model: nn.Module,
    *,
    device: torch.device,
    mixed_precision: str = "auto",
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` in place over all ranks of the default process group and return it.

    ``mixed_precision``: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16`` or ``fp32``.
    ``reshard_after_forward``: free each layer's gathered parameters after its forward
    (ZeRO-3; ``False`` keeps them until the backward, ZeRO-2-like, more memory, less traffic).
    """
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {mixed_precision!r}")
    if not dist.is_initialized():
        raise RuntimeError("fsdp.wrap needs a process group: call bapo.infra.dist.init() under torchrun first")
    bf16 = uses_bf16(mixed_precision, device)
    mp = MixedPrecisionPolicy(**(dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    if activation_checkpointing:  # transformers renamed it in 5.2x; the old name stays until v6
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    empty = any(p.is_meta for p in model.parameters())
    source = getattr(getattr(model, "config", None), "_name_or_path", "") if empty else None
    if empty and not source:
        raise ValueError("fsdp.wrap: the model's parameters are on the meta device but its config names no checkpoint")
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()} if empty else {}
    if not cpu_offload and not empty:
        model.to(device)
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    # The root's parameters (embeddings, final norm, LM head) are needed again at once by the backward.
    fully_shard(model, reshard_after_forward=False, **kw)
    if empty:  # allocate this rank's shards only, then read them from the checkpoint
        model.to_empty(device="cpu" if cpu_offload else device)
        with torch.no_grad():
            for name, b in buffers.items():  # to_empty wiped them (rotary tables: computed, not stored)
                model.get_buffer(name).copy_(b)
        load_local_shards(model, source)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # sum, not mean, over ranks: see the module docstring
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of the HF folder ``path`` that holds it (one file, or an index)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json to read shards from")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def shard_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [start, stop) of a dim-0 length ``n`` that FSDP2's ``Shard(0)`` gives ``rank`` (torch.chunk's split:
    ceil(n / world) rows per rank, the last ranks fewer or none)."""
    chunk = -(-n // world)
    start = min(n, rank * chunk)
    return start, min(n, start + chunk)


@torch.no_grad()
def load_local_shards(model: nn.Module, path: str | Path) -> None:
    """Fill each sharded parameter of ``model`` (after ``to_empty``) with its rows of the checkpoint at ``path``.

    Every rank reads only its own rows of each tensor (safetensors slices, memory-mapped), in the file's dtype,
    and casts them into its shard (fp32 master weights from a bf16 checkpoint: fp32 for this shard only).
    No rank ever holds a full copy of the model. Tied parameters appear once (``named_parameters``).
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard

    files = checkpoint_files(path)
    params = dict(model.named_parameters())
    missing = sorted(n for n in params if n not in files)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} of the model's parameters, e.g. {missing[:3]}")
    for name, p in params.items():
        # One open per tensor: the file's pages this rank read leave its address space (and its RSS) at once.
        with safe_open(str(files[name]), framework="pt") as f:
            if not isinstance(p, DTensor):  # not sharded (not under fully_shard): the whole tensor
                p.copy_(f.get_tensor(name))
                continue
            if tuple(p.placements) != (Shard(0),):
                raise ValueError(f"{name}: placements {p.placements}, expected FSDP2's (Shard(0),)")
            local = p.to_local()
            start, stop = shard_rows(p.shape[0], p.device_mesh.get_local_rank(), p.device_mesh.size())
            if local.shape[0] != stop - start:
                raise RuntimeError(f"{name}: local shard has {local.shape[0]} rows, expected {stop - start}")
            if stop > start:
                local.copy_(f.get_slice(name)[start:stop])


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded weights under their HF names (a collective: every rank must call it).

    ``rank0_only``: rank 0 gets CPU tensors and the other ranks an empty dict (export, or
    a rollout engine on rank 0). Otherwise every rank gets the full weights on its device
    (a rollout engine on every rank). Master weights: fp32 when loaded in fp32.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    sd = get_model_state_dict(model, options=options)
    return sd if not rank0_only or not dist.is_initialized() or dist.get_rank() == 0 else {}


def save_hf(
    model: nn.Module,
    out: str | Path,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    extra: dict | None = None,
    device: torch.device | None = None,
) -> None:
    """Write an HF folder (config + safetensors, the tokenizer if given, and ``extra``'s small text files) that
    ``from_pretrained`` loads, with the weights in ``dtype`` (the model's own, not the fp32 masters).

    A collective: the weights are gathered one tensor at a time, cast on the shard before the gather
    (:class:`bapo.learner.weights.StreamedWeights`), and only rank 0 keeps them (on the CPU). Rank 0 writes,
    under a temporary name renamed into place (:func:`bapo.infra.ckpt_folder.staged_folder`: an interrupted export
    leaves no half-written folder, and the folder is readable as the umask allows). A failure (a full disk)
    raises on every rank.
    """

    main = not dist.is_initialized() or dist.get_rank() == 0
    if device is None:
        device = next(model.parameters()).device
    sd: dict[str, torch.Tensor] = {}
    for name, full in StreamedWeights(model, device, dtype).items():
        if main:
            sd[name] = full.to("cpu")
        del full
    err = None
    if main:
        try:
            with ckpt_folder.staged_folder(Path(out), manifest=True) as tmp:
                model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
                write_dtype(tmp, dtype)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                write_extra(tmp, extra)
        except Exception as e:
            err = e
    _raise_together(err, f"writing {out}")


def uses_bf16(mixed_precision: str, device: torch.device) -> bool:
    """Whether :func:`wrap` computes in bf16 for this ``mixed_precision`` on ``device``."""
    return mixed_precision == "bf16" or (mixed_precision == "auto" and device.type == "cuda")


PLAIN = "plain.pt"  # the non-tensor part of the learner's state, beside DCP's files
TENSOR_REF = "__dcp_tensor__"  # in plain.pt, where a tensor stored by DCP goes back


def _split(state: Any, path: str = "", tensors: dict | None = None) -> tuple[dict[str, torch.Tensor], Any]:
    """``state`` as (flat {path: tensor} for DCP, the rest with ``{TENSOR_REF: path}`` where tensors were)."""
    tensors = {} if tensors is None else tensors
    if isinstance(state, torch.Tensor):
        if path in tensors:
            raise ValueError(f"two tensors of the learner's state flatten to the same name {path!r}")
        tensors[path] = state
        return tensors, {TENSOR_REF: path}
    if isinstance(state, dict):
        rest = {k: _split(v, f"{path}.{k}" if path else str(k), tensors)[1] for k, v in state.items()}
        return tensors, rest
    if isinstance(state, (list, tuple)):
        rest = [_split(v, f"{path}.{i}" if path else str(i), tensors)[1] for i, v in enumerate(state)]
        return tensors, type(state)(rest)
    return tensors, state


def _merge(plain: Any, tensors: dict[str, torch.Tensor], where: Path) -> Any:
    """Put the loaded tensors back where :func:`_split` took them from."""
    if isinstance(plain, dict):
        if set(plain) == {TENSOR_REF}:
            if plain[TENSOR_REF] not in tensors:
                raise CheckpointError(f"{where}: names a tensor {plain[TENSOR_REF]!r} this learner does not have")
            return tensors[plain[TENSOR_REF]]
        return {k: _merge(v, tensors, where) for k, v in plain.items()}
    if isinstance(plain, (list, tuple)):
        return type(plain)(_merge(v, tensors, where) for v in plain)
    return plain


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file admitting only the classes such a file is made of.

    Anything else (``os.system``, ``builtins.eval``, any other callable) is refused before it can be
    called: a crafted file fails closed with a CheckpointError naming the file and the refused global.
    """

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",  # parsed so that read_metadata can refuse it with a reason
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},  # looks a layout up by name in a fixed table
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath"},
        "collections": {"OrderedDict"},
    }

    def __init__(self, file, name: Path):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise CheckpointError(f"{self.name}: refused to load global {module}.{name} (not DCP metadata)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.name}: refused a persistent id (not DCP metadata)")


STORAGE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a plain file name in the DCP folder


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The DCP folder's ``.metadata``, unpickled by :class:`MetadataUnpickler` and checked: tensors only,
    stored in plain files of this folder, with no storage transforms."""
    f = Path(path) / ".metadata"
    try:
        with open(f, "rb") as fh:
            md = MetadataUnpickler(fh, f).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbled
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from e
    if type(md) is not dcp_metadata.Metadata:
        raise CheckpointError(f"{f}: holds a {type(md).__name__}, not DCP Metadata")
    entries = md.state_dict_metadata if isinstance(md.state_dict_metadata, dict) else {None: None}
    for key, entry in entries.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise CheckpointError(
                f"{f}: entry {key!r} is not a tensor ({type(entry).__name__}); this format keeps non-tensor "
                f"state in {PLAIN} (a checkpoint written by an older version cannot be loaded safely)"
            )
    if not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{f}: storage_data is not a dict")
    for idx, info in md.storage_data.items():
        if not isinstance(idx, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointError(f"{f}: storage_data holds {type(idx).__name__} -> {type(info).__name__}")
        if not isinstance(info.relative_path, str) or not STORAGE_FILE.match(info.relative_path):
            raise CheckpointError(f"{f}: {idx.fqn!r} is stored in {info.relative_path!r}, not a file of {path}")
        if info.transform_descriptors:
            raise CheckpointError(f"{f}: {idx.fqn!r} has storage transforms {info.transform_descriptors!r}")
    return md


class _CheckedReader(FileSystemReader):
    """DCP's file reader, handed metadata already read by :func:`read_metadata` instead of unpickling it.

    ``read_metadata`` takes no ``**kwargs``: DCP then never falls back to per-rank metadata files.
    """

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata):
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self) -> dcp_metadata.Metadata:
        md = copy.deepcopy(self._checked)
        if md.storage_meta is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """Refuses DCP's non-tensor path, which would ``torch.load(weights_only=False)`` the bytes."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"refused to unpickle non-tensor DCP entry {read_item.dest_index.fqn!r}")


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns that it assumes one process when there is no process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _raise_together(err: BaseException | None, doing: str, cleanup: Path | None = None) -> None:
    ckpt_folder.raise_together(err, doing, cleanup)


def save_sharded(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    """Write ``model`` and ``optimizer`` (sharded: every rank its part, as DCP tensors) and ``extra`` (small
    plain state: numbers, strings, containers, tensors) to the folder ``path``. Optimizer hyper-parameters and
    ``extra``'s non-tensor values go to ``plain.pt``, rank 0's copy (they are the same on every rank). An
    optimizer that has taken no step yet is saved as such (``optimizer_fresh``): DCP's ``get_state_dict`` fills its
    moments with a zero-lr step (AdamW's step count 1), which would make a resumed run's first update differ; the
    placeholder is dropped here and by :func:`load_sharded`.

    A collective: every rank calls it with the same ``path``. A failure on any rank (a full disk) raises
    CheckpointError on all of them, after rank 0 removes the partial checkpoint.
    """
    path = Path(path)
    fresh = not optimizer.state  # no step taken yet (a stop before the first update)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh:  # get_state_dict initialised the moments with a zero-lr step (step = 1): the run itself keeps none
        optimizer.state.clear()
    tensors, plain = _split({"model": model_sd, "optimizer": optim_sd, "learner": extra})
    plain["optimizer_fresh"] = fresh
    err = None
    try:
        with _single_process_ok():
            dcp.save(tensors, storage_writer=_Writer(path), no_dist=not dist.is_initialized())
        if not dist.is_initialized() or dist.get_rank() == 0:
            ckpt_folder.write(path / PLAIN, plain)
    except dcp.CheckpointException as e:  # a BaseException: gathers every rank's failure (as pickled copies)
        err = e if ckpt_folder.is_enospc(e) else CheckpointError(f"{path}: DCP could not write it: {e}")
    except Exception as e:
        err = e
    _raise_together(err, f"writing {ckpt_folder.partial_root(path)}", cleanup=path)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, its full disk an OSError(ENOSPC) where DCP gathers it. ``torch.save``'s zip writer reports
    ENOSPC as a RuntimeError whose ``__context__`` is the OSError, and DCP sends each rank's failure to the others
    pickled, which drops the context: every rank would see an unknown RuntimeError."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as e:
            if ckpt_folder.is_enospc(e):
                raise OSError(errno.ENOSPC, "No space left on device", str(self.path)) from e
            raise


def load_sharded(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, verify: bool = True) -> dict:
    """Restore ``model`` and ``optimizer`` from what :func:`save_sharded` wrote, resharding to the current world
    size, and return its ``extra`` (a collective).

    Never unpickles a class (module docstring). ``verify``: first check the files against the manifest of the
    checkpoint folder around ``path`` (rank 0 hashes, every rank gets the verdict); ``False`` for a bare DCP
    folder written outside :func:`bapo.infra.ckpt_folder.save`. Non-finite weights or optimizer moments are refused.
    """
    path = Path(path)
    err, md, plain = None, None, None
    try:
        if verify and (not dist.is_initialized() or dist.get_rank() == 0):
            ckpt_folder.verify_part(path)
        md = read_metadata(path)
        plain = torch.load(path / PLAIN, map_location="cpu", weights_only=True)
    except CheckpointError as e:
        err = e
    except Exception as e:
        err = CheckpointError(f"{path / PLAIN}: cannot be read ({type(e).__name__}: {e})")
    _raise_together(err, f"reading {path}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors, _ = _split({"model": model_sd, "optimizer": optim_sd})
    for key, entry in md.state_dict_metadata.items():  # extra's tensors: whole, as saved
        if key.startswith("learner."):
            tensors[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    try:
        with _single_process_ok():
            reader, planner = _CheckedReader(path, md), _TensorsOnlyPlanner()
            dcp.load(tensors, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
    except dcp.CheckpointException as e:  # raised on every rank alike (DCP gathers the failures)
        raise CheckpointError(f"{path}: DCP could not load it into this model and optimizer: {e}") from e
    try:
        ckpt_folder.check_finite(tensors, str(path))
        state = _merge(plain, tensors, path / PLAIN)
    except CheckpointError as e:
        err = e
    _raise_together(err, f"reading {path}")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if plain.get("optimizer_fresh"):  # saved before any step: its moments are DCP's placeholders, not AdamW's
        optimizer.state.clear()
    return state["learner"]
