"""Checkpoint evaluation: metrics on canned responses, the typed config, set loading, and
eval.py end to end on the tiny model (subprocess and compose API)."""

import json
import logging
import os
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bapo.config import ConfigError
from bapo.eval.adopt import adopt_run, find_checkpoint
from bapo.eval.evaluate import EvalSet, evaluate, evaluate_set, evaluate_sets, prepare_set
from bapo.eval.job import build_job, load_evalset, named_set
from bapo.infra.artifacts import check_model_folder
from bapo.reward import MathVerifier
from bapo.samples import Problem, Sample
from eval import run as eval_run
from tests.helpers.evaluation import run_folder
from tests.helpers.evaluation_runs import CONF, SAMPLE_FIELDS, TINY_RUN, _cfg, _check_run_folder

ROOT = Path(__file__).resolve().parents[3]
SETS = sorted(p.stem for p in (CONF / "eval").glob("*.yaml") if p.stem != "heldout")


class CannedRollout:
    """Returns fixed responses per problem id, as a rollout engine would: k per prompt, grouped."""

    def __init__(self, responses: dict[str, list[str]]):
        self.responses = responses

    def generate(self, prompts, *, n, temperature, seed=None):
        out = []
        for g, p in enumerate(prompts):
            for j in range(n):
                text = self.responses[p.problem.id][j]
                ids = tuple(range(len(text.split())))
                out.append(Sample(p, g, ids, (0.0,) * len(ids), text, 0, truncated=text.endswith("...")))
        return out


PROBLEMS = [Problem("half", "What is 1/2?", "\\frac{1}{2}"), Problem("seven", "What is 3+4?", "7")]
RESPONSES = {
    # 2 of 4 correct; 0.5 and \dfrac12 are one answer with 2 votes, as is 3: the tie goes to 3 (sample 0)
    "half": ["\\boxed{3}", "\\boxed{0.5}", "\\boxed{3}", "so \\boxed{\\dfrac12}"],
    # 1 of 4 correct; majority 8 (2 votes); one response without an answer, one truncated
    "seven": ["\\boxed{8}", "\\boxed{7}", "I think...", "\\boxed{8}"],
}


def _set(problems, tok, instruction="", limit=None):
    return prepare_set("test", problems, tok, instruction=instruction, max_prompt_tokens=limit)


def test_metrics_on_canned_responses(tiny_tok):
    with MathVerifier(num_workers=0) as verifier:
        res = evaluate_set(
            CannedRollout(RESPONSES), verifier, _set(PROBLEMS, tiny_tok, "Box it."), k=4, temperature=1.0
        )
    m = res.metrics
    assert m["avg@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    # pass@2: half 1 - C(2,2)/C(4,2) = 5/6; seven 1 - C(3,2)/C(4,2) = 1/2
    assert m["pass@1"] == pytest.approx(m["avg@4"])
    assert m["pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert m["pass@4"] == 1.0
    assert m["maj@4"] == 0.0  # half: tie 3 vs 1/2 goes to 3 (sample 0); seven: 8
    assert m["no_answer"] == pytest.approx(1 / 8) and m["truncated"] == pytest.approx(1 / 8)
    assert [p["majority"] for p in res.problems] == ["3", "8"]
    assert [p["n_correct"] for p in res.problems] == [2, 1]
    assert len(res.samples) == 8 and set(res.samples[0]) == SAMPLE_FIELDS
    assert res.samples[3]["extracted"] == "\\dfrac12" and res.samples[3]["correct"] is True
    assert "Box it." in res.samples[0]["prompt"]


def test_maj_groups_equivalent_answers_through_the_pool(tiny_tok):
    """0.5 and \\frac{1}{2} beat 3 only when grouped (2 votes each, 0.5 first; 3 has 2 votes against 1 and 1
    otherwise); the pairs run in the verifier's worker pool."""
    responses = {"half": ["\\boxed{0.5}", "\\boxed{3}", "\\boxed{\\frac{1}{2}}", "\\boxed{3}"]}
    with MathVerifier(num_workers=1) as verifier:
        res = evaluate_set(CannedRollout(responses), verifier, _set(PROBLEMS[:1], tiny_tok), k=4, temperature=1.0)
    assert res.metrics["maj@4"] == 1.0 and res.problems[0]["majority"] == "0.5"


def test_evaluate_sets_is_flat_and_evaluate_still_works(tiny_tok):
    from bapo.data.loading import render_prompt

    rollout = CannedRollout(RESPONSES)
    with MathVerifier(num_workers=0) as verifier:
        sets = {"a": _set(PROBLEMS, tiny_tok), "b": EvalSet(_set(PROBLEMS[1:], tiny_tok).prompts, skipped=3)}
        flat = evaluate_sets(rollout, verifier, sets, k=4, temperature=1.0)
        old = evaluate(rollout, verifier, [render_prompt(p, tiny_tok) for p in PROBLEMS], n=4, temperature=1.0,
                       prefix="eval/")  # fmt: skip
    for s in ("a", "b"):
        for key in ("avg@4", "pass@1", "pass@2", "pass@4", "maj@4", "response_len", "truncated"):
            assert f"eval/{s}/{key}" in flat
    assert flat["eval/b/avg@4"] == 0.25 and flat["eval/a/avg@4"] == old["eval/accuracy"]
    assert flat["eval/a/skipped"] == 0.0 and flat["eval/b/skipped"] == 3.0
    assert old["eval/pass@4"] == 1.0


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", SETS)
def test_every_evalset_composes_and_validates(name):
    job = build_job(_cfg([f"eval={name}"]))
    assert list(job.sets) == [name]


@pytest.mark.parametrize("name", SETS)
def test_training_loads_a_set_by_name_as_eval_py_composes_it(name):
    # bapo.loop runs eval.sets through named_set, outside eval.py's Hydra config
    assert named_set(name) == build_job(_cfg([f"eval={name}"])).sets[name]


def test_sets_are_the_documented_ones_and_several_compose_at_once():
    assert SETS == ["aime24", "aime25", "amc23", "arith", "gsm8k", "math500"]
    job = build_job(_cfg(["eval=[aime24,aime25,math500]", "eval.math500.answer_key=x"]))
    assert list(job.sets) == ["aime24", "aime25", "math500"]
    assert job.sets["math500"].answer_key == "x" and job.sets["aime24"].path.endswith("aime24.jsonl")


def test_arith_set_is_the_training_heldout_set():
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        data = compose(config_name="config").data
    a = build_job(_cfg(["eval=arith"])).sets["arith"].arith
    assert {k: getattr(a, k) for k in data.arith} == dict(data.arith)
    assert (a.seed, a.heldout_frac, a.size) == (data.heldout_seed, data.heldout_frac, data.heldout_size)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["k=0"], "k"),
        (["temperature=0"], "k"),  # greedy with k=4 gives four equal samples
        (["top_p=0"], "top_p"),
        (["eval.limit=0"], "eval.limit"),
        (["maj_max_distinct=0"], "maj_max_distinct"),
        (["rollout.engine=tgi"], "rollout.engine"),
        (["rollout.batch_size=0"], "rollout.batch_size"),
        (["eval.arith.kind=csv"], "eval.arith.kind"),
        (["eval.arith.arith.size=0"], "eval.arith.arith.size"),
        (["eval.arith.arith.min_terms=1"], "eval.arith.arith.min_terms"),  # training's arith check, under this key
        (["eval=aime24", "eval.aime24.path=null"], "eval.aime24.path"),
        (["max_prompt_tokens=0"], "max_prompt_tokens"),
        (["eval=heldout"], "eval"),  # training's held-out config, not a set
        (["model.dtype=int8"], "model.dtype"),
        (["reward.fallback=guess"], "reward.fallback"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ":"):
        build_job(_cfg(overrides))


def test_training_heldout_config_is_named_with_the_sets():
    for choice in ("eval=heldout", "eval=[aime24,heldout]"):
        with pytest.raises(ConfigError) as e:
            build_job(_cfg([choice]))
        msg = str(e.value)
        assert msg.startswith("eval: heldout is training's held-out config (conf/eval/heldout.yaml"), msg
        assert "not an eval set" in msg and str(SETS) in msg


def test_vllm_engine_composes():
    """eval.py rollout=vllm builds the vLLM engine (bapo.engines.build_rollout); model=qwen7b picks it."""
    assert build_job(_cfg(["rollout=vllm"])).engine == "vllm"
    assert build_job(_cfg(["model=qwen7b"])).engine == "vllm"


def test_bad_checkpoint_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="^checkpoint: .*neither"):
        eval_run(_cfg([*TINY_RUN, f"checkpoint={tmp_path}"]), tmp_path / "out")


# ----------------------------------------------------------------------------- loading


def test_hub_style_loader_reads_a_local_file(tmp_path):
    rows = [{"question": f"q{i}", "final": f"#### 1,00{i}"} for i in range(3)]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = [f"eval.gsm8k.{k}" for k in ("kind=hub", f"path={path}", "split=train", "problem_key=question")]
    over += ["eval.gsm8k.answer_key=final", "eval.gsm8k.answer_format=gsm8k"]
    s = build_job(_cfg(["eval=gsm8k", *over])).sets["gsm8k"]
    problems = load_evalset(s)
    assert [p.problem for p in problems] == ["q0", "q1", "q2"]
    assert [p.answer for p in problems] == ["1000", "1001", "1002"]
    assert load_evalset(s, limit=2) == problems[:2]


SHIPPED = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "gsm8k": 1319}  # rows (assets/evalsets/SOURCES.md)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_file_set_ships_and_loads_from_any_working_folder(name, tmp_path, monkeypatch):
    """A clone evaluates with nothing beside it: each set's default file is the repository's own, read by a path
    relative to it, from any working folder, whatever BAPO_DATA_DIR says."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BAPO_DATA_DIR", str(tmp_path / "nothing-here"))
    s = build_job(_cfg([f"eval={name}"])).sets[name]
    assert s.path.startswith("assets/evalsets/") and (ROOT / s.path).is_file()
    problems = load_evalset(s)
    assert len(problems) == SHIPPED[name] and all(p.problem and p.answer for p in problems)


def test_the_shipped_sets_are_the_shared_files_byte_for_byte(shared_data):
    shipped = sorted((ROOT / "assets" / "evalsets").glob("*.jsonl"))
    assert [f.name for f in shipped] == [
        "aime24.jsonl",
        "aime25.jsonl",
        "amc23.jsonl",
        "gsm8k_test.jsonl",
        "math500.jsonl",
    ]
    for f in shipped:
        assert f.read_bytes() == (shared_data / f.name).read_bytes(), f.name


def test_shared_sets_load(shared_data):
    for name, rows in [("aime24", 30), ("aime25", 30), ("amc23", 40), ("math500", 500), ("gsm8k", 1319)]:
        problems = load_evalset(build_job(_cfg([f"eval={name}"])).sets[name])
        assert len(problems) == rows and all(p.answer for p in problems), name
    hub = [
        "eval.aime24.kind=hub",
        f"eval.aime24.path={shared_data / 'aime24.jsonl'}",
        "eval.aime24.split=train",
    ]
    assert load_evalset(build_job(_cfg(["eval=aime24", *hub])).sets["aime24"]) == load_evalset(
        build_job(_cfg(["eval=aime24"])).sets["aime24"]
    )


# ----------------------------------------------------------------------------- end to end


def test_eval_compose_api_on_a_shared_set_is_deterministic(tmp_path, shared_data):
    # aime24's first 6 prompts have 421, 136, 375, 408, 173 and 204 tokens; the tiny model's context (256)
    # less max_new_tokens=8 leaves 248, so I-01, I-03 and I-04 are skipped
    over = ["eval=[arith,aime24]", "eval.limit=6", "k=2", "max_new_tokens=8", "reward.num_workers=0", "seed=3"]
    first = eval_run(_cfg(over), tmp_path / "a")
    _check_run_folder(tmp_path / "a", {"arith": 6, "aime24": (3, 3)}, 2)
    ids = [json.loads(line)["id"] for line in (tmp_path / "a" / "samples_aime24.jsonl").read_text().splitlines()]
    assert ids == ["aime24-I-02"] * 2 + ["aime24-I-05"] * 2 + ["aime24-I-06"] * 2
    # same seed, same samples; and a set's samples do not depend on the sets run before it
    eval_run(_cfg([*over[1:], "eval=aime24"]), tmp_path / "b")
    assert (tmp_path / "a" / "samples_aime24.jsonl").read_text() == (
        tmp_path / "b" / "samples_aime24.jsonl"
    ).read_text()
    assert set(first) == {"arith", "aime24"}


def test_checkpoint_loads_a_run_folders_export(tmp_path, tiny_model, tiny_tok):
    """A run folder without config.yaml, or a bare export, is evaluated with eval.py's own settings."""
    tiny_model.save_pretrained(tmp_path / "run" / "export")
    tiny_tok.save_pretrained(tmp_path / "run" / "export")
    over = [*TINY_RUN, "eval=arith", "reward.num_workers=0"]
    eval_run(_cfg([*over, f"checkpoint={tmp_path / 'run'}"]), tmp_path / "out")
    results = _check_run_folder(tmp_path / "out", {"arith": 3}, 2)
    assert results["config"]["model_path"] == str(tmp_path / "run" / "export")
    assert results["config"]["run_config"] is None and results["config"]["from_run"] == {}
    # the export folder itself works too, and gives the same samples as the shipped model it copies
    eval_run(_cfg([*over, f"checkpoint={tmp_path / 'run' / 'export'}"]), tmp_path / "out2")
    eval_run(_cfg(over), tmp_path / "out3")
    same = [(tmp_path / d / "samples_arith.jsonl").read_text() for d in ("out", "out2", "out3")]
    assert same[0] == same[1] == same[2]


# ----------------------------------------------------------------------------- a training run's settings

# what the run was trained with, each different from eval.py's own defaults (model=tiny)
RUN = [
    "model.max_new_tokens=40",
    "model.dtype=bfloat16",
    "model.answer_fallback=last_number",
    "data.instruction=Think step by step and box the answer.",
    "data.max_prompt_tokens=120",
]


def _adopt(overrides: list[str]):
    cfg = _cfg(overrides)
    settings = adopt_run(cfg, overrides)
    return cfg, settings, build_job(cfg)


@pytest.mark.parametrize("export", [False, True], ids=["run_folder", "export_with_bapo_config"])
def test_a_run_is_evaluated_with_its_own_settings(tmp_path, tiny_model, tiny_tok, caplog, export):
    name = "bapo_config.yaml" if export else "config.yaml"
    run = run_folder(tmp_path / "run", tiny_model, tiny_tok, *RUN, config_name=name, export=export)
    with caplog.at_level(logging.INFO, logger="bapo.eval.adopt"):
        cfg, settings, job = _adopt(["eval=arith", f"checkpoint={run}"])
    weights = run if export else run / "export"
    assert (job.run.max_new_tokens, job.run.max_prompt_tokens) == (40, 120)
    assert job.run.instruction == "Think step by step and box the answer."
    assert (job.model.dtype, job.model.answer_fallback) == ("bfloat16", "last_number")
    assert job.reward.fallback == "last_number"  # the grader extracts what training's did
    assert job.model.name_or_path == str(weights) and settings.weights == weights
    assert cfg.rollout.max_new_tokens == 40 and job.engine == "hf"
    assert settings.config_file == run / name
    assert settings.taken["max_new_tokens"] == 40 and settings.kept == {}
    block = caplog.text[caplog.text.index("evaluating as trained") :]
    for line in ("max_new_tokens=40", "model.dtype=bfloat16", "max_prompt_tokens=120", "rollout.engine=hf"):
        assert f"  {line}\n" in block, line


def test_a_command_line_override_wins_over_the_run_and_is_logged(tmp_path, tiny_model, tiny_tok, caplog):
    run = run_folder(tmp_path / "run", tiny_model, tiny_tok, *RUN)
    over = ["eval=arith", f"checkpoint={run}", "max_new_tokens=30", "model.dtype=float32", "instruction=Box it."]
    with caplog.at_level(logging.INFO, logger="bapo.eval.adopt"):
        _, settings, job = _adopt(over)
    assert (job.run.max_new_tokens, job.model.dtype, job.run.instruction) == (30, "float32", "Box it.")
    assert job.run.max_prompt_tokens == 120 and job.model.answer_fallback == "last_number"  # the rest: the run's
    assert settings.kept == {
        "max_new_tokens": (30, 40),
        "model.dtype": ("float32", "bfloat16"),
        "instruction": ("Box it.", "Think step by step and box the answer."),
    }
    assert "max_new_tokens=30 (command line) overrides the run's 40" in caplog.text
    assert "model.dtype=float32 (command line) overrides the run's bfloat16" in caplog.text
    # a group on the command line covers its keys: model=tiny keeps eval.py's whole model group
    _, settings, job = _adopt(["eval=arith", f"checkpoint={run}", "model=tiny"])
    assert (job.model.dtype, job.model.answer_fallback) == ("float32", "none")
    assert job.run.max_new_tokens == 40  # the run's rollout.max_new_tokens is not part of the model group


VLLM_RUN = [
    "rollout=vllm",
    "rollout.gpu_memory_utilization=0.7",
    "rollout.tensor_parallel_size=2",
    "rollout.enforce_eager=true",
    "rollout.enable_sleep_mode=false",
]


def test_a_run_brings_its_engine_and_knobs(tmp_path, tiny_model, tiny_tok):
    run = run_folder(tmp_path / "run", tiny_model, tiny_tok, *VLLM_RUN)
    cfg, settings, job = _adopt(["eval=arith", f"checkpoint={run}", "k=3", "temperature=0.5"])
    r = cfg.rollout
    assert job.engine == "vllm" and (r.gpu_memory_utilization, r.tensor_parallel_size, r.enforce_eager) == (
        0.7,
        2,
        True,
    )
    assert r.enable_sleep_mode is True  # the sleep settings are training's business: eval.py's own default
    assert (r.n, r.temperature, r.max_new_tokens) == (3, 0.5, 48)  # sampling is eval.py's (the run's budget)
    assert "rollout.enable_sleep_mode" not in settings.taken and settings.taken["rollout.tensor_parallel_size"] == 2
    # an engine chosen on the command line wins, with its own knobs
    cfg, settings, job = _adopt(["eval=arith", f"checkpoint={run}", "rollout=hf"])
    assert job.engine == "hf" and "gpu_memory_utilization" not in cfg.rollout and settings.kept["rollout.engine"]
    # rollout=vllm (needed to set one of its knobs) picks the engine only: the knobs not given are still the run's
    cfg, settings, _ = _adopt(["eval=arith", f"checkpoint={run}", "rollout=vllm", "rollout.enforce_eager=false"])
    assert (cfg.rollout.enforce_eager, cfg.rollout.tensor_parallel_size) == (False, 2)
    assert settings.kept == {"rollout.engine": ("vllm", "vllm"), "rollout.enforce_eager": (False, True)}
    # a placement picks the engine and its knobs
    cfg, _, job = _adopt(["eval=arith", f"checkpoint={run}", "placement=gpu_node"])
    assert job.engine == "vllm" and (cfg.rollout.gpu_memory_utilization, cfg.rollout.tensor_parallel_size) == (0.7, 1)
    # and a run on the HF engine switches eval.py's vLLM back to it
    hf_run = run_folder(tmp_path / "hf_run", tiny_model, tiny_tok, "rollout.batch_size=7")
    cfg, _, job = _adopt(["eval=arith", f"checkpoint={hf_run}", "model=qwen7b"])  # qwen7b picks rollout=vllm
    assert job.engine == "hf" and cfg.rollout.batch_size == 7


def test_a_server_runs_url_is_never_adopted(tmp_path, tiny_model, tiny_tok):
    """A rollout=vllm_server run's servers hold its newest weights (or by now another run's): evaluating its
    checkpoint there would evaluate them. eval.py evaluates the checkpoint on its ranks' own engine instead."""
    run = run_folder(tmp_path / "run", tiny_model, tiny_tok, "rollout=vllm_server", "rollout.url='http://gen:8000'",
                      "rollout.enforce_eager=true")  # fmt: skip
    cfg, settings, job = _adopt(["eval=arith", f"checkpoint={run}"])
    assert job.engine == "vllm" and "url" not in cfg.rollout and cfg.rollout.enforce_eager is True
    assert "rollout.url" not in settings.taken
    cfg, settings, _ = _adopt(
        ["eval=arith", f"checkpoint={run}", "rollout=vllm_server", "rollout.url='http://mine:9000'"]
    )
    assert cfg.rollout.url == "http://mine:9000"  # given on the command line: eval.py gives it the checkpoint first


def test_a_split_run_is_evaluated_on_the_eval_ranks_own_engine(tmp_path, tiny_model, tiny_tok, monkeypatch):
    """placement=gpu_node_split: the run's vLLM servers had GPUs 4-7 of the training node to themselves. Before:
    eval.py took rollout.gpus='4,5,6,7' with the server engine, and each of the 8 ranks it launches on 8 GPUs
    refused it ('4 devices for 8 local ranks' servers'). The ranks' own vLLM engine now evaluates it, with the
    servers' knobs that apply to it (its memory share, tensor parallelism, eager mode)."""
    from bapo.entry import launch

    run = run_folder(tmp_path / "run", tiny_model, tiny_tok, "placement=gpu_node_split", "rollout.enforce_eager=true")
    over = ["eval=arith", f"checkpoint={run}"]
    cfg, settings, job = _adopt(over)
    r = cfg.rollout
    assert job.engine == "vllm" and settings.taken["rollout.engine"] == "vllm" and "gpus" not in r
    assert (r.gpu_memory_utilization, r.tensor_parallel_size, r.enforce_eager) == (0.9, 1, True)
    assert not [k for k in settings.taken if k.startswith("rollout.") and k.split(".")[1] in ("gpus", "url", "port")]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(launch.FAKE_DEVICES, "8")  # the launch's decision on an 8-GPU node: one rank a GPU
    h = launch.decide(_cfg(over), over, entry="eval")
    assert (h.nproc, h.chosen) == (8, "8 ranks, data-parallel")
    # the command line still picks the server engine, and its GPUs, where the user has them
    cfg, settings, job = _adopt([*over, "rollout=vllm_server", "rollout.gpus='4,5,6,7'"])
    assert job.engine == "vllm_server" and cfg.rollout.gpus == "4,5,6,7" and cfg.rollout.enforce_eager is True


def test_the_checkpoint_weights_an_engine_is_given_are_the_exports(tmp_path, tiny_model, tiny_tok):
    import torch

    from bapo.eval.adopt import checkpoint_weights

    run = run_folder(tmp_path / "run", tiny_model, tiny_tok)
    got = checkpoint_weights(run / "export")
    want = tiny_model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(ConfigError, match="holds no safetensors files"):
        checkpoint_weights(tmp_path)


def test_a_run_is_evaluated_end_to_end_as_trained(tmp_path, tiny_model, tiny_tok, monkeypatch):
    import bapo.engines

    built = {}
    real = bapo.engines.build_rollout
    monkeypatch.setattr(bapo.engines, "build_rollout", lambda *a, **kw: built.update(kw) or real(*a, **kw))
    run = run_folder(tmp_path / "run", tiny_model, tiny_tok, *RUN)
    over = ["eval=arith", "eval.limit=3", "k=2", "reward.num_workers=0", f"checkpoint={run}"]
    eval_run(_cfg(over), tmp_path / "out", over)
    results = _check_run_folder(tmp_path / "out", {"arith": 3}, 2)
    config = results["config"]
    assert config["model_path"] == str(run / "export") and config["run_config"] == str(run / "config.yaml")
    assert config["max_new_tokens"] == 40 and config["model"]["dtype"] == "bfloat16"
    assert config["from_run"]["instruction"] == "Think step by step and box the answer."
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples_arith.jsonl").read_text().splitlines()]
    assert all("Think step by step and box the answer." in r["prompt"] for r in rows)
    assert all(r["length"] <= 40 for r in rows)
    assert built["max_model_len"] == 120 + 40  # the run's prompt limit (under the 256-token context) + its budget


def test_a_bare_folder_sizes_the_engine_from_the_models_context(tmp_path, monkeypatch):
    import bapo.engines

    built = {}
    real = bapo.engines.build_rollout
    monkeypatch.setattr(bapo.engines, "build_rollout", lambda *a, **kw: built.update(kw) or real(*a, **kw))
    eval_run(_cfg([*TINY_RUN, "eval=arith", "reward.num_workers=0"]), tmp_path)
    assert built["max_model_len"] == 256  # the context: 208 prompt tokens + 48 new ones
    eval_run(_cfg([*TINY_RUN, "eval=arith", "reward.num_workers=0", "max_prompt_tokens=100"]), tmp_path / "b")
    assert built["max_model_len"] == 148


def test_checkpoint_errors_name_the_folder(tmp_path, tiny_model, tiny_tok):
    with pytest.raises(ConfigError, match="^checkpoint: .*does not exist"):
        find_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.yaml").write_text("seed: 1\n")
    with pytest.raises(ConfigError, match="^checkpoint: .*training run without an export"):
        find_checkpoint(str(tmp_path / "unfinished"))
    run = run_folder(tmp_path / "run", tiny_model, tiny_tok)
    (run / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"^checkpoint: .*config.yaml: cannot be read: not YAML at line 2"):
        _adopt([f"checkpoint={run}"])
    (run / "config.yaml").write_text("seed: 1\n")
    with pytest.raises(ConfigError, match="^checkpoint: .*is not a training run's config: it has no model.dtype"):
        _adopt([f"checkpoint={run}"])


def test_a_truncated_export_is_named(tmp_path, tiny_model, tiny_tok):
    tiny_model.save_pretrained(tmp_path)
    check_model_folder(str(tmp_path), "checkpoint")  # whole: nothing to say
    weights = tmp_path / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ConfigError, match=f"^checkpoint: {re.escape(str(weights))} is damaged or truncated"):
        check_model_folder(str(tmp_path), "checkpoint")


# ----------------------------------------------------------------------------- prompt length


def test_over_long_prompts_are_skipped_and_counted_as_in_training(tmp_path, shared_data, tiny_tok):
    """The tiny model's context is 256 tokens; with max_new_tokens=48 a prompt may have 208 (the
    tokenizer counts below, independently of the limit's code)."""
    from transformers import AutoConfig

    from bapo.data.loading import render_prompt

    assert AutoConfig.from_pretrained(ROOT / "assets" / "tiny-math").max_position_embeddings == 256
    problems = load_evalset(build_job(_cfg(["eval=aime24"])).sets["aime24"], limit=8)
    fits = [p.id for p in problems if len(render_prompt(p, tiny_tok).ids) <= 256 - 48]
    assert 0 < len(fits) < 8
    eval_run(_cfg(["eval=aime24", "eval.limit=8", "k=2", "max_new_tokens=48", "reward.num_workers=0"]), tmp_path)
    _check_run_folder(tmp_path, {"aime24": (len(fits), 8 - len(fits))}, 2)
    rows = [json.loads(line) for line in (tmp_path / "samples_aime24.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows[::2]] == fits
    # nothing under the limit: one error naming the set and the keys that make the limit
    with pytest.raises(ConfigError, match=r"^eval\.arith: all 3 prompts are longer than .*max_prompt_tokens=5"):
        eval_run(_cfg([*TINY_RUN, "eval=arith", "max_prompt_tokens=5"]), tmp_path / "none")
