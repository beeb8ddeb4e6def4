"""A run's checkpoint: what :func:`bapo.checkpoint.save_run` writes and :func:`restore_run` reads back, its
records' plain encoding, and the learner's DCP part (loading it never runs code, its shards are checksummed,
its weights must be finite). The folder itself (atomic, verified, pruned) is ``tests/unit/infra/test_ckpt_folder.py``'s.

The learner here is a two-layer MLP with AdamW in one process (what ``save_learner`` reads of a
learner: model, optimizer, scheduler, skip count, objective state): DCP runs without a process group.
"""

import errno
import io
import json
import pickle
import random
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from bapo import checkpoint
from bapo.checkpoint import CheckpointError
from bapo.infra import ckpt_folder
from bapo.learner import fsdp
from bapo.samples import Problem, Prompt
from tests.helpers.checkpoints import Payload, enospc, flip_byte


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
    return ckpt_folder.save(ckpt_dir, step, state, keep=keep, tmp=tmp, **kw)


def resign(root: Path) -> None:
    """An attacker who edits a checkpoint can rewrite its manifest too: the checksums are not the defence."""
    checkpoint.write_manifest(root)


def attempt(fn, *args) -> BaseException | None:
    """The exception ``fn(*args)`` raised, if any (DCP's own CheckpointException is a BaseException)."""
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 (the test then says what it should have been)
        return e
    return None


# ---------------------------------------------------------------- the learner's DCP part never runs code


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


def test_a_dcp_checkpoint_before_the_first_step_keeps_the_optimizer_fresh(tmp_path):
    """DCP's get_state_dict fills an empty optimizer with a zero-lr step (AdamW step 1): neither the saving run nor a
    resumed one may keep it, or the first real update's bias correction differs from the uninterrupted run's."""

    def fresh():
        lrn = small_learner()
        lrn.optimizer = torch.optim.AdamW(lrn.model.parameters(), lr=1e-2)
        lrn.scheduler = torch.optim.lr_scheduler.LambdaLR(lrn.optimizer, lambda s: 1.0)
        return lrn

    learner, twin = fresh(), fresh()
    assert not learner.optimizer.state
    save_learner(learner, tmp_path / "d")
    assert not learner.optimizer.state  # the saving run goes on as it was
    resumed = fresh()
    for p in resumed.model.parameters():
        p.data.add_(1.0)  # weights that the load must bring back
    load_learner(resumed, tmp_path / "d", verify=False)
    assert not resumed.optimizer.state
    for lrn in (twin, resumed):  # one AdamW step on the same gradient, from the same weights
        for p in lrn.model.parameters():
            p.grad = torch.ones_like(p)
        lrn.optimizer.step()
    for a, b in zip(twin.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_planner_refuses_dcp_bytes_entries():
    item = SimpleNamespace(dest_index=MetadataIndex("learner.x"))
    with pytest.raises(CheckpointError, match="refused to unpickle non-tensor DCP entry 'learner.x'"):
        fsdp._TensorsOnlyPlanner().load_bytes(item, io.BytesIO(b"anything"))


# ---------------------------------------------------------------- the learner's DCP part is checksummed


def test_the_manifest_covers_the_learners_dcp_files(tmp_path):
    ckpt = loop_save(tmp_path, 1, small_learner())
    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {"manifest.json"}
    assert names >= {"state.pt", "meta.json", "producer_rank0.pt", "learner/.metadata", "learner/plain.pt"}
    assert set(json.loads((ckpt / "manifest.json").read_text())["files"]) == names
    checkpoint.verify(ckpt)


def test_fsdp_load_refuses_a_bit_flipped_shard(tmp_path):
    ckpt = loop_save(tmp_path, 1, small_learner())
    shard = ckpt / "learner" / "__0_0.distcp"
    flip_byte(shard, shard.stat().st_size - 40)  # in the last tensor's data
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: checksum mismatch")):
        load_learner(small_learner(1), ckpt / "learner")


# ---------------------------------------------------------------- the learner's part: a full disk, non-finite weights


def test_a_full_disk_inside_dcp_removes_the_partial_folder_and_says_so(tmp_path, monkeypatch):
    real = FileSystem.create_stream

    def full_for_shards(self, path, mode):
        if str(path).endswith(".distcp") and "w" in mode:
            enospc()
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", full_for_shards)
    tmp = tmp_path / ".tmp-step_000004"
    checkpoint.prepare(tmp)
    with pytest.raises(CheckpointError, match="^" + re.escape(f"no space left on device while writing {tmp} ")):
        save_learner(small_learner(), tmp / "learner")
    assert not tmp.exists()


def test_fsdp_load_refuses_non_finite_weights(tmp_path):
    bad = small_learner()
    with torch.no_grad():
        bad.model[2].bias[1] = float("nan")
    ckpt = loop_save(tmp_path, 1, bad)
    with pytest.raises(CheckpointError, match=r"learner: model.2.bias has 1 non-finite value"):
        load_learner(small_learner(1), ckpt / "learner")


# ---------------------------------------------------------------- save_run / restore_run


class Counter:
    """One of the loop's shared objects (the buffer, the monitor): a ``state_dict`` that holds records."""

    def __init__(self, n: int = 0):
        self.n, self.kept = n, [Prompt(Problem("p", "1 + 1", "2"), "t", (1, 2))]

    def state_dict(self) -> dict:
        return {"n": self.n, "kept": self.kept}

    def load_state_dict(self, state: dict) -> None:
        self.n, self.kept = state["n"], state["kept"]


class Source:
    """The rollout source's side of a checkpoint: its cursor and the batches it made ahead."""

    def __init__(self, cursor: int = 0, fail: bool = False):
        self.cursor, self.fail, self.pending = cursor, fail, []

    def state_dict(self, live: int | None = None, snapshots: bool = True) -> dict:
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return {"cursor": self.cursor, "live": live, "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.pending = state["cursor"], state["pending"]


class Learner:
    """The learner's side: a version and its own folder ``learner/``."""

    def __init__(self, version: int = 0):
        self.version, self.loaded = version, None

    def save(self, path: Path) -> None:
        path.mkdir()
        ckpt_folder.write(path / "learner.pt", {"version": self.version})

    def load(self, path: Path) -> None:
        self.loaded = ckpt_folder.load(path / "learner.pt", verify_checksum=False)["version"]


def test_restore_run_brings_back_what_save_run_wrote(tmp_path):
    rng = random.Random(3)
    rng.random()
    ckpt = checkpoint.save_run(
        tmp_path, 4, learner=Learner(8), source=Source(17), keep=2, lineage="L", loop_rng=rng, buffer=Counter(5)
    )
    assert ckpt == tmp_path / "step_000004" and checkpoint.read_meta(ckpt)["version"] == 8
    assert checkpoint.read_meta(ckpt)["lineage"] == "L"
    want = (rng.random(), random.random(), np.random.rand(), torch.rand(1))  # what comes after the checkpoint
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    learner, source, buffer, other = Learner(), Source(), Counter(), random.Random(0)
    step, pending = checkpoint.restore_run(ckpt, learner=learner, source=source, loop_rng=other, buffer=buffer)
    assert pending is None  # written at a step's end
    assert step == 4 and learner.loaded == 8 and source.cursor == 17 and buffer.n == 5
    assert buffer.kept == Counter().kept  # a record, decoded back into its dataclass
    assert (other.random(), random.random(), np.random.rand()) == want[:3] and torch.equal(torch.rand(1), want[3])


def test_restore_run_refuses_a_damaged_checkpoint_before_reading_it(tmp_path):
    ckpt = checkpoint.save_run(
        tmp_path, 1, learner=Learner(2), source=Source(), keep=2, lineage="L", loop_rng=random.Random()
    )
    flip_byte(ckpt / "learner" / "learner.pt")
    learner = Learner()
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / 'learner' / 'learner.pt'}: checksum mismatch")):
        checkpoint.restore_run(ckpt, learner=learner, source=Source(), loop_rng=random.Random())
    assert learner.loaded is None


def test_a_full_disk_in_save_run_removes_the_partial_checkpoint_and_says_so(tmp_path):
    kept = checkpoint.save_run(
        tmp_path, 1, learner=Learner(), source=Source(), keep=2, lineage="L", loop_rng=random.Random()
    )
    with pytest.raises(
        CheckpointError,
        match="^" + re.escape(f"no space left on device while writing {tmp_path / 'step_000002'} (removed"),
    ):
        checkpoint.save_run(
            tmp_path, 2, learner=Learner(), source=Source(fail=True), keep=2, lineage="L", loop_rng=random.Random()
        )
    assert [p.name for p in tmp_path.iterdir()] == [kept.name]


def test_a_checkpoint_of_another_world_size_resumes_from_rank_0s_producer_unless_it_held_batches(tmp_path):
    ckpt = checkpoint.save_run(
        tmp_path, 1, learner=Learner(), source=Source(6), keep=2, lineage="L", loop_rng=random.Random()
    )
    assert checkpoint._producer_state(ckpt, 1)["cursor"] == 6  # rank 1 of a larger job: rank 0's file
    busy = Source(6)
    busy.pending = [1]
    ckpt = checkpoint.save_run(
        tmp_path, 2, learner=Learner(), source=busy, keep=2, lineage="L", loop_rng=random.Random()
    )
    with pytest.raises(CheckpointError, match="producer_rank1.pt: missing; .* resume it with the world size"):
        checkpoint._producer_state(ckpt, 1)


def test_a_rank_still_holding_a_snapshot_rank_0_dropped_gets_it_back(tmp_path):
    """Async producers pause between batches, not at the same batch: rank 1 may still need version 7 after rank 0
    dropped it. Rank 0's file carries its own snapshots, rank 1's the ones rank 0 lacks (the resume of a split
    rehearsal failed with KeyError: 7 when only rank 0's were written)."""
    w7, w8 = {"w": torch.full((2,), 7.0)}, {"w": torch.full((2,), 8.0)}
    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    zero = {"pending": [], "snapshot_versions": [8], "snapshots": {8: w8}}
    one = {"pending": [], "snapshot_versions": [7, 8], "snapshots": {7: w7}}
    checkpoint.write(ckpt / "producer_rank0.pt", zero)
    checkpoint.write(ckpt / "producer_rank1.pt", one)
    checkpoint.write_manifest(ckpt)
    got = checkpoint._producer_state(ckpt, 1)["snapshots"]
    assert sorted(got) == [7, 8] and torch.equal(got[7]["w"], w7["w"]) and torch.equal(got[8]["w"], w8["w"])
    assert checkpoint._producer_state(ckpt, 0)["snapshots"].keys() == {8}


# ---------------------------------------------------------------- the plain encoding of the loop's records


def test_plain_encoding_round_trips_known_dataclasses_and_refuses_unknown_ones():
    p = Problem("7", "q", "1")
    plain = checkpoint.to_plain({"x": [p, (p,)]})
    assert plain["x"][0] == {checkpoint.TAG: "Problem", "id": "7", "problem": "q", "answer": "1", "source": ""}
    assert checkpoint.from_plain(plain) == {"x": [p, (p,)]}
    with pytest.raises(CheckpointError, match="unknown record type 'Evil'"):
        checkpoint.from_plain({"y": [{checkpoint.TAG: "Evil"}]})
    with pytest.raises(TypeError, match="cannot checkpoint SimpleNamespaceRecord: not one of"):
        checkpoint.to_plain([SimpleNamespaceRecord()])


@dataclass
class SimpleNamespaceRecord:
    """A dataclass the loop does not pass between stages: a checkpoint refuses to encode it."""

    x: int = 1
