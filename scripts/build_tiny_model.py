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
subtracting column by column without borrowing; ``bapo.tasks.careless``), and
the error carries into later steps. The warm-started policy therefore knows
both procedures and mixes them, so its held-out accuracy starts low (20-40%),
and the outcome reward alone can teach it to carry, which is the kind of
behaviour RL on LLMs amplifies. The gold answers of the RL task are always
the right ones.

Usage:  python scripts/build_tiny_model.py [--out assets/tiny-math] [--target 0.3]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bapo.checkpoint import staged_folder  # noqa: E402
from bapo.data import DEFAULT_INSTRUCTION  # noqa: E402
from bapo.tasks import ArithSource, ArithSpec, arith_heldout, arith_problem, arith_solution, is_heldout  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

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


def render(problem: str, solution: str | None) -> str:
    user = f"<|im_start|>user\n{problem}\n{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    return user if solution is None else user + solution + "<|im_end|>\n"


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


def build_tokenizer(rng: random.Random, heldout: set[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["".join(curriculum_example(rng, heldout)) for _ in range(4000)]
    corpus += ["Put your final answer within \\boxed{}. Solve: compute the sum and the difference."] * 10
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_batch(tok, pairs: list[tuple[str, str]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a loss mask that covers only the assistant's solution (and its end token)."""
    ids, masks = [], []
    for prompt, sol in pairs:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        s = tok(sol + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids.append(p + s)
        masks.append([0] * len(p) + [1] * len(s))
    L = max(map(len, ids))
    pad = tok.pad_token_id
    x = torch.tensor([r + [pad] * (L - len(r)) for r in ids], device=device)
    m = torch.tensor([r + [0] * (L - len(r)) for r in masks], device=device, dtype=torch.float)
    return x, m


BOX = re.compile(r"\\boxed\{(-?\d+)\}")


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


def write_model_folder(folder: Path, model, tok, build_info: dict) -> None:
    """Save a built model into ``folder``: weights, tokenizer, build_info.json, and a generation config that
    samples at T = 1 (no top-k, no top-p) and stops at the tokenizer's end token, as the rollout engines do."""
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_k, gc.top_p = True, 1.0, 0, 1.0
    gc.eos_token_id, gc.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    (folder / "build_info.json").write_text(json.dumps(build_info, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "assets" / "tiny-math"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=384)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=2500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
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

    tok = build_tokenizer(rng, heldout, args.vocab)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"vocab={len(tok)} params={nparams / 1e6:.2f}M")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args.max_steps) / args.max_steps)),
    )
    t0, history = time.time(), []
    acc = sampled_accuracy(model, tok, heldout_problems, temperature=args.eval_temperature, n=2)
    history.append({"step": 0, "accuracy": acc})
    step = 0
    for step in range(1, args.max_steps + 1):
        x, m = encode_batch(tok, [curriculum_example(rng, heldout) for _ in range(args.batch)], "cpu")
        logits = model(input_ids=x).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
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
    out = Path(args.out)
    tok.padding_side = "left"
    with staged_folder(out) as tmp:
        write_model_folder(
            tmp,
            model,
            tok,
            {
                "built_by": "scripts/build_tiny_model.py",
                "args": vars(args),
                "params": nparams,
                "sft_steps": step,
                "heldout_sampled_accuracy": acc,
                "heldout_greedy_accuracy": greedy,
                "history": history,
                "seconds": round(time.time() - t0, 1),
            },
        )
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
