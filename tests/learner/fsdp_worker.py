"""Run under torchrun by tests/learner/test_fsdp.py (and importable for its single-process reference).

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
import os
import pickle
import shutil
from pathlib import Path

import torch

from bapo.algos import surrogate_objective, token_logp
from bapo.infra import ckpt_folder, dist
from bapo.learner import Learner, collate
from bapo.modeling import load_model
from bapo.samples import Problem, Prompt, Sample, ScoredSample

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-math"
LEARNER_KW = dict(lr=1e-3, micro_batch_size=3)


def learner_config(kind: str = "single", **fields):
    """The typed learner group of ``learner=<kind>`` with the test's settings and ``fields``."""
    import dataclasses

    from bapo.config import FSDPLearnerConfig, SingleLearnerConfig

    common = dict(
        lr=1e-3, betas=[0.9, 0.999], weight_decay=0.0, eps=1e-8, warmup_steps=0, grad_clip=1.0, ppo_epochs=1,
        mini_batches_per_rollout=1, micro_batch_size=3, max_tokens_per_micro_batch=None, packing=False,
        old_logp="rollout", logp_check_share=0.0625, max_consecutive_skips=10,
    )  # fmt: skip
    if kind == "fsdp":
        cfg = FSDPLearnerConfig(kind="fsdp", mixed_precision="auto", activation_checkpointing=False, cpu_offload=False,
                                **common)  # fmt: skip
    else:
        cfg = SingleLearnerConfig(kind="single", device="cpu", **common)
    return dataclasses.replace(cfg, **fields)


def make_learner(model, kind: str = "single", **fields) -> Learner:
    return Learner(model, learner_config(kind, **fields), objective=objective(), pad_id=0, max_response_len=40)


def objective():
    """BAPO with its search on (paper defaults), plus entropy and the real aggregation."""
    return surrogate_objective("bapo", agg="seq-mean-token-mean", entropy_coef=0.01)


@torch.no_grad()
def samples(model, n: int = 11, seed: int = 0, adv_shift: float = 0.0, noise: float = 1.2) -> list[ScoredSample]:
    """Variable-length responses sampled from ``model``, behaviour log-probs of a perturbed policy
    (so ratios != 1), advantages mostly negative (so BAPO's search has to move the bounds)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randint(3, 340, (1, p), generator=g)
        for _ in range(r):
            probs = torch.softmax(model(input_ids=ids).logits[0, -1].double(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)[None]], 1)
        lp = token_logp(model(input_ids=ids).logits[:, :-1].double(), ids[:, 1:])[0, p - 1 :]
        lp = lp + noise * torch.randn(lp.shape, generator=g, dtype=lp.dtype)
        prompt_ids = tuple(ids[0, :p].tolist())
        prompt = Prompt(Problem(str(i), "p", "1"), "p", prompt_ids)
        s = Sample(prompt, i // 4, ids[0, p:].clone(), lp.float(), "t", 0, False)
        out.append(ScoredSample(s, 0.0, float(torch.randn(1, generator=g)) + adv_shift, False))
    return out


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for k, p in model.named_parameters():
        g = p.grad
        out[k] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out


class Payload:
    """Unpickling it calls ``os.system(cmd)``."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


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
