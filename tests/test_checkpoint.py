"""Checkpoints: loading one never runs code, every file is checksummed and verified, a damaged newest
checkpoint is skipped for the newest intact one, pruning stays within a run's lineage and goes by write
order, a full disk fails with a plain message, exports are readable by others, and weights must be finite.

The learner here is a two-layer MLP with AdamW in one process (what ``save_learner`` reads of a
learner: model, optimizer, scheduler, skip count, objective state): DCP runs without a process group.
"""

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import secrets
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from bapo import checkpoint
from bapo.checkpoint import CheckpointError
from bapo.learner import fsdp

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-math"


class Payload:
    """What an attacker pickles: unpickling it calls ``os.system(cmd)``."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def small_learner(seed: int = 0) -> SimpleNamespace:
    """What ``save_learner`` needs of a learner, after one AdamW step (so the moments are not zero)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    model(torch.randn(5, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    objective = SimpleNamespace(state=None)
    return SimpleNamespace(
        model=model, optimizer=opt, scheduler=sched, skipped_updates=seed + 2, critic=None, objective=objective
    )


def save_learner(learner, path: Path) -> None:
    """The learner's part of a checkpoint, as the FSDP strategy writes it (weights, AdamW, small state)."""
    extra = {"scheduler": learner.scheduler.state_dict(), "skipped_updates": learner.skipped_updates}
    fsdp.save_sharded(path, model=learner.model, optimizer=learner.optimizer, extra=extra)


def load_learner(learner, path: Path, *, verify: bool = True) -> None:
    extra = fsdp.load_sharded(path, model=learner.model, optimizer=learner.optimizer, verify=verify)
    learner.scheduler.load_state_dict(extra["scheduler"])
    learner.skipped_updates = int(extra["skipped_updates"])


def loop_save(ckpt_dir: Path, step: int, learner=None, keep: int = 5, **kw) -> Path:
    """A checkpoint as the loop writes it: a producer file and the DCP learner in a prepared folder, then save()."""
    tmp = ckpt_dir / f".tmp-step_{step:06d}"
    checkpoint.prepare(tmp)
    checkpoint.write(tmp / "producer_rank0.pt", {"pending": [], "cursor": torch.arange(step + 3)})
    if learner is not None:
        save_learner(learner, tmp / "learner")
    state = {"step": step, "weights": torch.full((64,), float(step) + 0.25)}
    return checkpoint.save(ckpt_dir, step, state, keep=keep, tmp=tmp, **kw)


def resign(root: Path) -> None:
    """An attacker who edits a checkpoint can rewrite its manifest too: the checksums are not the defence."""
    if hasattr(checkpoint, "write_manifest"):
        checkpoint.write_manifest(root)


def attempt(fn, *args) -> BaseException | None:
    """The exception ``fn(*args)`` raised, if any (DCP's own CheckpointException is a BaseException)."""
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 (the test then says what it should have been)
        return e
    return None


def flip_byte(f: Path, at: int | None = None) -> None:
    data = bytearray(f.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    f.write_bytes(bytes(data))


# ---------------------------------------------------------------- loading never runs code


def test_a_tampered_dcp_metadata_cannot_run_code(tmp_path):
    ckpt = loop_save(tmp_path / "checkpoints", 1, small_learner())
    marker = tmp_path / f"pwned-{secrets.token_hex(8)}"
    (ckpt / "learner" / ".metadata").write_bytes(pickle.dumps(Payload(f"touch {marker}")))
    resign(ckpt)
    err = attempt(load_learner, small_learner(1), ckpt / "learner")
    assert not marker.exists(), "loading the checkpoint ran the payload"
    assert type(err) is CheckpointError, err
    assert f"{ckpt / 'learner' / '.metadata'}: refused to load global posix.system" in str(err)


def test_a_non_tensor_dcp_entry_cannot_run_code(tmp_path):
    # DCP loads non-tensor ("bytes") entries with torch.load(weights_only=False): point one at a payload.
    ckpt = loop_save(tmp_path / "checkpoints", 1, small_learner())
    marker = tmp_path / f"pwned-{secrets.token_hex(8)}"
    dcp_dir = ckpt / "learner"
    md = pickle.loads((dcp_dir / ".metadata").read_bytes())  # our own file, just written: trusted here
    evil = io.BytesIO()
    torch.save(Payload(f"touch {marker}"), evil)
    (dcp_dir / "__evil.distcp").write_bytes(evil.getvalue())
    md.state_dict_metadata["learner.skipped_updates"] = BytesStorageMetadata()
    md.storage_data[MetadataIndex("learner.skipped_updates")] = _StorageInfo("__evil.distcp", 0, len(evil.getvalue()))
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(md))
    resign(ckpt)
    err = attempt(load_learner, small_learner(1), dcp_dir)
    assert not marker.exists(), "loading the checkpoint ran the payload"
    assert type(err) is CheckpointError, err
    assert "'learner.skipped_updates' is not a tensor" in str(err)


def test_a_pickled_payload_in_state_pt_cannot_run_code(tmp_path):
    ckpt = loop_save(tmp_path / "checkpoints", 1)
    marker = tmp_path / f"pwned-{secrets.token_hex(8)}"
    torch.save({"step": 1, "x": Payload(f"touch {marker}")}, ckpt / "state.pt")
    resign(ckpt)
    with pytest.raises(CheckpointError, match="state.pt: cannot be read"):
        checkpoint.load(ckpt)
    assert not marker.exists()


@pytest.mark.parametrize(
    "obj, refused",
    [
        (Payload("true"), "posix.system"),
        (eval, "builtins.eval"),  # pickled by reference, never called
        (torch.nn.Linear, "torch.nn.modules.linear.Linear"),
        (shutil.rmtree, "shutil.rmtree"),
        (torch.load, "torch.serialization.load"),
    ],
)
def test_the_metadata_unpickler_admits_only_dcp_classes(tmp_path, obj, refused):
    f = tmp_path / ".metadata"
    f.write_bytes(pickle.dumps(obj))
    with pytest.raises(CheckpointError, match=re.escape(f"{f}: refused to load global {refused} ")):
        fsdp.read_metadata(tmp_path)


def test_metadata_that_is_garbled_or_points_outside_its_folder_is_refused(tmp_path):
    learner = small_learner()
    save_learner(learner, tmp_path / "a")
    good = (tmp_path / "a" / ".metadata").read_bytes()
    (tmp_path / "a" / ".metadata").write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable"):
        fsdp.read_metadata(tmp_path / "a")
    md = pickle.loads(good)
    idx = next(iter(md.storage_data))
    md.storage_data[idx] = _StorageInfo("../../outside.distcp", 0, 8)
    (tmp_path / "a" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside.distcp', not a file of"):
        fsdp.read_metadata(tmp_path / "a")


def test_dcp_round_trip_keeps_only_tensors_in_dcp_and_restores_everything(tmp_path):
    saved = small_learner(0)
    save_learner(saved, tmp_path / "learner")
    md = fsdp.read_metadata(tmp_path / "learner")  # a real file passes the restricted unpickler
    assert md.state_dict_metadata and all(isinstance(e, TensorStorageMetadata) for e in md.state_dict_metadata.values())
    plain = torch.load(tmp_path / "learner" / "plain.pt", weights_only=True)
    assert plain["learner"]["skipped_updates"] == 2 and plain["optimizer"]["param_groups"][0]["lr"] == 5e-3
    other = small_learner(7)
    load_learner(other, tmp_path / "learner", verify=False)  # a bare DCP folder: no manifest
    for a, b in zip(saved.model.state_dict().values(), other.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, so = saved.optimizer.state_dict(), other.optimizer.state_dict()
    for i in sa["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][i][k], so["state"][i][k]), (i, k)
    assert sa["param_groups"] == so["param_groups"]
    assert other.scheduler.state_dict()["last_epoch"] == 1 and other.skipped_updates == 2


def test_dcp_extra_state_may_hold_tensors(tmp_path):
    learner = small_learner()
    extra = {"rng": torch.arange(5, dtype=torch.int64), "note": "x", "pair": (1, 2.5)}
    fsdp.save_sharded(tmp_path / "d", model=learner.model, optimizer=learner.optimizer, extra=extra)
    back = fsdp.load_sharded(tmp_path / "d", model=learner.model, optimizer=learner.optimizer, verify=False)
    assert torch.equal(back["rng"], extra["rng"]) and back["note"] == "x" and back["pair"] == (1, 2.5)


def test_the_planner_refuses_dcp_bytes_entries():
    item = SimpleNamespace(dest_index=MetadataIndex("learner.x"))
    with pytest.raises(CheckpointError, match="refused to unpickle non-tensor DCP entry 'learner.x'"):
        fsdp._TensorsOnlyPlanner().load_bytes(item, io.BytesIO(b"anything"))


# ---------------------------------------------------------------- checksums


def test_the_manifest_lists_every_file_of_the_checkpoint(tmp_path):
    ckpt = loop_save(tmp_path, 1, small_learner())
    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {"manifest.json"}
    assert names >= {"state.pt", "meta.json", "producer_rank0.pt", "learner/.metadata", "learner/plain.pt"}
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert set(files) == names
    for rel, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((ckpt / rel).read_bytes()).hexdigest(), rel
        assert entry["bytes"] == (ckpt / rel).stat().st_size
    checkpoint.verify(ckpt)


@pytest.mark.parametrize(
    "rel",
    ["state.pt", "meta.json", "producer_rank0.pt", "learner/.metadata", "learner/__0_0.distcp", "learner/plain.pt"],
)
def test_verify_names_a_bit_flipped_file(tmp_path, rel):
    ckpt = loop_save(tmp_path, 1, small_learner())
    checkpoint.verify(ckpt)  # also fills the digest cache: a later write must still be caught
    st = (ckpt / rel).stat()
    flip_byte(ckpt / rel)
    os.utime(ckpt / rel, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: ctime still moves
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / rel}: checksum mismatch")):
        checkpoint.verify(ckpt)


def test_verify_names_a_truncated_missing_or_unlisted_file(tmp_path):
    ckpt = loop_save(tmp_path, 1, small_learner())
    with open(ckpt / "learner" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: truncated or altered: 100 bytes, the manifest says \d+"):
        checkpoint.verify(ckpt)
    ckpt = loop_save(tmp_path, 2)
    (ckpt / "producer_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match="producer_rank0.pt: missing"):
        checkpoint.verify(ckpt)
    ckpt = loop_save(tmp_path, 3)
    (ckpt / "producer_rank1.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="producer_rank1.pt: not in"):
        checkpoint.verify(ckpt)
    ckpt = loop_save(tmp_path, 4)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        checkpoint.verify(ckpt)
    ckpt = loop_save(tmp_path, 5)
    (ckpt / "manifest.json").write_text('{"format": "bapo-checkpoint-manifest/1", "files": {"../x": {}}}')
    with pytest.raises(CheckpointError, match="bad entry '../x'"):
        checkpoint.verify(ckpt)


def test_load_refuses_a_bit_flipped_state_file_instead_of_returning_wrong_numbers(tmp_path):
    ckpt = loop_save(tmp_path, 3)
    data = (ckpt / "state.pt").read_bytes()
    at = data.index(torch.full((64,), 3.25).numpy().tobytes())  # inside the tensor's bytes: no parse error
    flip_byte(ckpt / "state.pt", at + 5)
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / 'state.pt'}: checksum mismatch")):
        checkpoint.load(ckpt)


def test_load_of_one_file_checks_only_that_file(tmp_path):
    ckpt = loop_save(tmp_path, 3, small_learner())
    flip_byte(ckpt / "learner" / "__0_0.distcp")  # another file's damage does not stop this read
    assert torch.equal(checkpoint.load(ckpt / "producer_rank0.pt")["cursor"], torch.arange(6))
    assert checkpoint.load(ckpt)["step"] == 3
    assert checkpoint.load(ckpt / "learner" / "plain.pt")["learner"]["skipped_updates"] == 2  # a sub-folder's file
    checkpoint.write(tmp_path / "loose.pt", {"a": 1})
    with pytest.raises(CheckpointError, match="loose.pt: no manifest.json in it or the two folders above"):
        checkpoint.load(tmp_path / "loose.pt")
    assert checkpoint.load(tmp_path / "loose.pt", verify_checksum=False) == {"a": 1}


def test_fsdp_load_refuses_a_bit_flipped_shard(tmp_path):
    ckpt = loop_save(tmp_path, 1, small_learner())
    shard = ckpt / "learner" / "__0_0.distcp"
    flip_byte(shard, shard.stat().st_size - 40)  # in the last tensor's data
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: checksum mismatch")):
        load_learner(small_learner(1), ckpt / "learner")


# ---------------------------------------------------------------- the newest intact checkpoint


def test_latest_intact_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        loop_save(tmp_path, step, small_learner())
    (tmp_path / "step_000004" / "state.pt").unlink()
    flip_byte(tmp_path / "step_000003" / "learner" / "__0_0.distcp")
    with open(tmp_path / "step_000002" / "state.pt", "r+b") as f:
        f.truncate(10)
    with caplog.at_level(logging.WARNING, logger="bapo.checkpoint"):
        assert checkpoint.latest_intact(tmp_path) == tmp_path / "step_000001"
    text = caplog.text
    assert "skipping damaged checkpoint step_000004" in text and "step_000004/state.pt: missing" in text
    assert "skipping damaged checkpoint step_000003" in text and "__0_0.distcp: checksum mismatch" in text
    assert "skipping damaged checkpoint step_000002" in text and "state.pt: truncated" in text
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000003"  # unverified: just the newest


def test_latest_intact_refuses_to_start_over_when_every_checkpoint_is_damaged(tmp_path, caplog):
    assert checkpoint.latest_intact(tmp_path / "none") is None
    loop_save(tmp_path, 1)
    loop_save(tmp_path, 2)
    (tmp_path / "step_000001" / "meta.json").write_text("{not json")
    flip_byte(tmp_path / "step_000002" / "state.pt")
    with caplog.at_level(logging.WARNING, logger="bapo.checkpoint"):
        with pytest.raises(CheckpointError, match="no intact checkpoint in .*step_000002: .*checksum mismatch"):
            checkpoint.latest_intact(tmp_path)
    assert "skipping checkpoint" in caplog.text and "step_000001/meta.json: unreadable" in caplog.text


# ---------------------------------------------------------------- lineage and pruning


def test_pruning_keeps_the_most_recent_writes_not_the_highest_steps(tmp_path):
    for step in (100, 110, 120):  # run A
        loop_save(tmp_path, step, keep=3)
    new = loop_save(tmp_path, 10, keep=3)  # run B, same folder, no lineage given: one lineage
    assert new.is_dir(), "the checkpoint just written was pruned"
    assert [s for s, _ in checkpoint.step_dirs(tmp_path)] == [10, 110, 120]
    assert checkpoint.latest(tmp_path) == new


def test_pruning_never_touches_another_lineage(tmp_path):
    for step in (100, 110, 120):
        loop_save(tmp_path, step, keep=2, lineage="A")
    for step in (10, 20, 30):
        loop_save(tmp_path, step, keep=2, lineage="B")
    assert [s for s, _ in checkpoint.step_dirs(tmp_path)] == [20, 30, 110, 120]
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000030"
    assert checkpoint.latest(tmp_path, lineage="A") == tmp_path / "step_000120"
    assert checkpoint.latest_intact(tmp_path, lineage="A") == tmp_path / "step_000120"
    assert checkpoint.latest(tmp_path, lineage="C") is None
    metas = {p.name: checkpoint.read_meta(p) for _, p in checkpoint.step_dirs(tmp_path)}
    assert metas["step_000030"]["lineage"] == "B" and metas["step_000120"]["lineage"] == "A"
    assert metas["step_000030"]["seq"] == metas["step_000120"]["seq"] + 3  # a write sequence over the folder


def test_a_step_of_another_lineage_is_not_replaced(tmp_path):
    a = loop_save(tmp_path, 20, lineage="A")
    before = (a / "manifest.json").read_text()
    with pytest.raises(CheckpointError, match="step_000020: belongs to lineage 'A', this run is 'B'"):
        loop_save(tmp_path, 20, lineage="B")
    assert (a / "manifest.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    again = loop_save(tmp_path, 20, lineage="A")  # a resumed run of A re-saving its step: replaced
    assert checkpoint.read_meta(again)["seq"] == 2
    checkpoint.verify(again)


# ---------------------------------------------------------------- a full disk


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["torch.save", "_write_json"])  # the state file; meta.json / manifest.json
def test_a_full_disk_while_saving_removes_the_partial_folder_and_says_so(tmp_path, monkeypatch, where):
    old = loop_save(tmp_path, 1)
    real = torch.save if where == "torch.save" else checkpoint._write_json

    def half_then_full(*args, **kw):
        real(*args, **kw)
        _enospc()

    monkeypatch.setattr(checkpoint.torch if where == "torch.save" else checkpoint, where.split(".")[-1], half_then_full)
    with pytest.raises(CheckpointError, match=r"^no space left on device while writing .*\.tmp-step_000002"):
        loop_save(tmp_path, 2)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001"]
    checkpoint.verify(old)


def test_a_full_disk_in_a_staged_folder_removes_it_and_keeps_the_old_one(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(CheckpointError, match="^no space left on device while writing .*/\\.tmp-out-"):
        with checkpoint.staged_folder(tmp_path / "out") as tmp:
            (tmp / "new.txt").write_text("half")
            _enospc()
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "old.txt").read_text() == "old"
    with checkpoint.staged_folder(tmp_path / "out") as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and os.listdir(tmp_path / "out") == ["new.txt"]


def test_a_full_disk_inside_dcp_removes_the_partial_folder_and_says_so(tmp_path, monkeypatch):
    real = FileSystem.create_stream

    def full_for_shards(self, path, mode):
        if str(path).endswith(".distcp") and "w" in mode:
            _enospc()
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", full_for_shards)
    tmp = tmp_path / ".tmp-step_000004"
    checkpoint.prepare(tmp)
    with pytest.raises(CheckpointError, match="^" + re.escape(f"no space left on device while writing {tmp} ")):
        save_learner(small_learner(), tmp / "learner")
    assert not tmp.exists()


def test_a_full_disk_while_exporting_keeps_the_previous_export(tmp_path, monkeypatch):
    from bapo.modeling import load_model

    model = load_model(str(TINY))
    fsdp.save_hf(model, tmp_path / "export")
    before = (tmp_path / "export" / "model.safetensors").read_bytes()

    def half_then_full(out, **kw):
        (Path(out) / "model.safetensors").write_bytes(b"partial")
        _enospc()

    monkeypatch.setattr(model, "save_pretrained", half_then_full)
    with pytest.raises(CheckpointError, match="^no space left on device while writing"):
        fsdp.save_hf(model, tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == before


def test_is_enospc_looks_through_causes_and_dcp_failures():
    try:
        try:
            _enospc()
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        wrapped = e
    dcp_like = SimpleNamespace(failures={1: (OSError(errno.ENOSPC, "full"), None)}, __cause__=None, __context__=None)
    assert checkpoint.is_enospc(wrapped) and checkpoint.is_enospc(dcp_like)
    assert checkpoint.is_enospc(RuntimeError("I/O error: No space left on device (os error 28)"))
    assert not checkpoint.is_enospc(OSError(errno.EACCES, "denied")) and not checkpoint.is_enospc(ValueError("x"))


# ---------------------------------------------------------------- exports readable by others


@pytest.mark.parametrize("umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_the_hf_export_has_the_permissions_the_umask_gives(tmp_path, umask, dir_mode, file_mode):
    from bapo.modeling import load_model

    model = load_model(str(TINY))
    old = os.umask(umask)
    try:
        fsdp.save_hf(model, tmp_path / "export")
    finally:
        os.umask(old)
    out = tmp_path / "export"
    assert out.stat().st_mode & 0o777 == dir_mode
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {file_mode}, modes


# ---------------------------------------------------------------- finite weights


def test_check_finite_names_the_first_non_finite_tensor():
    sd = {"a.weight": torch.ones(3), "b.weight": torch.tensor([1.0, float("nan"), float("inf")]), "n": torch.arange(3)}
    with pytest.raises(CheckpointError, match=r"^ckpt/x: b.weight has 2 non-finite value\(s\) of 3$"):
        checkpoint.check_finite(sd, "ckpt/x")
    checkpoint.check_finite({"a": torch.ones(2), "n": torch.arange(2), "s": "text"}, "ok")
    with pytest.raises(CheckpointError, match="opt: state.3.exp_avg has 1"):
        checkpoint.check_finite({"state": {3: {"exp_avg": torch.tensor([float("-inf")])}}}, "opt")


def test_fsdp_load_refuses_non_finite_weights(tmp_path):
    bad = small_learner()
    with torch.no_grad():
        bad.model[2].bias[1] = float("nan")
    ckpt = loop_save(tmp_path, 1, bad)
    with pytest.raises(CheckpointError, match=r"learner: model.2.bias has 1 non-finite value"):
        load_learner(small_learner(1), ckpt / "learner")


def test_plain_encoding_round_trips_known_dataclasses_and_refuses_unknown_ones():
    from bapo.samples import Problem

    p = Problem("7", "q", "1")
    assert checkpoint.from_plain(checkpoint.to_plain({"x": [p, (p,)]})) == {"x": [p, (p,)]}
    with pytest.raises(CheckpointError, match="unknown record type 'Evil'"):
        checkpoint.from_plain({checkpoint.TAG: "Evil"})
