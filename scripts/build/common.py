"""What the model builders share: the ChatML tokenizer, the small Llama, the supervised steps, the bands a built
model is measured by, and its folder (weights, tokenizer, ``build_info.json``), written whole and read back.

``build_tiny_model.py`` (tiny-math), ``build_tiny_explore_model.py`` (tiny-explore, tiny-longcot, tiny-ramble) and
``warm_start_smollm2.py`` (a pretrained LM brought into the same band) use it; ``standin.py`` writes a hub cache
with the families' own tokenizers and shares none of it. Every function draws its randomness where the callers
did before it was shared (the tokenizer's corpus, then the model's initial weights), so a builder's assets are
byte for byte those it wrote when this code lived in each builder.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this tree's bapo, not an installed one

from bapo.algos import grpo_advantages, positive_contribution  # noqa: E402
from bapo.checkpoint import staged_folder  # noqa: E402
from bapo.data.loading import DEFAULT_INSTRUCTION  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOX = re.compile(r"\\boxed\{(-?\d+)\}")


def add_sft_flags(ap, *, max_steps: int, batch: int, lr: float, model: tuple[int, int, int] | None = None) -> None:
    """A supervised build's flags, in the order its ``build_info.json`` records them: ``--seed``, the model's
    ``--vocab``, ``--hidden`` and ``--layers`` when it is built here (``model``: their defaults), ``--max-steps``,
    ``--batch`` and ``--lr``."""
    ap.add_argument("--seed", type=int, default=0)
    if model is not None:
        vocab, hidden, layers = model
        ap.add_argument("--vocab", type=int, default=vocab)
        ap.add_argument("--hidden", type=int, default=hidden)
        ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--max-steps", type=int, default=max_steps)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--lr", type=float, default=lr)


def render(problem: str, solution: str | None) -> str:
    """A problem as the tiny models' ChatML prompt (no system turn), followed by ``solution`` and its end token."""
    user = f"<|im_start|>user\n{problem}\n{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    return user if solution is None else user + solution + "<|im_end|>\n"


def train_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (digits one per token) trained on ``corpus``, with the ChatML template and special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
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


def tiny_llama(tok, *, hidden: int, layers: int, positions: int) -> LlamaForCausalLM:
    """A small Llama over ``tok``'s vocabulary, its weights drawn from torch's generator. Untied embeddings: vLLM's
    weight reload needs an untied ``lm_head``."""
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(cfg)


def sft_optimizer(model, *, lr: float, max_steps: int, warm: int = 100):
    """AdamW with a linear warm-up over ``warm`` steps, then a cosine decay to 0 at ``max_steps``."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, max_steps) / max_steps)),
    )
    return opt, sched


def sft_step(model, opt, x: torch.Tensor, m: torch.Tensor, sched=None) -> torch.Tensor:
    """One supervised step on token ids ``x`` [B, L], the loss on the tokens where ``m`` [B, L] is 1 (the mean over
    them), the gradient clipped at norm 1. Returns the loss."""
    logits = model(input_ids=x).logits[:, :-1]  # [B, L-1, V]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # [B, L-1]
    loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if sched is not None:
        sched.step()
    return loss


def pad_batch(ids: list[list[int]], masks: list[list[int]], pad_id: int, device=None):
    """Rows of token ids and of loss masks, right-padded to the longest: (ids [B, L], float mask [B, L])."""
    width = max(map(len, ids))
    x = torch.tensor([r + [pad_id] * (width - len(r)) for r in ids], device=device)  # [B, L]
    m = torch.tensor([r + [0] * (width - len(r)) for r in masks], device=device, dtype=torch.float)  # [B, L]
    return x, m


def encode_batch(tok, pairs: list[tuple[str, str]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a loss mask that covers only the assistant's solution (and its end token)."""
    ids, masks = [], []
    for prompt, sol in pairs:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        s = tok(sol + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids.append(p + s)
        masks.append([0] * len(p) + [1] * len(s))
    return pad_batch(ids, masks, tok.pad_token_id, device)


@torch.no_grad()
def measure(
    model, tok, problems, *, n: int, max_new_tokens: int, prompt=None, chunk_size: int = 32
) -> dict[str, float]:
    """avg@n and pass@n at T = 1, and the mean entropy (nats) per sampled response token.

    ``prompt(problem) -> str`` renders a problem (default: :func:`render`, ChatML without a system turn).
    """
    prompt = prompt or (lambda p: render(p.problem, None))
    model.eval()
    tok.padding_side = "left"
    correct, lengths = [], []
    ent_sum = ent_tokens = 0.0
    truncated = 0
    for i in range(0, len(problems), chunk_size):
        chunk = problems[i : i + chunk_size]
        enc = tok([prompt(p) for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, enc["input_ids"].shape[1] :]  # [B*n, T]
        logp = torch.stack(out.scores, dim=1).log_softmax(-1)  # [B*n, T, V]
        ent = -(logp.exp() * logp).sum(-1)  # [B*n, T]
        # a response's tokens run up to and including its first end token; padding after it is not counted
        ended = (new == tok.eos_token_id).long().cumsum(1)
        live = (ended == 0) | ((ended == 1) & (new == tok.eos_token_id))
        ent_sum += (ent * live).sum().item()
        ent_tokens += live.sum().item()
        lengths += live.sum(1).tolist()
        truncated += (ended[:, -1] == 0).sum().item()  # no end token within max_new_tokens
        texts = tok.batch_decode(new, skip_special_tokens=True)
        for j, t in enumerate(texts):
            m = BOX.findall(t)
            correct.append(bool(m) and m[-1] == chunk[j // n].answer)
    model.train()
    per_problem = [correct[k : k + n] for k in range(0, len(correct), n)]
    return {
        f"avg@{n}": sum(correct) / len(correct),
        f"pass@{n}": sum(any(c) for c in per_problem) / len(per_problem),
        "entropy_per_token": ent_sum / max(ent_tokens, 1),
        # response tokens of the right and of the wrong responses, over all problems
        "mean_tokens_right": sum(k for k, c in zip(lengths, correct, strict=True) if c) / max(sum(correct), 1),
        "mean_tokens_wrong": sum(k for k, c in zip(lengths, correct, strict=True) if not c)
        / max(len(correct) - sum(correct), 1),
        "truncated": truncated / len(correct),  # responses cut at max_new_tokens (the ramble mode's share)
        **token_balance(correct, lengths, n),
    }


def token_balance(correct: list[bool], lengths: list[int], n: int) -> dict[str, float]:
    """What a GRPO update sees of the length gap between right and wrong responses.

    Samples come in groups of ``n`` per problem. Only groups with both right and wrong responses
    ("mixed") carry a GRPO advantage, so a length gap between problems (hard ones long and all wrong)
    never reaches the update. Over the mixed groups: the mean tokens of a right and of a wrong response,
    and ``grpo_rho``, the positive share BAPO's search compares with rho0 (``bapo.algos.positive_contribution``
    at ratio 1, unweighted): every response token carries its response's group-normalised advantage.
    """
    if not correct or len(correct) % n or len(lengths) != len(correct):
        raise ValueError(f"token_balance: {len(correct)} results and {len(lengths)} lengths in groups of {n}")
    adv = grpo_advantages([float(c) for c in correct], n)  # [B]
    width = max(max(lengths), 1)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()  # [B, T]
    tokens_adv = adv[:, None].double().expand(-1, width) * mask  # [B, T]
    p, q = positive_contribution(
        torch.ones_like(mask), tokens_adv, mask, torch.zeros_like(mask), ratio_low=0.0, ratio_high=1.0, weight="none"
    )
    groups = [range(k, k + n) for k in range(0, len(correct), n)]
    mixed = [i for g in groups if 0 < sum(correct[i] for i in g) < n for i in g]
    right = [lengths[i] for i in mixed if correct[i]]
    wrong = [lengths[i] for i in mixed if not correct[i]]
    nan = float("nan")
    mean_right = sum(right) / len(right) if right else nan
    mean_wrong = sum(wrong) / len(wrong) if wrong else nan
    return {
        "mixed_groups": len(mixed) // n,
        "mean_tokens_right_mixed": mean_right,
        "mean_tokens_wrong_mixed": mean_wrong,
        "wrong_right_mixed": mean_wrong / mean_right if right and wrong else nan,  # the within-group length gap
        "grpo_rho": (p / (p + q)).item() if p + q > 0 else nan,
    }


def save_model(out: Path, model, tok, build_info: dict, write_more=None) -> None:
    """Write a built model into ``out``, whole or not at all (a staged folder, then a rename): weights, tokenizer,
    ``build_info.json``, a generation config that samples at T = 1 (no top-k, no top-p) and stops at the
    tokenizer's end token, as the rollout engines do, and what ``write_more(folder)`` adds (a task's problems)
    before them."""
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_k, gc.top_p = True, 1.0, 0, 1.0
    gc.eos_token_id, gc.pad_token_id = tok.eos_token_id, tok.pad_token_id
    tok.padding_side = "left"  # as the engines pad a batch of prompts
    with staged_folder(out) as folder:
        if write_more is not None:
            write_more(folder)
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        (folder / "build_info.json").write_text(json.dumps(build_info, indent=2) + "\n")
    print(f"saved to {out}")


def read_build_info(path: Path, built_by: str) -> dict:
    """``path``'s build_info.json, refused (SystemExit, naming why) unless the script ``built_by`` wrote the folder.
    The script is matched by its file name: the builders moved into scripts/build/, and a folder built before
    still names them at scripts/."""
    info_file = path / "build_info.json"
    if not info_file.is_file():
        raise SystemExit(f"--measure: {info_file} not found (a folder written by {built_by})")
    info = json.loads(info_file.read_text())
    if Path(info.get("built_by") or "").name != Path(built_by).name:
        raise SystemExit(f"--measure: {info_file} says built_by {info.get('built_by')!r}, not {built_by}")
    return info
