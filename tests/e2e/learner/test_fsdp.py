"""FSDP2 under torchrun (2 gloo processes) against one plain process on the same global batch.

One torchrun launch (``fsdp_worker.py``, about 15 s on 2 cores) runs, on each rank's
shard: packing, a token budget that gives the ranks different numbers of micro-batches,
BAPO's bound search with its sums all-reduced, an update, a DCP checkpoint round trip
(tensors only in DCP, verified against a manifest), an HF export, and three broken
checkpoints that must fail on both ranks alike. The reference is the plain single-process learner, padded, fixed-size
micro-batches. float64, so that any difference beyond summation order is a bug.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bapo.learner import collate
from bapo.learner import fsdp as fsdp_mod
from tests.helpers import fsdp as W

pytestmark = pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

BUDGET = 70  # tokens: shard 0 packs into 3 micro-batches, shard 1 into 2 (so rank 1 runs an empty one)


def max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from bapo.modeling import load_model

    out = tmp_path_factory.mktemp("fsdp")
    model = load_model(str(W.TINY)).double()
    data = W.samples(model)
    torch.save(data, out / "samples.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(HERE / "fsdp_worker.py"), str(out), "--packing", "--max-tokens", str(BUDGET), "--dtype", "float64"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    # The reference: one process, the whole batch, padded, 3 rows per micro-batch.
    lrn = W.make_learner(model)
    batch = collate(data, pad_id=0)
    metrics = lrn.accumulate(batch)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), lrn.cfg.grad_clip)
    lrn.optimizer.step()
    lrn.optimizer.zero_grad(set_to_none=True)
    ref = dict(metrics=metrics, grads=grads, after_one=copy.deepcopy(model.state_dict()))
    return out, ranks, ref, data


def test_ranks_take_disjoint_shards_with_different_micro_batch_counts(run):
    _, ranks, _, data = run
    ids = [i for r in ranks for i in r["shard"]]
    assert sorted(ids) == sorted(s.sample.prompt.problem.id for s in data) and len(set(ids)) == len(ids)
    assert [r["micro_batches"] for r in ranks] == [3, 2]  # rank 1 pads with a micro-batch of no tokens


def test_bounds_are_identical_on_every_rank_and_equal_one_process(run):
    _, ranks, ref, _ = run
    for key in ("clip/low", "clip/high", "bapo/search_steps"):
        assert ranks[0]["metrics"][key] == ranks[1]["metrics"][key] == ref["metrics"][key], key
    assert 0 < ref["metrics"]["bapo/search_steps"] < 51  # the search moved and stopped on the way (target met)
    for key in ("learner/loss", "learner/entropy", "learner/pg_loss", "clip/rho"):
        assert ranks[0]["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-12), key


def test_gradients_and_post_step_weights_equal_one_process(run):
    _, ranks, ref, _ = run
    assert max_rel(ranks[0]["grads"], ref["grads"]) < 1e-12
    assert max_rel(ranks[1]["grads"], ref["grads"]) < 1e-12
    assert max_rel(ranks[0]["after_one"], ref["after_one"]) < 1e-12
    assert ranks[1]["after_one"] == {}  # full weights are gathered to rank 0 only


def test_activation_checkpointing_and_cpu_offload_keep_the_gradients(run):
    _, ranks, _, _ = run
    for r in ranks:
        assert max_rel(r["grads_ac_offload"], r["grads"]) == 0.0


def test_dcp_resume_reproduces_the_next_step_exactly(run):
    _, ranks, _, _ = run
    r0 = ranks[0]
    assert all(torch.equal(r0["after_two"][k], r0["after_resume"][k]) for k in r0["after_two"])
    assert r0["straight"]["learner/loss"] == r0["restored"]["learner/loss"]
    assert any(not torch.equal(r0["after_one"][k], r0["after_two"][k]) for k in r0["after_one"])


def test_dcp_checkpoint_of_two_ranks_resumes_in_one_plain_process(run):
    from bapo.modeling import load_model

    out, ranks, _, data = run
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "plain.pt"} <= {p.name for p in (out / "ckpt").iterdir()}
    md = fsdp_mod.read_metadata(out / "ckpt")  # the restricted unpickler reads a real 2-rank file
    assert all(type(e).__name__ == "TensorStorageMetadata" for e in md.state_dict_metadata.values())
    model = load_model(str(W.TINY)).double()
    lrn = W.make_learner(model)
    # written by 2 FSDP ranks, resharded to 1 process, verified against the manifest
    extra = fsdp_mod.load_sharded(out / "ckpt", model=lrn.model, optimizer=lrn.optimizer)
    lrn.load_state_dict(extra)
    assert max_rel(dict(model.state_dict()), ranks[0]["after_one"]) == 0.0
    lrn.update(collate(data, pad_id=0))
    assert max_rel(dict(model.state_dict()), ranks[0]["after_two"]) < 1e-12


def test_hf_export_loads_with_transformers(run):
    from transformers import AutoModelForCausalLM

    out, ranks, _, data = run
    model, info = AutoModelForCausalLM.from_pretrained(out / "export", output_loading_info=True, dtype=torch.float64)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert max_rel(dict(model.state_dict()), ranks[0]["after_resume"]) == 0.0
    assert (out / "export" / "model.safetensors").exists()


def test_a_broken_checkpoint_fails_on_every_rank_without_a_hang(run):
    out, ranks, _, _ = run
    for r in ranks:
        assert "refused to load global posix.system" in r["broken"]["bad_metadata"]
        assert r["broken"]["full_disk"].startswith("no space left on device while writing ")
        assert ".tmp-step_000009" in r["broken"]["full_disk"]
    assert not (out / "pwned").exists()
    # the shard's checksum is checked on rank 0; rank 1 learns the verdict from it
    assert "__1_0.distcp: checksum mismatch" in ranks[0]["broken"]["bad_shard"]
    assert ranks[1]["broken"]["bad_shard"].startswith(f"reading {out / 'bad_shard'} failed on rank 0: CheckpointError")
    assert not (out / "checkpoints" / ".tmp-step_000009").exists()  # rank 0 removed the partial write
