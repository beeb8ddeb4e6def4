"""Decode throughput of the HF engine's two paths: the lean loop against HF ``generate``.

For each model (the shipped tiny model, and SmolLM2-135M when its converted folder exists:
``make smollm2``), both paths sample ``n`` responses for the same arithmetic prompts at
temperature 1 with the same seeds, in interleaved rounds, in this one process; it prints the
median and best tokens/s of each, their ratio, and the mean response length of each (the paths
sample the same distribution with different random draws, so the lengths should be close).
Defaults: 32 prompts x 8 = 256 sequences, 48 new tokens, 2 torch threads.

    python scripts/bench/bench_decode.py [--models tiny,smollm2_135m] [--prompts 32] [--n 8]
                                   [--max-new-tokens 48] [--rounds 5] [--threads 2]

On a shared machine the best round is the steadier figure: other processes only ever slow a round down.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

import torch  # noqa: E402

from bapo.engines import HFRollout  # noqa: E402
from bapo.modeling import load_model, load_tokenizer  # noqa: E402
from scripts.bench.harness import add_model_flags, arith_prompts, local_model, medians, parser, start, tokens_per_s  # noqa: E402

PATHS = ("lean", "generate")


def bench(name: str, args) -> dict | None:
    path = local_model(name)
    if path is None:
        return None
    tok = load_tokenizer(path)
    prompts = arith_prompts(name, tok, args.prompts)
    model = load_model(path)
    kw = dict(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, batch_size=args.prompts * args.n)
    engines = {d: HFRollout(model, tok, decode=d, **kw) for d in PATHS}
    for eng in engines.values():  # warm-up
        eng.generate(prompts[:2], seed=0)
    rates: dict[str, list[float]] = {d: [] for d in PATHS}
    lengths: dict[str, list[int]] = {d: [] for d in PATHS}
    for r in range(args.rounds):  # interleaved, so a busy machine slows both alike
        for d, eng in engines.items():
            rate, samples = tokens_per_s(eng, prompts, seed=r)
            rates[d].append(rate)
            lengths[d] += [len(s.response_ids) for s in samples]
    med = medians(rates)
    best = {d: max(v) for d, v in rates.items()}
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"[{name}] {params:.1f}M params, {args.prompts} prompts x n={args.n}, {args.max_new_tokens} new tokens, "
        f"{torch.get_num_threads()} torch threads, {args.rounds} rounds\n"
        f"  lean     median {med['lean']:8,.0f} tok/s   best {best['lean']:8,.0f} tok/s\n"
        f"  generate median {med['generate']:8,.0f} tok/s   best {best['generate']:8,.0f} tok/s\n"
        f"  lean/generate = {med['lean'] / med['generate']:.2f}x (median), "
        f"{best['lean'] / best['generate']:.2f}x (best); mean response length "
        f"{statistics.mean(lengths['lean']):.1f} (lean) / {statistics.mean(lengths['generate']):.1f} (generate)"
    )
    return {"model": name, "median": med, "best": best}


def main() -> None:
    ap = parser(__doc__, rounds=5, threads=2)
    add_model_flags(ap, n=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = start(ap)
    for name in args.models.split(","):
        bench(name.strip(), args)


if __name__ == "__main__":
    main()
