"""Throughput of the reward stage: the worker pool against serial in-process verification.

Builds GRPO-shaped batches (128 prompts x 8 samples = 1,024 responses) from the
MATH/AIME training answers: per group, some samples box the gold exactly (string
fast path), some box an equivalent form (decimal for a fraction, "x = 5", "5.0",
\\dfrac), some box a wrong answer, and some never box. Every measured batch uses
fresh problems, so no method profits from caches warmed by another.

It also times worker start-up: a fresh verifier scoring one pair that the string
fast path cannot decide (so a worker must start and answer), then the same after
``close()`` (a restart, which is what replacing a killed worker costs).

    python scripts/bench/bench_reward.py [--workers 2] [--batches 3]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from bapo.reward import MathVerifier, extract_answer, is_equivalent  # noqa: E402
from scripts.bench.harness import ROOT, timed  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "train_math.jsonl"
GROUP, PROMPTS = 8, 128

FILLER = [
    "Let us set up the problem carefully.",
    r"We write the condition as an equation and simplify both sides, giving $2x + 3 = 11$.",
    r"Substituting back, the check $4 \cdot 2 = 8$ holds.",
    "Counting the remaining cases one by one gives the same total.",
]


def variant(gold: str, rng: random.Random) -> str:
    """An equivalent way of writing ``gold``, so math-verify (not the fast path) must decide."""
    if re.fullmatch(r"-?\d+", gold):
        return rng.choice([f"x = {gold}", f"{gold}.0", f"\\frac{{{2 * int(gold)}}}{{2}}"])
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", gold)
    if frac and int(frac.group(3)) != 0:
        sign, num, den = frac.groups()
        value = int(num) / int(den)
        return rng.choice(
            [
                f"{sign}{num}/{den}",
                f"{sign}{value:.10g}",
                f"{sign}\\dfrac{{{2 * int(num)}}}{{{2 * int(den)}}}",
            ]
        )
    return f"x = {gold}"  # intervals, tuples, expressions: an assignment math-verify must unwrap


def wrong(gold: str, rng: random.Random) -> str:
    if re.fullmatch(r"-?\d+", gold):
        return str(int(gold) + rng.choice([-2, -1, 1, 3]))
    return rng.choice([f"2({gold})", f"{gold} + 1", r"\frac{\sqrt{3}}{2}", "7"])


def response(gold: str, kind: str, rng: random.Random) -> str:
    steps = " ".join(rng.sample(FILLER, 3))
    if kind == "exact":
        return f"{steps} Therefore the answer is $\\boxed{{{gold}}}$."
    if kind == "variant":
        return f"{steps} So we get $\\boxed{{{variant(gold, rng)}}}$."
    if kind == "wrong":
        return f"{steps} Hence the result is \\boxed{{{wrong(gold, rng)}}}."
    return f"{steps} I could not finish the computation."


def make_batches(n: int, seed: int = 0) -> list[tuple[list[str], list[str]]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    rng = random.Random(seed)
    rng.shuffle(rows)
    kinds = ["exact"] * 3 + ["variant"] * 2 + ["wrong"] * 2 + ["none"]  # per group of 8
    batches = []
    for b in range(n):
        responses, answers = [], []
        for row in rows[b * PROMPTS : (b + 1) * PROMPTS]:
            for kind in rng.sample(kinds, GROUP):
                responses.append(response(row["answer"], kind, rng))
                answers.append(row["answer"])
        batches.append((responses, answers))
    return batches


def startup(workers: int, timeout_s: float, restarts: int = 3) -> tuple[float, list[float]]:
    """Seconds to the first verdict on a fresh verifier, and after each of ``restarts`` close() calls."""
    pair = ([r"\boxed{0.5}"], [r"\frac12"])  # equal, but only math-verify can tell
    verifier = MathVerifier(num_workers=workers, timeout_s=timeout_s)
    first, _ = timed(lambda: verifier.score(*pair))
    again = []
    for _ in range(restarts):
        verifier.close()
        again.append(timed(lambda: verifier.score(*pair))[0])
    verifier.close()
    return first, again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    batches = make_batches(3 * args.batches + 1)
    size = len(batches[0][0])

    first, again = startup(args.workers, args.timeout_s)
    print(f"start-up of {args.workers} workers to the first verdict: {first:.3f} s")
    print(f"restart after close(): {' '.join(f'{t:.3f}' for t in again)} s")

    with MathVerifier(num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        cold, (_, stats) = timed(lambda: pool.score(*batches[0]))  # includes starting the workers
        print(f"batch of {size}: {stats}")
        print(f"pool ({args.workers} workers), first batch incl. start-up: {cold:.3f} s")
        pool_s = [timed(lambda b=b: pool.score(*b))[0] for b in batches[1 : 1 + args.batches]]

    serial = MathVerifier(num_workers=0, timeout_s=args.timeout_s)
    serial_s = [timed(lambda b=b: serial.score(*b))[0] for b in batches[1 + args.batches : 1 + 2 * args.batches]]

    def naive(b):  # no fast path in the parent, no de-duplication: one check per response
        return [
            (a := extract_answer(r)) is not None and is_equivalent(a, g, timeout_s=args.timeout_s)
            for r, g in zip(*b, strict=True)
        ]

    naive_s = [timed(lambda b=b: naive(b))[0] for b in batches[1 + 2 * args.batches :]]

    def report(name: str, times: list[float]) -> float:
        mean = sum(times) / len(times)
        print(f"{name:44s} {mean:.3f} s/batch  ({1e3 * mean / size:.2f} ms/response)")
        return mean

    p = report(f"pool, {args.workers} workers, warm", pool_s)
    s = report("serial in-process (same fast path + dedup)", serial_s)
    n = report("serial in-process, one check per response", naive_s)
    print(f"ratio pool / serial: {p / s:.2f}   pool / naive serial: {p / n:.2f}")


if __name__ == "__main__":
    main()
