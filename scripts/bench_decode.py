"""Decode throughput of the HF engine's two paths: the lean loop against HF ``generate``.

For each model (the shipped tiny model, and SmolLM2-135M when its converted folder exists:
``make smollm2``), both paths sample ``n`` responses for the same arithmetic prompts at
temperature 1 with the same seeds, in interleaved rounds, in this one process; it prints the
median and best tokens/s of each, their ratio, and the mean response length of each (the paths
sample the same distribution with different random draws, so the lengths should be close).
Defaults: 32 prompts x 8 = 256 sequences, 48 new tokens, 2 torch threads.

    python scripts/bench_decode.py [--models tiny,smollm2_135m] [--prompts 32] [--n 8]
                                   [--max-new-tokens 48] [--rounds 5] [--threads 2]

On a shared machine the best round is the steadier figure: other processes only ever slow a round down.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bapo.data import render_prompt  # noqa: E402
from bapo.modeling import load_model, load_tokenizer, model_path  # noqa: E402
from bapo.rollout import HFRollout  # noqa: E402
from bapo.tasks import ArithSpec, arith_heldout  # noqa: E402

PATHS = ("lean", "generate")


def resolve_model(name: str) -> str | None:
    """The local folder of conf/model/<name>.yaml, or None if it is not there (nothing downloads)."""
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    gguf = cfg.get("gguf")
    try:
        path = model_path(cfg.name_or_path, gguf.package if gguf else None, gguf.file if gguf else None)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"[{name}] skipped: {e}")
        return None
    path = path if Path(path).is_absolute() else str(ROOT / path)
    if not (Path(path) / "config.json").exists():
        print(f"[{name}] skipped: no model at {path}")
        return None
    return path


def tokens_per_s(engine: HFRollout, prompts, seed: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    samples = engine.generate(prompts, seed=seed)
    return sum(len(s.response_ids) for s in samples) / (time.perf_counter() - t0), samples


def bench(name: str, args) -> dict | None:
    path = resolve_model(name)
    if path is None:
        return None
    tok = load_tokenizer(path)
    spec = ArithSpec() if name == "tiny" else ArithSpec(max_value=20, max_terms=2)
    prompts = [render_prompt(p, tok) for p in arith_heldout(args.prompts, seed=1, heldout_frac=0.1, spec=spec)]
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
    med = {d: statistics.median(v) for d, v in rates.items()}
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2_135m", help="conf/model names, comma-separated")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        bench(name.strip(), args)


if __name__ == "__main__":
    main()
