"""What the engine tests share: the prompts they sample, what they check of the samples an engine returns, the
checkpoint copies they sample from, and the learner's forward pass they compare log-probs with."""

import json
import shutil
from pathlib import Path

import torch

from bapo.algos import token_logp
from bapo.data.loading import render_prompt
from bapo.data.tasks import ArithSpec, arith_heldout
from bapo.learner import collate
from bapo.samples import ScoredSample
from tests.helpers.paths import TINY

# Sampling defaults a checkpoint's generation_config.json may set: penalties, filters, a temperature. An engine
# that obeyed them would sample other tokens than softmax(logits / T); every engine must ignore them.
SHAPED_DEFAULTS = dict(repetition_penalty=2.0, no_repeat_ngram_size=2, min_new_tokens=5, top_k=3, top_p=0.5,
                       temperature=0.3)  # fmt: skip


def tiny_copy(dest: Path, **generation) -> Path:
    """assets/tiny-math with ``generation`` written into its generation_config.json."""
    shutil.copytree(TINY, dest)
    cfg = json.loads((dest / "generation_config.json").read_text()) | generation
    (dest / "generation_config.json").write_text(json.dumps(cfg))
    return dest


def tied_copy(dest: Path) -> None:
    """assets/tiny-math with tied input and output embeddings (SmolLM2 and Qwen2.5-0.5B are tied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bapo.modeling import load_model

    cfg = AutoConfig.from_pretrained(TINY)
    cfg.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(cfg)
    src = load_model(str(TINY)).state_dict()
    model.load_state_dict({k: v for k, v in src.items() if k != "lm_head.weight"}, strict=False)
    model.save_pretrained(dest)


def rows(samples):
    """Each sample's (response token ids, behaviour log-probs), to compare two generations exactly."""
    return [(s.response_ids.tolist(), s.logp.tolist()) for s in samples]


def assert_tagged_and_shaped(samples, prompts, tok, *, n: int, max_new_tokens: int):
    """``n`` samples per prompt, in contiguous groups that map back to their prompt; each a long response with one
    float32 log-prob (<= 0) per token, ending at the eos unless truncated at ``max_new_tokens``, and its text the
    decoded response."""
    assert len(samples) == n * len(prompts)
    assert [s.group for s in samples] == [i // n for i in range(len(samples))]
    assert all(s.prompt is prompts[s.group] for s in samples)
    for s in samples:
        assert s.response_ids.dtype == torch.long and s.logp.dtype == torch.float32
        assert len(s.logp) == len(s.response_ids) > 0
        assert (s.logp <= 0).all()
        assert s.truncated == (tok.eos_token_id not in s.response_ids.tolist())
        assert s.truncated or s.response_ids[-1] == tok.eos_token_id
        assert s.text == tok.decode(s.response_ids.tolist(), skip_special_tokens=True)
        if s.truncated:
            assert len(s.response_ids) == max_new_tokens


def assert_cut_at_first_stop(plain, got, stop_ids) -> list[tuple]:
    """Each of ``got`` is the ``plain`` response of the same seed cut after its first token of ``stop_ids`` (or
    whole, and truncated, without one), and at least half of them were cut early. Returns (plain, got, end) per
    pair, for the caller's own checks of what it cut."""
    pairs = []
    for p, g in zip(plain, got, strict=True):
        ids = p.response_ids.tolist()
        hits = [i for i, t in enumerate(ids) if t in stop_ids]
        end = hits[0] + 1 if hits else len(ids)
        assert g.response_ids.tolist() == ids[:end]
        assert g.truncated == (not hits)
        pairs.append((p, g, end))
    assert sum(end < len(p.response_ids) for p, _, end in pairs) >= len(got) // 2
    return pairs


# The vLLM engine's settings in the tests: small and eager, so that it starts in seconds on CPU.
ENGINE_KW = dict(
    max_new_tokens=40,
    dtype="float32",
    enforce_eager=True,  # no torch.compile: start-up in seconds
    seed=0,
    block_size=32,  # the CPU minimum, so that the ~55-token LONG prompts fill a block and hit the prefix cache
    max_num_batched_tokens=256,  # small, so that prefills get chunked (which broke seeded sampling on CPU)
)


def arith_prompts(tok, n=6, spec=None):
    """``n`` held-out arithmetic prompts (seed 1234), rendered with ``tok``'s chat template."""
    spec = spec or ArithSpec()
    return [render_prompt(p, tok) for p in arith_heldout(n, seed=1234, heldout_frac=0.1, spec=spec)]


def learner_logp(model, samples, temperature: float) -> list[torch.Tensor]:
    """Each response's log-probs from one right-padded forward: log_softmax(logits / T) gathered."""
    seqs = [torch.tensor(list(s.prompt.ids) + s.response_ids.tolist()) for s in samples]
    L = max(len(x) for x in seqs)
    ids = torch.zeros((len(seqs), L), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], attn[i, : len(x)] = x, 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float()  # [B, L, V]
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, L-1]
    return [logp[i, len(s.prompt.ids) - 1 : len(seqs[i]) - 1] for i, s in enumerate(samples)]


def learner_logp_diff(model, samples, temperature, pad_id) -> float:
    """Max |engine logp - learner logp| over response tokens (the learner's right-padded forward)."""
    batch = collate([ScoredSample(s, 0.0, 0.0, False) for s in samples], pad_id=pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logp(logits[:, :-1].float() / temperature, batch.input_ids[:, 1:])  # [B, L-1]
    assert batch.mask.sum().item() == sum(len(s.response_ids) for s in samples)
    return ((logp - batch.old_logp) * batch.mask).abs().max().item()
