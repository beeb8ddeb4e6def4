"""`torchrun --nproc_per_node=2 train.py learner=fsdp`: the whole loop on two gloo ranks, and an exact resume."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers.metrics import rows, untimed
from tests.helpers.processes import shared_torchrun, torchrun
from tests.helpers.runs import killed_after_step_3

pytestmark = pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)

ROOT = Path(__file__).resolve().parents[2]
ONE = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]


MODES = {
    "sync": [],
    "async": ["train.async_rollout=true", "buffer.max_staleness=3"],
    # recompute under FSDP (no scratch model): needs the weights of an older version
    "sync_every2_recompute": ["train.sync_every=2", "learner.mini_batches_per_rollout=1", "learner.old_logp=recompute"],
}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_two_rank_fsdp_run_trains_checkpoints_and_resumes_exactly(tmp_path, tmp_path_factory, mode):
    run, out = shared_torchrun(tmp_path_factory, *mode)  # the disaggregated tests compare against the same run
    full = rows(run)
    assert [r["step"] for r in full] == [0, 1, 2, 3, 4]
    assert out.count("step    3 |") == 1  # only rank 0 reports
    ckpt = run / "checkpoints" / "step_000002"
    assert {p.name for p in ckpt.iterdir()} >= {
        "state.pt",
        "meta.json",
        "learner",
        "producer_rank0.pt",
        "producer_rank1.pt",
    }
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 2
    from bapo.checkpoint import load

    states = [load(ckpt / f"producer_rank{r}.pt") for r in (0, 1)]
    assert states[0]["snapshot_versions"] == states[1]["snapshot_versions"]
    assert states[1]["snapshots"] == {}  # the ranks' copies are the same: rank 0's file holds them, once
    assert sorted(states[0]["snapshots"]) == states[0]["snapshot_versions"]
    if "learner.old_logp=recompute" in mode:  # recompute keeps the versions its buffered samples came from
        assert states[0]["snapshot_versions"], states[0]["snapshot_versions"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "export")  # the gathered HF export loads
    killed_after_step_3(run, tmp_path / "resumed")
    out = torchrun(tmp_path / "resumed", *mode, "resume=auto")
    assert "resumed from" in out and "step_000002" in out
    assert untimed(rows(tmp_path / "resumed")) == untimed(full)


def test_a_two_rank_sync_checkpoint_resumes_on_one_rank(tmp_path):
    torchrun(tmp_path / "two", "train.steps=2")
    shutil.copytree(tmp_path / "two", tmp_path / "one")
    (tmp_path / "one" / "final_metrics.json").unlink()
    out = torchrun(tmp_path / "one", "train.steps=3", "resume=auto", launcher=ONE)  # DCP reshards to 1 rank
    assert "resumed from" in out
    assert [r["step"] for r in rows(tmp_path / "one")] == [0, 1, 2, 3]
