"""Answer extraction: the last box, and the no-box fallbacks."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo.reward.extract import FALLBACKS, clean_answer, extract_answer, last_boxed, last_number


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is $\boxed{42}$.", "42"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped set braces do not count
        (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
        (r"\fbox{7}", "7"),
        (r"The answer is \boxed 5.", "5"),
        (r"$\boxed 12$", "12"),
        (r"First \boxed{3}, then we correct it: \boxed{4}", "4"),  # the last one counts
        (r"\boxed{ x = 3. }", "x = 3"),  # surrounding space and trailing period
        (r"\boxed{$\frac{1}{2}$}", r"\frac{1}{2}"),
        (r"\boxed{\text{(C)}}", r"\text{(C)}"),
        (r"\boxed{3\,}", r"3\,"),  # a LaTeX thin space is not punctuation
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "no box here, the answer is 5",
        r"\boxed{}",  # empty
        r"we get \boxed{5} and then \boxed{\frac{1}{2",  # the last box is truncated
        r"\boxedfoo{3}",  # not the \boxed command
    ],
)
def test_last_boxed_none(text):
    assert last_boxed(text) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She pays 12 dollars, so the total is 1,250.", "1250"),
        ("The temperature drops to -7 degrees.", "-7"),
        ("Subtracting, 10-3 = 7 and then 8 - 2", "2"),  # a minus after a digit is subtraction
        ("The probability is 3/4.", "3/4"),
        (r"The probability is $\frac{3}{4}$.", "3/4"),
        (r"so it is $\dfrac{-5}{12}$", "-5/12"),
        ("The answer is .5", ".5"),
        ("x2 and AZ9Q", None),  # digits inside words are not numbers
        ("it measures 1,000.99m² in total", "1000.99"),  # units glued on the end are fine
        ("12,000,023. I hope it is correct.", "12000023"),
        ("3.14159 rounds to 3.14", "3.14"),
        ("no digits at all", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_no_box_scores_nothing_by_default():
    text = "Adding the two gives 12 + 30 = 42. So the answer is 42."
    assert extract_answer(text) is None
    assert extract_answer(text, fallback="last_number") == "42"


def test_box_beats_fallback():
    text = r"We get \boxed{17}. Check: 17 + 1 = 18."
    for fallback in FALLBACKS:
        assert extract_answer(text, fallback=fallback) == "17"


def test_truncated_box_does_not_fall_back():
    # A response cut mid-box committed to no answer; an earlier number must not count.
    assert extract_answer(r"So 12 ... \boxed{\frac{3", fallback="last_number") is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Final Answer: The final answer is $(0, 1)$. I hope it is correct.", "(0, 1)"),
        ("The answer is 7.78. Thanks!", "7.78"),
        ("Reasoning...\nAnswer: 25\n", "25"),
        ("Answer: \\[\n x = 2 \n\\]\nDone.", "x = 2"),
        ("The answer is 5. Wait, the answer is 6.", "6"),
        ("no phrase here 3", None),
    ],
)
def test_final_answer_fallback(text, expected):
    assert extract_answer(text, fallback="final_answer") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Some work.\n\nThe result is $3$.\n\n", "The result is $3$"),
        ("Work.\nAnswer \\[ \n 9 \n \\]\n", "Answer \\[ \n 9 \n \\]"),  # widened to the whole display
        ("Work.\n$$\n10\n$$", "10"),
        ("   \n  ", None),
    ],
)
def test_last_line_fallback(text, expected):
    assert extract_answer(text, fallback="last_line") == expected


def test_unknown_fallback_names_the_allowed_values():
    with pytest.raises(ValueError, match="last_number") as err:
        extract_answer("x", fallback="first_number")
    for name in FALLBACKS:
        assert repr(name) in str(err.value)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("$5$", "5"),
        ("$$ 5 $$.", "5"),
        (r"\( x+1 \)", "x+1"),
        (r"\[ 2 \]", "2"),
        ("$a$ and $b$", "$a$ and $b$"),  # two math spans, not one wrapper
        ("7.", "7"),
        ("7.5", "7.5"),
    ],
)
def test_clean_answer(raw, expected):
    assert clean_answer(raw) == expected


_BOX_SAFE = st.text(alphabet=st.characters(blacklist_characters="{}\\$"), max_size=30)


@settings(max_examples=200, deadline=None)
@given(prefix=_BOX_SAFE, content=_BOX_SAFE, suffix=_BOX_SAFE)
def test_last_boxed_property(prefix, content, suffix):
    # Whatever surrounds it, the box's content comes back cleaned (or None when blank).
    got = last_boxed(prefix + "\\boxed{" + content + "}" + suffix)
    assert got == (clean_answer(content) or None)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200), fallback=st.sampled_from(FALLBACKS))
def test_extract_never_raises(text, fallback):
    got = extract_answer(text, fallback=fallback)
    assert got is None or (isinstance(got, str) and got == got.strip())


# Long runs of what the extraction regexes look for: each must be scanned in linear time
# (a hang guard; they take milliseconds), since extraction runs in the trainer, untimed.
_RUNS = ["0", "1,", " ", "\\", "{", "}", "\\frac{", "\\boxed{", "\\boxed", "$", "answer is ", "\n", "\\[", "1/", "-"]


@pytest.mark.parametrize("run", _RUNS)
@pytest.mark.parametrize("fallback", FALLBACKS)
def test_extraction_is_linear_on_long_runs(run, fallback):
    text = "x" + run * (40_000 // len(run)) + "x"
    start = time.monotonic()
    extract_answer(text, fallback=fallback)
    extract_answer("\\boxed{" + text, fallback=fallback)
    assert time.monotonic() - start < 5.0


def test_unicode_whitespace_before_trailing_punctuation_is_stripped():
    # found by hypothesis: NEL (\x85) is whitespace to str.strip but was left in front of a stripped ':'
    assert extract_answer("0\x85:", fallback="last_line") == "0"
    assert extract_answer("answer: 7\u00a0.", fallback="final_answer") == "7"
