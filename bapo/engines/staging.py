"""Weight folders staged for a vLLM engine in other processes: written by the learner, read by vLLM's workers.

Where the engine's workers live in other processes (``rollout=vllm_server``; ``rollout=vllm`` with tensor
parallelism and no torchrun) the learner's weights reach them as a folder: ``model.safetensors`` (written
under a temporary name, then renamed) and :data:`MANIFEST`, what the learner meant to send. The workers read
the folder tensor by tensor, hand each to vLLM's in-place reload, and answer with what they read; the learner
refuses a sync whose answer differs from what it sent (:func:`check_reply`).

Streaming. :func:`save_weights` reads the mapping once and writes each tensor as it comes, a chunk at a time
(:data:`CHUNK_BYTES`): the chunk is cast, fingerprinted and appended to the file, so a writer holds one chunk,
never the model. The safetensors header (a JSON table of names, shapes and byte offsets in front of the data)
is written last, into room reserved from the mapping's names before the first tensor (:func:`_header_room`),
padded with spaces as safetensors pads its own: any safetensors reader reads the file as it reads one that
``safetensors.torch.save_file`` wrote. Where a tensor lives on an accelerator it is cast and fingerprinted there
and only the cast chunk crosses to the host; a host tensor (an asynchronous snapshot) is cast on ``device``
when one is given (a chunk copied there and the cast chunk back), else on the host.

Fingerprints. Each tensor's fingerprint is ``[numel, S1, S2]``: its bytes read as little-endian 64-bit words
(the last one padded with zero bytes), S1 the sum of the words and S2 the sum of their squares, both modulo
2**64 (written as signed int64). Integer sums modulo 2**64 are exact in any order, so the learner's GPU, the
host and a server's GPU agree bit for bit; they are additive over pieces cut at multiples of 8 bytes, which is
how a tensor is fingerprinted chunk by chunk; and they cost one pass over the bytes with no wider copy of them
(a 64-bit word is already the accumulator's width). A tensor is fingerprinted where it was cast, before it
crosses to the host, so a copy that goes wrong on the way (a freed block reused, a short read) shows as a
mismatch. A tensor is written once: a name whose tensor is *the same live tensor* as an earlier name's (a tied
``lm_head.weight``) is recorded as an alias of it, and must carry the same fingerprint.

Why "live". A freshly all-gathered GPU tensor is freed after its host copy, and CUDA's caching allocator
hands the same block to the next tensor of the same size: two different parameters can then share a
``data_ptr``. Deduplicating on ``(data_ptr, shape)`` would drop whole layers at every sync on a GPU (22 of 75
tensors of a tiny Qwen2 when ``Tensor.cpu`` copies, as a device-to-host copy does), and vLLM's layerwise reload
would then keep the old weights of a layer that got none. Here an alias needs the earlier tensor to be alive
(held by a weak reference that has not died), so its memory cannot have been reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bapo.infra.checks import ConfigError

WEIGHTS_FILE = "model.safetensors"
MANIFEST = "bapo_weights.json"
FORMAT = 2  # 2: fingerprints over 64-bit words
CHUNK_BYTES = 32 << 20  # what a writer casts, fingerprints and writes at a time (a multiple of 8)
_WORDS = {"cpu": 1 << 16, "accelerator": 1 << 22}  # 64-bit words squared at a time: 512 KiB on a host, 32 MiB on a GPU
MASK64 = (1 << 64) - 1
# safetensors' names of the dtypes a staged folder may hold
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
MAX_DIMS = 8  # the header's room is reserved for shapes of up to this many dimensions


class StagingError(RuntimeError):
    """A staged folder does not hold what the learner sent, or the engine did not load all of it (one line)."""


def _signed(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


class Fingerprint:
    """The running ``[numel, S1, S2]`` of one tensor whose bytes arrive in pieces (:meth:`update`): every piece but
    the last a multiple of 8 bytes long. The sums stay on the pieces' device until :meth:`value`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.s1 = torch.zeros((), dtype=torch.int64, device=device)
        self.s2 = torch.zeros((), dtype=torch.int64, device=device)
        self._scratch: torch.Tensor | None = None
        self._tail = False

    def update(self, raw: torch.Tensor) -> None:
        """Add the bytes of ``raw`` (a contiguous 1-D uint8 tensor on this fingerprint's device)."""
        if self._tail:
            raise ValueError("fingerprint: only the last piece may end off a multiple of 8 bytes")
        whole = raw.numel() - raw.numel() % 8
        if whole:
            self._add(_words(raw[:whole]))
        if whole < raw.numel():  # the tensor's last bytes, padded with zeros to one word
            pad = torch.zeros(8, dtype=torch.uint8, device=raw.device)
            pad[: raw.numel() - whole] = raw[whole:]
            self._add(pad.view(torch.int64))
            self._tail = True

    def _add(self, w: torch.Tensor) -> None:
        step = _WORDS["cpu" if w.device.type == "cpu" else "accelerator"]
        if self._scratch is None or self._scratch.numel() < min(step, w.numel()):
            self._scratch = torch.empty(min(step, w.numel()), dtype=torch.int64, device=w.device)
        for i in range(0, w.numel(), step):
            c = w[i : i + step]  # [k] int64 words
            self.s1 += c.sum()  # int64 sums wrap: modulo 2**64, exact in any order
            self.s2 += torch.mul(c, c, out=self._scratch[: c.numel()]).sum()

    def value(self, numel: int) -> list[int]:
        return [int(numel), _signed(int(self.s1)), _signed(int(self.s2))]


def _words(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8, a multiple of 8 bytes) as int64 words, copied first where it does not start on 8 bytes."""
    if raw.storage_offset() % 8 or raw.data_ptr() % 8:
        raw = raw.clone()
    return raw.view(torch.int64)


def fingerprint(t: torch.Tensor) -> list[int]:
    """``[numel, S1, S2]`` of ``t``: the sums, modulo 2**64, of its bytes read as little-endian int64 words (the last
    padded with zero bytes) and of their squares. Order-free within a tensor, additive over pieces cut at multiples
    of 8 bytes; computed on ``t``'s device."""
    flat = t.detach().contiguous().reshape(-1)
    fp = Fingerprint(flat.device)
    if flat.numel():
        fp.update(flat.view(torch.uint8))
    return fp.value(flat.numel())


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


def _unique(weights: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, str | None]]:
    """``(name, tensor, None)`` for each tensor to write, ``(name, tensor, target)`` for a tied alias of an earlier
    name: the same *live* tensor (its storage, offset, shape and strides, while the earlier tensor object is still
    alive, so its memory cannot have been handed to another). Neither an address nor a Python ``id`` alone
    identifies a tensor: both are reused once the earlier one is freed."""
    live: dict[tuple, tuple[weakref.ref, str]] = {}
    for name, given in weights.items():
        src = given.detach()
        key = (src.untyped_storage().data_ptr(), src.storage_offset(), tuple(src.shape), tuple(src.stride()))
        earlier = live.get(key)
        if earlier is not None and earlier[0]() is not None:
            yield name, src, earlier[1]
            continue
        live[key] = (weakref.ref(given), name)
        yield name, src, None


class _Pieces:
    """Tensors cast to the staged dtype a chunk at a time, on the device where the cast happens: the tensor's own
    accelerator, else ``device`` for a host tensor where one is given (its own CUDA stream, so that it never waits
    behind the learner's queued kernels), else the host. The chunk buffers are kept from one tensor to the next."""

    def __init__(self, device: torch.device | str | None):
        self.device = None if device is None or torch.device(device).type == "cpu" else torch.device(device)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._stream = None

    def _buffer(self, key: tuple, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            pin = device.type == "cpu" and key[0] == "host"  # the device-to-host copy's landing place
            buf = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8, device=device, pin_memory=pin)
            self._buffers[key] = buf
        return buf[:nbytes]

    @contextlib.contextmanager
    def _on(self, src: torch.Tensor) -> Iterator[torch.device]:
        """The device ``src`` is cast and fingerprinted on, current (with its stream) for the block."""
        work = src.device if src.device.type != "cpu" or self.device is None else self.device
        if work.type != "cuda":
            yield work
            return
        with torch.cuda.device(work):
            if src.device.type != "cpu":
                yield work
                return
            if self._stream is None:
                self._stream = torch.cuda.Stream(work)
            with torch.cuda.stream(self._stream):
                yield work

    def stage(self, src: torch.Tensor, dtype: torch.dtype, sink: _File | None = None, name: str = "") -> list[int]:
        """``src`` cast to ``dtype`` (floating tensors; others as they are), fingerprinted where it was cast and,
        with a ``sink``, appended to it under ``name``; returns the fingerprint."""
        out = dtype if src.is_floating_point() else src.dtype
        flat = src.contiguous().reshape(-1)
        size = torch.empty((), dtype=out).element_size()
        per = CHUNK_BYTES // max(flat.element_size(), size)  # elements a chunk: a multiple of 8 bytes either way
        if sink is not None:
            sink.begin(name, out, list(src.shape))
        with self._on(flat) as work:
            fp = Fingerprint(work)
            for i in range(0, flat.numel(), per):
                piece = flat[i : i + per]
                moved = piece.to(work) if piece.device != work else piece  # a host chunk to the casting device
                if moved.dtype != out:
                    key = ("cast", str(work), piece.device.type)  # one buffer per stream
                    cast = self._buffer(key, moved.numel() * size, work).view(out)
                    raw = cast.copy_(moved).view(torch.uint8)
                else:
                    raw = moved.view(torch.uint8)
                fp.update(raw)
                if sink is None:
                    continue
                if raw.device.type == "cpu":
                    sink.write(raw)
                elif moved is not piece and moved.dtype == out:  # not cast: the host chunk is what is written
                    sink.write(piece.view(torch.uint8))
                else:  # cast on the device: the cast chunk crosses to the host once
                    sink.write(self._buffer(("host",), raw.numel(), torch.device("cpu")).copy_(raw))
            value = fp.value(flat.numel())
        if sink is not None:
            sink.end()
        return value


def writer_bytes(on_device: bool) -> int:
    """What one writer holds while it stages, its chunk buffers: on the GPU that casts a host snapshot, the fp32
    chunk moved there, its cast and the squares of its words; on the host, the pinned chunk the cast crosses back
    into."""
    return 3 * CHUNK_BYTES if on_device else CHUNK_BYTES


def _header_room(names: list[str]) -> int:
    """Bytes reserved for the header of a file holding ``names`` (a multiple of 8): each entry's longest text
    (safetensors' longest dtype name, :data:`MAX_DIMS` dimensions and two offsets of 20 digits each)."""
    entry = len(json.dumps({"dtype": "BOOL", "shape": [10**19] * MAX_DIMS, "data_offsets": [10**19, 10**19]}))
    meta = len(json.dumps({"__metadata__": {"format": "pt"}}, separators=(",", ":")))
    need = meta + sum(len(json.dumps(n)) + 2 + entry for n in names)
    return (need + 7) // 8 * 8


class _File:
    """A safetensors file written one tensor at a time: the data, each tensor after the one before, from byte
    ``8 + room`` on, then the header (its length, its JSON padded with spaces to ``room``) in front."""

    def __init__(self, path: Path, names: list[str]):
        self.path, self.names = path, set(names)
        self.room = _header_room(names)
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self._open: tuple[str, int, int] | None = None
        self.f = open(path, "wb")  # noqa: SIM115 (closed by close() or abort())
        self.f.seek(8 + self.room)

    def begin(self, name: str, dtype: torch.dtype, shape: list[int]) -> None:
        if name not in self.names:
            raise StagingError(f"staging: the weights yielded {name!r}, which their keys do not list")
        if dtype not in DTYPES:
            raise StagingError(f"staging: {name} is {dtype}, which a staged folder cannot hold")
        numel = 1
        for d in shape:
            numel *= d
        self.entries[name] = {"dtype": DTYPES[dtype], "shape": shape, "data_offsets": [self.offset, self.offset]}
        self._open = (name, self.offset, self.offset + numel * torch.empty((), dtype=dtype).element_size())

    def write(self, raw: torch.Tensor) -> None:
        self.f.write(memoryview(raw.numpy()))
        self.offset += raw.numel()

    def end(self) -> None:
        name, start, stop = self._open
        if self.offset != stop:
            raise StagingError(f"staging: {name} wrote {self.offset - start} bytes, its shape holds {stop - start}")
        self.entries[name]["data_offsets"][1] = stop
        self._open = None

    def close(self) -> int:
        """Write the header and close; returns the file's size."""
        head = {"__metadata__": {"format": "pt"}} | self.entries
        text = json.dumps(head, separators=(",", ":")).encode()
        if len(text) > self.room:
            self.abort()
            raise StagingError(f"staging: the header takes {len(text)} bytes, {self.room} were reserved")
        self.f.seek(0)
        self.f.write(struct.pack("<Q", self.room) + text + b" " * (self.room - len(text)))
        self.f.close()
        return 8 + self.room + self.offset

    def abort(self) -> None:
        self.f.close()
        self.path.unlink(missing_ok=True)


def save_weights(
    weights: Mapping[str, torch.Tensor],
    folder: Path,
    dtype: torch.dtype,
    *,
    write: bool = True,
    device: torch.device | str | None = None,
) -> Staged:
    """The learner's weights as ``folder/model.safetensors`` in ``dtype`` and a :data:`MANIFEST` beside it.

    ``weights`` is read once, in its order (a streamed FSDP mapping gathers each tensor as it is read), and each
    tensor is cast, fingerprinted and written a chunk at a time (the module's docstring): on its accelerator, on
    ``device`` for a host tensor where one is given, else on the host. Its keys must name what it yields (they
    size the header). Written under temporary names and renamed, so a reader never sees a half-written folder.
    ``write=False`` reads and fingerprints the same way and writes nothing (a rank whose node's first rank writes
    the copy they share)."""
    t0 = time.perf_counter()
    pieces = _Pieces(device)
    prints: dict[str, list[int]] = {}
    aliases: dict[str, str] = {}
    alias_prints: dict[str, list[int]] = {}
    sink = None
    if write:
        folder.mkdir(parents=True, exist_ok=True)
        sink = _File(folder / (WEIGHTS_FILE + ".tmp"), list(weights))
    try:
        for name, src, target in _unique(weights):
            if target is not None:
                aliases[name], alias_prints[name] = target, pieces.stage(src, dtype)
                continue
            prints[name] = pieces.stage(src, dtype, sink, name)
        for name, target in aliases.items():
            if alias_prints[name] != prints[target]:
                raise StagingError(f"staging: {name} was taken for a tied alias of {target} but its values differ")
        nbytes = sink.close() if sink is not None else 0
    except BaseException:
        if sink is not None and not sink.f.closed:
            sink.abort()
        raise
    staged = Staged(folder, prints, aliases, nbytes, 0.0)
    if write:
        (folder / (WEIGHTS_FILE + ".tmp")).replace(folder / WEIGHTS_FILE)
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
