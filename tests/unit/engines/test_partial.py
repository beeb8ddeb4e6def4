"""Partial rollouts on the HF engine: a response continued from its prefix, segment by segment.

The prefix is re-prefilled, never re-sampled; each token is drawn from a uniform of (response seed, position)
(``counter_uniform``), so with unchanged weights a response drawn in segments is the response drawn at once;
with weights that change between segments, every token's log-prob is the learner's under the weights (the
version) that sampled it."""

import pytest
import torch

from bapo.data.loading import render_prompt
from bapo.data.tasks import ArithSpec, arith_heldout
from bapo.engines import HFRollout
from bapo.engines.decode import counter_uniform
from bapo.samples import Partial
from tests.helpers.engines import learner_logp
from tests.helpers.fakes import perturbed

L = 24


def _prompts(tok, n=3):
    return [render_prompt(p, tok) for p in arith_heldout(n, seed=99, heldout_frac=0.1, spec=ArithSpec())]


def _fresh(prompts, n=2):
    empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    return [Partial(p, *empty, seed=1000 + 7 * i + j) for i, p in enumerate(prompts) for j in range(n)]


def _run(engine, partials, budget):
    """Extend every unfinished response until all have finished; returns them and the segments per call."""
    calls = 0
    while not all(p.finished(engine.max_new_tokens) for p in partials):
        todo = [i for i, p in enumerate(partials) if not p.finished(engine.max_new_tokens)]
        for i, p in zip(todo, engine.extend([partials[i] for i in todo], budget=budget), strict=True):
            partials[i] = p
        calls += 1
    return partials, calls


def _splitmix64(seed: int, pos: int) -> float:
    """SplitMix64's output function in plain Python (unsigned arithmetic), the reference for the torch one."""
    m = (1 << 64) - 1
    z = (seed + (pos + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def test_counter_uniform_is_splitmix64_of_seed_and_position():
    seeds = [0, 1, 12345, (1 << 63) - 1, 987654321987654321]
    pos = [0, 1, 5, 47, 1 << 20]
    got = counter_uniform(torch.tensor(seeds), torch.tensor(pos)).tolist()
    assert got == [_splitmix64(s, p) for s, p in zip(seeds, pos, strict=True)]
    u = counter_uniform(torch.full((20000,), 7), torch.arange(20000))
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01  # uniform-looking


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_segments_with_unchanged_weights_equal_the_response_drawn_at_once(tiny_model, tiny_tok, temperature):
    engine = HFRollout(tiny_model, tiny_tok, n=2, max_new_tokens=L, temperature=temperature, batch_size=4)
    prompts = _prompts(tiny_tok)
    whole, calls = _run(engine, _fresh(prompts), budget=L)
    assert calls == 1
    pieces, calls = _run(engine, _fresh(prompts), budget=5)
    assert calls > 1 and any(p.segments > 1 for p in pieces)  # something was resumed
    for a, b in zip(whole, pieces, strict=True):
        assert a.response_ids.tolist() == b.response_ids.tolist()
        torch.testing.assert_close(a.logp, b.logp, atol=1e-5, rtol=0)
        assert a.stopped == b.stopped and b.segments == -(-len(b.response_ids) // 5)


def test_greedy_continuation_equals_the_greedy_response_of_generate(tiny_model, tiny_tok):
    engine = HFRollout(tiny_model, tiny_tok, n=1, max_new_tokens=L, temperature=0.0, batch_size=8)
    prompts = _prompts(tiny_tok)
    at_once = engine.generate(prompts)
    pieces, _ = _run(engine, _fresh(prompts, n=1), budget=3)
    for s, p in zip(at_once, pieces, strict=True):
        assert s.response_ids.tolist() == p.response_ids.tolist()


def test_three_segments_under_three_versions_carry_each_tokens_version_and_log_prob(tiny_model, tiny_tok):
    # A response built over three "steps", each with other weights: every token's version is the step's, and
    # its log-prob the learner's forward under that step's weights (not under the final ones).
    models = [tiny_model, perturbed(tiny_model, 0.05, seed=1), perturbed(tiny_model, 0.05, seed=2)]
    engine = HFRollout(copy_of(tiny_model), tiny_tok, n=2, max_new_tokens=L, temperature=1.0, batch_size=8)
    partials = _fresh(_prompts(tiny_tok, 4))
    for v, m in enumerate(models):
        engine.load_weights(m.state_dict(), version=10 + v)
        todo = [i for i, p in enumerate(partials) if not p.finished(L)]
        for i, p in zip(todo, engine.extend([partials[i] for i in todo], budget=4), strict=True):
            partials[i] = p
    long = [p for p in partials if len(p.response_ids) == 12 and not p.stopped]
    assert long, "no response ran through all three segments"
    samples = [engine.complete(p, group=0) for p in partials]
    for p, s in zip(partials, samples, strict=True):
        n = len(p.response_ids)
        expect = torch.tensor([10 + j // 4 for j in range(n)])
        assert p.versions.tolist() == expect.tolist() and s.token_versions().tolist() == expect.tolist()
        assert s.version == 10 and torch.equal(s.logp, p.logp)
    for v, m in enumerate(models):
        ref = learner_logp(m, samples, 1.0)
        for s, r in zip(samples, ref, strict=True):
            here = s.token_versions() == 10 + v
            # engine (cached decode) against the learner (packed forward): float32 kernels differ by up to ~2e-5
            # on some CPUs, so the project's engine-learner tolerance, 1e-4, as every other engine test
            torch.testing.assert_close(s.logp[here], r[here], atol=1e-4, rtol=0)
            if (~here).any() and v > 0:
                assert (s.logp[~here] - r[~here]).abs().max() > 1e-4  # the other versions' weights differ


def test_extend_cuts_at_the_first_stop_and_never_exceeds_max_new_tokens(tiny_model, tiny_tok):
    engine = HFRollout(tiny_model, tiny_tok, n=4, max_new_tokens=L, temperature=1.0, batch_size=16)
    done, _ = _run(engine, _fresh(_prompts(tiny_tok), n=4), budget=7)
    for p in done:
        n_stops = sum(int(t) in engine.stop_ids for t in p.response_ids)
        assert len(p.response_ids) <= L and n_stops == int(p.stopped)
        assert not p.stopped or int(p.response_ids[-1]) in engine.stop_ids
        assert len(p.logp) == len(p.versions) == len(p.response_ids)


def copy_of(model):
    import copy

    return copy.deepcopy(model)
