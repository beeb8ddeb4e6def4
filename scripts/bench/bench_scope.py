"""What BAPO's mini-batch scope costs: learner updates with scope=mini_batch vs micro_batch.

With ``scope=mini_batch`` (the paper's) the bound search needs the current ratios of
the whole mini-batch before the first backward, so the learner runs an extra no-grad
forward over every micro-batch. ``scope=micro_batch`` (the authors' code) searches on
each micro-batch from the forward that carries the gradient. Fixed bounds (GRPO) need
no pre-pass at all and are timed as the floor.

Runs on the shipped tiny model with synthetic sequences shaped like the default job's
as it was when this was written (mini-batch = prompts_per_step x n / mini_batches_per_rollout
= 128 samples, micro-batches of 64; today's default is 256 samples in one micro-batch).
The scopes are timed in interleaved rounds and the median is reported, so that a busy machine
skews both alike; one torch thread by default, because oversubscribed threads on a
shared CPU make timings swing several-fold. Prints medians and the ratio.

    python scripts/bench/bench_scope.py [--samples 128] [--micro 64] [--updates 4] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from bapo.algos import surrogate_objective, token_logp  # noqa: E402
from bapo.learner import Learner, collate  # noqa: E402
from bapo.modeling import load_model, load_tokenizer  # noqa: E402
from bapo.samples import Problem, Prompt, Sample, ScoredSample  # noqa: E402
from scripts.bench.harness import ROOT, medians, parser, start, timed  # noqa: E402


def make_batch(model, tok, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p_len = int(torch.randint(18, 30, (1,), generator=g))
        r_len = int(torch.randint(16, 49, (1,), generator=g))
        ids = torch.randint(3, len(tok), (p_len + r_len,), generator=g)
        with torch.no_grad():
            lp = token_logp(model(input_ids=ids[None]).logits[0, :-1], ids[1:])[p_len - 1 :]
        lp = lp + 0.2 * torch.randn(lp.shape, generator=g)  # behaviour policy != current: ratios != 1
        prompt = Prompt(Problem(str(i), "p", "1"), "p", tuple(ids[:p_len].tolist()))
        s = Sample(prompt, i // 8, tuple(ids[p_len:].tolist()), tuple(lp.tolist()), "t", 0, False)
        samples.append(ScoredSample(s, 0.0, float(torch.randn(1, generator=g)), False))
    return collate(samples, pad_id=tok.pad_token_id)


def time_updates(model, batch, objective, scope: str, micro: int, updates: int) -> float:
    learner = Learner(copy.deepcopy(model), objective=objective, scope=scope, lr=1e-4, micro_batch_size=micro)
    learner.update(batch)  # warm-up
    seconds, _ = timed(lambda: [learner.update(batch) for _ in range(updates)])
    return seconds / updates


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--samples", type=int, default=128, help="samples per mini-batch (one optimizer update)")
    ap.add_argument("--micro", type=int, default=64, help="micro-batch size")
    ap.add_argument("--updates", type=int, default=4, help="timed updates per round and setting")
    args = start(ap)
    tok = load_tokenizer(str(ROOT / "assets" / "tiny-math"))
    model = load_model(str(ROOT / "assets" / "tiny-math"))
    batch = make_batch(model, tok, args.samples)
    settings = {
        "bapo, scope=mini_batch (pre-pass)": (surrogate_objective("bapo"), "mini_batch"),
        "bapo, scope=micro_batch": (surrogate_objective("bapo"), "micro_batch"),
        "fixed bounds (no search)": (surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2), "mini_batch"),
    }
    times: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(args.rounds):
        for name, (objective, scope) in settings.items():
            times[name].append(time_updates(model, batch, objective, scope, args.micro, args.updates))
    print(
        f"tiny model, {args.samples} samples/update ({batch.num_tokens} response tokens), "
        f"micro-batches of {args.micro}, {args.rounds} rounds x {args.updates} updates, torch threads "
        f"{torch.get_num_threads()}"
    )
    med = medians(times)
    for name, t in med.items():
        spread = f"{min(times[name]) * 1e3:.0f}-{max(times[name]) * 1e3:.0f}"
        print(f"  {name:36s} {t * 1e3:8.1f} ms/update  (rounds: {spread} ms)")
    mini, micro = med["bapo, scope=mini_batch (pre-pass)"], med["bapo, scope=micro_batch"]
    print(f"ratio mini_batch / micro_batch = {mini / micro:.3f}")


if __name__ == "__main__":
    main()
