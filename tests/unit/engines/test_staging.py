"""Staged weight folders (bapo/engines/staging.py): what the learner writes for a vLLM engine in other processes.

The GPU behaviour that matters is given to the CPU here: a device-to-host copy (``Tensor.cpu``) that makes a new
tensor and frees its source, so the allocator can hand the next tensor the same address (on CPU ``.cpu()`` copies
nothing). Under that copy, the learner's streamed FSDP2 weights must reach the folder whole.
"""

import shutil
from collections import namedtuple
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from bapo.engines.staging import (
    MANIFEST,
    WEIGHTS_FILE,
    Reader,
    StagingError,
    check_reply,
    check_space,
    fingerprint,
    make_root,
    save_weights,
)
from bapo.infra.checks import ConfigError


def _tiny_qwen2(tied: bool):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


class Streamed(Mapping):
    """A mapping whose ``items()`` makes each tensor as it is read (as a streamed FSDP mapping gathers it); its keys
    name what it yields."""

    def __init__(self, names):
        self.names = list(names)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def __getitem__(self, name):
        return dict(self.items())[name]


@pytest.fixture()
def copying_cpu(monkeypatch):
    """``Tensor.cpu`` with a device-to-host copy's semantics: a new tensor every time."""
    original = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: original(self, *a, **k).clone())


# ----------------------------------------------------------------------------- fingerprints


def _signed(x: int) -> int:
    x %= 2**64
    return x - 2**64 if x >= 2**63 else x


def test_fingerprint_by_hand():
    # bf16 1.0 is 0x3F80 = 16256: bytes 80 3F, padded with six zero bytes into one little-endian word
    assert fingerprint(torch.tensor([1.0], dtype=torch.bfloat16)) == [1, 16256, 16256**2]
    # bf16 [1.0, -1.0]: bytes 80 3F 80 BF, one word 0xBF803F80; its square is taken modulo 2**64
    w = 0xBF803F80
    assert fingerprint(torch.tensor([1.0, -1.0], dtype=torch.bfloat16)) == [2, w, _signed(w * w)]
    # fp32 1.0 is 0x3F800000
    assert fingerprint(torch.tensor([1.0])) == [1, 0x3F800000, 0x3F800000**2]
    # one byte (bool): padded with zero bytes into one word, 1
    assert fingerprint(torch.tensor([True])) == [1, 1, 1]
    assert fingerprint(torch.zeros(0)) == [0, 0, 0]
    # 8 bytes of 0xFF: the word -1, its square 1; two such words sum to -2 (sums wrap modulo 2**64, signed)
    assert fingerprint(torch.full((2,), -1, dtype=torch.int64)) == [2, -2, 2]


def _reference(t: torch.Tensor) -> list[int]:
    """The same sums, one 64-bit word at a time in Python integers, reduced modulo 2**64 at the end."""
    raw = bytes(t.contiguous().view(torch.uint8).tolist())
    raw += b"\0" * (-len(raw) % 8)
    words = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]
    return [t.numel(), _signed(sum(words)), _signed(sum(w * w for w in words))]


@given(
    st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=40),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    st.integers(0, 39),
)
def test_fingerprint_matches_a_word_by_word_reference_and_adds_over_pieces_of_whole_words(xs, dtype, cut):
    t = torch.tensor(xs).to(dtype)
    assert fingerprint(t) == _reference(t)
    per_word = 8 // t.element_size()
    cut -= cut % per_word  # pieces cut at a multiple of 8 bytes
    a, b = t[:cut], t[cut:]
    fa, fb = fingerprint(a), fingerprint(b)
    assert fingerprint(t) == [x + y for x, y in zip(fa[:1], fb[:1], strict=True)] + [
        _signed(x + y) for x, y in zip(fa[1:], fb[1:], strict=True)
    ]


def test_fingerprint_wraps_as_the_reference_does_on_large_words():
    """Sums past 2**63 wrap: the vectorised sums agree with Python's integers modulo 2**64."""
    t = torch.tensor([2**62 + 12345, 2**63 - 1, -(2**63), 2**62] * 70_000, dtype=torch.int64)
    assert fingerprint(t) == _reference(t)


def test_fingerprint_of_a_view_that_does_not_start_on_a_word():
    t = torch.randn(101, dtype=torch.bfloat16)
    assert fingerprint(t[3:]) == _reference(t[3:])  # bytes 6.. of the storage


def test_fingerprint_sees_one_changed_bit():
    t = torch.randn(1000, dtype=torch.bfloat16)
    u = t.clone()
    u.view(torch.int16)[517] ^= 1
    assert fingerprint(t) != fingerprint(u)


# ----------------------------------------------------------------------------- the learner's side


def test_streamed_fsdp_weights_reach_the_folder_whole_when_the_host_copy_frees_its_source(tmp_path, copying_cpu):
    """A 1-rank gloo FSDP2 tiny Qwen2, streamed as a sync streams it: every state-dict name is written (the tied
    head once, as an alias) with the full weights' values. Deduplicating by address dropped 11 of 27 tensors."""
    from bapo.infra import dist
    from bapo.learner import fsdp
    from bapo.learner.weights import StreamedWeights

    device = dist.init_one_rank("gloo")
    try:
        model = fsdp.wrap(_tiny_qwen2(tied=True), device=device)
        full = {k: v.to(torch.bfloat16) for k, v in fsdp.full_state_dict(model, rank0_only=False).items()}
        staged = save_weights(StreamedWeights(model, device, torch.bfloat16), tmp_path / "v1", torch.bfloat16)
    finally:
        dist.teardown()
    written = load_file(tmp_path / "v1" / WEIGHTS_FILE)
    assert sorted(written) == sorted(k for k in full if k != "lm_head.weight")
    assert staged.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    for k, v in written.items():
        assert torch.equal(v, full[k]), k
    assert staged.tensors == {k: fingerprint(v) for k, v in written.items()}


def test_a_plain_state_dict_writes_tied_weights_once_and_untied_ones_all(tmp_path, copying_cpu):
    tied = _tiny_qwen2(tied=True)
    staged = save_weights(tied.state_dict(), tmp_path / "tied", torch.float32)
    assert staged.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    untied = _tiny_qwen2(tied=False)
    staged = save_weights(untied.state_dict(), tmp_path / "untied", torch.bfloat16)
    assert staged.aliases == {} and len(load_file(tmp_path / "untied" / WEIGHTS_FILE)) == len(untied.state_dict())


def test_a_freed_tensor_whose_address_comes_back_is_not_an_alias(tmp_path, copying_cpu):
    """Distinct tensors at one address (each gone before the next is made, as a caching allocator reuses a freed
    block) are all written."""

    class Reused(Streamed):
        def items(self):
            buf = torch.empty(64)
            for name, value in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
                t = buf.fill_(value)  # the same storage, a new value: the earlier one is gone
                yield name, t.view(8, 8)

    staged = save_weights(Reused("abc"), tmp_path / "v", torch.float32)
    got = load_file(tmp_path / "v" / WEIGHTS_FILE)
    assert staged.aliases == {} and {k: float(v[0, 0]) for k, v in got.items()} == {"a": 1.0, "b": 2.0, "c": 3.0}


def test_an_alias_whose_values_changed_is_refused(tmp_path):
    class Changing(Streamed):
        def items(self):
            t = torch.ones(4)
            yield "embed", t
            t.add_(1)  # the same live tensor, read again after a change: not what a tie means
            yield "head", t

    with pytest.raises(StagingError, match="head was taken for a tied alias of embed"):
        save_weights(Changing(["embed", "head"]), tmp_path / "v", torch.float32)


def test_the_streamed_file_reads_back_with_safetensors_as_written(tmp_path, monkeypatch):
    """Tensors of every kind a state dict holds, several chunks long where the chunk is made small: safetensors' own
    readers (load_file, safe_open) give back each tensor cast to the staged dtype, and each fingerprint is the whole
    tensor's, though it was summed a chunk at a time."""
    from safetensors import safe_open

    from bapo.engines import staging

    monkeypatch.setattr(staging, "CHUNK_BYTES", 64)  # 32 bf16 values a chunk
    g = torch.Generator().manual_seed(0)
    weights = {
        "odd": torch.randn(7, 13, generator=g),  # 91 values: 3 whole chunks and a short one, not a whole word
        "exact": torch.randn(4, 32, generator=g),  # 4 whole chunks
        "half": torch.randn(5, generator=g, dtype=torch.float64).half(),  # another float dtype, cast too
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),  # 3 bytes, never cast
        "steps": torch.arange(9, dtype=torch.int64),
        "transposed": torch.randn(6, 40, generator=g).t(),  # not contiguous
    }
    staged = save_weights(weights, tmp_path / "v", torch.bfloat16)
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}
    got = load_file(tmp_path / "v" / WEIGHTS_FILE)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    assert staged.tensors == {k: fingerprint(v) for k, v in want.items()}
    with safe_open(str(tmp_path / "v" / WEIGHTS_FILE), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(want)
    assert staged.nbytes == (tmp_path / "v" / WEIGHTS_FILE).stat().st_size
    assert not list((tmp_path / "v").glob("*.tmp"))


def test_a_writer_holds_a_chunk_not_the_model(tmp_path, monkeypatch):
    """16 fp32 tensors of 4 MiB (a 32 MiB bf16 copy) staged with 1 MiB chunks: the allocations made while
    ``save_weights`` runs peak at its chunk buffers (the cast chunk, the squares of its words), not at a copy of
    the model."""
    from bapo.engines import staging
    from scripts.gpu.gpu_check_scale import cpu_peak

    monkeypatch.setattr(staging, "CHUNK_BYTES", 1 << 20, raising=False)
    weights = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(16)}  # 16 x 4 MiB of fp32
    staged, peak = cpu_peak(lambda: save_weights(weights, tmp_path / "v", torch.bfloat16))
    assert staged.nbytes > 32 << 20
    assert peak < 3 << 20, f"{peak / 2**20:.1f} MiB allocated at the peak"


def test_keys_that_do_not_list_what_the_mapping_yields_are_refused(tmp_path):
    class Unlisted(Streamed):
        def items(self):
            yield "a", torch.ones(2)
            yield "b", torch.ones(2)

    with pytest.raises(StagingError, match="the weights yielded 'b', which their keys do not list"):
        save_weights(Unlisted(["a"]), tmp_path / "v", torch.float32)
    assert not list((tmp_path / "v").iterdir())  # no partial file left


# ----------------------------------------------------------------------------- the workers' side


def _staged(tmp_path: Path):
    model = _tiny_qwen2(tied=False)
    return save_weights(model.state_dict(), tmp_path / "v", torch.bfloat16)


def test_the_reader_reads_what_the_manifest_lists(tmp_path):
    staged = _staged(tmp_path)
    reader = Reader(staged.folder)
    names = [n for n, _ in reader]
    assert names and (staged.folder / MANIFEST).is_file()
    reply = reader.check()
    assert reply == {"tensors": len(names), "digest": staged.digest}
    check_reply(staged, [reply, reply], "test")  # one reply per worker


@pytest.mark.parametrize("damage", ["missing", "changed", "extra"])
def test_a_folder_that_differs_from_its_manifest_is_refused(tmp_path, damage):
    staged = _staged(tmp_path)
    f = staged.folder / WEIGHTS_FILE
    tensors = load_file(f)
    name = "model.layers.1.self_attn.q_proj.weight"
    if damage == "missing":
        del tensors[name]
    elif damage == "changed":
        tensors[name] = tensors[name].clone()
        tensors[name].view(torch.int16)[0, 0] ^= 1
    else:
        tensors["stray.weight"] = torch.zeros(2)
    save_file(tensors, str(f))
    reader = Reader(staged.folder)
    for _ in reader:
        pass
    with pytest.raises(StagingError, match="does not hold what the learner sent: 1 "):
        reader.check()


def test_a_reply_with_another_digest_is_refused(tmp_path):
    staged = _staged(tmp_path)
    with pytest.raises(StagingError, match="read other weights than the learner wrote"):
        check_reply(staged, [{"tensors": len(staged.tensors), "digest": "0" * 16}], "rollout=vllm_server")
    with pytest.raises(StagingError, match="read other weights"):
        check_reply(staged, [None], "rollout=vllm_server")


# ----------------------------------------------------------------------------- where the folders go


def test_weights_dir_is_created_and_an_unwritable_one_is_one_line(tmp_path):
    root = make_root(str(tmp_path / "a" / "b"), "bapo-test-")
    assert root.parent == tmp_path / "a" / "b" and root.is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^rollout.weights_dir: .*file/sub cannot hold the weight folders"):
        make_root(str(tmp_path / "file" / "sub"), "bapo-test-")


def test_too_little_space_names_the_container_flags_and_the_key(monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(64 << 20, 0, 64 << 20))
    with pytest.raises(ConfigError, match=r"--shm-size=<size> or --ipc=host, or set rollout.weights_dir"):
        check_space(Path("/dev/shm/bapo-x"), 15 << 30)
    with pytest.raises(ConfigError, match=r"^rollout.weights_dir: /data/w has 0.06 GiB free, .* stages 15.00 GiB"):
        check_space(Path("/data/w"), 15 << 30)
    check_space(Path("/data/w"), 1 << 20)  # fits: nothing said


def test_reading_without_writing_sees_the_same_tensors_when_python_ids_come_back(tmp_path, copying_cpu):
    """A rank that only fingerprints the stream (its node's first rank writes) must agree with the writer: a tensor
    freed before the next is made often gets the same Python id, which is no alias either."""
    ids = []

    class Fresh(Streamed):
        def items(self):
            for i in range(24):
                t = torch.full((16,), float(i))
                ids.append(id(t))
                yield f"w{i}", t
                del t

    names = [f"w{i}" for i in range(24)]
    read = save_weights(Fresh(names), tmp_path / "r", torch.float32, write=False)
    assert len(set(ids)) < len(ids), "the test needs CPython to reuse an id"
    assert not (tmp_path / "r").exists()
    written = save_weights(Fresh(names), tmp_path / "w", torch.float32)
    assert read.tensors == written.tensors and read.digest == written.digest and read.aliases == {}
