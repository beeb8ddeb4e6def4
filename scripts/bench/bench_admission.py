"""How full ``rollout=vllm_server``'s admission keeps a server: the mean sequences in flight against what vLLM's own
scheduler would run, at paper_7b's shape, through the engine's real HTTP side and a loopback stand-in server.

    python scripts/bench/bench_admission.py [--batches 2] [--prompts 64] [--overcommit 1.0 1.2]

The stand-in (tests/helpers/vllm_standin.py, :class:`KVScheduler`) runs completions as vLLM's scheduler would:
sequences run while their KV cache (prompt and tokens so far) fits the server's, the newest are preempted when it
overflows, the rest wait; every running sequence generates the same tokens a tick (decode is memory-bound, so a
sequence's speed does not depend on how many run), so generation time is proportional to the tokens asked for.
The server is a split placement's: 1,015,851 tokens of KV cache (bapo/plan/'s paper_7b server at 0.9 of an 80 GB
GPU) and vLLM's default ``max_num_seqs`` on such a GPU (1,024). A batch is a server's share of a paper_7b step: 64
prompts of 100-400 tokens, n = 16 responses of at most 8,192 tokens each. Response lengths are drawn from a
log-normal (mu 7.91, sigma 0.937) capped at 8,192: a mean of 3.5k tokens, a median of 2.7k and 12% at the cap, as
DeepSeek-R1-Distill-Qwen-7B's responses on MATH at an 8k budget. Everything is counted in units of 16 tokens (a
tick generates 4 units, 64 tokens, every 20 ms) so that a batch takes seconds here.

Variants, each on a fresh stand-in and engine, ``--batches`` batches one after another (the engine learns the
lengths from the batches before):
- ``vLLM alone``: the engine sends every request at once and the stand-in's scheduler decides: what vLLM itself
  would hold (with its preemptions);
- ``engine``: the engine's admission (``rollout.kv_overcommit``, each value of ``--overcommit``).
Printed for each: the mean sequences running over the ticks with work (and its share of vLLM alone's), the mean
share of the KV cache they hold, the preemptions, the ticks the batches took (the generation time), and failed
requests (none may fail).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo, scripts/ and tests/

from scripts.bench.harness import parser  # noqa: E402

UNIT = 16  # tokens a stand-in token stands for
KV_TOKENS = 1_015_851  # bapo/plan/: experiment=paper_7b placement=gpu_node_split, a server's KV cache
MAX_NUM_SEQS = 1024  # vLLM 0.32's default on GPUs of 70 GB and more (OpenAI server)
MAX_NEW = 8192  # experiment=paper_7b: model.max_new_tokens
MU, SIGMA = 7.91, 0.937  # log-normal lengths capped at MAX_NEW: mean 3.5k, median 2.7k, 12% at the cap


def length(seed: int, index: int) -> int:
    """Child ``index`` of the request seeded ``seed``: its response length, in units."""
    return max(1, round(min(MAX_NEW, random.Random(seed * 131 + index).lognormvariate(MU, SIGMA)) / UNIT))


def prompts(count: int, seed: int) -> list:
    from bapo.samples import Problem, Prompt

    r = random.Random(seed)
    out = []
    for i in range(count):
        ids = tuple(r.randrange(10, 300) for _ in range(r.randint(100, 400) // UNIT))
        out.append(Prompt(Problem(f"p{seed}-{i}", "", "0"), "", ids))
    return out


ALONE = -1.0  # the variant that sends every request at once


def run(overcommit: float | None, batches: int, count: int) -> dict:
    """``batches`` batches through a fresh engine and stand-in: ``overcommit`` :data:`ALONE`, every request sent at
    once; None, the engine's default admission; else ``rollout.kv_overcommit``."""
    from transformers import AutoTokenizer

    from bapo.engines.admission import Admission
    from bapo.engines.vllm_server import VLLMServerRollout
    from bapo.engines.vllm_server_http import ServerError
    from tests.helpers.paths import TINY
    from tests.helpers.vllm_standin import Fake, KVScheduler, serve

    kv = KV_TOKENS // UNIT
    fake = Fake()
    fake.describe |= {"kv_tokens": kv, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": 64 + MAX_NEW // UNIT}
    fake.scheduler = KVScheduler(kv, MAX_NUM_SEQS, length, per_tick=4, tick_s=0.02)
    httpd, url = serve(fake)
    tok = AutoTokenizer.from_pretrained(str(TINY))
    kw = {} if overcommit in (None, ALONE) else {"kv_overcommit": overcommit}
    engine = VLLMServerRollout(str(TINY), tok, n=16, max_new_tokens=MAX_NEW // UNIT, url=url,
                               max_model_len=64 + MAX_NEW // UNIT, temperature=0.6, **kw)  # fmt: skip
    if overcommit == ALONE:  # every request at once: the stand-in's scheduler alone decides what runs
        engine.admission = Admission(None, 10**9)
    failed, seconds = 0, time.perf_counter()
    try:
        for b in range(batches):
            try:
                before = dict(fake.scheduler.occupancy)
                samples = engine.generate(prompts(count, seed=b), seed=1000 * b)
                assert len(samples) == 16 * count
                after = fake.scheduler.occupancy
                ticks = after["ticks"] - before["ticks"]
                running = (after["seq_ticks"] - before["seq_ticks"]) / max(1, ticks)
                print(f"  batch {b}: {ticks} ticks, {running:.1f} sequences running on average")
            except ServerError as e:
                failed += 1
                print(f"  batch {b} failed: {e}")
    finally:
        engine.close()
        httpd.shutdown()
        fake.scheduler.close()
    return fake.scheduler.occupancy | {"failed": failed, "wall_s": time.perf_counter() - seconds}


def main() -> None:
    ap = parser(__doc__, rounds=1, threads=None)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64, help="prompts a batch (n = 16 responses each)")
    ap.add_argument("--overcommit", type=float, nargs="*", default=[], help="rollout.kv_overcommit values to try "
                    "(none: the engine's default)")  # fmt: skip
    args = ap.parse_args()
    sample = [min(MAX_NEW, random.Random(i).lognormvariate(MU, SIGMA)) for i in range(100_000)]
    m1, m2 = sum(sample) / len(sample), sum(x * x for x in sample) / len(sample)
    print(f"lengths: mean {m1:.0f}, at the cap {sum(x >= MAX_NEW for x in sample) / len(sample):.0%}, held while "
          f"running on average {m2 / (2 * m1):.0f} tokens; KV cache {KV_TOKENS:,} tokens, max_num_seqs "
          f"{MAX_NUM_SEQS}; {args.batches} batches of {args.prompts} prompts x 16")  # fmt: skip
    variants = [("vLLM alone", ALONE)] + [(f"engine, kv_overcommit {o:g}", o) for o in args.overcommit]
    variants = variants if args.overcommit else [*variants, ("engine", None)]
    results = {name: run(o, args.batches, args.prompts) for name, o in variants}
    alone = results["vLLM alone"]["mean_running"]
    for name, r in results.items():
        print(f"{name:>28}: {r['mean_running']:6.1f} sequences running on average ({r['mean_running'] / alone:4.0%} "
              f"of vLLM alone), at most {r['most_running']}, KV cache {r['mean_kv_share']:4.0%} full, "
              f"{r['preemptions']} preemptions, {r['ticks']} ticks, {r['failed']} failed "
              f"({r['wall_s']:.0f} s here)")  # fmt: skip


if __name__ == "__main__":
    main()
