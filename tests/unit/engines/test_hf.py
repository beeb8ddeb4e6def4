"""The HF engine, on both decode paths: neutral sampling, the eos union, log-probs that match the
learner's forward, seeded reproducibility, top-p only without log-probs, the builder and the interface."""

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bapo.config import ConfigError
from bapo.engines import HFRollout, RolloutEngine, build_rollout, make_sample, pad_id_of, stop_ids_of
from bapo.engines.decode import _pick
from bapo.modeling import load_model
from tests.helpers.engines import (
    SHAPED_DEFAULTS,
    arith_prompts,
    assert_cut_at_first_stop,
    assert_tagged_and_shaped,
    learner_logp,
    rows,
    tiny_copy,
)

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "assets" / "tiny-math"
PATHS = ["lean", "generate"]


@pytest.mark.parametrize("decode", PATHS)
def test_samples_are_tagged_and_shaped(tiny_model, tiny_tok, decode):
    eng = HFRollout(tiny_model, tiny_tok, n=3, max_new_tokens=40, batch_size=8, decode=decode)
    eng.version = 7
    prompts = arith_prompts(tiny_tok)
    samples = eng.generate(prompts)
    assert len(samples) == 18
    # groups are contiguous and map back to their prompt, also across calls (8 // 3 = 2 prompts a call)
    assert_tagged_and_shaped(samples, prompts, tiny_tok, n=3, max_new_tokens=40)
    for s in samples:
        assert s.version == 7
        assert not s.response_ids.is_inference() and not s.logp.is_inference()  # usable in the learner's graph


@pytest.mark.parametrize("decode", PATHS)
def test_behaviour_logp_matches_learner_forward(tiny_model, tiny_tok, decode):
    """Left-padded KV-cache sampling and the right-padded learner pass agree per token."""
    for temperature in (1.0, 0.7):
        eng = HFRollout(tiny_model, tiny_tok, n=4, temperature=temperature, max_new_tokens=48, decode=decode)
        samples = eng.generate(arith_prompts(tiny_tok, 8), seed=1)
        want = learner_logp(tiny_model, samples, temperature)
        diff = max((w - s.logp).abs().max().item() for w, s in zip(want, samples, strict=True))
        assert diff < 1e-4, diff


def test_both_paths_decode_greedily_alike(tiny_model, tiny_tok):
    prompts = arith_prompts(tiny_tok, 8)
    lean, gen = (
        HFRollout(tiny_model, tiny_tok, n=1, max_new_tokens=40, batch_size=5, decode=d).generate(prompts, temperature=0)
        for d in PATHS
    )
    assert [x.response_ids.tolist() for x in lean] == [x.response_ids.tolist() for x in gen]
    assert max((x.logp - y.logp).abs().max().item() for x, y in zip(lean, gen, strict=True)) < 1e-5


def test_lean_sampler_draws_from_the_tempered_softmax():
    """Inverse-CDF sampling: frequencies match softmax(logits / T) within 5 sigma over 200k draws,
    a token of probability 0 is never drawn, the nucleus is renormalised, and each draw's log-prob
    is log_softmax(logits / T) at the drawn token."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 0.5, -1.0, float("-inf"), 1.0, -3.0])
    N = 200_000
    for temperature, top_p in ((1.0, 1.0), (0.6, 1.0), (1.0, 0.8)):
        tok, lp = _pick(logits.expand(N, -1), temperature, top_p, torch.rand(N, dtype=torch.float64))
        p = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1:  # the nucleus: the most likely tokens whose mass first reaches top_p
            order = p.argsort(descending=True)
            keep = order[: int((p[order].cumsum(0) < top_p).sum()) + 1]
            p = torch.zeros_like(p).index_fill_(0, keep, 1) * p
            p = p / p.sum()
        freq = torch.bincount(tok, minlength=6).double() / N
        sigma = (p * (1 - p) / N).sqrt().double()
        assert ((freq - p.double()).abs() <= 5 * sigma + 1e-12).all(), (temperature, top_p, freq, p)
        assert freq[3] == 0
        want = torch.log_softmax(logits / temperature, dim=-1)[tok] if top_p == 1 else p.log()[tok]
        assert torch.allclose(lp, want, atol=1e-6)
    ends = torch.tensor([0.0, 1.0 - 1e-12], dtype=torch.float64)
    tok, _ = _pick(logits.expand(2, -1), 1.0, 1.0, ends)
    assert tok.tolist() == [0, 5]  # the first and the last token with mass


@pytest.mark.parametrize("decode", PATHS)
def test_same_seed_same_samples(tiny_model, tiny_tok, decode):
    eng = HFRollout(tiny_model, tiny_tok, n=2, max_new_tokens=24, decode=decode)
    a = eng.generate(arith_prompts(tiny_tok, 3), temperature=1.0, seed=3)
    torch.manual_seed(99)
    b = eng.generate(arith_prompts(tiny_tok, 3), temperature=1.0, seed=3)
    c = eng.generate(arith_prompts(tiny_tok, 3), temperature=1.0, seed=4)
    assert rows(a) == rows(b)
    assert [s.response_ids.tolist() for s in a] != [s.response_ids.tolist() for s in c]


@pytest.mark.parametrize("decode", PATHS)
def test_greedy_is_deterministic(tiny_model, tiny_tok, decode):
    eng = HFRollout(tiny_model, tiny_tok, n=1, max_new_tokens=40, decode=decode)
    a = eng.generate(arith_prompts(tiny_tok), temperature=0.0)
    torch.manual_seed(123)
    b = eng.generate(arith_prompts(tiny_tok), temperature=0.0)
    assert rows(a) == rows(b)


@pytest.mark.parametrize("decode", PATHS)
def test_checkpoint_generation_defaults_do_not_leak(tiny_tok, tmp_path, decode):
    """A checkpoint's sampling defaults (penalties, filters, lengths) change nothing: the engine
    samples plain softmax(logits / T), token for token and log-prob for log-prob."""
    ids = tiny_tok.convert_tokens_to_ids(["1", "+", "="])
    shaped = tiny_copy(
        tmp_path / "shaped",
        **SHAPED_DEFAULTS,
        # and what else transformers' generate would read from the checkpoint
        min_length=40,
        suppress_tokens=[ids[0]],
        begin_suppress_tokens=[ids[1]],
        bad_words_ids=[[ids[2]]],
        sequence_bias=[[[ids[1]], -5.0]],
        min_p=0.2,
        typical_p=0.5,
        do_sample=False,
        max_new_tokens=4,
        renormalize_logits=True,
    )
    model = load_model(str(shaped))
    assert model.generation_config.repetition_penalty == 2.0  # the defaults did load
    prompts = arith_prompts(tiny_tok, 8)
    kw = dict(n=4, temperature=1.0, max_new_tokens=40, decode=decode)
    plain = HFRollout(load_model(str(TINY)), tiny_tok, **kw).generate(prompts, seed=11)
    got = HFRollout(model, tiny_tok, **kw).generate(prompts, seed=11)
    assert rows(got) == rows(plain)
    assert model.generation_config.repetition_penalty == 2.0  # restored after the call


@pytest.mark.parametrize("decode", PATHS)
def test_responses_stop_at_any_eos_of_tokenizer_or_checkpoint(tiny_model, tiny_tok, tmp_path, decode):
    """generation_config.eos_token_id = [2, x]: each response is the plain one cut at its first 2 or x."""
    prompts = arith_prompts(tiny_tok, 8)
    kw = dict(n=4, temperature=1.0, max_new_tokens=40, decode=decode)
    plain = HFRollout(tiny_model, tiny_tok, **kw).generate(prompts, seed=2)
    counts = torch.bincount(torch.cat([s.response_ids[:-1] for s in plain]))
    extra = int(counts.argmax())  # the token the responses use most, so most of them end early
    assert extra != tiny_tok.eos_token_id
    model = load_model(str(tiny_copy(tmp_path / "m", eos_token_id=[tiny_tok.eos_token_id, extra])))
    eng = HFRollout(model, tiny_tok, **kw)
    assert eng.stop_ids == (tiny_tok.eos_token_id, extra)
    got = eng.generate(prompts, seed=2)
    for p, g, end in assert_cut_at_first_stop(plain, got, eng.stop_ids):
        assert g.logp.tolist() == p.logp[:end].tolist()
        text_ids = g.response_ids.tolist() if g.truncated else g.response_ids[:-1].tolist()  # without its stop
        assert g.text == tiny_tok.decode(text_ids, skip_special_tokens=True)


def test_top_p_is_for_evaluation_only(tiny_model, tiny_tok):
    with pytest.raises(ConfigError, match=r"^rollout\.top_p:"):
        HFRollout(tiny_model, tiny_tok, n=2, top_p=0.9)
    with pytest.raises(ConfigError, match=r"^rollout\.top_p:"):
        HFRollout(tiny_model, tiny_tok, n=2, top_p=0.0, logprobs=False)
    prompts = arith_prompts(tiny_tok, 4)
    greedy = HFRollout(tiny_model, tiny_tok, n=1, max_new_tokens=30).generate(prompts, temperature=0.0)
    for decode in PATHS:  # a nucleus of one token is greedy decoding; no training log-probs come out
        eng = HFRollout(tiny_model, tiny_tok, n=2, max_new_tokens=30, top_p=1e-6, logprobs=False, decode=decode)
        got = eng.generate(prompts, temperature=1.0, seed=0)
        assert [s.response_ids.tolist() for s in got] == [s.response_ids.tolist() for s in greedy for _ in range(2)]
        assert all(torch.isnan(s.logp).all() for s in got)


def test_load_weights_changes_policy_and_version(tiny_model, tiny_tok):
    eng = HFRollout(copy.deepcopy(tiny_model), tiny_tok, n=1, max_new_tokens=8)
    new = {k: v + 0.01 for k, v in tiny_model.state_dict().items()}
    assert eng.load_weights(new, version=3) >= 0
    assert eng.version == 3
    got = eng.model.state_dict()
    assert all(torch.equal(got[k], new[k]) for k in new)
    assert eng.generate(arith_prompts(tiny_tok, 1))[0].version == 3


def test_engine_meets_the_interface(tiny_model, tiny_tok):
    eng = HFRollout(tiny_model, tiny_tok, n=1)
    assert isinstance(eng, RolloutEngine)
    assert eng.pad_id == pad_id_of(tiny_tok) == tiny_tok.pad_token_id
    eng.sleep()
    eng.wake()
    no_pad = SimpleNamespace(pad_token_id=None, eos_token_id=2)
    assert pad_id_of(no_pad) == 2
    assert stop_ids_of(no_pad, SimpleNamespace(eos_token_id=[7, 2, 9])) == (2, 7, 9)
    assert stop_ids_of(no_pad, SimpleNamespace(eos_token_id=None)) == (2,)
    with pytest.raises(ConfigError, match=r"^rollout\.decode:"):
        HFRollout(tiny_model, tiny_tok, n=1, decode="fast")


def test_make_sample_cuts_at_the_first_stop(tiny_tok):
    prompt = arith_prompts(tiny_tok, 1)[0]
    a, b = tiny_tok.convert_tokens_to_ids(["1", "2"])
    s = make_sample(prompt, 4, [a, b, 9, a, 2, b], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], (2, 9), 3, tiny_tok)
    assert s.response_ids.tolist() == [a, b, 9] and s.logp.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert not s.truncated and s.text == "12" and (s.group, s.version, s.prompt) == (4, 3, prompt)
    t = make_sample(prompt, 0, torch.tensor([a, b]), torch.tensor([-1.0, -2.0]), (2,), 0, tiny_tok)
    assert t.truncated and t.text == "12" and t.logp.dtype == torch.float32
    assert torch.isnan(make_sample(prompt, 0, [a, 2], None, (2,), 0, tiny_tok).logp).all()
    with pytest.raises(ValueError, match="1 log-probs for a response of 2 tokens"):
        make_sample(prompt, 0, [a, 2], [-1.0], (2,), 0, tiny_tok)


def test_build_rollout_makes_the_configured_engine(tiny_model, tiny_tok):
    cfg = SimpleNamespace(engine="hf", n=3, temperature=0.7, max_new_tokens=12, batch_size=6, decode="generate")
    eng = build_rollout(cfg, path=str(TINY), tokenizer=tiny_tok, model=tiny_model)
    assert isinstance(eng, HFRollout) and eng.model is tiny_model
    assert (eng.n, eng.temperature, eng.max_new_tokens, eng.batch_size, eng.decode) == (3, 0.7, 12, 6, "generate")
    loaded = build_rollout(cfg, path=str(TINY), tokenizer=tiny_tok, top_p=0.5, logprobs=False)
    assert loaded.top_p == 0.5 and not loaded.logprobs
    assert torch.equal(loaded.model.lm_head.weight, tiny_model.lm_head.weight)
    with pytest.raises(ConfigError, match=r"^rollout\.top_p:"):
        build_rollout(cfg, path=str(TINY), tokenizer=tiny_tok, model=tiny_model, top_p=0.5)
    with pytest.raises(ConfigError, match=r"^rollout\.engine:"):
        build_rollout(SimpleNamespace(engine="tgi"), path=str(TINY), tokenizer=tiny_tok)


def test_a_subclass_that_passes_kwargs_on_takes_its_parents_yaml_keys():
    # docs/extending.md's new engine adds a key to HF's: its constructor takes `log_every` and passes the rest on.
    # Every key of the parent's YAML must still reach the parent (before: batch_size and decode were dropped, and
    # HFRollout fell back to its own defaults with no error).
    from bapo.engines.base import EngineContext, constructor_kwargs

    class Logged(HFRollout):
        def __init__(self, model, tokenizer, *, log_every: int, **kwargs):
            super().__init__(model, tokenizer, **kwargs)
            self.log_every = log_every

    cfg = SimpleNamespace(n=2, temperature=1.0, max_new_tokens=8, batch_size=7, decode="generate", log_every=3)
    got = constructor_kwargs(Logged, cfg, EngineContext(path="", tokenizer=None))
    assert (got["batch_size"], got["decode"], got["log_every"]) == (7, "generate", 3)
    plain = constructor_kwargs(HFRollout, cfg, EngineContext(path="", tokenizer=None))
    assert "log_every" not in plain and plain["batch_size"] == 7
