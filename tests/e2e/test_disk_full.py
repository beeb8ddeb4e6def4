"""A full disk while a checkpoint is written: one line, "no space left on device while writing <folder>
(removed the partial write)", and nothing left behind on the full disk; in one process and on launched ranks.

``torch.save``'s zip writer turns the ENOSPC of a write into ``RuntimeError: [enforce fail at
inline_container.cc...] unexpected pos`` (the OSError is only its ``__context__``): the injected failure here
is an ENOSPC from the file's ``write``, which torch wraps exactly so, and a real small tmpfs where the
machine allows mounting one."""

import errno
import io
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from bapo.infra import ckpt_folder
from bapo.infra.ckpt_folder import CheckpointError
from bapo.loop import run
from tests.helpers.config import smoke_cfg

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


class FullFile(io.FileIO):
    """A file on a disk with ``room`` bytes left: the write that would pass it fails with ENOSPC."""

    room = 512

    def write(self, b) -> int:
        if self.tell() + len(memoryview(b)) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(b)


def full_disk_for(monkeypatch, name: str) -> None:
    """Files called ``name`` that bapo.infra.ckpt_folder opens for writing land on a full disk."""
    real = open

    def fake_open(path, mode="r", *args, **kw):
        if Path(path).name == name and "w" in mode:
            return FullFile(path, "wb")
        return real(path, mode, *args, **kw)

    monkeypatch.setattr(ckpt_folder, "open", fake_open, raising=False)


def test_torch_saves_full_disk_error_is_recognised_as_one():
    """The premise: what torch.save raises on a full disk is a RuntimeError, not an OSError."""
    path = Path(f"/tmp/bapo-full-{uuid.uuid4().hex}.pt")
    try:
        with pytest.raises(RuntimeError, match="inline_container") as info, FullFile(path, "wb") as f:
            torch.save({"w": torch.zeros(1000)}, f)
        assert not isinstance(info.value, OSError) and ckpt_folder.is_enospc(info.value)
    finally:
        path.unlink(missing_ok=True)


def test_a_full_disk_inside_torch_save_removes_the_partial_checkpoint_and_says_so(tmp_path, monkeypatch):
    """Before: the checkpoint's write caught OSError only, so the RuntimeError escaped and .tmp-step_* stayed."""
    full_disk_for(monkeypatch, "state.pt")
    ckpt_dir = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match=r"^no space left on device while writing .*\.tmp-step_000003"):
        ckpt_folder.save(ckpt_dir, 3, {"w": torch.zeros(1000)}, keep=2)
    assert list(ckpt_dir.iterdir()) == []


@pytest.mark.parametrize("writer", ["torch's", "the learner's"])
def test_a_full_disk_inside_dcp_is_still_one_once_dcp_gathers_it(tmp_path, monkeypatch, writer):
    """DCP sends each rank's failure to every rank pickled, which drops the OSError that torch.save's zip writer
    reports as the context of its RuntimeError: with torch's own writer (the premise) a full disk is then an unknown
    error on every rank; the sharded learner's writer says ENOSPC itself, where DCP gathers it."""
    import contextlib
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    from bapo.learner.fsdp import _Writer

    @contextlib.contextmanager
    def full_stream(self, path, mode):
        with FullFile(path, "wb") as f:
            yield f

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full_stream)
    made = dcp.FileSystemWriter if writer == "torch's" else _Writer
    with pytest.raises(dcp.CheckpointException) as info:
        dcp.save({"w": torch.zeros(1000)}, storage_writer=made(tmp_path / "ckpt"), no_dist=True)
    gathered = pickle.loads(pickle.dumps(info.value))  # what another rank receives
    assert ckpt_folder.is_enospc(gathered) is (writer != "torch's")


@pytest.mark.slow
def test_a_full_disk_while_the_loop_saves_the_learner_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """Before: the single-process learner.save was not wrapped, and the RuntimeError of its torch.save escaped."""
    full_disk_for(monkeypatch, "learner.pt")
    with pytest.raises(CheckpointError) as info:
        run(smoke_cfg(["train.steps=1", "eval.every=0"]), tmp_path)
    folder = tmp_path / "checkpoints" / "step_000001"
    assert str(info.value) == f"no space left on device while writing {folder} (removed the partial write)"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == []


@pytest.fixture()
def small_tmpfs(tmp_path):
    """``small_tmpfs(size)``: a tmpfs of ``size`` (``2m``; root only), mounted until the test ends."""
    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / "disk"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# One process on 2 MiB: room for a run folder's small files, not for a checkpoint of the tiny model. Two ranks the
# launch starts (FSDP2) on 6 MiB: room for the small files and the ranks' plain writes, not for their DCP shards of
# the model and AdamW (about 3.4 MB a rank), so the disk fills inside DCP's write. Before, that launched run ended
# in about 250 lines of both ranks' tracebacks and no error: line (DCP gathers each rank's failure as a pickled
# copy, which lost the full disk's OSError); on 2 MiB, where a plain write fills it, in two error: lines, one a rank.
LAYOUTS = {"one process": ([], "2m"), "2 launched ranks": (["learner=fsdp", "launcher.nproc_per_node=2"], "6m")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_train_py_on_a_full_tmpfs_prints_one_line_and_leaves_no_partial_checkpoint(small_tmpfs, layout):
    over, size = LAYOUTS[layout]
    run_dir = small_tmpfs(size) / "run"
    cmd = [sys.executable, "train.py", "debug=smoke", "train.steps=1", "eval.every=0", *over,
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert [x for x in proc.stderr.splitlines() if x.startswith("error:")] == [last]  # one line, the run's
    folder = re.escape(str(run_dir / "checkpoints" / "step_000001"))
    assert re.fullmatch(
        f"error: CheckpointError: no space left on device while writing {folder} " + r"\(removed the partial write\)",
        last,
    ), last
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == []
