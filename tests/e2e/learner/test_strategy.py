"""The FSDP strategy's weight paths on 2 gloo ranks (one torchrun launch, ``strategy_worker.py``), and the
pieces of them that run in one process.

On 2 ranks: meta-device loading reads each rank's shard straight from the checkpoint and matches
loading everything then sharding (fp32, and bf16 into fp32 master shards); the streamed full weights
equal the gathered state dict while never holding two full parameters at once; snapshots are CPU copies;
data-parallel evaluation and a tensor-parallel rollout group gather correctly.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bapo.learner import fsdp
from bapo.modeling import load_model
from tests.helpers.engines import tied_copy

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TINY = ROOT / "assets" / "tiny-math"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    src = tmp_path_factory.mktemp("models")
    shutil.copytree(TINY, src / "fp32")
    load_model(str(TINY)).to(torch.bfloat16).save_pretrained(src / "bf16")
    tied_copy(src / "tied")
    out = tmp_path_factory.mktemp("out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, str(HERE / "strategy_worker.py"), str(out), str(src)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize(
    "check",
    [
        "meta_load",
        "stream_values",
        "stream_one_at_a_time",
        "snapshot",
        "eval_shared",
        "maker_tp",
        "stream_bf16",
        "export_bf16",
        "recompute_sharded",
        "kl_reference",
    ],
)
def test_on_two_ranks(results, check):
    for rank, res in enumerate(results):
        entry = res.get(check) or res.get(check.split("_")[0])  # a failed two-part check records "stream"
        assert entry is not None, f"rank {rank}: no result for {check}: {sorted(res)}"
        ok, detail = entry
        assert ok, f"rank {rank}: {check} failed:\n{detail}"


def test_shard_rows_partition_like_fsdp2():
    """The row ranges tile [0, n) in rank order, ceil(n / world) rows each (torch.chunk's split)."""
    for n in (1, 2, 5, 343, 1000):
        for world in (1, 2, 3, 8):
            ranges = [fsdp.shard_rows(n, r, world) for r in range(world)]
            chunks = torch.arange(n).chunk(world)
            for r, (a, b) in enumerate(ranges):
                expect = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(a, b)) == expect, (n, world, r)


def test_checkpoint_files_single_and_index(tmp_path):
    files = fsdp.checkpoint_files(TINY)
    assert set(files.values()) == {TINY / "model.safetensors"} and "model.embed_tokens.weight" in files
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "part-1.st"}}))
    assert fsdp.checkpoint_files(tmp_path) == {"a.weight": tmp_path / "part-1.st"}
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        fsdp.checkpoint_files(tmp_path / "nothing")


def test_meta_model_has_real_buffers_and_no_weights():
    model = load_model(str(TINY), device="meta")
    assert all(p.is_meta for p in model.parameters())
    ref = load_model(str(TINY))
    for (name, b), (_, r) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        assert not b.is_meta and torch.equal(b, r), name  # rotary tables: in no checkpoint, computed here
    assert model.config._name_or_path == str(TINY)
