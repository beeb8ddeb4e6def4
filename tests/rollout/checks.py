"""What the HF and the vLLM engine tests both check of the samples an engine returns, and the checkpoint copies
they sample from."""

import json
import shutil
from pathlib import Path

import torch

from tests.conftest import TINY

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
