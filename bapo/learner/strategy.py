"""How the learner's model is placed: one process, or FSDP2 over torchrun's ranks.

The learner picks its strategy once, in its constructor, from ``learner.kind``;
everything that differs between the two lives here, so neither the learner's
update nor the loop branches on it:

===================  ==================================  =======================================
                     ``single``                          ``fsdp``
===================  ==================================  =======================================
device               ``learner.device``                  this rank's (``bapo.infra.dist.init``)
wrap                 move to the device                  ``fully_shard`` per decoder layer + root
collectives          none                                all-reduce sum / max over the ranks
mini-batch           all of it                           this rank's share (``dist.shard``)
full weights         the live ``state_dict``             streamed: one parameter gathered at a time
snapshot             a copy of the ``state_dict``        streamed into CPU tensors (a full copy)
frozen copy (KL ref) moved to the device                 sharded like the policy, no optimizer
gather (recompute)   none                                every rank's rows, all-gathered
policy at a version  a scratch copy loaded with it       the shards swapped in, then back
checkpoint           ``learner.pt`` (weights_only)       DCP shards + plain state (no pickle)
HF export            ``save_pretrained``                 gathered one tensor at a time, rank 0 writes
===================  ==================================  =======================================

Dtypes. Weights handed to an engine, snapshots and the HF export can be asked for in another dtype than the
learner's (FSDP keeps fp32 master weights; the engine and the export want the model's bf16). Under FSDP the cast
happens on the local shard, *before* the all-gather, so a sync moves and holds half the bytes.

Streaming. Under FSDP, :meth:`FSDPStrategy.full_weights` returns :class:`StreamedWeights`: a
mapping whose values are gathered (``full_tensor``) only when read, one parameter at a time, so a
rank never holds the whole unsharded model. Reading it is a collective: every rank must read the
same keys in the same order (``items()`` does), which is why the producer only hands these *live*
weights to an engine inline on the learner's thread (sync mode, at a step boundary); the async
producer's thread gets :meth:`snapshot` copies, made on the learner's thread (``bapo.rollout.producer``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from bapo.infra import ckpt_folder, dist
from bapo.learner.weights import StreamedWeights, full_tensor, write_dtype, write_extra


def make_strategy(cfg, device: torch.device | None = None):
    """The strategy of a typed ``learner`` config (``kind``: single | fsdp)."""
    if cfg.kind == "fsdp":
        return FSDPStrategy(cfg)
    if cfg.kind == "single":
        return SingleStrategy(torch.device(device) if device is not None else pick_device(cfg.device))
    raise ValueError(f"learner.kind must be 'single' or 'fsdp', got {cfg.kind!r}")


def master_dtype(cfg, model_dtype: str) -> str:
    """The dtype to load the policy in: FSDP keeps fp32 master weights (bf16 compute on GPU comes from its
    mixed-precision policy); one process trains in ``model.dtype``."""
    return "float32" if cfg.kind == "fsdp" else model_dtype


def frozen_dtype(cfg, model_dtype: str) -> str:
    """The dtype to load a frozen copy of the policy in (the KL reference): the dtype the policy computes in, so
    that at step 0 the two forwards agree. FSDP computes in bf16 under bf16 mixed precision (``auto`` on CUDA),
    else in its fp32 masters; one process in ``model.dtype``."""
    if cfg.kind != "fsdp":
        return model_dtype
    cuda = torch.cuda.is_available()
    return "bfloat16" if cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and cuda) else "float32"


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _finite(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 when every tensor is finite, else 0.0 (one fused norm per tensor, no host sync per tensor)."""
    if not params:
        return torch.ones(())
    norms = torch._foreach_norm([p.detach() for p in params])
    return torch.isfinite(torch.stack([n.float() for n in norms])).all().float().cpu()


class SingleStrategy:
    supports_critic = True
    reduce_sum = None
    reduce_max = None
    gather = None  # nothing to gather in one process

    def __init__(self, device: torch.device):
        self.device = device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def wrap_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def shard(self, items: Sequence) -> list:
        return list(items)

    def shard_indices(self, n: int, rank: int | None = None) -> list[int]:
        return list(range(n))

    def full_weights(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The live ``state_dict`` (aliases the parameters; an engine copies and casts them itself)."""
        return model.state_dict()

    def snapshot(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(dtype if dtype and v.is_floating_point() else v.dtype, copy=True)
                for k, v in model.state_dict().items()}  # fmt: skip

    @contextlib.contextmanager
    def policy_at(self, model, weights, scratch: Callable[[], torch.nn.Module]) -> Iterator[torch.nn.Module]:
        if weights is None:
            yield model
            return
        other = scratch()
        other.load_state_dict(weights)
        yield other

    def params_finite(self, model: torch.nn.Module) -> bool:
        return bool(_finite(list(model.parameters())).item())

    def save(self, path: Path, *, model, optimizer, extra: dict, critic=None) -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra}
        if critic is not None:
            state["critic"] = critic.state_dict()
        path.mkdir(parents=True, exist_ok=True)
        ckpt_folder.write(path / "learner.pt", state)

    def load(self, path: Path, *, model, optimizer, critic=None) -> dict:
        state = ckpt_folder.load(path / "learner.pt", verify_checksum=False)  # the run's restore verified the folder
        if (critic is None) != ("critic" not in state):
            has = "has" if "critic" in state else "has no"
            raise ckpt_folder.CheckpointError(f"{path}: the checkpoint {has} critic and this run's algo disagrees")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if critic is not None:
            critic.load_state_dict(state["critic"])
        return state["extra"]

    def export_hf(self, model, out: Path, tokenizer, *, dtype: torch.dtype | None = None, extra: dict | None = None):
        sd = None
        if dtype is not None and model.dtype != dtype:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        with ckpt_folder.staged_folder(out, manifest=True) as tmp:
            model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
            write_dtype(tmp, dtype)
            tokenizer.save_pretrained(tmp)
            write_extra(tmp, extra)


class FSDPStrategy:
    """FSDP2 (``bapo.learner.fsdp``) over the default process group, one device per rank."""

    supports_critic = False

    def __init__(self, cfg):
        self.cfg = cfg
        self.device = dist.init_one_rank()  # torchrun's group, or one rank of our own
        self.reduce_sum = dist.reduce_sum
        self.reduce_max = dist.reduce_max
        self.gather = dist.all_gather_tensors

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        ac = self.cfg.activation_checkpointing
        return self._shard(model, mixed_precision=self.cfg.mixed_precision, activation_checkpointing=ac)

    def wrap_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy (the KL reference): sharded like the policy, in the dtype it computes in, so a rank holds
        1/W of it (2 bytes a parameter in bf16) and gathers one layer at a time in its no-grad forward."""
        model.requires_grad_(False)
        return self._shard(model, mixed_precision="fp32")

    def _shard(self, model: torch.nn.Module, **options) -> torch.nn.Module:
        """``fsdp.wrap`` on this rank's device, offloaded to the CPU as ``learner.cpu_offload`` says."""
        from bapo.learner import fsdp

        return fsdp.wrap(model, device=self.device, cpu_offload=self.cfg.cpu_offload, **options)

    def shard(self, items: Sequence) -> list:
        return dist.shard(items)

    def shard_indices(self, n: int, rank: int | None = None) -> list[int]:
        """The positions :meth:`shard` gives ``rank`` (this rank's by default) of ``n`` items."""
        return dist.shard(range(n), rank_=rank)

    def full_weights(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> Mapping[str, torch.Tensor]:
        """The live weights, gathered one tensor at a time as they are read (:class:`StreamedWeights`), in
        ``dtype`` (cast on the shard, before the gather)."""
        return StreamedWeights(model, self.device, dtype)

    def snapshot(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A full copy on the CPU (an async batch may load it after more updates; it holds no GPU memory),
        gathered one tensor at a time in ``dtype``; tied names share one tensor, as in the model."""
        sd = model.state_dict(keep_vars=True)
        copies: dict[int, torch.Tensor] = {}  # id(shard) -> its CPU copy: tied names get one tensor
        out: dict[str, torch.Tensor] = {}
        for name, t in sd.items():
            if id(t) not in copies:
                copies[id(t)] = full_tensor(t, self.device, dtype).to("cpu", copy=True)
            out[name] = copies[id(t)]
        return out

    @contextlib.contextmanager
    def policy_at(self, model, weights, scratch) -> Iterator[torch.nn.Module]:
        """The sharded policy with ``weights`` (full, on every rank) swapped in for the block, then restored."""
        if weights is None:
            yield model
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        own = {k: v.detach().clone() for k, v in model.state_dict().items()}  # this rank's shards
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
        try:
            yield model
        finally:
            set_model_state_dict(model, own)

    def params_finite(self, model: torch.nn.Module) -> bool:
        local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        return bool(dist.reduce_max(1.0 - _finite(local)).item() == 0.0)

    def save(self, path: Path, *, model, optimizer, extra: dict, critic=None) -> None:
        from bapo.learner import fsdp

        fsdp.save_sharded(path, model=model, optimizer=optimizer, extra=extra)

    def load(self, path: Path, *, model, optimizer, critic=None) -> dict:
        from bapo.learner import fsdp

        return fsdp.load_sharded(path, model=model, optimizer=optimizer)

    def export_hf(self, model, out: Path, tokenizer, *, dtype: torch.dtype | None = None, extra: dict | None = None):
        from bapo.learner import fsdp

        fsdp.save_hf(model, out, tokenizer=tokenizer, dtype=dtype, extra=extra, device=self.device)
