"""Local copies of the hub sets the data group names, in each set's own schema and file layout (as
``hf download <set> --repo-type dataset --local-dir <folder>`` leaves them), written by the tests: nothing is
downloaded. The problems are small arithmetic with answers the tests know."""

from __future__ import annotations

import json
from pathlib import Path

SKYWORK_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# (problem, answer): gradable, and each answer differs from the others
PROBLEMS = [
    ("What is $5 - 3$?", "2"),
    ("Compute $6 \\div 2$.", "3"),
    ("Find $x$ if $2x + 3 = 13$.", "5"),
    ("What is $\\frac{1}{4} + \\frac{1}{4}$?", "\\frac{1}{2}"),
    ("How many positive divisors does $12$ have?", "6"),
    ("Evaluate $2^{10}$.", "1024"),
]


def _parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _verl_row(source: str, content: str, truth: str, style: str, extra: dict, system: str | None = None) -> dict:
    chat = ([{"content": system, "role": "system"}] if system else []) + [{"content": content, "role": "user"}]
    return {
        "data_source": source,
        "prompt": chat,
        "ability": "math",
        "reward_model": {"ground_truth": truth, "style": style},
        "extra_info": extra,
    }


def write_skywork_or1(folder: Path, problems=PROBLEMS, *, bad_rows: bool = True) -> Path:
    """Skywork-OR1-RL-Data: a dataset card whose configs name the ``math`` and ``code`` splits (data/math-*,
    data/code-*), verl's layout, the ground truth a JSON list of answers, the DeepScaleR instruction after the
    problem; row 1's chat opens with a system message. ``bad_rows``: four math rows no verifier can grade (several
    answers, an empty list, an empty string, a ground truth of null), after the good ones."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: math\n    path: data/math-*\n"
        "  - split: code\n    path: data/code-*\n---\n# a local copy of Skywork-OR1-RL-Data's layout\n"
    )
    difficulty = {
        "DeepSeek-R1-Distill-Qwen-1.5B": 3,
        "DeepSeek-R1-Distill-Qwen-32B": 1,
        "DeepSeek-R1-Distill-Qwen-7B": 2,
    }
    rows = [
        _verl_row(
            "train-math-deepscaler",
            f"{p} {SKYWORK_INSTRUCTION}",
            json.dumps([a]),
            "rule",
            {"index": i, "model_difficulty": difficulty},
            system="You are a helpful assistant." if i == 1 else None,
        )
        for i, (p, a) in enumerate(problems)
    ]
    if bad_rows:
        for j, truth in enumerate([json.dumps(["1", "2"]), "[]", "", None]):
            extra = {"index": len(problems) + j, "model_difficulty": difficulty}
            rows.append(
                _verl_row("train-math-still3", f"Which is it ({j})? {SKYWORK_INSTRUCTION}", truth, "rule", extra)
            )
    _parquet(folder / "data" / "math-00000-of-00001.parquet", rows)
    truth = json.dumps({"inputs": ["1"], "outputs": ["1"]})
    code = [_verl_row("code", "Write a function f.", truth, "rule", {"index": 0, "model_difficulty": difficulty})]
    _parquet(folder / "data" / "code-00000-of-00001.parquet", code)
    return folder


def write_dapo_math(folder: Path, problems=PROBLEMS, *, copies: int = 3) -> Path:
    """DAPO-Math-17k: one parquet file (data/dapo-math-17k.parquet, split ``train``), verl's layout, each problem
    wrapped in DAPO's "Answer:" instruction and stored ``copies`` times (100 on the hub), each copy with an index of
    its own."""
    rows = [
        _verl_row(
            "math_dapo", f"{DAPO_PREFIX}{p}{DAPO_SUFFIX}", a, "rule-lawyer", {"index": f"{i:04d}-{c}"}
        )
        for c in range(copies)
        for i, (p, a) in enumerate(problems)
    ]  # fmt: skip
    _parquet(folder / "data" / "dapo-math-17k.parquet", rows)
    return folder


def write_deepscaler(folder: Path, problems=PROBLEMS) -> Path:
    """DeepScaleR-Preview-Dataset: one JSON file (deepscaler.json, a list), fields problem, answer and solution."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"problem": p, "answer": a, "solution": f"Work it out: $\\boxed{{{a}}}$"} for p, a in problems]
    (folder / "deepscaler.json").write_text(json.dumps(rows, indent=1))
    return folder
