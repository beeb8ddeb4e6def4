"""Build the exploration testbed, ``assets/tiny-explore``: a model and its ``mixops`` task.

The shipped tiny model (``scripts/build/build_tiny_model.py``) is near-deterministic per token
(0.02 nats) and starts near 50% accuracy, so the positive share of its updates is about 0.5
and there is no entropy to lose (docs/study/v1/README.md). This testbed is built to start where
off-policy RL on LLMs starts: mostly wrong, uncertain, with room to learn.

The task (``bapo.data.tasks.mixed_problem``): expressions of 3-5 operands with ``+``, ``-`` and ``*``
and the usual precedence ("What is 12 + 8 * 7 - 20?"). The worked solutions do the products
first, in a random order, then either go left to right or add the positive and the negative
terms apart and take the difference: every solution is correct, but length and order vary.
The gold answer is an integer, graded by the ordinary reward stage (``reward=math``).

Steps, all deterministic under ``--seed``:
1. Write the task's problem sets: ``train.jsonl`` and ``heldout.jsonl``, split by a hash
   of the problem text (``bapo.data.tasks.is_heldout``), so they never overlap.
2. Train a byte-level BPE tokenizer (digits one per token) with a ChatML template.
3. Build a small Llama (untied embeddings, for vLLM's weight reload).
4. Supervised warm start on correct worked solutions, stopped early: as soon as the
   sampled held-out accuracy (T = 1) reaches ``--target``. An early-stopped model is
   uncertain about digits and about which strategy to follow, so its per-token entropy
   is high and its accuracy low: no teacher mistakes are needed (the tiny model's
   careless teacher is not used here).
5. Measure the bands the testbed promises, on the held-out set at T = 1 with 8 samples
   per problem: avg@8, pass@8 and the mean entropy per response token; they go into
   ``build_info.json``.

The long-chain-of-thought testbed, ``assets/tiny-longcot`` (study v3), is the same build with half the
solutions in a long, slip-prone style (products by repeated addition, ``bapo.data.tasks.mixed_long_lines``)
and every ``a+b`` / ``a*b`` step written in either order at random (``commute``). Long solutions fail
more often, so the model's wrong responses are longer than its right ones (about 1.7x), and the
commuted steps keep it uncertain per token (0.30 nats) at the same accuracy. Without ``--commute`` the
entropy at 12% accuracy was 0.26 (docs/study/README.md lists the attempts).

The rambling testbed, ``assets/tiny-ramble`` (study v4), puts the length gap inside a problem's group instead:
a fixed share of the solutions (``--ramble-share``), drawn alike for every problem, never box an answer; after
the first attempt they start another, and another, and the warm start fits them cut at ``--max-new-tokens`` with
no end token (:func:`ramble`, :func:`encode_sft`). About a third of the model's samples then run to the cap, on
easy and hard problems alike, so GRPO's positive share at step 0 (``grpo_rho``) is about 0.4, the paper's.
``--measure`` prints it with the within-group length ratio (``wrong_right_mixed``) and the truncated share.

Usage:  python scripts/build/build_tiny_explore_model.py [--out assets/tiny-explore] [--target 0.12]
        python scripts/build/build_tiny_explore_model.py --out assets/tiny-longcot --long-share 0.5 --commute \
            --max-new-tokens 128 --positions 384
        python scripts/build/build_tiny_explore_model.py --out assets/tiny-ramble --commute --ramble-share 0.28 \
            --max-new-tokens 56
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from bapo.data.tasks import (  # noqa: E402
    MixedSpec,
    is_heldout,
    mixed_lines,
    mixed_long_lines,
    mixed_problem,
    mixed_solution,
    mixed_split,
)
from scripts.build.common import (  # noqa: E402
    ROOT,
    add_sft_flags,
    measure,
    pad_batch,
    read_build_info,
    render,
    save_model,
    sft_optimizer,
    sft_step,
    tiny_llama,
    train_tokenizer,
)

BUILT_BY = "scripts/build/build_tiny_explore_model.py"
SPEC = MixedSpec(min_terms=3, max_terms=5, max_value=20, max_factor=9, p_mul=0.35)
HELDOUT_FRAC = 0.1  # as conf/data/mixops.yaml
SPLIT_SEED = 1234
N_TRAIN = 20_000
N_HELDOUT = 500


LINE = re.compile(r"^(\d+)([+*])(\d+)=(-?\d+)$")


def commute(lines: list[str], rng: random.Random) -> list[str]:
    """Write each ``a+b=c`` or ``a*b=c`` line (non-negative operands) as ``b+a=c`` with probability 1/2.

    A free choice the model keeps at every such step, and none of them changes the answer: a warm start
    on these solutions stays uncertain per token (entropy) without being any less right.
    """
    out = []
    for line in lines:
        m = LINE.match(line)
        out.append(f"{m[3]}{m[2]}{m[1]}={m[4]}" if m and rng.random() < 0.5 else line)
    return out


def sft_problem(
    rng: random.Random,
    long_share: float = 0.0,
    random_base: bool = False,
    commuted: bool = False,
    ramble_share: float = 0.0,
    ramble_chars: int = 0,
) -> tuple[str, str]:
    """A training-split problem's text (never one that hashes into the held-out split) and a worked solution.

    With ``long_share`` > 0, that share of the solutions is the long, slip-prone style
    (``bapo.data.tasks.mixed_long_lines``). With ``ramble_share`` > 0, that share, drawn alike for every problem,
    never boxes an answer: after its first attempt it starts another, and another, until it is at least
    ``ramble_chars`` characters long (:func:`ramble`; :func:`encode_sft` cuts it at the token cap, with no end
    token). At 0 neither makes an extra random draw, so the tiny-explore and tiny-longcot builds are unchanged.
    """
    while True:
        expr, lines, value = mixed_problem(rng, SPEC)
        text = f"What is {expr}?"
        if not is_heldout(text, HELDOUT_FRAC):
            if long_share > 0 and rng.random() < long_share:
                lines, value = mixed_long_lines(expr, rng if random_base else None)
            if commuted:
                lines = commute(lines, rng)
            if ramble_share > 0 and rng.random() < ramble_share:
                return text, ramble(expr, lines, rng, min_chars=ramble_chars, commuted=commuted)
            return text, mixed_solution(lines, value)


def ramble(expr: str, lines: list[str], rng: random.Random, *, min_chars: int, commuted: bool) -> str:
    """A worked solution that never concludes: ``lines`` (a first attempt), then fresh attempts at the same
    expression (``bapo.data.tasks.mixed_lines``, commuted like the first), one after another, and no box.

    Every line is true; what makes it wrong is that it never answers, and it runs on to the length cap,
    like a long-CoT model's rechecking loop that is cut off by ``max_new_tokens``. The attempts are fresh
    random strategies, so the ramble is as uncertain per token as a concluding solution.
    """
    out = list(lines)
    while sum(len(line) + 1 for line in out) < min_chars:
        more, _ = mixed_lines(expr, rng)
        out += commute(more, rng) if commuted else more
    return "\n".join(out)


def is_ramble(solution: str) -> bool:
    """A warm-start solution that never boxes its answer (:func:`ramble`)."""
    return "\\boxed{" not in solution


def sft_example(rng: random.Random, *style) -> tuple[str, str]:
    """:func:`sft_problem` (``style``: its other arguments) with the problem rendered as this tokenizer's prompt."""
    text, solution = sft_problem(rng, *style)
    return render(text, None), solution


def encode_sft(tok, pairs: list[tuple[str, str]], max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and the loss mask over the solutions, as ``common.encode_batch``; a ramble
    (:func:`is_ramble`) is cut at ``max_new_tokens`` and gets no end token, so the model learns that this
    mode runs to the cap. Batches without a ramble give exactly ``encode_batch``'s tensors.
    """
    ids, masks = [], []
    for prompt, sol in pairs:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        if is_ramble(sol):
            s = tok(sol, add_special_tokens=False)["input_ids"][:max_new_tokens]
        else:
            s = tok(sol + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids.append(p + s)
        masks.append([0] * len(p) + [1] * len(s))
    return pad_batch(ids, masks, tok.pad_token_id)


def sft_corpus(rng: random.Random) -> list[str]:
    """The tokenizer's training text: rendered warm-start examples in the plain style."""
    return ["".join(sft_example(rng)) for _ in range(4000)]


def measure_built(path: Path, *, seed: int = 0) -> dict[str, float]:
    """The final bands of a built model, measured again: 200 held-out problems x 8, with its own max_new_tokens."""
    info = read_build_info(path, BUILT_BY)  # not another task's model (tiny-math): mixops bands mean nothing there
    model, tok = LlamaForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    heldout = mixed_split(N_HELDOUT, seed=SPLIT_SEED, split="heldout", heldout_frac=HELDOUT_FRAC, spec=SPEC)
    torch.manual_seed(seed)
    max_new_tokens = info["args"].get("max_new_tokens", 64)  # builds before the flag generated 64 tokens
    return measure(model, tok, heldout[:200], n=8, max_new_tokens=max_new_tokens)


def write_jsonl(path: Path, problems) -> None:
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "assets" / "tiny-explore"))
    add_sft_flags(ap, model=(384, 96, 2), max_steps=3000, batch=32, lr=4e-3)
    ap.add_argument("--target", type=float, default=0.12, help="stop once the sampled held-out accuracy reaches this")
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--long-share", type=float, default=0.0, help="share of long, slip-prone solutions (tiny-longcot)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="as the model's conf/model/*.yaml")
    ap.add_argument("--random-base", action="store_true", help="long style: add either factor, at random")
    ap.add_argument("--commute", action="store_true", help="write a+b / a*b steps in either order, at random")
    ap.add_argument("--positions", type=int, default=256, help="max_position_embeddings")
    ap.add_argument(
        "--ramble-share", type=float, default=0.0, help="share of solutions that never box and run to the cap"
    )
    ap.add_argument("--measure", metavar="DIR", help="build nothing: measure a built model's bands and print them")
    args = ap.parse_args()
    for flag, share in (("--long-share", args.long_share), ("--ramble-share", args.ramble_share)):
        if not 0.0 <= share <= 1.0:
            ap.error(f"{flag} is a share of the solutions, in [0, 1]; got {share}")
    if args.measure:
        print(json.dumps(measure_built(Path(args.measure), seed=args.seed), indent=1))
        return

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    heldout = mixed_split(N_HELDOUT, seed=SPLIT_SEED, split="heldout", heldout_frac=HELDOUT_FRAC, spec=SPEC)
    train = mixed_split(N_TRAIN, seed=SPLIT_SEED, split="train", heldout_frac=HELDOUT_FRAC, spec=SPEC)
    assert not {p.problem for p in heldout} & {p.problem for p in train}
    probe = heldout[:200]  # what the early stop watches

    tok = train_tokenizer(sft_corpus(rng), args.vocab)
    model = tiny_llama(tok, hidden=args.hidden, layers=args.layers, positions=args.positions)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"vocab={len(tok)} params={nparams / 1e6:.2f}M", flush=True)
    opt, sched = sft_optimizer(model, lr=args.lr, max_steps=args.max_steps)
    t0, history, step = time.time(), [], 0
    for step in range(1, args.max_steps + 1):
        style = (args.long_share, args.random_base, args.commute, args.ramble_share, 2 * args.max_new_tokens)
        batch = [sft_example(rng, *style) for _ in range(args.batch)]
        loss = sft_step(model, opt, *encode_sft(tok, batch, args.max_new_tokens), sched)
        if step % args.eval_every == 0:
            torch.manual_seed(args.seed + step)  # the probe's samples depend on the step only
            probe_stats = measure(model, tok, probe, n=2, max_new_tokens=args.max_new_tokens)
            history.append({"step": step, "loss": round(loss.item(), 4), **probe_stats})
            print(f"step {step:5d} loss {loss.item():.4f} {probe_stats} [{time.time() - t0:.0f}s]", flush=True)
            if probe_stats["avg@2"] >= args.target:
                break

    torch.manual_seed(args.seed)
    bands = measure(model, tok, heldout[:200], n=8, max_new_tokens=args.max_new_tokens)
    print(f"final: step {step} {bands}", flush=True)
    out = Path(args.out)

    def write_task(folder: Path) -> None:
        write_jsonl(folder / "train.jsonl", train)
        write_jsonl(folder / "heldout.jsonl", heldout)

    info = {
        "built_by": BUILT_BY,
        "args": vars(args) | {"out": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else args.out},
        "task": {"spec": vars(SPEC), "train": N_TRAIN, "heldout": N_HELDOUT, "split_seed": SPLIT_SEED},
        "params": nparams,
        "sft_steps": step,
        "heldout_bands_T1_n8_first200": bands,
        "history": history,
    }
    save_model(out, model, tok, info | {"seconds": round(time.time() - t0, 1)}, write_more=write_task)


if __name__ == "__main__":
    main()
