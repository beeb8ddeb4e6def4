"""FSDP2 for the policy: sharding, full weights out (rollout sync, HF export), sharded DCP checkpoints.

:func:`wrap` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer
and then to the root, after which the model trains under the ordinary
:class:`bapo.learner.Learner` (built *after* wrapping, so AdamW holds the sharded
parameters) with ``reduce_sum=bapo.dist.reduce_sum`` and
``reduce_max=bapo.dist.reduce_max``.

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

Checkpoints are torch.distributed.checkpoint folders: every rank writes its shard,
and a load reshards, so a run can resume at another world size. The learner's small
state (LR schedule, skip count, the card's eps) rides along in the same folder.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from bapo.learner.learner import Learner

MIXED_PRECISION = ("auto", "bf16", "fp32")


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
        raise RuntimeError("fsdp.wrap needs a process group: call bapo.dist.init() under torchrun first")
    bf16 = mixed_precision == "bf16" or (mixed_precision == "auto" and device.type == "cuda")
    mp = MixedPrecisionPolicy(**(dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    if activation_checkpointing:  # transformers renamed it in 5.2x; the old name stays until v6
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not cpu_offload:
        model.to(device)
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    # The root's parameters (embeddings, final norm, LM head) are needed again at once by the backward.
    fully_shard(model, reshard_after_forward=False, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # sum, not mean, over ranks: see the module docstring
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded weights under their HF names (a collective: every rank must call it).

    ``rank0_only``: rank 0 gets CPU tensors and the other ranks an empty dict (export, or
    a rollout engine on rank 0). Otherwise every rank gets the full weights on its device
    (a rollout engine on every rank). Master weights: fp32 when loaded in fp32.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    sd = get_model_state_dict(model, options=options)
    return sd if not rank0_only or not dist.is_initialized() or dist.get_rank() == 0 else {}


def save_hf(model: nn.Module, out: str | Path, *, tokenizer=None, dtype: torch.dtype | None = None) -> None:
    """Write an HF folder (config + safetensors, and the tokenizer if given) that ``from_pretrained`` loads.

    A collective (the weights are gathered); rank 0 writes, under a temporary name renamed
    into place, so an interrupted export leaves no half-written folder.
    """
    sd = full_state_dict(model, rank0_only=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()


def _learner_state(learner: Learner) -> dict:
    if learner.critic is not None:
        raise NotImplementedError("DCP checkpoints of a learner with a critic (algo=ppo) are not supported yet")
    extra = {"scheduler": learner.scheduler.state_dict(), "skipped_updates": learner.skipped_updates}
    if learner.objective.state is not None:
        extra["objective"] = learner.objective.state.state_dict()
    model_sd, optim_sd = get_state_dict(learner.model, learner.optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "learner": extra}


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns that it assumes one process when there is no process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_checkpoint(learner: Learner, path: str | Path) -> None:
    """Write the learner (sharded model and AdamW state, schedule, skip count, objective state) to a DCP folder.

    A collective: every rank calls it with the same ``path`` and writes its own shard.
    """
    with _single_process_ok():
        dcp.save(_learner_state(learner), checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_checkpoint(learner: Learner, path: str | Path) -> None:
    """Restore what :func:`save_checkpoint` wrote, resharding to the current world size (a collective)."""
    state = _learner_state(learner)
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(
        learner.model,
        learner.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    extra = state["learner"]
    learner.scheduler.load_state_dict(extra["scheduler"])
    learner.skipped_updates = int(extra["skipped_updates"])
    if learner.objective.state is not None:
        learner.objective.state.load_state_dict(extra["objective"])
