"""A stand-in checkpoint served under a hub id: what ``hf download <id>`` leaves in the HF cache, made offline.

It writes ``<cache>/models--<org>--<name>/`` the way ``huggingface_hub`` does (``refs/main`` naming a revision,
``snapshots/<rev>/`` holding relative symlinks into ``blobs/``), with:

- a Qwen2-architecture causal LM (``model_type: qwen2``, untied embeddings, bf16, random weights from a seed),
  in the shape the arguments give: tiny for the CPU rehearsal (``tests/e2e/test_rehearsal.py``), the published
  shape for ``scripts/gpu/gpu_check.py``; safetensors in several shards with an index, as the 7B repositories are;
- the family's ``generation_config.json`` (its sampling defaults, which the rollout engines must ignore);
- the family's tokenizer class and chat template: ``Qwen/Qwen2.5-*-Instruct`` (``Qwen2Tokenizer``, ChatML
  ``<|im_start|>``/``<|im_end|>``, ``<|endoftext|>`` as padding, the default system prompt) or
  ``deepseek-ai/DeepSeek-R1-Distill-Qwen-*`` (``LlamaTokenizerFast`` declared over a byte-level BPE, BOS/EOS
  ``<｜begin▁of▁sentence｜>``/``<｜end▁of▁sentence｜>``, ``<｜User｜>``/``<｜Assistant｜>`` turns, a ``<think>``
  generation prompt). Its vocabulary is a small byte-level BPE trained here on a few KB of math text, with
  the family's pre-tokenizer (digits one per token), so any text encodes and decodes exactly; the special
  tokens follow it, and the model's vocabulary is padded beyond the tokenizer's, as the real ones are.

Random weights never box an answer, so every reward is 0 and an RL update has no signal. ``boxed_answers``
(the rehearsal's ``"123"``) gives the stand-in a few supervised steps that teach it to answer ``\\boxed{d}``
right after the family's generation prompt, with ``d`` drawn from those characters: then rewards differ
within a group of responses, advantages are not 0, and the weights move.

The templates are written for this project from the families' documented prompt formats.

    python scripts/build/standin.py --cache /tmp/hub deepseek-ai/DeepSeek-R1-Distill-Qwen-7B
    HF_HUB_CACHE=/tmp/hub HF_HUB_OFFLINE=1 python train.py experiment=paper_7b ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# ChatML with Qwen2.5-Instruct's default system prompt (used when the conversation brings none).
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}"
    "{%- set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{%- set turns = messages %}"
    "{%- endif %}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- for message in turns %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# DeepSeek-R1's format: BOS, the system prompt bare, <｜User｜>/<｜Assistant｜> turns, an assistant turn ends with
# EOS and keeps only what follows its reasoning (</think>), and the generation prompt opens the reasoning.
R1_TEMPLATE = (
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] %}{%- endif %}"
    "{%- endfor %}"
    "{{- bos_token + ns.system }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Family:
    """What a model family's tokenizer and configs look like on the hub."""

    name: str
    tokenizer_class: str  # as tokenizer_config.json declares it
    chat_template: str
    special: tuple[str, ...]  # added after the BPE vocabulary, in this order
    plain_added: tuple[str, ...]  # added tokens that are not special (kept by decode)
    bos: str | None
    eos: str
    pad: str
    add_bos: bool  # the tokenizer's post-processor prepends bos
    generation: dict = field(default_factory=dict)  # sampling defaults of generation_config.json
    extra_eos: tuple[str, ...] = ()  # more eos ids of generation_config.json (Qwen: <|endoftext|>)
    config_bos: str | None = None  # config.json's bos_token_id, when it is not the tokenizer's bos
    vocab_files: bool = False  # the repository also ships vocab.json and merges.txt


QWEN = Family(
    name="qwen2.5-instruct",
    tokenizer_class="Qwen2Tokenizer",
    chat_template=QWEN_TEMPLATE,
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    plain_added=("<tool_call>", "</tool_call>"),
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    add_bos=False,
    generation={"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
    extra_eos=("<|endoftext|>",),
    config_bos="<|endoftext|>",
    vocab_files=True,
)
R1_DISTILL = Family(
    name="r1-distill-qwen",
    tokenizer_class="LlamaTokenizerFast",
    chat_template=R1_TEMPLATE,
    special=("<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>"),
    plain_added=("<think>", "</think>"),
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    pad="<｜end▁of▁sentence｜>",
    add_bos=True,
    generation={"do_sample": True, "temperature": 0.6, "top_p": 0.95},
)
FAMILIES = {f.name: f for f in (QWEN, R1_DISTILL)}


def family_of(repo_id: str) -> Family:
    """The family of a hub id: DeepSeek-R1-Distill-Qwen-* or Qwen2.5-* (the GPU model configs' ids)."""
    name = repo_id.split("/")[-1].lower()
    if name.startswith("deepseek-r1-distill-qwen"):
        return R1_DISTILL
    if name.startswith("qwen2.5"):
        return QWEN
    raise ValueError(f"{repo_id}: no stand-in family (known: DeepSeek-R1-Distill-Qwen-*, Qwen2.5-*)")


# A few KB of math text in the style of the training and evaluation sets, for the BPE's merges.
CORPUS = r"""
Please reason step by step, and put your final answer within \boxed{}.
Put the final answer in \boxed{}.
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.
Let $f(x) = 3x^2 - 5x + 2$. Find $f(4)$. We compute $f(4) = 3 \cdot 16 - 20 + 2 = 30$, so the answer is $\boxed{30}$.
A rectangle has a perimeter of 56 meters and its length is three times its width. What is its area?
Let the width be $w$. Then $2(3w + w) = 56$, so $w = 7$ and the length is $21$. The area is $7 \cdot 21 = \boxed{147}$.
How many positive divisors does $360$ have? Since $360 = 2^3 \cdot 3^2 \cdot 5$, it has $(3+1)(2+1)(1+1) = \boxed{24}$.
Find the remainder when $2^{100}$ is divided by $7$. The powers of 2 modulo 7 repeat with period 3, and
$100 = 3 \cdot 33 + 1$, so $2^{100} \equiv 2 \pmod{7}$. The remainder is $\boxed{2}$.
Solve for $x$: $\frac{x}{3} + \frac{x}{4} = 14$. Multiplying by 12 gives $7x = 168$, so $x = \boxed{24}$.
The sum of an arithmetic sequence with first term $a_1 = 5$ and common difference $d = 3$ over $n = 20$ terms
is $S = \frac{n}{2}(2a_1 + (n-1)d) = 10(10 + 57) = \boxed{670}$.
In triangle $ABC$, $AB = 13$, $BC = 14$ and $CA = 15$. Find the area of the triangle. By Heron's formula with
$s = 21$, the area is $\sqrt{21 \cdot 8 \cdot 7 \cdot 6} = \sqrt{7056} = \boxed{84}$.
Compute $\binom{10}{3}$. We have $\binom{10}{3} = \frac{10 \cdot 9 \cdot 8}{3 \cdot 2 \cdot 1} = \boxed{120}$.
What is the least common multiple of $12$, $18$ and $30$? The prime factorizations give $2^2 \cdot 3^2 \cdot 5$,
which is $\boxed{180}$.
If $x + y = 10$ and $xy = 21$, what is $x^2 + y^2$? We have $x^2 + y^2 = (x+y)^2 - 2xy = 100 - 42 = \boxed{58}$.
Let $z = 1 + i$. Compute $z^8$. Since $z^2 = 2i$, $z^8 = (2i)^4 = 16$, so the answer is $\boxed{16}$.
Find the number of ordered pairs $(a, b)$ of positive integers with $a + b = 12$. There are $\boxed{11}$.
The probability that a fair die shows an even number twice in a row is $\frac{1}{2} \cdot \frac{1}{2} =
\boxed{\frac{1}{4}}$.
Evaluate $\sum_{k=1}^{10} k^2 = \frac{10 \cdot 11 \cdot 21}{6} = \boxed{385}$.
Convert the point $(0, 3)$ in rectangular coordinates to polar coordinates: $\left( 3, \frac{\pi}{2} \right)$.
<think>
Okay, so I need to find the value. Let me think. First, I add the two numbers, then I check the result.
Wait, let me double-check: 17 + 25 = 42. Yes, that is right.
</think>
The answer is $\boxed{42}$.
Every morning Aya walks 9 kilometers. At $s$ kilometers per hour the walk takes 4 hours; at $s + 2$ it takes
2 hours and 24 minutes. Then $\frac{9}{s} - \frac{9}{s+2} = 1.6$, so $s = 2.5$ and the answer is $\boxed{204}$.
Find the sum of all integer bases $b > 9$ for which $17_b$ is a divisor of $97_b$. The answer is $\boxed{70}$.
"""


def train_bpe(family: Family, vocab_size: int = 512):
    """A byte-level BPE with the family's normaliser, pre-tokenizer and decoder, trained on :data:`CORPUS`,
    with the family's added tokens after its vocabulary (a ``tokenizers.Tokenizer``)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # the Qwen2 family's split

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line], trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain_added])
    if family.add_bos:
        bos = (family.bos, tok.token_to_id(family.bos))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos}:0 $A:0", pair=f"{family.bos}:0 $A:0 {family.bos}:1 $B:1", special_tokens=[bos]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(family: Family, tok) -> dict:
    """tokenizer_config.json as the family's repositories write it (the chat template inside it)."""
    added = {}
    for t in (*family.special, *family.plain_added):
        special = t in family.special
        added[str(tok.token_to_id(t))] = dict(
            content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=special
        )
    cfg = {
        "add_bos_token": family.add_bos,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": family.bos,
        "chat_template": family.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": family.eos,
        "model_max_length": 16384 if family is R1_DISTILL else 131072,
        "pad_token": family.pad,
        "tokenizer_class": family.tokenizer_class,
        "unk_token": None,
    }
    if family is QWEN:
        cfg |= {"errors": "replace", "split_special_tokens": False, "additional_special_tokens": list(family.special)}
    else:
        cfg |= {"legacy": True, "sp_model_kwargs": {}, "use_default_system_prompt": False}
    return cfg


def pad_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def model_config(family: Family, tok, *, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                 num_attention_heads: int, num_key_value_heads: int, max_position_embeddings: int,
                 vocab_size: int | None, rope_theta: float) -> dict:  # fmt: skip
    """config.json fields of a Qwen2 causal LM with the family's token ids (vocabulary padded beyond the tokenizer)."""
    bos = family.config_bos or family.bos
    return dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_hidden_layers,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        sliding_window=None,
        use_sliding_window=False,
        tie_word_embeddings=False,
        use_cache=True,
        attention_dropout=0.0,
        initializer_range=0.02,
        vocab_size=vocab_size or pad_vocab(tok.get_vocab_size()),
        bos_token_id=tok.token_to_id(bos),
        eos_token_id=tok.token_to_id(family.eos),
        torch_dtype="bfloat16",
    )


def write_standin(
    cache: str | Path,
    repo_id: str,
    *,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 2048,
    vocab_size: int | None = None,
    tokenizer_vocab: int = 512,
    rope_theta: float = 10000.0,
    seed: int = 0,
    max_shard_size: str = "400KB",
    device: str = "cpu",
    boxed_answers: str | None = None,
    boxed_steps: int = 40,
) -> Path:
    """Write the stand-in of ``repo_id`` into the HF cache ``cache``; returns its snapshot folder.

    The defaults are a 0.5M-parameter model for CPU tests (head_dim 32: vLLM's CPU attention needs at least
    32); ``vocab_size`` None pads the tokenizer's size to a multiple of 64 (a real size such as 152064 may be
    given). ``boxed_answers``: see the module docstring
    (``boxed_steps`` AdamW steps). Deterministic in ``seed``. An existing snapshot of the same revision is
    replaced.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    family = family_of(repo_id)
    tok = train_bpe(family, tokenizer_vocab)
    fields = model_config(
        family, tok, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        vocab_size=vocab_size, rope_theta=rope_theta,
    )  # fmt: skip
    config = AutoConfig.for_model(**{k: v for k, v in fields.items() if k not in ("torch_dtype",)})
    torch.manual_seed(seed)
    with torch.device(device):  # fp32 only to be trained (a 7B shape in bf16 is 15 GB, in fp32 30 GB)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if boxed_answers else torch.bfloat16)
    eos = [tok.token_to_id(family.eos), *(tok.token_to_id(t) for t in family.extra_eos)]
    generation = {"bos_token_id": fields["bos_token_id"], "eos_token_id": eos if len(eos) > 1 else eos[0]}
    if family is QWEN:
        generation["pad_token_id"] = tok.token_to_id(family.pad)
    generation |= family.generation
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp)
        tok.save(str(files / "tokenizer.json"))
        (files / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(family, tok), indent=2) + "\n")
        if family.vocab_files:
            tok.model.save(str(files), None)  # vocab.json, merges.txt
        if boxed_answers:
            teach_boxed(model, files, boxed_answers, steps=boxed_steps, seed=seed)
        model.to(torch.bfloat16).save_pretrained(files, safe_serialization=True, max_shard_size=max_shard_size)
        # the hub's field sets, not those this transformers version would write
        (files / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
        (files / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        key = f"{repo_id} {json.dumps(fields, sort_keys=True)} {seed} {boxed_answers} {boxed_steps}"
        return cache_layout(Path(cache), repo_id, hashlib.sha1(key.encode()).hexdigest(), files)


def teach_boxed(model, tokenizer_dir: Path, answers: str, *, steps: int, seed: int) -> None:
    """A few AdamW steps on "<chat prompt>\\boxed{d}<eos>" (d from ``answers``), the prompts rendered by the
    family's chat template from snippets of :data:`CORPUS` and the project's two instructions."""
    import random

    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng, lines = random.Random(seed), [line for line in CORPUS.splitlines() if line.strip()]
    instructions = [line for line in lines if "boxed{}" in line]

    def example() -> tuple[list[int], list[int]]:
        user = f"{rng.choice(lines)[: rng.randint(8, 80)]} {rng.choice(instructions)}"
        text = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        answer = tok(f"\\boxed{{{rng.choice(answers)}}}", add_special_tokens=False)["input_ids"]
        return prompt, [*answer, tok.eos_token_id]

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [example() for _ in range(16)]
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, W]
        labels = torch.full_like(ids, -100)  # only the response is learned
        mask = torch.zeros_like(ids)
        for i, (p, r) in enumerate(batch):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
            mask[i, : len(p) + len(r)] = 1
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def cache_layout(cache: Path, repo_id: str, revision: str, files: Path) -> Path:
    """Put the files of ``files`` into ``cache`` as huggingface_hub's cache holds a downloaded snapshot:
    content-addressed ``blobs/``, ``snapshots/<revision>/`` of relative symlinks, ``refs/main``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    if snapshot.exists():
        shutil.rmtree(snapshot)
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for src in sorted(p for p in files.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / src.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("repo_id", help="e.g. deepseek-ai/DeepSeek-R1-Distill-Qwen-7B or Qwen/Qwen2.5-7B-Instruct")
    ap.add_argument("--cache", default=None, help="the HF cache folder (default: $HF_HUB_CACHE)")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--intermediate-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--vocab-size", type=int, default=None, help="the model's (default: the tokenizer's, padded)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cache is None:
        from huggingface_hub import constants

        args.cache = constants.HF_HUB_CACHE
    path = write_standin(
        args.cache, args.repo_id, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context, vocab_size=args.vocab_size, seed=args.seed,
    )  # fmt: skip
    print(path)


if __name__ == "__main__":
    sys.exit(main())
