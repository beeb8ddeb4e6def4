import json
import re

import pytest

from bapo.data import loading, tasks
from bapo.data.loading import ListSource, LoadReport, load_hub, load_jsonl, problem_sources, render_prompt
from bapo.data.tasks import ArithSource, ArithSpec, arith_heldout, arith_problem, careless, is_heldout
from bapo.samples import Problem
from tests.helpers.config import run_config
from tests.helpers.guards import alarm_guard


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


def test_a_binary_file_is_one_error_with_a_count_and_no_warning_per_row(tmp_path, caplog):
    # Before: a 200 kB binary file logged 737 "skipping malformed row" warnings before its error.
    f = tmp_path / "d.jsonl"
    f.write_bytes((bytes(range(0x80, 0xB1)) + b"\n") * 100)  # 100 rows, none of them UTF-8
    with caplog.at_level("WARNING"), pytest.raises(loading.DataFileError) as e:
        load_jsonl(f)
    assert caplog.records == []
    assert str(e.value).endswith(
        f"no valid rows (100 skipped; the first: {f}:1: invalid UTF-8 (byte 0x80 at column 1))"
    )


def test_many_malformed_rows_are_logged_a_few_then_once_with_a_count(tmp_path, caplog):
    f = tmp_path / "d.jsonl"
    good = '{"problem": "1+1?", "answer": "2"}\n'
    f.write_text(good + "not json\n" * 12 + good)
    rep = LoadReport()
    with caplog.at_level("WARNING"):
        rows = load_jsonl(f, report=rep)
    assert len(rows) == 2 and rep.skipped == 12
    logged = [r.getMessage() for r in caplog.records]
    assert logged[: loading.ROWS_LOGGED] == [
        f"skipping malformed row: {f}:{i}: invalid JSON (Expecting value)" for i in range(2, 7)
    ]
    assert logged[loading.ROWS_LOGGED :] == [f"skipping malformed rows: 7 more in {f} (12 in all)"]


def test_jsonl_missing_file_and_all_bad(tmp_path):
    from bapo.config import ConfigError

    with pytest.raises(ConfigError, match=r"^data\.path: no such file: .*nope\.jsonl"):
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
    cfg = run_config(
        "data=hub",
        f"data.path={f}",
        "data.problem_key=question",
        "data.answer_format=gsm8k",
        "data.heldout_frac=0.2",
        "data.heldout_size=10",
        "data.train_seed=0",
        "data.heldout_seed=0",
    ).data
    train, held, rep = problem_sources(cfg)  # fmt: skip
    assert len(held) == 10 and all(p.answer.endswith("000") and "," not in p.answer for p in held)
    held_texts = {p.problem for p in held}
    assert all(next(train).problem not in held_texts for _ in range(300))


def test_shared_math_sets_load(shared_data):
    for name in ("aime24.jsonl", "math500.jsonl", "gsm8k_test.jsonl", "train_math.jsonl"):
        rep = LoadReport()
        rows = load_jsonl(shared_data / name, report=rep)
        assert rows and rep.skipped == 0


def test_list_source_epochs_and_state():
    from bapo.samples import Problem

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
    from bapo.samples import Problem

    p = render_prompt(Problem("x", "What is 2 + 3?", "5"), tiny_tok)
    assert p.text.startswith("<|im_start|>user\nWhat is 2 + 3?\nPut the final answer in \\boxed{}.")
    assert p.text.endswith("<|im_start|>assistant\n")
    assert tiny_tok.decode(list(p.ids)) == p.text


# ----------------------------------------------------------------------------- hardening
# The new API is reached through the module (``loading.X``) so that, on code without it,
# each test fails on its own instead of the whole file failing to import.


def hang_guard():
    """A generous guard so an endless loop fails the test instead of hanging the suite."""
    return alarm_guard(60)


class CountingTokenizer:
    """The tiny tokenizer, recording the length of every text it is asked to encode (a rendered prompt is encoded)."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    def __getattr__(self, name):  # its chat template, special tokens and name: bapo.infra.chat_template renders
        return getattr(self.tok, name)

    def __call__(self, text, **kw):
        self.seen.append(len(text))
        return self.tok(text, **kw)


def as_key(p) -> tuple:
    """A prompt by value, whatever container its ids travel in."""
    return p.problem, p.text, [int(i) for i in p.ids]


def n_tokens(tok, problem: Problem) -> int:
    return len(render_prompt(problem, tok).ids)


def test_jsonl_invalid_utf8_line_is_skipped_with_its_line_number(tmp_path, caplog):
    f = tmp_path / "d.jsonl"
    f.write_bytes(
        b'{"problem": "1+1?", "answer": "2"}\n'
        b'{"problem": "caf\xe9?", "answer": "1"}\n'  # latin-1 e-acute: not UTF-8
        b'{"problem": "\xc3\xa9 + 1?", "answer": "3"}\n'  # the same letter in UTF-8 is fine
    )
    rep = LoadReport()
    with caplog.at_level("WARNING"):
        rows = load_jsonl(f, report=rep)
    assert [r.problem for r in rows] == ["1+1?", "\u00e9 + 1?"]
    assert rep.rows == 2 and rep.skipped == 1
    assert f"{f}:2: invalid UTF-8 (byte 0xe9" in caplog.text
    assert f"{f}:1" not in caplog.text and f"{f}:3" not in caplog.text


def test_jsonl_bom_before_row_1_is_dropped(tmp_path):
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"problem": "1+1?", "answer": "2"}\r\n{"problem": "2+2?", "answer": "4"}\r\n')
    rep = LoadReport()
    rows = load_jsonl(f, report=rep)
    assert [(r.id, r.problem, r.answer) for r in rows] == [("1", "1+1?", "2"), ("2", "2+2?", "4")]
    assert rep.skipped == 0


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "is empty"),
        (b"\n\n", "could not load"),
        (b'{"problem": "1+1?", "answer": "2"}\nnot json\n', "could not load"),
    ],
)
def test_hub_unreadable_local_file_is_a_value_error_naming_it(tmp_path, content, why):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(f)) + ".*" + why):
        load_hub(str(f), split="train")


def test_hub_rows_missing_a_field_stay_per_row_skips(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": null}\n')
    rep = LoadReport()
    rows = load_hub(str(f), split="train", report=rep)
    assert [r.problem for r in rows] == ["1+1?"] and rep.rows == 1 and rep.skipped == 1


def test_render_prompts_skips_over_long_rows_and_counts_them(tiny_tok, caplog):
    short, fits = Problem("s", "What is 2 + 3?", "5"), Problem("f", "What is 2 + 3 + 4?", "9")
    limit = n_tokens(tiny_tok, fits)  # exactly at the limit is allowed
    long = Problem("l", "What is " + " + ".join(["7"] * 20) + "?", "140")  # under the character cap
    absurd = Problem("a", "9" * (loading.MAX_CHARS_PER_TOKEN * limit + 1), "0")
    assert n_tokens(tiny_tok, long) > limit and len(long.problem) <= loading.MAX_CHARS_PER_TOKEN * limit
    tok = CountingTokenizer(tiny_tok)
    rep = LoadReport(rows=4)
    with caplog.at_level("WARNING"):
        out = loading.render_prompts([short, long, absurd, fits], tok, max_prompt_tokens=limit, report=rep)
    assert [p.problem.id for p in out] == ["s", "f"]
    assert as_key(out[0]) == as_key(render_prompt(short, tiny_tok))
    assert (rep.rows, rep.skipped, rep.too_long) == (4, 2, 2)
    assert max(tok.seen) < len(absurd.problem)  # the absurd row never reached the template or tokenizer
    logged = [r.getMessage() for r in caplog.records]
    assert sum("'l'" in m and "tokens > max_prompt_tokens" in m for m in logged) == 1
    assert sum("'a'" in m and "not tokenized" in m for m in logged) == 1
    # no limit: everything is rendered; a bad limit names the key
    assert len(loading.render_prompts([short, long], tiny_tok, max_prompt_tokens=None)) == 2
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        loading.render_prompts([short], tiny_tok, max_prompt_tokens=0)
    with pytest.raises(ValueError, match="^eval.aime.max_prompt_tokens: all 1 prompts are longer"):
        loading.render_prompts([long], tiny_tok, max_prompt_tokens=limit, limit_key="eval.aime.max_prompt_tokens")


def test_the_prompt_keywords_are_checked_where_they_are_given(tiny_tok):
    """render_prompts and PromptStream take PromptFit's keywords: a missing limit or a misspelt key fails at once."""
    rows = [Problem("s", "What is 2 + 3?", "5")]
    with pytest.raises(TypeError, match="max_prompt_tokens"):
        loading.render_prompts(rows, tiny_tok)
    with pytest.raises(TypeError, match="instructions"):
        loading.PromptStream(iter(rows), tiny_tok, max_prompt_tokens=64, instructions="Box it.")
    (prompt,) = loading.render_prompts(rows, tiny_tok, max_prompt_tokens=None, instruction="Box it.")
    assert prompt == next(loading.PromptStream(iter(rows), tiny_tok, max_prompt_tokens=None, instruction="Box it."))
    assert "Box it." in prompt.text and prompt == render_prompt(rows[0], tiny_tok, instruction="Box it.")


def long_and_short(tok, n_short: int, n_long: int) -> tuple[list[Problem], int]:
    """A shuffled-looking mix of problems under and over a limit, and that limit."""
    short = [Problem(f"s{i}", f"What is {i} + 1?", str(i + 1)) for i in range(n_short)]
    long = [Problem(f"l{i}", f"What is {i} + " + " + ".join(["7"] * 20) + "?", "0") for i in range(n_long)]
    limit = max(n_tokens(tok, p) for p in short)
    assert min(n_tokens(tok, p) for p in long) > limit
    mixed = [p for pair in zip(long, short, strict=False) for p in pair] + long[len(short) :] + short[len(long) :]
    return mixed, limit


def test_prompt_stream_skips_over_long_rows_and_counts_each_once(tiny_tok, caplog):
    problems, limit = long_and_short(tiny_tok, n_short=4, n_long=3)
    rep = LoadReport()
    stream = loading.PromptStream(ListSource(problems, seed=5), tiny_tok, max_prompt_tokens=limit, report=rep)
    with caplog.at_level("WARNING"), hang_guard():
        got = [next(stream) for _ in range(12)]  # three epochs of the four short rows
    # the reference: the same source, filtered by hand
    ref_src = ListSource(problems, seed=5)
    ref = [p for p in (next(ref_src) for _ in range(21)) if p.id.startswith("s")]
    assert [p.problem.id for p in got] == [p.id for p in ref]
    assert all(len(p.ids) <= limit for p in got) and as_key(got[0]) == as_key(render_prompt(ref[0], tiny_tok))
    assert (rep.skipped, rep.too_long) == (3, 3)  # each long row once, though drawn every epoch
    assert sorted(r.getMessage().split("'")[1] for r in caplog.records) == ["l0", "l1", "l2"]


def test_prompt_stream_state_round_trip_is_exact(tiny_tok):
    problems, limit = long_and_short(tiny_tok, n_short=5, n_long=5)
    stream = loading.PromptStream(ListSource(problems, seed=0), tiny_tok, max_prompt_tokens=limit)
    for _ in range(7):
        next(stream)
    state = json.loads(json.dumps(stream.state_dict()))
    assert state == json.loads(json.dumps(stream.source.state_dict()))
    after = [next(stream).problem.id for _ in range(9)]
    resumed = loading.PromptStream(ListSource(problems, seed=1), tiny_tok, max_prompt_tokens=limit)
    resumed.load_state_dict(state)
    assert [next(resumed).problem.id for _ in range(9)] == after

    # an endless arithmetic source, with a limit between the 2-term and 4-term prompts
    spec = ArithSpec(min_terms=2, max_terms=4)
    limit = n_tokens(tiny_tok, Problem("", "What is 10 + 10 + 10?", ""))
    arith = loading.PromptStream(
        ArithSource(seed=3, split="train", heldout_frac=0.1, spec=spec), tiny_tok, max_prompt_tokens=limit
    )
    for _ in range(10):
        next(arith)
    state = json.loads(json.dumps(arith.state_dict()))
    after = [as_key(next(arith)) for _ in range(20)]
    assert arith.report.too_long > 0 and all(len(ids) <= limit for _, _, ids in after)
    resumed = loading.PromptStream(
        ArithSource(seed=99, split="train", heldout_frac=0.1, spec=spec), tiny_tok, max_prompt_tokens=limit
    )
    resumed.load_state_dict(state)
    assert [as_key(next(resumed)) for _ in range(20)] == after


def test_prompt_stream_with_nothing_under_the_limit_raises(tiny_tok, monkeypatch):
    problems, limit = long_and_short(tiny_tok, n_short=1, n_long=6)
    only_long = [p for p in problems if p.id.startswith("l")]
    stream = loading.PromptStream(ListSource(only_long, seed=0), tiny_tok, max_prompt_tokens=limit)
    with (
        hang_guard(),
        pytest.raises(
            ValueError, match=f"max_prompt_tokens: no prompt fits in {limit} tokens.*whole epoch of the 6 rows"
        ),
    ):
        next(stream)
    assert stream.report.too_long == 6
    # one usable row among six long ones: streaks of skips span reshuffled epochs, yet never raise
    mixed = loading.PromptStream(ListSource(problems, seed=0), tiny_tok, max_prompt_tokens=limit)
    with hang_guard():
        assert {next(mixed).problem.id for _ in range(100)} == {"s0"}
    # an endless source of unknown size gives up after MAX_SKIP_STREAK skips in a row
    monkeypatch.setattr(loading, "MAX_SKIP_STREAK", 30)
    arith = loading.PromptStream(
        ArithSource(seed=0, split="train", heldout_frac=0.1, spec=ArithSpec()), tiny_tok, max_prompt_tokens=3
    )
    with hang_guard(), pytest.raises(ValueError, match="last 30 problems.*unknown size"):
        next(arith)


# ----------------------------------------------------------------------------- mixops (the exploration testbed)


def _precedence_value(expr: str) -> int:
    """Evaluate 'a op b op c ...' (+ - * with the usual precedence) by hand: no eval of text."""
    toks = expr.split()
    terms, sign, prod = [], 1, int(toks[0])
    for op, v in zip(toks[1::2], toks[2::2], strict=True):
        if op == "*":
            prod *= int(v)
        else:
            terms.append(sign * prod)
            sign, prod = (1 if op == "+" else -1), int(v)
    return sum(terms) + sign * prod


def _replay(lines: list[str]) -> list[tuple[int, str, int, int]]:
    """Each solution line 'a<op>b=c' as (a, op, b, c); the arithmetic of every line must hold."""
    out = []
    for line in lines:
        m = re.fullmatch(r"(-?\d+)([+\-*])(\d+)=(-?\d+)", line)
        assert m, line
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert {"+": a + b, "-": a - b, "*": a * b}[op] == c, line
        out.append((a, op, b, c))
    return out


def test_mixed_answers_follow_precedence_and_every_step_is_right():
    import random

    rng = random.Random(0)
    spec = tasks.MixedSpec()
    for _ in range(500):
        expr, lines, value = tasks.mixed_problem(rng, spec)
        assert _precedence_value(expr) == value, expr
        n = len(expr.split()) // 2 + 1
        assert spec.min_terms <= n <= spec.max_terms
        steps = _replay(lines)
        if steps:  # the last step produces the answer
            assert steps[-1][3] == value, (expr, lines)
        assert tasks.mixed_solution(lines, value).endswith(f"\\boxed{{{value}}}")


def test_mixed_precedence_hand_computed():
    # 2 + 3 * 4 = 2 + 12 = 14 (left to right without precedence would give 20)
    assert _precedence_value("2 + 3 * 4") == 14
    assert _precedence_value("20 - 9 * 7 + 5 * 7 + 3") == 20 - 63 + 35 + 3


def test_mixed_solutions_vary_in_strategy_and_length():
    import random

    rng = random.Random(1)
    spec = tasks.MixedSpec(min_terms=4, max_terms=4, p_mul=0.0)
    lengths, orders = set(), set()
    for _ in range(300):
        expr, lines, value = tasks.mixed_problem(rng, spec)
        lengths.add(len(lines))
        toks = expr.split()
        # the left-to-right solution, by hand: each step combines the running value with the next operand
        acc, ltr = int(toks[0]), []
        for op, v in zip(toks[1::2], toks[2::2], strict=True):
            new = acc + int(v) if op == "+" else acc - int(v)
            ltr.append(f"{acc}{op}{v}={new}")
            acc = new
        orders.add(lines == ltr)
    assert orders == {True, False}  # both strategies occur
    assert lengths == {3}  # n - 1 combining steps either way: strategy changes the order, not the count
    rng = random.Random(2)
    lengths = {len(tasks.mixed_problem(rng, tasks.MixedSpec())[1]) for _ in range(300)}
    assert lengths == {2, 3, 4}  # 3-5 operands: 2-4 steps (a product is one step as a sum is)


def test_mixed_split_is_disjoint_deterministic_and_named():
    spec = tasks.MixedSpec()
    held = tasks.mixed_split(100, seed=3, split="heldout", heldout_frac=0.1, spec=spec)
    train = tasks.mixed_split(300, seed=3, split="train", heldout_frac=0.1, spec=spec)
    assert len({p.problem for p in held}) == 100 and len({p.problem for p in train}) == 300
    assert not {p.problem for p in held} & {p.problem for p in train}
    assert all(is_heldout(p.problem, 0.1) for p in held)
    assert [p.problem for p in held] == [
        p.problem for p in tasks.mixed_split(100, seed=3, split="heldout", heldout_frac=0.1, spec=spec)
    ]
    assert all(p.answer == str(_precedence_value(p.problem[len("What is ") : -1])) for p in held)
    with pytest.raises(ValueError, match="split"):
        tasks.mixed_split(1, seed=0, split="test", heldout_frac=0.1, spec=spec)


def test_jsonl_relative_path_is_found_from_the_repo_root(tmp_path, monkeypatch):
    # data=mixops names its files relative to the repo; a run launched elsewhere must still find them
    monkeypatch.chdir(tmp_path)
    rc = run_config("data=mixops", "model=tiny_explore")
    train, held, _ = problem_sources(rc.data)
    assert len(held) == 200 and next(train).source == ""
    assert held[0].problem.startswith("What is ")


def test_mixed_long_lines_hand_computed():
    # 13 - 6 * 9 - 12: 9 added 6 times (5 additions), then left to right
    lines, value = tasks.mixed_long_lines("13 - 6 * 9 - 12")
    assert lines == ["9+9=18", "18+9=27", "27+9=36", "36+9=45", "45+9=54", "13-54=-41", "-41-12=-53"]
    assert value == 13 - 6 * 9 - 12
    # a chained product: 2 * 3 = 3+3, then 6 * 4 = 6+6+6+6
    assert tasks.mixed_long_lines("2 * 3 * 4") == (["3+3=6", "6+6=12", "12+6=18", "18+6=24"], 24)
    with pytest.raises(ValueError, match="not a mixops expression"):
        tasks.mixed_long_lines("2 / 3")


def test_mixed_long_lines_agree_with_precedence_and_are_longer():
    import random

    rng = random.Random(2)
    spec = tasks.MixedSpec()
    longer = 0
    for _ in range(500):
        expr, short, value = tasks.mixed_problem(rng, spec)
        lines, got = tasks.mixed_long_lines(expr)
        assert got == value == _precedence_value(expr), expr
        assert tasks.mixed_long_lines(expr, rng)[1] == value  # either factor as the base: the same answer
        steps = _replay(lines)  # every line is true arithmetic
        assert all(op in "+-" for _, op, _, _ in steps)  # products are repeated additions
        if steps:
            assert steps[-1][3] == value
        assert len(lines) >= len(short)
        longer += len(lines) > len(short)
    assert longer > 200  # most problems have a product, and then the long style is longer


def test_commuted_steps_stay_true_and_both_orders_occur():
    import random

    from scripts.build.build_tiny_explore_model import commute

    rng = random.Random(0)
    lines = ["9+9=18", "7*8=56", "13-54=-41", "-41-12=-53"]
    seen = set()
    for _ in range(50):
        out = commute(lines, rng)
        assert out[2:] == lines[2:]  # subtraction and negative operands are never swapped
        _replay(out)  # every line is still true
        seen.add(out[1])
    assert seen == {"7*8=56", "8*7=56"}
