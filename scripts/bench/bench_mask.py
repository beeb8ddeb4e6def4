"""The shared-prompt layout's 4-D attention mask at paper_7b's micro-batch shape: the old way against the new.

Without flash-attn (the ``[vllm]`` extra does not install it) the learner runs sdpa under a 4-D mask
[R, W, W] (``bapo.learner.batching.pack_shared``). A paper_7b micro-batch holds up to 16,384 tokens
(``placement.max_tokens_per_micro_batch``) of responses up to 8,192 tokens, so R x W x W is about
2 x 8.3k x 8.3k = 131 MiB. Timed per micro-batch and optimizer update with BAPO's pre-pass (two passes
over every micro-batch; three with a KL reference, ``--passes 3``):

- old: every pass laid the micro-batch out (``pack_shared``), built the mask on the host with five
  elementwise passes over [R, W, W] (same segment, earlier position, prompt or own branch) and copied it
  to the learner's device;
- new: one layout per micro-batch and update, moved to the device once; the mask built there from its
  blocks (``shared_mask``: zeros, then each triangle and rectangle it may see), once per pass (the
  reference's forward shares the training pass's).

The micro-batches are a rank's share of one paper_7b mini-batch (8 prompts x 16 responses: 1,024 rows over 8
ranks), prompts of 60-200 tokens, a quarter of the responses cut at 8,192 tokens and the rest of 500-8,192,
shuffled and split by the token budget as the learner does. Both ways run in this process on the same
micro-batches, and the masks are checked equal. One torch thread by default (a shared machine).

    python scripts/bench/bench_mask.py [--micro-batches 3] [--passes 2] [--rounds 3] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from bapo.learner.batching import collate, pack_shared, shared_mask, split_by_tokens  # noqa: E402
from bapo.samples import Problem, Prompt, Sample, ScoredSample  # noqa: E402
from scripts.bench.harness import parser, start, timed  # noqa: E402

BUDGET = 16384  # conf/placement/gpu_node.yaml: max_tokens_per_micro_batch
MAX_NEW = 8192  # experiment=paper_7b: model.max_new_tokens


def micro_batches(seed: int = 0) -> list:
    """One rank's micro-batches of a paper_7b mini-batch (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(8):
        p = int(torch.randint(60, 201, (1,), generator=g))
        prompt = Prompt(Problem(str(i), "p", "1"), "p", tuple(torch.randint(3, 150000, (p,), generator=g).tolist()))
        for _ in range(16):
            cut = torch.rand(1, generator=g) < 0.25
            n = MAX_NEW if cut else int(torch.randint(500, MAX_NEW, (1,), generator=g))
            s = Sample(prompt, i, torch.randint(3, 150000, (n,), generator=g), torch.zeros(n), "", 0, bool(cut))
            rows.append(ScoredSample(s, 0.0, 1.0, False))
    order = torch.randperm(len(rows), generator=g).tolist()
    return split_by_tokens(collate([rows[k] for k in order], pad_id=0), BUDGET, packed=True)


def old_mask(sp, device) -> torch.Tensor:
    """The mask as it was built: on the host, five elementwise passes over [R, W, W], then copied."""
    seg, pos, branch = sp.segment, sp.position_ids, sp.branch  # [R, W]
    allowed = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])  # [R, W, W]
    allowed &= (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    return allowed[:, None].to(device)


def sync(device: torch.device):
    """What makes a timing count the device's queued work: None on the CPU."""
    return partial(torch.cuda.synchronize, device) if device.type == "cuda" else None


def old_way(mb, passes: int, device) -> tuple[float, float]:
    """(seconds for every pass of one update over ``mb``, seconds of one mask build and copy)."""
    total, one = 0.0, 0.0
    for _ in range(passes):
        t, sp = timed(pack_shared, mb, sync=sync(device))
        t_mask, _ = timed(old_mask, sp, device, sync=sync(device))
        total, one = total + t + t_mask, t_mask
    return total, one


def new_way(mb, passes: int, device) -> tuple[float, float]:
    t, sp = timed(lambda: pack_shared(mb).to(device), sync=sync(device))
    total, one = t, 0.0
    for _ in range(min(passes, 2)):  # a KL reference's forward shares the training pass's mask
        one, _ = timed(lambda: shared_mask(sp, device)[:, None], sync=sync(device))
        total += one
    return total, one


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--micro-batches", type=int, default=3, help="micro-batches timed (the first of the rank's)")
    ap.add_argument("--passes", type=int, default=2, help="forwards per micro-batch and update (3: a KL reference)")
    ap.add_argument("--device", default="cpu", help="the learner's device (cpu, cuda)")
    args = start(ap)
    device = torch.device(args.device)
    micro = micro_batches()
    chosen = micro[: args.micro_batches]
    for mb in chosen:  # the new mask is the old one
        sp = pack_shared(mb)
        assert torch.equal(shared_mask(sp, device)[:, None], old_mask(sp, device)), "the masks differ"
    runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        for mb in chosen:
            runs["old"].append(old_way(mb, args.passes, device))
            runs["new"].append(new_way(mb, args.passes, device))
    shapes = [tuple(pack_shared(mb).input_ids.shape) for mb in chosen]
    print(
        f"paper_7b micro-batches (budget {BUDGET} tokens; a rank has {len(micro)} per update): timed the first "
        f"{len(chosen)}, [R, W] = {shapes}, masks of {[r * w * w / 2**20 for r, w in shapes]} MiB; "
        f"{args.passes} passes per update; device {device}; torch threads {torch.get_num_threads()}; "
        f"{args.rounds} rounds, medians"
    )
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
    for k, (update, one) in med.items():
        print(f"  {k}: {update * 1e3:8.1f} ms per micro-batch and update   {one * 1e3:8.1f} ms per mask")
    (old_u, old_m), (new_u, new_m) = med["old"], med["new"]
    print(f"  ratio old / new: x{old_u / new_u:.1f} per micro-batch and update, x{old_m / new_m:.1f} per mask")
    n = len(micro)
    print(f"  per update and rank ({n} micro-batches): old {old_u * n:.1f} s, new {new_u * n:.1f} s")


if __name__ == "__main__":
    main()
