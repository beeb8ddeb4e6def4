"""`python train.py learner=fsdp ...` without torchrun: one rank of its own, and every exit path tears it down.

The GPU model configs pick ``learner=fsdp``; started without torchrun the run joins a one-rank process group
(``bapo.infra.dist.init_one_rank``) and trains through the same FSDP2 code. On a GPU machine a model whose learner
state cannot fit on one GPU is refused at start-up, naming the torchrun command instead."""

import os

import pytest
import torch.distributed as tdist

from bapo.config import ConfigError
from bapo.infra import dist
from bapo.learner import Learner
from bapo.loop import run
from tests.helpers.config import compose, run_config, smoke_cfg
from tests.helpers.metrics import rows, untimed

FSDP = ["learner=fsdp", "train.steps=2", "checkpoint.every=1"]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _clean() -> None:
    assert not tdist.is_initialized(), "the process group outlived the run"
    left = [k for k in LAUNCHER_ENV if k in os.environ]
    assert not left, f"launcher variables left in the environment: {left}"


def test_fsdp_without_torchrun_trains_on_one_rank_resumes_and_tears_down(tmp_path):
    assert "WORLD_SIZE" not in os.environ
    run(smoke_cfg(FSDP), tmp_path / "run")
    _clean()
    full = rows(tmp_path / "run")
    assert [r["step"] for r in full] == [0, 1, 2] and full[-1]["policy/version"] == 4
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "learner").is_dir()  # DCP: the sharded learner
    run(smoke_cfg([*FSDP, "resume=auto"]), tmp_path / "run")  # already complete: returns at once, leaves nothing up
    _clean()
    run(smoke_cfg([*FSDP, "train.steps=3", "resume=auto"]), tmp_path / "run")
    _clean()
    assert [r["step"] for r in rows(tmp_path / "run")] == [0, 1, 2, 3]


def test_an_error_inside_a_step_still_tears_down_and_shuts_engines(tmp_path, monkeypatch):
    closed = []

    def boom(self, samples):
        dist.before_teardown(lambda: closed.append(True))  # as a colocated vLLM engine registers itself
        raise RuntimeError("injected failure in the update")

    monkeypatch.setattr(Learner, "learn", boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        run(smoke_cfg(FSDP), tmp_path / "run")
    _clean()
    assert closed == [True]


def test_a_failing_engine_shutdown_does_not_hide_the_runs_error(tmp_path, monkeypatch):
    def boom(self, samples):
        dist.before_teardown(lambda: 1 / 0)
        raise RuntimeError("the real error")

    monkeypatch.setattr(Learner, "learn", boom)
    with pytest.raises(RuntimeError, match="the real error"):
        run(smoke_cfg(FSDP), tmp_path / "run")
    _clean()


def test_one_rank_fsdp_matches_the_single_process_learner(tmp_path):
    """Sharding over one rank changes nothing: learner=fsdp on one rank is learner=single metric for metric."""
    same = ["train.steps=2", "learner.micro_batch_size=8", "learner.lr=3e-4"]  # the two groups' defaults differ
    run(smoke_cfg(same), tmp_path / "single")
    run(smoke_cfg([*same, "learner=fsdp"]), tmp_path / "fsdp")
    drop = ("reward/verify_s",)  # a wall-clock time outside the time/ prefix
    a = [{k: v for k, v in r.items() if k not in drop} for r in untimed(rows(tmp_path / "single"))]
    b = [{k: v for k, v in r.items() if k not in drop} for r in untimed(rows(tmp_path / "fsdp"))]
    assert a == b


def test_a_model_too_big_for_one_gpu_is_refused_without_torchrun(monkeypatch):
    import torch

    from bapo.plan import verdict as plan

    rc = run_config("model=qwen7b")
    monkeypatch.setattr(plan, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 2**30}))
    with pytest.raises(ConfigError, match=r"learner.kind: .*torchrun --standalone --nproc_per_node") as e:
        plan.check_one_gpu(rc, launched=False)
    assert "7.6B parameters" in str(e.value)
    # the smallest change that fits one GPU is named, with what the plan says it then needs
    assert "it fits with learner.cpu_offload=true (" in str(e.value)
    offloaded = run_config("model=qwen7b", "learner.cpu_offload=true")
    plan.check_one_gpu(offloaded, launched=False)  # and it does start
    plan.check_one_gpu(rc, launched=True)  # under torchrun it is the user's node to fill
    small = run_config("model=qwen2.5_0.5b")
    plan.check_one_gpu(small, launched=False)  # 0.5B: 8 GiB of learner state fits on one GPU
    plan.check_one_gpu(run_config("model=qwen7b", "learner=single"), launched=False)  # not fsdp: not this check's
    with pytest.raises(ConfigError, match="learner.kind"):  # the training entry runs it before the model loads
        run(compose("model=qwen7b"), "unused")


def test_async_colocated_vllm_that_sleeps_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.enable_sleep_mode: train.async_rollout=true"):
        run_config("rollout=vllm", "train.async_rollout=true", "buffer.max_staleness=2")
    run_config("rollout=vllm", "train.async_rollout=true", "buffer.max_staleness=2", "rollout.enable_sleep_mode=false")
    assert compose("rollout=vllm").rollout.enable_sleep_mode  # the shipped default sleeps: sync mode
