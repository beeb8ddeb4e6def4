"""A row as a Problem (bapo/data/rows.py): dotted keys, chat prompts, the set's own instruction cut, answer formats,
and the rows no verifier can grade, refused with where they are."""

import json

import pytest

from bapo.data.loading import load_jsonl
from bapo.data.rows import LoadReport, RowFields, strip_texts

WHERE = "set[train] row 7"


def problem(row, **fields):
    return RowFields(**fields).problem_of(row, WHERE, 7)


def refused(row, **fields) -> str:
    with pytest.raises(ValueError) as e:
        problem(row, **fields)
    msg = str(e.value)
    assert msg.startswith(f"{WHERE}: "), msg  # where the row is, first
    return msg


VERL = {
    "data_source": "math_dapo",
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1? Box it."}],
    "reward_model": {"ground_truth": "2", "style": "rule"},
    "extra_info": {"index": 3},
}


def test_a_dotted_key_reaches_a_nested_field_and_a_chat_gives_its_user_message():
    p = problem(VERL, problem_key="prompt", answer_key="reward_model.ground_truth")
    assert (p.problem, p.answer, p.id, p.source) == ("What is 1+1? Box it.", "2", "7", "math_dapo")
    # the last user message of a multi-turn chat; a key that exists as it is wins over the dotted walk
    chat = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "q"},
    ]
    assert problem({"p": chat, "a.b": "1", "a": {"b": "2"}}, problem_key="p", answer_key="a.b").answer == "1"
    assert problem({"p": chat, "answer": "1"}, problem_key="p").problem == "q"


def test_a_missing_nested_field_names_the_path_and_what_is_there():
    msg = refused(VERL, problem_key="prompt", answer_key="reward_model.truth")
    assert "missing field 'reward_model.truth' (reward_model has ['ground_truth', 'style'])" in msg
    assert "missing field 'answer' (has [" in refused({"problem": "p"})


def test_a_chat_without_a_user_message_or_a_list_that_is_no_chat_is_refused():
    assert "no user message" in refused(
        {"prompt": [{"role": "system", "content": "s"}], "answer": "1"}, problem_key="prompt"
    )
    assert "not a chat" in refused({"prompt": ["just", "words"], "answer": "1"}, problem_key="prompt")
    assert "non-empty string" in refused(
        {"prompt": [{"role": "user", "content": ""}], "answer": "1"}, problem_key="prompt"
    )


def test_the_sets_own_instruction_is_cut_from_either_end_and_only_there():
    dapo = ("Solve it. The last line is Answer: $Answer.", 'Remember "Answer:".')
    text = f"{dapo[0]}\n\nWhat is 2+2?\n\n{dapo[1]}"
    assert strip_texts(text, dapo) == "What is 2+2?"
    # the same words inside the problem stay; a text that is not there changes nothing
    inside = f"Say 'Remember \"Answer:\".' twice. {dapo[1]}"
    assert strip_texts(inside, dapo) == "Say 'Remember \"Answer:\".' twice."
    assert strip_texts("  What is 2+2?  ", dapo) == "What is 2+2?"
    p = problem({"problem": text, "answer": "4"}, strip_instructions=list(dapo))
    assert p.problem == "What is 2+2?"
    assert "nothing but its instruction" in refused({"problem": dapo[1], "answer": "4"}, strip_instructions=dapo)


@pytest.mark.parametrize(
    ("truth", "answer"),
    [
        ('["204"]', "204"),
        ('["\\\\frac{1}{2}"]', "\\frac{1}{2}"),  # JSON's escaped backslash
        ('["7", "7"]', "7"),  # equal answers are one
        ("[3]", "3"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),  # not JSON: a plain answer
        ("12", "12"),
    ],
)
def test_json_list_answers_give_their_one_answer(truth, answer):
    assert problem({"problem": "p", "answer": truth}, answer_format="json_list").answer == answer


@pytest.mark.parametrize(
    ("truth", "why"),
    [
        ('["1", "2"]', "lists 2 different answers"),
        ("[]", "an empty list of answers"),
        ("", "is an empty string"),
        (None, "must be a string or number"),
        ('[["1"]]', "must be a string or number"),
        ("[NaN]", "NaN is not a number"),
    ],
)
def test_answers_no_verifier_can_grade_are_refused(truth, why):
    assert why in refused({"problem": "p", "answer": truth}, answer_format="json_list")


def test_a_list_column_of_answers_is_read_as_a_list_in_every_format():
    assert problem({"problem": "p", "answer": ["72"]}).answer == "72"
    assert "lists 2 different answers" in refused({"problem": "p", "answer": ["72", "73"]})
    assert problem({"problem": "p", "answer": "so #### 1,072"}, answer_format="gsm8k").answer == "1072"
    assert "has nothing after '####'" in refused({"problem": "p", "answer": "so ####"}, answer_format="gsm8k")


def test_jsonl_files_in_verl_layout_load_with_the_mapping_and_skip_ungradable_rows(tmp_path, caplog):
    f = tmp_path / "verl.jsonl"
    rows = [VERL, {**VERL, "reward_model": {"ground_truth": "", "style": "rule"}}, {**VERL, "prompt": []}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = LoadReport()
    fields = RowFields(problem_key="prompt", answer_key="reward_model.ground_truth", strip_instructions=("Box it.",))
    with caplog.at_level("WARNING"):
        (p,) = load_jsonl(f, fields=fields, report=report)
    assert (p.problem, p.answer) == ("What is 1+1?", "2")
    assert (report.rows, report.skipped) == (1, 2)
    assert f"{f}:2: field 'reward_model.ground_truth' is an empty string" in caplog.text
    assert f"{f}:3: field 'prompt' is a chat with no user message" in caplog.text


def test_an_unknown_answer_format_is_refused():
    with pytest.raises(ValueError, match="answer_format must be one of"):
        RowFields(answer_format="csv")
