"""Run under torchrun by tests/e2e/learner/test_fsdp.py (its single-process reference shares tests/helpers/fsdp.py).

Each rank takes its shard of one global mini-batch, runs one FSDP2 update with the real
BAPO objective and writes what the test compares to ``$OUT/rank{r}.pt``: the full
gradients before the step, the chosen bounds, the metrics, the post-step weights, the
weights after a further step taken straight on and after a DCP save/load round trip,
and the gradients with activation checkpointing and CPU offload on. Rank 0 also
exports an HF folder. Last, three broken checkpoints (a metadata file carrying a payload,
a bit-flipped shard that only rank 0 verifies, a full disk on rank 0 only) must each raise
CheckpointError on *both* ranks: none may hang in a collective while the other fails.
"""

from __future__ import annotations

import argparse
import errno
import pickle
import shutil
from pathlib import Path

import torch

from bapo.infra import ckpt_folder, dist
from bapo.learner import collate
from bapo.modeling import load_model
from tests.helpers.checkpoints import Payload
from tests.helpers.fsdp import TINY, full_grads, make_learner


def broken_checkpoints(lrn, out: Path) -> dict[str, str | None]:
    """The CheckpointError each broken case raised on this rank (None: it raised nothing, a failure)."""
    from bapo.learner import fsdp

    main, seen = dist.rank() == 0, {}
    if main:
        meta, shard = out / "bad_metadata", out / "bad_shard"
        shutil.copytree(out / "ckpt", meta)
        (meta / ".metadata").write_bytes(pickle.dumps(Payload(f"touch {out / 'pwned'}")))
        ckpt_folder.write_manifest(meta)  # re-signed, as an attacker would
        shutil.copytree(out / "ckpt", shard)
        data = bytearray((shard / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 1
        (shard / "__1_0.distcp").write_bytes(bytes(data))
    dist.barrier()
    for case in ("bad_metadata", "bad_shard"):
        try:
            fsdp.load_sharded(out / case, model=lrn.model, optimizer=lrn.optimizer)
            seen[case] = None
        except ckpt_folder.CheckpointError as e:
            seen[case] = str(e)
    real = ckpt_folder.write

    def full_disk_on_rank0(path, state):
        if main:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, state)

    ckpt_folder.write = full_disk_on_rank0
    tmp = out / "checkpoints" / ".tmp-step_000009"
    if main:
        ckpt_folder.prepare(tmp)
    dist.barrier()
    try:
        lrn.save(tmp / "learner")
        seen["full_disk"] = None
    except ckpt_folder.CheckpointError as e:
        seen["full_disk"] = str(e)
    finally:
        ckpt_folder.write = real
    return seen


def main(out_dir: str, packing: bool, max_tokens: int | None, dtype: str) -> None:
    from bapo.learner import fsdp

    dist.init("gloo")
    out = Path(out_dir)
    data = torch.load(out / "samples.pt", weights_only=False)  # written by the test: the same on every rank

    def learner(**fields):
        model = load_model(str(TINY)).to(getattr(torch, dtype))
        return make_learner(model, "fsdp", packing=packing, max_tokens_per_micro_batch=max_tokens, **fields)

    lrn = learner()  # the learner wraps the model in FSDP2 itself (its strategy)
    mine = collate(lrn.shard(data), pad_id=0)
    metrics = lrn.accumulate(mine)
    grads = full_grads(lrn.model)
    torch.nn.utils.clip_grad_norm_(lrn.model.parameters(), lrn.cfg.grad_clip)
    lrn.optimizer.step()
    lrn.optimizer.zero_grad(set_to_none=True)
    after_one = fsdp.full_state_dict(lrn.model)
    lrn.save(out / "ckpt")
    dist.barrier()
    if dist.rank() == 0:  # as bapo.infra.ckpt_folder.save would, so that the loads below verify it
        ckpt_folder.write_manifest(out / "ckpt")
    dist.barrier()
    straight = lrn.update(mine)
    after_two = fsdp.full_state_dict(lrn.model)
    # A fresh learner (new AdamW, new schedule) restored from the checkpoint must take the same second step.
    lrn = learner()
    lrn.load(out / "ckpt")
    restored = lrn.update(mine)
    after_resume = fsdp.full_state_dict(lrn.model)
    lrn.export_hf(out / "export", tokenizer=_NoTokenizer())
    # Options that must not change the gradients: activation checkpointing and CPU offload.
    other = learner(activation_checkpointing=True, cpu_offload=True)
    other.accumulate(mine)
    broken = broken_checkpoints(lrn, out)
    result = dict(
        broken=broken,
        metrics=metrics,
        grads=grads,
        grads_ac_offload=full_grads(other.model),
        after_one=after_one,
        after_two=after_two,
        after_resume=after_resume,
        straight=straight,
        restored=restored,
        shard=[s.prompt.problem.id for s in (x.sample for x in dist.shard(data))],
        micro_batches=len(lrn.micro_batches(mine, sync=False)),
    )
    torch.save(result, out / f"rank{dist.rank()}.pt")
    dist.teardown()


class _NoTokenizer:
    """The export writes a tokenizer folder too; these tests compare weights only."""

    def save_pretrained(self, path) -> None:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    a = parser.parse_args()
    main(a.out_dir, a.packing, a.max_tokens, a.dtype)
