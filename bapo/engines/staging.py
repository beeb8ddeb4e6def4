"""Weight folders staged for a vLLM engine in other processes: written by the learner, read by vLLM's workers.

Where the engine's workers live in other processes (``rollout=vllm_server``; ``rollout=vllm`` with tensor
parallelism and no torchrun) the learner's weights reach them as a folder: ``model.safetensors`` (written
under a temporary name, then renamed) and :data:`MANIFEST`, what the learner meant to send. The workers read
the folder tensor by tensor, hand each to vLLM's in-place reload, and answer with what they read; the learner
refuses a sync whose answer differs from what it sent (:func:`check_reply`).

Fingerprints. Each tensor's fingerprint is ``[numel, S1, S2]``: the sums of its 16-bit words and of their
squares (bytes read as int16, summed in int64: exact, so two machines agree bit for bit, and additive
over concatenation). It is taken on the tensor's own device before it crosses to the host, so a copy
that goes wrong on the way (a freed block reused, a short read) shows as a mismatch. A tensor is written
once: a name whose tensor is *the same live tensor* as an earlier name's (a tied ``lm_head.weight``) is
recorded as an alias of it, and must carry the same fingerprint.

Why "live". A freshly all-gathered GPU tensor is freed after its host copy, and CUDA's caching allocator
hands the same block to the next tensor of the same size: two different parameters can then share a
``data_ptr``. An earlier version deduplicated on ``(data_ptr, shape)`` and so dropped whole layers at every
sync on a GPU (22 of 75 tensors of a tiny Qwen2 when ``Tensor.cpu`` copies, as a device-to-host copy does);
vLLM's layerwise reload then kept the old weights of a layer that got none. Here an alias needs the earlier
tensor to be alive (held by a weak reference that has not died), so its memory cannot have been reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bapo.infra.checks import ConfigError

WEIGHTS_FILE = "model.safetensors"
MANIFEST = "bapo_weights.json"
FORMAT = 1
_CHUNK = 1 << 24  # 16-bit words per fingerprint chunk: 128 MiB of int64 at a time


class StagingError(RuntimeError):
    """A staged folder does not hold what the learner sent, or the engine did not load all of it (one line)."""


def fingerprint(t: torch.Tensor) -> list[int]:
    """``[numel, S1, S2]`` of ``t``: the sums of its bytes read as int16 words and of their squares (int64,
    exact; an odd byte count is padded with a zero byte). Order-free within a tensor, additive over
    concatenation; computed on ``t``'s device."""
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.zeros(0, dtype=torch.uint8, device=flat.device)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    words = raw.view(torch.int16)
    s1 = s2 = 0
    for i in range(0, words.numel(), _CHUNK):
        w = words[i : i + _CHUNK].to(torch.int64)
        s1 += int(w.sum())
        s2 += int((w * w).sum())
    return [int(flat.numel()), s1, s2]


def digest(fingerprints: Mapping[str, list[int]]) -> str:
    """One hex digest of named fingerprints (independent of their order)."""
    h = hashlib.sha256()
    for name in sorted(fingerprints):
        h.update(f"{name}:{':'.join(map(str, fingerprints[name]))};".encode())
    return h.hexdigest()[:16]


@dataclass
class Staged:
    """What :func:`save_weights` wrote: the folder, its tensors' fingerprints, the aliases and the timings."""

    folder: Path
    tensors: dict[str, list[int]]
    aliases: dict[str, str]
    nbytes: int
    seconds: float
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        self.digest = digest(self.tensors)


def _unique(weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor, str | None]]:
    """``(name, tensor in dtype, None)`` for each tensor to write, ``(name, tensor, target)`` for a tied alias of
    an earlier name: the same *live* tensor (its storage, offset, shape and strides, while the earlier tensor
    object is still alive, so its memory cannot have been handed to another). Neither an address nor a Python
    ``id`` alone identifies a tensor: both are reused once the earlier one is freed."""
    live: dict[tuple, tuple[weakref.ref, str]] = {}
    for name, given in weights.items():
        src = given.detach()
        key = (src.untyped_storage().data_ptr(), src.storage_offset(), tuple(src.shape), tuple(src.stride()))
        earlier = live.get(key)
        t = src.to(dtype) if src.is_floating_point() else src
        if earlier is not None and earlier[0]() is not None:
            yield name, t, earlier[1]
            continue
        live[key] = (weakref.ref(given), name)
        yield name, t, None


def save_weights(
    weights: Mapping[str, torch.Tensor], folder: Path, dtype: torch.dtype, *, write: bool = True
) -> Staged:
    """The learner's weights as ``folder/model.safetensors`` in ``dtype`` and a :data:`MANIFEST` beside it.

    ``weights`` is read once, in its order (a streamed FSDP mapping gathers each tensor as it is read); each
    tensor is cast on its device, fingerprinted there, and copied to the host. Written under temporary
    names and renamed, so a reader never sees a half-written folder. ``write=False`` reads and fingerprints
    the same way and writes nothing (a rank whose node's first rank writes the copy they share)."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    host: dict[str, torch.Tensor] = {}
    prints: dict[str, list[int]] = {}
    aliases: dict[str, str] = {}
    alias_prints: dict[str, list[int]] = {}
    shared: set[int] = set()  # host storages written, to copy a tensor whose storage another name shares
    for name, t, target in _unique(weights, dtype):
        if target is not None:
            aliases[name], alias_prints[name] = target, fingerprint(t)
            continue
        prints[name] = fingerprint(t)
        if not write:
            continue
        h = t.cpu().contiguous()
        if h.untyped_storage().data_ptr() in shared:  # a view of a tensor written under another name
            h = h.clone()
        shared.add(h.untyped_storage().data_ptr())
        host[name] = h
    for name, target in aliases.items():
        if alias_prints[name] != prints[target]:
            raise StagingError(f"staging: {name} was taken for a tied alias of {target} but its values differ")
    staged = Staged(folder, prints, aliases, 0, 0.0)
    if write:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (WEIGHTS_FILE + ".tmp")
        save_file(host, str(tmp), metadata={"format": "pt"})
        staged.nbytes = tmp.stat().st_size
        tmp.replace(folder / WEIGHTS_FILE)
        manifest = {"format": FORMAT, "dtype": str(dtype), "tensors": prints, "aliases": aliases}
        (folder / (MANIFEST + ".tmp")).write_text(json.dumps(manifest | {"digest": staged.digest}))
        (folder / (MANIFEST + ".tmp")).replace(folder / MANIFEST)
    staged.seconds = time.perf_counter() - t0
    return staged


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StagingError(f"staging: {path} cannot be read ({e})") from None
    if manifest.get("format") != FORMAT:
        raise StagingError(f"staging: {path} has format {manifest.get('format')!r}, this reader knows {FORMAT}")
    return manifest


class Reader:
    """The workers' side: the staged tensors one at a time (moved to ``device``), each fingerprinted as it is
    handed on; :meth:`check` then compares what was read with the manifest."""

    def __init__(self, folder: str | Path, device: torch.device | str = "cpu"):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.device = torch.device(device)
        self.read: dict[str, list[int]] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        with safe_open(str(self.folder / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_tensor(name)
                if self.device.type != "cpu":
                    t = t.to(self.device, non_blocking=True)
                self.read[name] = fingerprint(t)
                yield name, t

    def check(self) -> dict:
        """Raise :class:`StagingError` unless every tensor the manifest lists was read with its fingerprint;
        returns the reply the learner checks (:func:`check_reply`)."""
        want = self.manifest["tensors"]
        missing = sorted(set(want) - set(self.read))
        extra = sorted(set(self.read) - set(want))
        differ = sorted(n for n in set(want) & set(self.read) if list(want[n]) != list(self.read[n]))
        if missing or extra or differ:
            parts = [f"{len(x)} {what} (first: {x[0]})" for x, what in
                     ((missing, "missing"), (extra, "unexpected"), (differ, "with other values")) if x]  # fmt: skip
            raise StagingError(f"staging: {self.folder} does not hold what the learner sent: {', '.join(parts)}")
        return {"tensors": len(self.read), "digest": digest(self.read)}


def check_reply(staged: Staged, reply, who: str) -> None:
    """Refuse a sync whose workers read other tensors than the learner wrote (``reply``: one
    :meth:`Reader.check` result per worker)."""
    for r in reply if isinstance(reply, list) else [reply]:
        got = r if isinstance(r, dict) else {"digest": repr(r)[:80], "tensors": "?"}
        if got.get("digest") != staged.digest or got.get("tensors") != len(staged.tensors):
            raise StagingError(
                f"{who}: the engine read other weights than the learner wrote (digest {got.get('digest')}, "
                f"{got.get('tensors')} tensors; sent {staged.digest}, {len(staged.tensors)} tensors)"
            )


def reload_checked(worker, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
    """Inside a vLLM worker: vLLM's in-place reload of ``weights`` (checkpoint format), refusing a reload that
    leaves a parameter without weights, or a fused layer (``qkv_proj``, ``gate_up_proj``) with only some of its
    parts (vLLM itself logs the first and fills the second's rest with whatever memory held). Returns the number
    of parameters loaded."""
    model = worker.model_runner.get_model()
    expected = {name for name, _ in model.named_parameters()}
    seen: dict[str, object] = {}
    inner = model.load_weights

    def counting(ws):
        loaded = inner(ws)
        seen["loaded"] = set(loaded) if loaded is not None else expected
        seen["partial"] = _partly_loaded(model)  # before vLLM finalises (and forgets) the layers' counts
        return loaded

    model.load_weights = counting
    try:
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    finally:
        del model.load_weights
    missing = sorted(expected - seen.get("loaded", set()))
    if missing:
        raise StagingError(f"vLLM loaded no weights for {len(missing)} parameter(s) (first: {missing[0]})")
    partial = seen.get("partial") or []
    if partial:
        raise StagingError(f"vLLM got only part of {len(partial)} fused layer(s) (first: {partial[0]})")
    return len(expected)


def _partly_loaded(model: torch.nn.Module) -> list[str]:
    """Layers vLLM's layerwise reload counted as partly loaded (vocabulary layers aside: their padding rows are
    never loaded). Empty where this vLLM has no layerwise reload to ask."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError:
        return []
    out = []
    for name, layer in model.named_modules():
        if "Vocab" in type(layer).__name__ or "LMHead" in type(layer).__name__:
            continue
        info = get_layerwise_info(layer)
        if info.can_load() and 0 < info.load_numel < info.load_numel_total:
            out.append(f"{name}: {info.load_numel} of {info.load_numel_total} elements")
    return out


def model_bytes(weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> int:
    """Bytes one staged copy of ``weights`` takes in ``dtype`` (tied names once; shapes only, nothing gathered)."""
    total, seen = 0, set()
    for name in weights:
        t = weights._sd[name] if hasattr(weights, "_sd") else weights[name]
        if id(t) in seen:
            continue
        seen.add(id(t))
        size = torch.empty((), dtype=dtype).element_size() if t.is_floating_point() else t.element_size()
        total += t.numel() * size
    return total


def check_space(base: Path, need: int, key: str = "rollout.weights_dir") -> None:
    """Refuse a staging folder that cannot hold ``need`` bytes, in one line naming the fixes."""
    free = shutil.disk_usage(base).free
    if free >= need:
        return
    gib = 2**30
    hint = (
        "a container's /dev/shm is 64 MB by default: start it with --shm-size=<size> or --ipc=host, or"
        if str(base).startswith("/dev/shm")
        else ""
    )
    raise ConfigError(
        f"{key}: {base} has {free / gib:.2f} GiB free, the weight sync stages {need / gib:.2f} GiB there; "
        f"{hint} set {key} to a folder with room (a local disk is slower than tmpfs, not wrong)".replace("  ", " ")
    )


def make_root(weights_dir: str | None, prefix: str) -> Path:
    """A fresh staging folder under ``weights_dir`` (created, checked writable), else under /dev/shm where it
    exists, else the temporary folder."""
    import tempfile

    if weights_dir is not None:
        base = Path(weights_dir)
        try:
            base.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        except OSError as e:
            raise ConfigError(
                f"rollout.weights_dir: {base} cannot hold the weight folders ({e.strerror or e})"
            ) from None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=shm))
