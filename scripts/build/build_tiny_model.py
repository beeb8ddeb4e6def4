"""Build the embedded default model, ``assets/tiny-math``.

Three steps, all deterministic under ``--seed``:
1. Train a byte-level BPE tokenizer (digits split one per token) on rendered
   curriculum text and wrap it as a ``PreTrainedTokenizerFast`` with a ChatML
   chat template.
2. Build a small Llama-architecture causal LM with untied input/output
   embeddings (vLLM's weight reload needs an untied ``lm_head``).
3. Supervised warm-start on a synthetic arithmetic curriculum whose worked
   solutions end in ``\\boxed{answer}``.

Why the warm-start teacher is careless: the RL task needs headroom. A model
that is simply under-trained makes confident, unsystematic errors that a few
minutes of RL cannot fix. Instead, the teacher's worked solutions do each step
carelessly with probability ``--slip-rate`` (adding without carrying,
subtracting column by column without borrowing; ``bapo.data.tasks.careless``), and
the error carries into later steps. The warm-started policy therefore knows
both procedures and mixes them, so its held-out accuracy starts low (20-40%),
and the outcome reward alone can teach it to carry, which is the kind of
behaviour RL on LLMs amplifies. The gold answers of the RL task are always
the right ones.

Usage:  python scripts/build/build_tiny_model.py [--out assets/tiny-math] [--target 0.3]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from bapo.data.tasks import ArithSource, ArithSpec, arith_heldout, arith_problem, arith_solution, is_heldout  # noqa: E402
from scripts.build.common import (  # noqa: E402
    BOX,
    ROOT,
    add_sft_flags,
    encode_batch,
    render,
    save_model,
    sft_optimizer,
    sft_step,
    tiny_llama,
    train_tokenizer,
)

BUILT_BY = "scripts/build/build_tiny_model.py"

# The curriculum: easy single-digit sums up to the RL task's own family.
CURRICULUM = [
    (0.2, ArithSpec(min_terms=2, max_terms=2, min_value=1, max_value=9)),
    (0.3, ArithSpec(min_terms=2, max_terms=2, min_value=1, max_value=50)),
    (0.5, ArithSpec()),  # the RL task's family (train split only)
]
RL_SPEC = ArithSpec()
HELDOUT_FRAC = 0.1  # as conf/data/arith.yaml
HELDOUT_SEED = 1234
SLIP_RATE = 0.85  # set from --slip-rate


def curriculum_example(rng: random.Random, heldout: set[str]) -> tuple[str, str]:
    r, acc = rng.random(), 0.0
    for w, spec in CURRICULUM:  # noqa: B007 (spec is used after the loop)
        acc += w
        if r <= acc:
            break
    while True:
        expr, steps, ans = arith_problem(rng, spec, slip_rate=SLIP_RATE)
        text = f"What is {expr}?"
        if text not in heldout and not is_heldout(text, HELDOUT_FRAC):
            return render(text, None), arith_solution(steps, ans)


def curriculum_corpus(rng: random.Random, heldout: set[str]) -> list[str]:
    """The tokenizer's training text: rendered curriculum examples and the instruction's words."""
    corpus = ["".join(curriculum_example(rng, heldout)) for _ in range(4000)]
    return corpus + ["Put your final answer within \\boxed{}. Solve: compute the sum and the difference."] * 10


@torch.no_grad()
def sampled_accuracy(model, tok, problems, *, temperature: float, n: int) -> float:
    model.eval()
    tok.padding_side = "left"
    correct = total = 0
    for i in range(0, len(problems), 64):
        chunk = problems[i : i + 64]
        enc = tok(
            [render(p.problem, None) for p in chunk],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        out = model.generate(
            **enc,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=0,
            top_p=1.0,
            max_new_tokens=48,
            num_return_sequences=n,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for j, t in enumerate(texts):
            m = BOX.findall(t)
            correct += int(bool(m) and m[-1] == chunk[j // n].answer)
            total += 1
    model.train()
    return correct / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "assets" / "tiny-math"))
    add_sft_flags(ap, model=(384, 128, 4), max_steps=2500, batch=64, lr=2e-3)
    ap.add_argument("--slip-rate", type=float, default=0.85, help="share of careless steps in the teacher's solutions")
    ap.add_argument("--target", type=float, default=None, help="optional early stop at this sampled accuracy")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-temperature", type=float, default=1.0)
    args = ap.parse_args()

    global SLIP_RATE
    SLIP_RATE = args.slip_rate
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    # The RL task's held-out problems (same split and seed as conf/data/arith.yaml).
    heldout_problems = arith_heldout(200, seed=HELDOUT_SEED, heldout_frac=HELDOUT_FRAC, spec=RL_SPEC)
    # Every problem whose text hashes into the held-out split is excluded from the
    # curriculum (curriculum_example); the explicit set is a second guard.
    heldout = {p.problem for p in heldout_problems}
    train_src = ArithSource(seed=args.seed, split="train", heldout_frac=HELDOUT_FRAC, spec=RL_SPEC)
    assert all(next(train_src).problem not in heldout for _ in range(1000))

    tok = train_tokenizer(curriculum_corpus(rng, heldout), args.vocab)
    model = tiny_llama(tok, hidden=args.hidden, layers=args.layers, positions=256)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"vocab={len(tok)} params={nparams / 1e6:.2f}M")
    opt, sched = sft_optimizer(model, lr=args.lr, max_steps=args.max_steps)
    t0, history = time.time(), []
    acc = sampled_accuracy(model, tok, heldout_problems, temperature=args.eval_temperature, n=2)
    history.append({"step": 0, "accuracy": acc})
    step = 0
    for step in range(1, args.max_steps + 1):
        x, m = encode_batch(tok, [curriculum_example(rng, heldout) for _ in range(args.batch)])
        loss = sft_step(model, opt, x, m, sched)
        if step % args.eval_every == 0:
            acc = sampled_accuracy(model, tok, heldout_problems, temperature=args.eval_temperature, n=2)
            history.append({"step": step, "loss": round(loss.item(), 4), "accuracy": acc})
            print(
                f"step {step:5d} loss {loss.item():.4f} heldout acc (T={args.eval_temperature}) {acc:.3f} "
                f"[{time.time() - t0:.0f}s]",
                flush=True,
            )
            if args.target is not None and acc >= args.target:
                break

    greedy = sampled_accuracy(model, tok, heldout_problems, temperature=0.0, n=1)
    print(f"final: step {step} sampled acc {acc:.3f} greedy acc {greedy:.3f}")
    info = {"built_by": BUILT_BY, "args": vars(args), "params": nparams, "sft_steps": step}
    info |= {"heldout_sampled_accuracy": acc, "heldout_greedy_accuracy": greedy, "history": history}
    save_model(Path(args.out), model, tok, info | {"seconds": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
