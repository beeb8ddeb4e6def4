"""Checkpoint folders: every file is checksummed and verified, reading never unpickles a class, a damaged newest
checkpoint is skipped for the newest intact one, pruning stays within a lineage and goes by write order, a full
disk fails with a plain message and leaves the previous folder, exports are readable by others, weights must be
finite.

The folders here are filled the way a run's writers fill them (several files, one in a sub-folder), with plain
files only: what a run puts in them is ``tests/unit/test_checkpoint.py``'s.
"""

import errno
import hashlib
import json
import logging
import os
import re
import secrets
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bapo.infra import ckpt_folder
from bapo.infra.ckpt_folder import CheckpointError
from bapo.learner import fsdp
from tests.helpers.checkpoints import Payload, enospc, flip_byte

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "assets" / "tiny-math"
FILES = ["state.pt", "meta.json", "producer_rank0.pt", "learner/plain.pt", "learner/__0_0.distcp"]


def commit(ckpt_dir: Path, step: int, keep: int = 5, **kw) -> Path:
    """A checkpoint as several writers fill it (a file per rank, a sub-folder of the learner's), then save()."""
    tmp = ckpt_dir / f".tmp-step_{step:06d}"
    ckpt_folder.prepare(tmp)
    ckpt_folder.write(tmp / "producer_rank0.pt", {"pending": [], "cursor": torch.arange(step + 3)})
    (tmp / "learner").mkdir()
    ckpt_folder.write(tmp / "learner" / "plain.pt", {"skipped_updates": 2})
    (tmp / "learner" / "__0_0.distcp").write_bytes(torch.arange(256, dtype=torch.int64).numpy().tobytes())
    state = {"step": step, "weights": torch.full((64,), float(step) + 0.25)}
    return ckpt_folder.save(ckpt_dir, step, state, keep=keep, tmp=tmp, **kw)


# ---------------------------------------------------------------- checksums


def test_the_manifest_lists_every_file_of_the_checkpoint(tmp_path):
    ckpt = commit(tmp_path, 1)
    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {"manifest.json"}
    assert names == set(FILES)
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert set(files) == names
    for rel, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((ckpt / rel).read_bytes()).hexdigest(), rel
        assert entry["bytes"] == (ckpt / rel).stat().st_size
    ckpt_folder.verify(ckpt)


@pytest.mark.parametrize("rel", FILES)
def test_verify_names_a_bit_flipped_file(tmp_path, rel):
    ckpt = commit(tmp_path, 1)
    ckpt_folder.verify(ckpt)  # also fills the digest cache: a later write must still be caught
    st = (ckpt / rel).stat()
    flip_byte(ckpt / rel)
    os.utime(ckpt / rel, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: ctime still moves
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / rel}: checksum mismatch")):
        ckpt_folder.verify(ckpt)


def _truncate_shard(ckpt: Path) -> None:
    with open(ckpt / "learner" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)


DAMAGE = {
    "truncated": (_truncate_shard, r"__0_0.distcp: truncated or altered: 100 bytes, the manifest says \d+"),
    "missing": (lambda c: (c / "producer_rank0.pt").unlink(), "producer_rank0.pt: missing"),
    "unlisted": (lambda c: (c / "producer_rank1.pt").write_bytes(b"x"), "producer_rank1.pt: not in"),
    "no manifest": (lambda c: (c / "manifest.json").unlink(), "manifest.json: missing"),
    "unsafe entry": (
        lambda c: (c / "manifest.json").write_text('{"format": "bapo-checkpoint-manifest/1", "files": {"../x": {}}}'),
        "bad entry '../x'",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_verify_names_a_truncated_missing_or_unlisted_file(tmp_path, damage):
    ckpt = commit(tmp_path, 1)
    harm, message = DAMAGE[damage]
    harm(ckpt)
    with pytest.raises(CheckpointError, match=message):
        ckpt_folder.verify(ckpt)


def test_load_refuses_a_bit_flipped_state_file_instead_of_returning_wrong_numbers(tmp_path):
    ckpt = commit(tmp_path, 3)
    data = (ckpt / "state.pt").read_bytes()
    at = data.index(torch.full((64,), 3.25).numpy().tobytes())  # inside the tensor's bytes: no parse error
    flip_byte(ckpt / "state.pt", at + 5)
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / 'state.pt'}: checksum mismatch")):
        ckpt_folder.load(ckpt)


def test_load_of_one_file_checks_only_that_file(tmp_path):
    ckpt = commit(tmp_path, 3)
    flip_byte(ckpt / "learner" / "__0_0.distcp")  # another file's damage does not stop this read
    assert torch.equal(ckpt_folder.load(ckpt / "producer_rank0.pt")["cursor"], torch.arange(6))
    assert ckpt_folder.load(ckpt)["step"] == 3
    assert ckpt_folder.load(ckpt / "learner" / "plain.pt")["skipped_updates"] == 2  # a sub-folder's file
    ckpt_folder.write(tmp_path / "loose.pt", {"a": 1})
    with pytest.raises(CheckpointError, match="loose.pt: no manifest.json in it or the two folders above"):
        ckpt_folder.load(tmp_path / "loose.pt")
    assert ckpt_folder.load(tmp_path / "loose.pt", verify_checksum=False) == {"a": 1}


def test_a_pickled_payload_in_state_pt_cannot_run_code(tmp_path):
    ckpt = commit(tmp_path / "checkpoints", 1)
    marker = tmp_path / f"pwned-{secrets.token_hex(8)}"
    torch.save({"step": 1, "x": Payload(f"touch {marker}")}, ckpt / "state.pt")
    ckpt_folder.write_manifest(ckpt)  # an attacker re-signs: the checksums are not the defence
    with pytest.raises(CheckpointError, match="state.pt: cannot be read"):
        ckpt_folder.load(ckpt)
    assert not marker.exists()


# ---------------------------------------------------------------- the newest intact checkpoint


def test_latest_intact_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        commit(tmp_path, step)
    (tmp_path / "step_000004" / "state.pt").unlink()
    flip_byte(tmp_path / "step_000003" / "learner" / "__0_0.distcp")
    with open(tmp_path / "step_000002" / "state.pt", "r+b") as f:
        f.truncate(10)
    with caplog.at_level(logging.WARNING, logger="bapo.infra.ckpt_folder"):
        assert ckpt_folder.latest_intact(tmp_path) == tmp_path / "step_000001"
    text = caplog.text
    assert "skipping damaged checkpoint step_000004" in text and "step_000004/state.pt: missing" in text
    assert "skipping damaged checkpoint step_000003" in text and "__0_0.distcp: checksum mismatch" in text
    assert "skipping damaged checkpoint step_000002" in text and "state.pt: truncated" in text
    assert ckpt_folder.latest(tmp_path) == tmp_path / "step_000003"  # unverified: just the newest


def test_written_since_is_the_newest_checkpoint_dated_at_or_after_the_time(tmp_path):
    """What the launcher asks after it SIGKILLed a rank: did the stop save first? The newest checkpoint's own
    meta.json time decides (an unreadable one is skipped); an older one or a missing folder is no."""
    assert ckpt_folder.written_since(tmp_path / "none", 0.0) is None
    first = commit(tmp_path, 1)
    at = ckpt_folder.read_meta(first)["time"]
    assert ckpt_folder.written_since(tmp_path, at) == first
    assert ckpt_folder.written_since(tmp_path, at + 1.0) is None
    second = commit(tmp_path, 2)
    later = ckpt_folder.read_meta(second)["time"]
    assert ckpt_folder.written_since(tmp_path, later) == second and ckpt_folder.written_since(tmp_path, at) == second
    (second / "meta.json").write_text("{not json")  # unreadable: the newest readable one is asked instead
    assert ckpt_folder.written_since(tmp_path, later) is None and ckpt_folder.written_since(tmp_path, at) == first


def test_latest_intact_refuses_to_start_over_when_every_checkpoint_is_damaged(tmp_path, caplog):
    assert ckpt_folder.latest_intact(tmp_path / "none") is None
    commit(tmp_path, 1)
    commit(tmp_path, 2)
    (tmp_path / "step_000001" / "meta.json").write_text("{not json")
    flip_byte(tmp_path / "step_000002" / "state.pt")
    with caplog.at_level(logging.WARNING, logger="bapo.infra.ckpt_folder"):
        with pytest.raises(CheckpointError, match="no intact checkpoint in .*step_000002: .*checksum mismatch"):
            ckpt_folder.latest_intact(tmp_path)
    assert "skipping checkpoint" in caplog.text and "step_000001/meta.json: unreadable" in caplog.text


def test_clean_partial_removes_the_leftovers_of_interrupted_writes_only(tmp_path):
    kept = commit(tmp_path, 1)
    for name in (".tmp-step_000002", ".old-step_000001-123-abcd"):
        (tmp_path / name / "learner").mkdir(parents=True)
    gone = ckpt_folder.clean_partial(tmp_path)
    assert sorted(p.name for p in gone) == [".old-step_000001-123-abcd", ".tmp-step_000002"]
    assert [p.name for p in tmp_path.iterdir()] == [kept.name]


# ---------------------------------------------------------------- lineage and pruning


def test_pruning_keeps_the_most_recent_writes_not_the_highest_steps(tmp_path):
    for step in (100, 110, 120):  # run A
        commit(tmp_path, step, keep=3)
    new = commit(tmp_path, 10, keep=3)  # run B, same folder, no lineage given: one lineage
    assert new.is_dir(), "the checkpoint just written was pruned"
    assert [s for s, _ in ckpt_folder.step_dirs(tmp_path)] == [10, 110, 120]
    assert ckpt_folder.latest(tmp_path) == new


def test_pruning_never_touches_another_lineage(tmp_path):
    for step in (100, 110, 120):
        commit(tmp_path, step, keep=2, lineage="A")
    for step in (10, 20, 30):
        commit(tmp_path, step, keep=2, lineage="B")
    assert [s for s, _ in ckpt_folder.step_dirs(tmp_path)] == [20, 30, 110, 120]
    assert ckpt_folder.latest(tmp_path) == tmp_path / "step_000030"
    assert ckpt_folder.latest(tmp_path, lineage="A") == tmp_path / "step_000120"
    assert ckpt_folder.latest_intact(tmp_path, lineage="A") == tmp_path / "step_000120"
    assert ckpt_folder.latest(tmp_path, lineage="C") is None
    metas = {p.name: ckpt_folder.read_meta(p) for _, p in ckpt_folder.step_dirs(tmp_path)}
    assert metas["step_000030"]["lineage"] == "B" and metas["step_000120"]["lineage"] == "A"
    assert metas["step_000030"]["seq"] == metas["step_000120"]["seq"] + 3  # a write sequence over the folder


def test_a_step_of_another_lineage_is_not_replaced(tmp_path):
    a = commit(tmp_path, 20, lineage="A")
    before = (a / "manifest.json").read_text()
    with pytest.raises(CheckpointError, match="step_000020: belongs to lineage 'A', this run is 'B'"):
        commit(tmp_path, 20, lineage="B")
    assert (a / "manifest.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    again = commit(tmp_path, 20, lineage="A")  # a resumed run of A re-saving its step: replaced
    assert ckpt_folder.read_meta(again)["seq"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["step_000020"]  # the one it replaced is gone
    ckpt_folder.verify(again)


# ---------------------------------------------------------------- a full disk


@pytest.mark.parametrize("where", ["torch.save", "_write_json"])  # the state file; meta.json / manifest.json
def test_a_full_disk_while_saving_removes_the_partial_folder_and_says_so(tmp_path, monkeypatch, where):
    old = commit(tmp_path, 1)
    real = torch.save if where == "torch.save" else ckpt_folder._write_json

    def half_then_full(*args, **kw):
        real(*args, **kw)
        enospc()

    owner = ckpt_folder.torch if where == "torch.save" else ckpt_folder
    monkeypatch.setattr(owner, where.split(".")[-1], half_then_full)
    with pytest.raises(CheckpointError, match=r"^no space left on device while writing .*\.tmp-step_000002"):
        commit(tmp_path, 2)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001"]
    ckpt_folder.verify(old)


def test_a_full_disk_in_a_staged_folder_removes_it_and_keeps_the_old_one(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(CheckpointError, match="^no space left on device while writing .*/\\.tmp-out-"):
        with ckpt_folder.staged_folder(tmp_path / "out") as tmp:
            (tmp / "new.txt").write_text("half")
            enospc()
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "old.txt").read_text() == "old"
    with ckpt_folder.staged_folder(tmp_path / "out") as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and os.listdir(tmp_path / "out") == ["new.txt"]


def test_a_full_disk_while_exporting_keeps_the_previous_export(tmp_path, monkeypatch):
    from bapo.modeling import load_model

    model = load_model(str(TINY))
    fsdp.save_hf(model, tmp_path / "export")
    before = (tmp_path / "export" / "model.safetensors").read_bytes()

    def half_then_full(out, **kw):
        (Path(out) / "model.safetensors").write_bytes(b"partial")
        enospc()

    monkeypatch.setattr(model, "save_pretrained", half_then_full)
    with pytest.raises(CheckpointError, match="^no space left on device while writing"):
        fsdp.save_hf(model, tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == before


def test_is_enospc_looks_through_causes_and_dcp_failures():
    try:
        try:
            enospc()
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        wrapped = e
    dcp_like = SimpleNamespace(failures={1: (OSError(errno.ENOSPC, "full"), None)}, __cause__=None, __context__=None)
    assert ckpt_folder.is_enospc(wrapped) and ckpt_folder.is_enospc(dcp_like)
    assert ckpt_folder.is_enospc(RuntimeError("I/O error: No space left on device (os error 28)"))
    assert not ckpt_folder.is_enospc(OSError(errno.EACCES, "denied")) and not ckpt_folder.is_enospc(ValueError("x"))


def test_a_failure_in_a_together_block_removes_the_partial_write_and_is_raised(tmp_path):
    """Without a process group the block's own error comes back; a full disk says so and removes ``cleanup``."""
    tmp = tmp_path / ".tmp-step_000007"
    ckpt_folder.prepare(tmp)
    with ckpt_folder.together("writing x", cleanup=tmp):
        pass  # nothing failed: nothing raised, nothing removed
    assert tmp.is_dir()
    with pytest.raises(ValueError, match="^bad$"):
        with ckpt_folder.together("writing x"):
            raise ValueError("bad")
    with pytest.raises(CheckpointError, match=r"^no space left on device while writing x \(removed the partial"):
        with ckpt_folder.together("writing x", cleanup=tmp / "learner" / "plain.pt"):
            enospc()
    assert not tmp.exists()


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
        ckpt_folder.check_finite(sd, "ckpt/x")
    ckpt_folder.check_finite({"a": torch.ones(2), "n": torch.arange(2), "s": "text"}, "ok")
    with pytest.raises(CheckpointError, match="opt: state.3.exp_avg has 1"):
        ckpt_folder.check_finite({"state": {3: {"exp_avg": torch.tensor([float("-inf")])}}}, "opt")
