"""Learner throughput: sequence packing and token-budget micro-batches against padding, and
the share of an update spent in BAPO's bound search.

RL mini-batches mix short answers with responses cut at ``max_new_tokens``, so padded
micro-batches spend much of their compute on padding. Four layouts of the same
mini-batch are timed (full BAPO updates: the no-grad pre-pass, the search, forward and
backward, AdamW): padded and packed, each with fixed-size micro-batches (``--micro``
rows) and with a token budget (``--micro`` x the mean sequence length, so micro-batches
are the same size on average). Throughput counts real (non-padding) tokens, so the
ratios against "padded, rows" are speed-ups on the same work. The search's share is the
time inside ``Objective.choose`` over the whole update.

Models: ``tiny`` (the shipped 1M-parameter model, 343-token vocabulary, sequences up
to 256 tokens) or ``small`` (a random 4-layer Llama with a 32k vocabulary and sequences
up to 1024 tokens, where the LM head and log-softmax weigh as in a real LM). Layouts are
timed in interleaved rounds and medians reported, one torch thread by default, so a busy
machine skews all alike.

    python scripts/bench/bench_learner.py [--model tiny|small] [--samples 32] [--micro 8] [--rounds 3] [--updates 2]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from bapo.algos import surrogate_objective  # noqa: E402
from bapo.learner import Learner, collate  # noqa: E402
from bapo.samples import Problem, Prompt, Sample, ScoredSample  # noqa: E402
from scripts.bench.harness import ROOT, parser, start, timed  # noqa: E402

MODELS = {  # name: (max prompt length, max response length)
    "tiny": (48, 200),
    "small": (96, 900),
}


def learner_cfg(**fields):
    """The default ``learner=single`` group, typed, with ``fields`` replaced."""
    import dataclasses

    from hydra import compose, initialize_config_dir

    from bapo.config import build

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="config", overrides=["logger=none"])
    return dataclasses.replace(build(cfg, "/tmp/bench-learner").learner, **fields)


def build_model(name: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if name == "tiny":
        from bapo.modeling import load_model

        return load_model(str(ROOT / "assets" / "tiny-math"))
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def make_batch(model, n: int, max_prompt: int, max_resp: int, seed: int = 0):
    """Random prompts of 16..max_prompt tokens; response lengths long-tailed, a quarter cut at max_resp."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    samples = []
    for i in range(n):
        p = int(torch.randint(16, max_prompt + 1, (1,), generator=g))
        r = max_resp if torch.rand(1, generator=g) < 0.25 else int(torch.randint(8, max_resp // 2, (1,), generator=g))
        ids = torch.randint(3, vocab, (p + r,), generator=g)
        prompt = Prompt(Problem(str(i), "p", "1"), "p", tuple(ids[:p].tolist()))
        s = Sample(prompt, i // 8, tuple(ids[p:].tolist()), (0.0,) * r, "t", 0, False)
        samples.append(ScoredSample(s, 0.0, float(torch.randn(1, generator=g)), False))
    batch = collate(samples, pad_id=0)
    # Behaviour log-probs near the current policy's, so the ratios look like off-policy RL's.
    cfg = learner_cfg(packing=True, max_tokens_per_micro_batch=2048)
    probe = Learner(model, cfg, objective=surrogate_objective("bapo"), pad_id=0)
    row = 0
    for mb in probe.micro_batches(batch):
        with torch.no_grad():
            logp = probe._forward(model, mb, entropy=False)[0]  # [b, l-1], trimmed to the micro-batch
        noise = 0.2 * torch.randn(logp.shape, generator=g)
        batch.old_logp[row : row + len(mb), : logp.shape[1]] = (logp + noise) * mb.mask
        row += len(mb)
    return batch


class Timed:
    """Wraps ``Objective.choose`` and adds up the time spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def time_layout(model, batch, updates: int, **kw) -> tuple[float, float, int]:
    """(seconds per update, search share of it, micro-batches) for one learner layout."""
    objective = surrogate_objective("bapo")
    fields = dict(lr=1e-5, packing=False, max_tokens_per_micro_batch=None) | kw
    learner = Learner(copy.deepcopy(model), learner_cfg(**fields), objective=objective, pad_id=0,
                      max_response_len=batch.mask.shape[1])  # fmt: skip
    learner.update(batch)  # warm-up
    objective.choose = search = Timed(objective.choose)
    total, _ = timed(lambda: [learner.update(batch) for _ in range(updates)])
    return total / updates, search.seconds / total, len(learner.micro_batches(batch))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--samples", type=int, default=32, help="sequences per mini-batch (one optimizer update)")
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch (and the token budget's scale)")
    ap.add_argument("--updates", type=int, default=2, help="timed updates per round and layout")
    args = start(ap)
    model = build_model(args.model)
    batch = make_batch(model, args.samples, *MODELS[args.model])
    real = int(batch.attention_mask.sum())
    budget = args.micro * real // len(batch)
    layouts = {
        f"padded, {args.micro} rows": dict(micro_batch_size=args.micro),
        f"packed, {args.micro} rows": dict(micro_batch_size=args.micro, packing=True),
        f"padded, budget {budget} tok": dict(max_tokens_per_micro_batch=budget),
        f"packed, budget {budget} tok": dict(max_tokens_per_micro_batch=budget, packing=True),
    }
    runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in layouts}
    for _ in range(args.rounds):
        for name, kw in layouts.items():
            runs[name].append(time_layout(model, batch, args.updates, **kw))
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.model} model ({n_params / 1e6:.1f}M params, vocab {model.config.vocab_size}), "
        f"{len(batch)} sequences/update: {real} real tokens, {batch.attention_mask.numel()} padded "
        f"({1 - real / batch.attention_mask.numel():.0%} padding), {batch.num_tokens} response tokens; "
        f"BAPO paper scope; {args.rounds} rounds x {args.updates} updates; torch threads {torch.get_num_threads()}"
    )
    base = statistics.median(t for t, _, _ in runs[next(iter(layouts))])
    for name, rs in runs.items():
        t = statistics.median(r[0] for r in rs)
        share = statistics.median(r[1] for r in rs)
        print(
            f"  {name:28s} {t * 1e3:8.0f} ms/update {real / t:9.0f} tok/s  x{base / t:5.2f} vs padded  "
            f"search {share:5.1%} of the update  ({rs[0][2]} micro-batches)"
        )


if __name__ == "__main__":
    main()
