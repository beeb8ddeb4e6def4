"""The learner's weights going out: streamed one parameter at a time under FSDP2 (:class:`StreamedWeights`, what an
engine's sync and the HF export read), and the small files an export writes beside its safetensors. Used by both
placement strategies (bapo.learner.strategy) and by FSDP2's export (bapo.learner.fsdp); imports neither."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch


class StreamedWeights(Mapping):
    """The full (unsharded) weights of an FSDP2 model under their state-dict names, gathered lazily.

    ``weights[name]`` gathers that one tensor (a collective); ``items()`` yields every entry in the
    model's state-dict order, gathering each shared tensor once (a tied ``lm_head.weight`` is the
    embedding's tensor again). The values are new tensors on this rank's device, so a consumer that
    drops each one after use holds at most one full parameter at a time. Reads see the live weights:
    an optimizer step between two reads changes what the second returns.
    """

    collective = True  # every rank reads it at the same time (an engine may coordinate its ranks meanwhile)

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype | None = None):
        self._sd = model.state_dict(keep_vars=True)  # the DTensor parameters themselves: tied names share one
        self._device = device
        self._dtype = dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return full_tensor(self._sd[name], self._device, self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sd)

    def __len__(self) -> int:
        return len(self._sd)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        gathered: dict[int, torch.Tensor] = {}  # id(shard) -> its full tensor, for aliases only
        aliased = _aliased(self._sd)
        for name, t in self._sd.items():
            full = gathered.get(id(t))
            if full is None:
                full = full_tensor(t, self._device, self._dtype)
                if id(t) in aliased:
                    gathered[id(t)] = full
            yield name, full


def _aliased(sd: Mapping[str, torch.Tensor]) -> set[int]:
    """Ids of the tensors that appear under more than one name (tied weights)."""
    seen: set[int] = set()
    twice: set[int] = set()
    for t in sd.values():
        (twice if id(t) in seen else seen).add(id(t))
    return twice


def full_tensor(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full tensor of a DTensor shard (a collective), on ``device``, cast to ``dtype`` (floating tensors only)
    before the gather; a plain tensor detached (and cast) as is."""
    from torch.distributed.tensor import DTensor

    cast = dtype is not None and t.is_floating_point() and t.dtype != dtype
    if not isinstance(t, DTensor):
        return t.detach().to(dtype) if cast else t.detach()
    local = t.to_local().detach()
    if local.device != device or cast:  # CPU offload: the collective runs on the rank's device
        local = local.to(device=device, dtype=dtype if cast else local.dtype)
        t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor().detach()


def write_dtype(folder: Path, dtype: torch.dtype | None) -> None:
    """Make the export's config.json name the dtype its safetensors hold (``save_pretrained`` writes the model's
    own, the fp32 masters', even when it is given a bf16 state dict)."""
    if dtype is None:
        return
    f = Path(folder) / "config.json"
    config = json.loads(f.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    f.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_extra(folder: Path, extra: dict | None) -> None:
    """Small text files beside the weights (the run's resolved config as ``bapo_config.yaml``)."""
    for name, text in (extra or {}).items():
        (Path(folder) / name).write_text(text)
