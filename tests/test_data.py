import json

import pytest

from bapo.data import (
    ArithSource,
    ArithSpec,
    ListSource,
    LoadReport,
    arith_heldout,
    arith_problem,
    careless,
    is_heldout,
    load_hub,
    load_jsonl,
    problem_sources,
    render_prompt,
)


def test_arith_answers_are_right():
    import random

    rng = random.Random(0)
    for _ in range(200):
        expr, steps, ans = arith_problem(rng, ArithSpec(ops="+-*"))
        # independent check: evaluate left to right by hand-rolled parsing (no eval of text)
        toks = expr.split()
        acc = int(toks[0])
        for op, v in zip(toks[1::2], toks[2::2], strict=True):
            acc = {"+": acc + int(v), "-": acc - int(v), "*": acc * int(v)}[op]
        assert acc == ans
        assert steps[-1].endswith(f"= {ans}")


def test_careless_slips_hand_computed():
    assert careless("+", 47, 85) == 22  # 7+5=12 -> 2, 4+8=12 -> 2, carries dropped
    assert careless("+", 12, 34) == 46  # no carry: same as the right answer
    assert careless("-", 52, 38) == 26  # |2-8|=6, |5-3|=2
    assert careless("-", 38, 52) == -26
    assert careless("+", -3, 4) == 1  # negatives are never slipped


def test_heldout_split_is_disjoint_and_deterministic():
    spec = ArithSpec()
    held = arith_heldout(50, seed=1234, heldout_frac=0.1, spec=spec)
    assert [p.problem for p in held] == [p.problem for p in arith_heldout(50, seed=1234, heldout_frac=0.1, spec=spec)]
    assert len({p.problem for p in held}) == 50
    train = ArithSource(seed=7, split="train", heldout_frac=0.1, spec=spec)
    train_texts = {next(train).problem for _ in range(3000)}
    assert not train_texts & {p.problem for p in held}
    assert all(is_heldout(p.problem, 0.1) for p in held)


def test_arith_source_state_roundtrip():
    src = ArithSource(seed=3, split="train", heldout_frac=0.1, spec=ArithSpec())
    for _ in range(5):
        next(src)
    state = json.loads(json.dumps(src.state_dict()))  # survives a JSON trip
    a = [next(src).problem for _ in range(5)]
    src2 = ArithSource(seed=99, split="train", heldout_frac=0.1, spec=ArithSpec())
    src2.load_state_dict(state)
    assert [next(src2).problem for _ in range(5)] == a


def test_jsonl_malformed_rows_are_reported_and_skipped(tmp_path, caplog):
    f = tmp_path / "d.jsonl"
    f.write_text(
        '{"problem": "1+1?", "answer": "2"}\n'
        "not json\n"
        '{"problem": "2+2?"}\n'
        "\n"
        '{"problem": "", "answer": "3"}\n'
        '["a list"]\n'
        '{"problem": "3+3?", "answer": 6}\n'
    )
    rep = LoadReport()
    with caplog.at_level("WARNING"):
        rows = load_jsonl(f, report=rep)
    assert [r.answer for r in rows] == ["2", "6"]
    assert rep.rows == 2 and rep.skipped == 4
    text = caplog.text
    assert f"{f}:2" in text and "invalid JSON" in text
    assert f"{f}:3" in text and "'answer'" in text
    assert f"{f}:5" in text and f"{f}:6" in text


def test_jsonl_missing_file_and_all_bad(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    with pytest.raises(ValueError, match="no valid rows"):
        load_jsonl(bad)


def test_hub_loader_reads_local_files_through_datasets(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"work #### {i},000"}) for i in range(5)))
    rows = load_hub(str(f), split="train", problem_key="question")
    assert len(rows) == 5 and rows[0].problem == "q0"


def test_problem_sources_gsm8k_format_and_holdout(tmp_path):
    f = tmp_path / "g.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}?", "answer": f"so #### {i},000"}) for i in range(200)))
    train, held, rep = problem_sources(
        kind="hub",
        arith=ArithSpec(),
        train_seed=0,
        heldout_seed=0,
        heldout_frac=0.2,
        heldout_size=10,
        path=str(f),
        eval_path=None,
        split="train",
        eval_split=None,
        subset=None,
        problem_key="question",
        answer_key="answer",
        answer_format="gsm8k",
    )
    assert len(held) == 10 and all(p.answer.endswith("000") and "," not in p.answer for p in held)
    held_texts = {p.problem for p in held}
    assert all(next(train).problem not in held_texts for _ in range(300))


def test_shared_math_sets_load(shared_data):
    for name in ("aime24.jsonl", "math500.jsonl", "gsm8k_test.jsonl", "train_math.jsonl"):
        rep = LoadReport()
        rows = load_jsonl(shared_data / name, report=rep)
        assert rows and rep.skipped == 0


def test_list_source_epochs_and_state():
    from bapo.types import Problem

    probs = [Problem(str(i), f"p{i}", str(i)) for i in range(5)]
    src = ListSource(probs, seed=0)
    first = [next(src).id for _ in range(5)]
    assert sorted(first) == [str(i) for i in range(5)]
    state = src.state_dict()
    nxt = [next(src).id for _ in range(7)]
    src2 = ListSource(probs, seed=1)
    src2.load_state_dict(state)
    assert [next(src2).id for _ in range(7)] == nxt


def test_render_prompt_uses_chat_template(tiny_tok):
    from bapo.types import Problem

    p = render_prompt(Problem("x", "What is 2 + 3?", "5"), tiny_tok)
    assert p.text.startswith("<|im_start|>user\nWhat is 2 + 3?\nPut the final answer in \\boxed{}.")
    assert p.text.endswith("<|im_start|>assistant\n")
    assert tiny_tok.decode(list(p.ids)) == p.text
