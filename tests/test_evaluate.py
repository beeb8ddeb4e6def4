"""Checkpoint evaluation: metrics on canned responses, the typed config, set loading, and
eval.py end to end on the tiny model (subprocess and compose API)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bapo.config import ConfigError
from bapo.evaluate import build_job, evaluate, evaluate_problems, evaluate_sets, load_evalset, named_set
from bapo.reward import MathVerifier
from bapo.types import Problem, Sample
from eval import run as eval_run

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SETS = sorted(p.stem for p in (CONF / "evaluation" / "eval").glob("*.yaml"))
SAMPLE_FIELDS = {"id", "sample", "prompt", "response", "extracted", "gold", "correct", "length", "truncated"}
SAMPLE_FIELDS |= {"share", "seed", "request"}  # where each sample's randomness came from (data-parallel eval)
TINY_RUN = ["eval.limit=3", "k=2", "max_new_tokens=48"]


def _cfg(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name="eval_config", overrides=overrides)


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


def test_metrics_on_canned_responses(tiny_tok):
    with MathVerifier(num_workers=0) as verifier:
        res = evaluate_problems(
            CannedRollout(RESPONSES), verifier, tiny_tok, PROBLEMS, k=4, temperature=1.0, instruction="Box it."
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
        res = evaluate_problems(CannedRollout(responses), verifier, tiny_tok, PROBLEMS[:1], k=4, temperature=1.0,
                                instruction="")  # fmt: skip
    assert res.metrics["maj@4"] == 1.0 and res.problems[0]["majority"] == "0.5"


def test_evaluate_sets_is_flat_and_evaluate_still_works(tiny_tok):
    from bapo.data import render_prompt

    rollout = CannedRollout(RESPONSES)
    with MathVerifier(num_workers=0) as verifier:
        flat = evaluate_sets(rollout, verifier, tiny_tok, {"a": PROBLEMS, "b": PROBLEMS[1:]}, k=4, temperature=1.0,
                             instruction="")  # fmt: skip
        old = evaluate(rollout, verifier, [render_prompt(p, tiny_tok) for p in PROBLEMS], n=4, temperature=1.0,
                       prefix="eval/")  # fmt: skip
    for s in ("a", "b"):
        for key in ("avg@4", "pass@1", "pass@2", "pass@4", "maj@4", "response_len", "truncated"):
            assert f"eval/{s}/{key}" in flat
    assert flat["eval/b/avg@4"] == 0.25 and flat["eval/a/avg@4"] == old["eval/accuracy"]
    assert old["eval/pass@4"] == 1.0


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", SETS)
def test_every_evalset_composes_and_validates(name):
    job = build_job(_cfg([f"eval={name}"]))
    assert list(job.sets) == [name]


@pytest.mark.parametrize("name", SETS)
def test_training_loads_a_set_by_name_as_eval_py_composes_it(name):
    # bapo.loop runs eval.sets through named_set, outside eval.py's Hydra config
    assert named_set(name, data_dir="/d") == build_job(_cfg([f"eval={name}", "paths.data_dir=/d"])).sets[name]


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
        (["eval=aime24", "eval.aime24.path=null"], "eval.aime24.path"),
        (["eval=heldout"], "eval.every"),  # training's held-out config, not a set
        (["model.dtype=int8"], "model.dtype"),
        (["reward.fallback=guess"], "reward.fallback"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ":"):
        build_job(_cfg(overrides))


def test_vllm_engine_composes():
    """eval.py rollout=vllm builds the vLLM engine (bapo.rollout.build_rollout); model=qwen7b picks it."""
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


def _check_run_folder(out: Path, sets: dict[str, int], k: int) -> dict:
    results = json.loads((out / "results.json").read_text())
    assert set(results["sets"]) == set(sets) and results["config"]["k"] == k
    for name, n in sets.items():
        r = results["sets"][name]
        assert r["n_problems"] == n and r["k"] == k and len(r["problems"]) == n
        keys = {f"avg@{k}", *(f"pass@{j}" for j in (1, 2)), f"maj@{k}", "response_len", "truncated"}
        assert keys <= set(r["metrics"])
        for key, v in r["metrics"].items():
            assert math.isfinite(v) and (key == "response_len" or 0.0 <= v <= 1.0), (key, v)
        assert r["metrics"]["pass@1"] == pytest.approx(r["metrics"][f"avg@{k}"])
        lines = (out / f"samples_{name}.jsonl").read_text().splitlines()
        assert len(lines) == n * k
        assert all(set(json.loads(line)) == SAMPLE_FIELDS for line in lines)
    table = (out / "results.md").read_text()
    assert table.startswith("| set | n | k | avg@2 | pass@1 | pass@2 | maj@2 |")
    assert all(f"| {name} | {n} | {k} |" in table for name, n in sets.items())
    return results


@pytest.mark.slow
def test_eval_py_subprocess(tmp_path):
    out = tmp_path / "run"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "eval.py", "model=tiny", "eval=arith", *TINY_RUN, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _check_run_folder(out, {"arith": 3}, 2)
    assert results["sets"]["arith"]["metrics"]["avg@2"] > 0  # the tiny model does arithmetic


def test_eval_compose_api_on_a_shared_set_is_deterministic(tmp_path, shared_data):
    over = ["eval=[arith,aime24]", "eval.limit=3", "k=2", "max_new_tokens=8", "reward.num_workers=0", "seed=3"]
    first = eval_run(_cfg(over), tmp_path / "a")
    _check_run_folder(tmp_path / "a", {"arith": 3, "aime24": 3}, 2)
    ids = [json.loads(line)["id"] for line in (tmp_path / "a" / "samples_aime24.jsonl").read_text().splitlines()]
    assert ids == ["aime24-I-01"] * 2 + ["aime24-I-02"] * 2 + ["aime24-I-03"] * 2
    # same seed, same samples; and a set's samples do not depend on the sets run before it
    eval_run(_cfg([*over[1:], "eval=aime24"]), tmp_path / "b")
    assert (tmp_path / "a" / "samples_aime24.jsonl").read_text() == (
        tmp_path / "b" / "samples_aime24.jsonl"
    ).read_text()
    assert set(first) == {"arith", "aime24"}


def test_checkpoint_loads_a_run_folders_export(tmp_path, tiny_model, tiny_tok):
    tiny_model.save_pretrained(tmp_path / "run" / "export")
    tiny_tok.save_pretrained(tmp_path / "run" / "export")
    over = [*TINY_RUN, "eval=arith", "reward.num_workers=0"]
    eval_run(_cfg([*over, f"checkpoint={tmp_path / 'run'}"]), tmp_path / "out")
    results = _check_run_folder(tmp_path / "out", {"arith": 3}, 2)
    assert results["config"]["model_path"] == str(tmp_path / "run" / "export")
    # the export folder itself works too, and gives the same samples as the shipped model it copies
    eval_run(_cfg([*over, f"checkpoint={tmp_path / 'run' / 'export'}"]), tmp_path / "out2")
    eval_run(_cfg(over), tmp_path / "out3")
    same = [(tmp_path / d / "samples_arith.jsonl").read_text() for d in ("out", "out2", "out3")]
    assert same[0] == same[1] == same[2]
