"""Which GPU a rank takes (bapo/infra/dist.py ``rank_device``), with CUDA faked: a process that sees one GPU uses it
whatever its local rank (SLURM's per-task binding), one that sees the node's GPUs uses ``cuda:<local rank>``."""

import pytest
import torch

from bapo.infra import dist
from bapo.infra.checks import ConfigError

# srun --nodes=2 --ntasks-per-node=4 --gpus-per-task=1 python train.py ...: task 5 of 8, local rank 1 on its node
SLURM_TASK = {
    "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}  # fmt: skip
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def cuda(monkeypatch):
    """``cuda(n)``: this process sees n CUDA devices; returns what ``set_device`` and ``init_process_group`` got."""
    calls: dict = {}
    for k in LAUNCHER_VARS:
        monkeypatch.setenv(k, "")  # recorded, so that what from_slurm sets is undone after the test
        monkeypatch.delenv(k)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(dist, "_JOINED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.__setitem__("set_device", d))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    joined = lambda backend, **kw: calls.update(kw, backend=backend)  # noqa: E731
    monkeypatch.setattr(torch.distributed, "init_process_group", joined)

    def sees(n: int) -> dict:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return calls

    return sees


def test_a_slurm_task_bound_to_one_gpu_uses_it_whatever_its_local_rank(cuda, monkeypatch):
    """Before: local rank 1 asked for cuda:1 of a process that sees one GPU (invalid device ordinal)."""
    calls = cuda(1)
    for k, v in SLURM_TASK.items():
        monkeypatch.setenv(k, v)
    assert dist.from_slurm() and dist.local_rank() == 1
    device = dist.init()
    assert device == torch.device("cuda", 0)
    assert calls == {"set_device": device, "backend": "nccl", "timeout": calls["timeout"], "device_id": device}


def test_a_rank_that_sees_the_nodes_gpus_takes_its_local_ranks(cuda, monkeypatch):
    calls = cuda(4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.rank_device() == torch.device("cuda", 3)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert dist.init() == torch.device("cuda", 3) and calls["device_id"] == torch.device("cuda", 3)


def test_a_local_rank_beyond_the_gpus_it_sees_is_one_error(cuda, monkeypatch):
    cuda(4)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(ConfigError, match=r"^LOCAL_RANK: local rank 5 needs a GPU of its own, this process sees 4 "
                       r"\(CUDA_VISIBLE_DEVICES=0,1,2,3\)"):  # fmt: skip
        dist.init()
