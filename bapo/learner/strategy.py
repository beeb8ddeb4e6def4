"""How the learner's model is placed: one process, or FSDP2 over torchrun's ranks.

The learner picks its strategy once, in its constructor, from ``learner.kind``;
everything that differs between the two lives here, so neither the learner's
update nor the loop branches on it:

===================  ==================================  =======================================
                     ``single``                          ``fsdp``
===================  ==================================  =======================================
device               ``learner.device``                  this rank's (``bapo.dist.init``)
wrap                 move to the device                  ``fully_shard`` per decoder layer + root
collectives          none                                all-reduce sum / max over the ranks
mini-batch           all of it                           this rank's share (``dist.shard``)
full weights         the live ``state_dict``             gathered on every rank (a collective)
policy at a version  a scratch copy loaded with it       the shards swapped in, then back
checkpoint           ``learner.pt`` (weights_only)       DCP shards + plain state (no pickle)
HF export            ``save_pretrained``                 gathered, rank 0 writes
===================  ==================================  =======================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from bapo import checkpoint, dist


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

    def __init__(self, device: torch.device):
        self.device = device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def shard(self, items: Sequence) -> list:
        return list(items)

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def snapshot(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

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
        checkpoint.write(path / "learner.pt", state)

    def load(self, path: Path, *, model, optimizer, critic=None) -> dict:
        state = checkpoint.load(path / "learner.pt", verify_checksum=False)  # the run's restore verified the folder
        if (critic is None) != ("critic" not in state):
            has = "has" if "critic" in state else "has no"
            raise checkpoint.CheckpointError(f"{path}: the checkpoint {has} critic and this run's algo disagrees")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if critic is not None:
            critic.load_state_dict(state["critic"])
        return state["extra"]

    def export_hf(self, model, out: Path, tokenizer) -> None:
        with checkpoint.staged_folder(out) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)


class FSDPStrategy:
    """FSDP2 (``bapo.learner.fsdp``) over the default process group, one device per rank."""

    supports_critic = False

    def __init__(self, cfg):
        self.cfg = cfg
        self.device = dist.init()
        self.reduce_sum = dist.reduce_sum
        self.reduce_max = dist.reduce_max

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from bapo.learner import fsdp

        return fsdp.wrap(
            model,
            device=self.device,
            mixed_precision=self.cfg.mixed_precision,
            activation_checkpointing=self.cfg.activation_checkpointing,
            cpu_offload=self.cfg.cpu_offload,
        )

    def shard(self, items: Sequence) -> list:
        return dist.shard(items)

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from bapo.learner import fsdp

        return fsdp.full_state_dict(model, rank0_only=False)

    def snapshot(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return self.full_weights(model)  # gathered into new tensors: already a copy

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

    def export_hf(self, model, out: Path, tokenizer) -> None:
        from bapo.learner import fsdp

        fsdp.save_hf(model, out, tokenizer=tokenizer)
