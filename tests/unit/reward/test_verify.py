"""Verification: normalisation, equivalence, the worker pool, and agreement with labelled data."""

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from math_verify import parse, verify

from bapo.reward import MathVerifier, is_equivalent, normalize_answer, score_math
from bapo.reward.verify import same_normalized, verify_pair

REPO = Path(__file__).resolve().parents[3]
DATA = REPO.parent / "shared" / "data"

# (full response, gold answer, expected verdict). Written for these tests in the
# style of chain-of-thought completions; the last box counts.
# fmt: off
RESPONSES = [
    # integers and negatives
    (r"Each box holds 12 apples and there are 7 boxes, so $12 \cdot 7 = 84$. There are \boxed{84} apples.",
     "84", True),
    (r"The sum of the roots is $-b/a = 6$, and their product is 5. So the answer is $\boxed{6}$.", "6", True),
    (r"Substituting $x=2$ gives $3(2)-11=-5$. Therefore $f(2)=\boxed{-5}$.", "-5", True),
    (r"We have $4 - 9 = -5$, but we need the absolute value, so the distance is $\boxed{5}$.", "-5", False),
    (r"Counting the cases gives $6+4+2 = 12$ arrangements, so the answer is \boxed{12}.", "13", False),
    (r"There are $\binom{10}{3} = 120$ committees. \[\boxed{120}\]", "120", True),
    # fractions, decimals, \dfrac
    (r"The chance of exactly one head in two tosses is $2 \cdot \frac14$, i.e. $\boxed{\frac{1}{2}}$.",
     "0.5", True),
    (r"Dividing, $\frac{3}{8} = 0.375$. So the answer is $\boxed{0.375}$.", r"\frac{3}{8}", True),
    (r"Simplifying the ratio $\frac{14}{21}$ by 7 gives $\boxed{\dfrac{2}{3}}$.", r"\frac{2}{3}", True),
    (r"The slope is $\frac{5-1}{4-2}$, which is $\boxed{\tfrac{4}{2}}$.", "2", True),
    (r"So the fraction of red marbles is $\boxed{\frac{3}{5}}$.", r"\frac{2}{5}", False),
    (r"The mean is $\frac{7}{3} \approx 2.33$, so $\boxed{2.33}$.", r"\frac{7}{3}", False),
    (r"The probability is $\boxed{\frac12}$ since the two outcomes are symmetric.", r"\dfrac{1}{2}", True),
    # \left( ... \right), tuples, intervals, sets
    (r"Solving the system gives $x=1$, $y=2$, so the point is $\boxed{\left(1, 2\right)}$.", "(1,2)", True),
    (r"The midpoint is $\left(\frac{2+4}{2}, \frac{3+5}{2}\right) = \boxed{(3, 4)}$.", "(3,4)", True),
    (r"The intersection point is $\boxed{(2, 1)}$, found by elimination.", "(1,2)", False),
    (r"The inequality holds between the roots, so $x \in \boxed{[-2, 5]}$.", "[-2,5]", True),
    (r"Both endpoints are excluded, giving $\boxed{(-2, 5)}$.", "[-2,5]", False),
    (r"The domain excludes 3, so it is $\boxed{(-\infty, 3) \cup (3, \infty)}$.",
     r"(-\infty,3)\cup(3,\infty)", True),
    (r"The roots are $x = 1$ and $x = 2$, so the solution set is $\boxed{\{1, 2\}}$.", r"\{1,2\}", True),
    (r"Listing the roots in decreasing order: $\boxed{\{2, 1\}}$.", r"\{1,2\}", True),
    (r"The solutions are $\boxed{1, 2}$.", r"\{1,2\}", True),
    (r"The solutions are $\boxed{1, 3}$.", r"\{1,2\}", False),
    # matrices
    (r"Multiplying entry by entry, the product is $\boxed{\begin{pmatrix} 2 & 0 \\ 0 & 2 \end{pmatrix}}$.",
     r"\begin{pmatrix} 2 & 0 \\ 0 & 2 \end{pmatrix}", True),
    (r"The inverse is $\boxed{\begin{pmatrix} 1 & -2 \\ 0 & 1 \end{pmatrix}}$ as the determinant is 1.",
     r"\begin{pmatrix} 1 & 2 \\ 0 & 1 \end{pmatrix}", False),
    (r"So the vector is $\boxed{\begin{pmatrix} 3 \\ -1 \end{pmatrix}}$.",
     r"\begin{pmatrix}3\\-1\end{pmatrix}", True),
    # equations vs values
    (r"Isolating $x$: $2x + 1 = 7 \Rightarrow 2x = 6 \Rightarrow \boxed{x = 3}$.", "3", True),
    (r"Dividing both sides by 4 gives $\boxed{x=4}$.", "3", False),
    (r"The line through the points is $\boxed{y = 2x + 1}$.", "y=2x+1", True),
    # degrees, percent, units, money
    (r"The angles sum to $180^\circ$, so the third angle is $180 - 50 - 60 = \boxed{70^\circ}$.", "70", True),
    (r"Each interior angle of a regular hexagon is $\boxed{120^{\circ}}$.", r"120^\circ", True),
    (r"The price went from 80 to 88, an increase of $\frac{8}{80} = 10\%$. So \boxed{10\%}.", "10", True),
    (r"The discount is $\boxed{25\%}$ off the original price.", "20", False),
    (r"The perimeter is $2(3+4) = 14$, so the answer is $\boxed{14\text{ cm}}$.", "14", True),
    (r"The area is $\boxed{15\mbox{ cm}^2}$.", "15", True),
    (r"The total cost is $3 \times \$4.50 = \$13.50$, so \boxed{\$13.50}.", "13.5", True),
    (r"The trip ends at \boxed{4:30 \text{ p.m.}} after the two-hour drive.", r"\text{4:30 p.m.}", True),
    # thousands separators, leading zeros, big integers
    (r"Multiplying out, $25 \times 40 = 1000$, so \boxed{1,000} people attended.", "1000", True),
    (r"There are $\boxed{10,\!000}$ four-digit codes.", "10000", True),
    (r"That gives $\boxed{14{,}916}$ as the smallest value.", "14916", True),
    (r"The remainder when $N$ is divided by 1000 is $\boxed{033}$.", "33", True),
    (r"The remainder is $\boxed{033}$.", "303", False),
    (r"$2^{64} = \boxed{18446744073709551616}$.", "18446744073709551616", True),
    (r"$2^{64} - 1 = \boxed{18446744073709551615}$.", "18446744073709551616", False),
    (r"By the formula, $n! / (n-k)! = \boxed{6227020800}$ orderings.", "6,227,020,800", True),
    # radicals and pi
    (r"The diagonal of the unit square is $\sqrt{1^2+1^2} = \boxed{\sqrt{2}}$.", r"\sqrt2", True),
    (r"Rationalising, $\frac{1}{\sqrt{2}} = \boxed{\frac{\sqrt{2}}{2}}$.", r"\frac{1}{\sqrt{2}}", True),
    (r"The hypotenuse is $\sqrt{9+16} = \boxed{5\sqrt{1}}$.", "5", True),
    (r"Simplifying the radical, $\sqrt{72} = \boxed{6\sqrt{2}}$.", r"6\sqrt{2}", True),
    (r"Simplifying the radical, $\sqrt{72} = \boxed{3\sqrt{8}}$.", r"6\sqrt{2}", True),
    (r"Simplifying the radical, $\sqrt{72} = \boxed{2\sqrt{6}}$.", r"6\sqrt{2}", False),
    (r"The area of the circle of radius 3 is $\pi r^2 = \boxed{9\pi}$.", r"9\pi", True),
    (r"The circumference is $2\pi \cdot 3 = \boxed{6\pi}$.", r"9\pi", False),
    (r"The arc length is $\boxed{\frac{3\pi}{2}}$.", r"\frac{3}{2}\pi", True),
    (r"So the expression equals $\boxed{2 + \sqrt{3}}$.", r"\sqrt{3} + 2", True),
    # nested braces, \fbox, \boxed without braces, several boxes
    (r"Thus the value is $\boxed{\frac{\sqrt{\frac{1}{4}}}{2}}$.", r"\frac{1}{4}", True),
    (r"Simplifying the compound fraction gives $\boxed{\frac{1}{1+\frac{1}{2}}}$.", r"\frac{2}{3}", True),
    (r"Therefore the final count is \fbox{27}.", "27", True),
    (r"Hence the answer is $\boxed 5$.", "5", True),
    (r"Hence the answer is $\boxed 7$.", "5", False),
    (r"First I got \boxed{12}, but I double counted; dividing by 2 gives \boxed{6}.", "6", True),
    (r"First I got \boxed{6}, but I forgot the reflections; doubling gives \boxed{12}.", "6", False),
    # multiple choice and text
    (r"Only option C satisfies both conditions, so the answer is $\boxed{\text{(C)}}$.", "C", True),
    (r"Comparing average speeds, $\boxed{\text{Evelyn}}$ is the fastest.", r"\text{Evelyn}", True),
    # no box at all: no answer under the default settings
    (r"Adding the two numbers, 17 + 25 = 42. So the answer is 42.", "42", False),
    (r"We conclude that the answer is $\frac{1}{2}$.", r"\frac12", False),
    # degenerate outputs
    ("", "5", False),
    (r"\boxed{}", "5", False),
    (r"I am not sure how to solve this. \boxed{\text{no solution}}", "5", False),
    # more of each kind, so every family has true and false cases
    (r"Half of 0.8 is 0.4, so the answer is $\boxed{0.40}$.", "0.4", True),
    (r"The ratio simplifies to $\boxed{\dfrac{9}{12}}$, i.e. three quarters.", r"\frac{3}{4}", True),
    (r"Each share is $\boxed{\dfrac{5}{6}}$ of a pizza.", r"\frac{6}{5}", False),
    (r"The probability is $1 - 0.35 = \boxed{0.65}$.", r"\frac{13}{20}", True),
    (r"Solving $2x + 3 = 0$ gives $x = \boxed{-\frac{3}{2}}$.", "-1.5", True),
    (r"Solving $2x - 3 = 0$ gives $x = \boxed{\frac{3}{2}}$.", "-1.5", False),
    (r"Completing the square, the vertex is $\boxed{\left( -1, \frac{1}{2} \right)}$.", r"(-1,\frac{1}{2})", True),
    (r"The center of the circle is $\boxed{\left(2,-3\right)}$.", "(-3,2)", False),
    (r"Since the triangle is equilateral, each angle measures $\boxed{60^\circ}$.", r"60^\circ", True),
    (r"The supplement of $35^\circ$ is $\boxed{145^\circ}$.", "135", False),
    (r"Out of 40 students 14 passed, which is $\frac{14}{40} = \boxed{35\%}$.", "35", True),
    (r"The population grows by $\boxed{12.5\%}$ per year.", "12.5", True),
    (r"The tank holds $\boxed{250 \text{ liters}}$ when full.", "250", True),
    (r"Walking at 3 km/h for 2 hours covers $\boxed{6\text{ km}}$.", "5", False),
    (r"Since $f(x) = x^2 \ge 0$ and every value is reached, the range is $\boxed{[0, \infty)}$.",
     r"[0,\infty)", True),
    (r"The quadratic is negative strictly between its roots, so $x \in \boxed{(-3, 1)}$.", "(-3,1)", True),
    (r"The possible values of $k$ are $\boxed{\{-1, 0, 1\}}$.", r"\{-1,0,1\}", True),
    (r"Checking each case, the possible values of $k$ are $\boxed{\{-1, 1\}}$.", r"\{-1,0,1\}", False),
    (r"Back-substituting, the ordered triple is $\boxed{(1, 2, 3)}$.", "(1,2,3)", True),
    (r"Back-substituting, the ordered triple is $\boxed{(3, 2, 1)}$.", "(1,2,3)", False),
    (r"The product is the identity, $\boxed{\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}}$.",
     r"\begin{pmatrix}1&0\\0&1\end{pmatrix}", True),
    (r"Rotating by $90^\circ$ gives $\boxed{\begin{pmatrix} 0 & -1 \\ 1 & 0 \end{pmatrix}}$.",
     r"\begin{pmatrix}0&1\\-1&0\end{pmatrix}", False),
    (r"Subtracting the equations gives $\boxed{y = -2}$.", "-2", True),
    (r"Hence $\boxed{x = 5}$.", "x=3", False),
    (r"The last three digits of $7^{100}$ are $\boxed{001}$.", "1", True),
    (r"Taking the result modulo 1000 gives $\boxed{070}$.", "7", False),
    (r"Multiplying out gives $\boxed{123456789012345678901234567890}$.", "123456789012345678901234567890", True),
    (r"Summing the series gives $\boxed{99999999999999999999}$.", "100000000000000000000", False),
    (r"Thus $a + b = \fbox{-4}$.", "-4", True),
    (r"A heptagon has $\frac{7 \cdot 4}{2} = 14$ diagonals, so \fbox{20}.", "14", False),
    (r"The minimum is at $x = 0$, where $f(0) = 0$; the answer is $\boxed 0$.", "0", True),
    (r"The answer is $\boxed{\frac{1}{2^{3}}}$.", r"\frac{1}{8}", True),
    (r"Evaluating the tower from the top, $\boxed{2^{2^{2}}}$.", "16", True),
    (r"Part (a) gives \boxed{3}. Part (b) gives \boxed{5}, which is what is asked, so \boxed{5}.", "5", True),
    (r"We get \boxed{4} for the first case and \boxed{9} for the second.", "4", False),
    (r"The final answer is 42.", "42", False),
    (r"Therefore the number of arrangements is $5! = 120$.", "120", False),
]
# fmt: on

# With fallback="final_answer", an unboxed "final answer is ..." counts; a box still wins.
# fmt: off
FINAL_ANSWER_RESPONSES = [
    (r"Adding gives $17 + 25 = 42$. The final answer is 42.", "42", True),
    (r"So the final answer is $\frac{3}{4}$.", r"\frac34", True),
    (r"Therefore, the final answer is $x = 3$.", "3", True),
    (r"The final answer is 41.", "42", False),
    (r"I could not finish the computation.", "42", False),
    (r"The answer is 8, wait, the final answer is \boxed{7}.", "7", True),
]
# fmt: on


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(num_workers=2, timeout_s=5.0) as v:
        yield v


def _mismatches(got, table):
    return [(resp[-70:], gold, want, g) for g, (resp, gold, want) in zip(got, table, strict=True) if g != float(want)]


def test_response_table_size():
    assert len(RESPONSES) >= 100
    assert {want for _, _, want in RESPONSES} == {True, False}


def test_response_table_pool(verifier):
    rewards, stats = verifier.score([r for r, _, _ in RESPONSES], [g for _, g, _ in RESPONSES])
    assert _mismatches(rewards, RESPONSES) == []
    assert stats["reward/no_answer"] + stats["reward/fast_path"] + stats["reward/verified"] == len(RESPONSES)
    assert stats["reward/fast_path"] > 0 and stats["reward/verified"] > 0
    assert stats["reward/timeouts"] == 0 and stats["reward/worker_failures"] == 0


def test_response_table_in_process():
    v = MathVerifier(num_workers=0)
    rewards, _ = v.score([r for r, _, _ in RESPONSES], [g for _, g, _ in RESPONSES])
    assert _mismatches(rewards, RESPONSES) == []


def test_fallback_last_number_scores_unboxed_responses():
    v = MathVerifier(num_workers=0, fallback="last_number")
    rewards, stats = v.score(
        ["Adding the two numbers, 17 + 25 = 42. So the answer is 42.", "It costs 1,250 dollars.", "No idea."],
        ["42", "1250", "3"],
    )
    assert rewards == [1.0, 1.0, 0.0]
    assert stats["reward/no_answer"] == 1


def test_fallback_final_answer_table():
    v = MathVerifier(num_workers=0, fallback="final_answer")
    rewards, _ = v.score([r for r, _, _ in FINAL_ANSWER_RESPONSES], [g for _, g, _ in FINAL_ANSWER_RESPONSES])
    assert _mismatches(rewards, FINAL_ANSWER_RESPONSES) == []


def test_format_reward():
    v = MathVerifier(num_workers=0, format_reward=0.1)
    rewards, _ = v.score([r"\boxed{3}", r"\boxed{4}", "4"], ["3", "3", "3"])
    assert rewards == [1.0, 0.1, 0.0]


# --------------------------------------------------------------- normalisation

# Each of these fails with plain math-verify (both sides boxed) and passes here.
MV_WRONG = [
    (r"10\%", "10"),
    ("28 %", "28"),
    (r"4:30 \text{ p.m.}", r"\text{4:30 p.m.}"),
    ("x ∈ [-2,5]", r"x \in [-2,5]"),  # unicode symbols
    ("90°", "90"),
]


@pytest.mark.parametrize("pred, gold", MV_WRONG)
def test_normalisation_fixes_math_verify(pred, gold):
    plain = verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}"))
    assert not plain
    assert is_equivalent(pred, gold, timeout_s=5.0)


def test_bare_frac_is_wrapped_before_parsing():
    assert parse(r"\frac12") == []  # math-verify finds nothing in bare LaTeX
    assert is_equivalent(r"\frac12", "0.5", timeout_s=5.0)
    assert is_equivalent("0.5", r"\frac12", timeout_s=5.0)


# Each of these differs as a raw string and matches after normalisation, so the
# parent decides it without sympy or a worker.
FAST_PATH = [
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    (r"\tfrac12", r"\frac{1}{2}"),
    (r"\frac{3}4", r"\frac{3}{4}"),
    (r"\left(1, 2\right)", "(1,2)"),
    (r"\left\{1,2\right\}", r"\{1,2\}"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    (r"5\text{ cm}", "5"),
    (r"15\mbox{ cm}^2", "15"),
    (r"10 \text{ square units}", "10"),
    (r"10,\!000", "10000"),
    (r"11,\! 111,\! 111", "11111111"),
    ("1,000", "1000"),
    ("10{,}000", "10000"),
    ("033", "33"),
    ("-0", "0"),
    (r"\$13.50", "13.50"),
    (r"\sqrt3", r"\sqrt{3}"),
    ("(C)", "C"),
    (r"\text{(C)}", "C"),
    ("12 $ and $13", r"12\text{ and }13"),
    (r"\displaystyle 7", "7"),
    (r"2\,\text{cm}", "2"),
    ("−5", "-5"),
    ("$x$", "x"),
]


@pytest.mark.parametrize("pred, gold", FAST_PATH)
def test_normalisation_fast_path(pred, gold):
    assert pred != gold
    assert same_normalized(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [
        (r"12\text{ and }13", "1213"),
        ("5x", "5"),
        ("3 a", "3"),
        ("0.33", "033"),
        ("1,2", "12"),
        ("1, 000", "1000"),  # a list, not a thousands separator
        (r"10\%", "0.1"),  # percent is dropped, not divided
        ("(D)", "C"),
        ("", ""),
    ],
)
def test_normalisation_does_not_merge_different_answers(pred, gold):
    assert not same_normalized(pred, gold)


def test_normalize_answer_examples():
    assert normalize_answer(r"$\dfrac{1}{2}$.") == r"\frac{1}{2}"
    assert normalize_answer(r"\boxed{033}") == "33"
    assert normalize_answer(r"\left( 3, \frac12 \right)") == r"( 3, \frac{1}{2} )"


_LATEX_BITS = list("0123456789.,-+/$%{}()[] ^_xC") + [
    "\\frac", "\\dfrac", "\\left(", "\\right)", "\\text{", "\\!", "\\$", "\\circ", "\\%", "\\boxed{",
    "\\,", "\\\\", "°", "∈", "\\sqrt",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_LATEX_BITS), max_size=20).map("".join) | st.text(max_size=60))
def test_normalize_answer_total(s):
    assert isinstance(normalize_answer(s), str)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(-(10**12), 10**12),
    spell=st.sampled_from(["{}", "00{}", "{:,}", "{:,}.0"]),  # 42, 0042 (AIME), 1,234, 1,234.0
    wrap=st.sampled_from(["{}", "${}$", "\\boxed{{{}}}"]),
)
def test_integer_spellings_are_equivalent(n, spell, wrap):
    spelled = wrap.format(("-" if n < 0 else "") + spell.format(abs(n)))
    if not spell.endswith(".0"):
        assert same_normalized(spelled, str(n))  # decided in the parent, without sympy
    assert is_equivalent(spelled, str(n), timeout_s=5.0)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 50), q=st.integers(2, 50), k=st.integers(2, 9))
def test_scaled_fractions_are_equivalent(p, q, k):
    assert is_equivalent(f"\\dfrac{{{p * k}}}{{{q * k}}}", f"{p}/{q}", timeout_s=5.0)
    assert not is_equivalent(f"\\frac{{{p + q}}}{{{q}}}", f"{p}/{q}", timeout_s=5.0)


def test_huge_integer_does_not_raise():
    big = "9" * 5000  # past Python's int() digit limit
    assert normalize_answer("0" + big) == big
    assert verify_pair(big + "1", big, 2.0)[0] is False


def test_leading_zeros_and_signs():
    assert [normalize_answer(x) for x in ["000", "-00", "-0033", "0033x", "-"]] == ["0", "0", "-33", "0033x", "-"]


# Each used to make a regex in normalisation backtrack quadratically (times measured before
# the fix, at 100k characters, in the comments). Linear now: milliseconds. The bound is a hang guard.
SLOW_BEFORE = [
    "0" * 100_000 + "x",  # (-?)0*(\d+): 73 s
    r"\boxed{" + "0" * 100_000 + "x}",  # the same, reached through the box
    "90^" + " " * 100_000 + "x",  # \^\s*\{?\s*\\circ: 20 s
    "^" + "\n" * 100_000 + "x",  # the same, with newlines: 24 s
]


@pytest.mark.parametrize("s", SLOW_BEFORE, ids=["zeros", "boxed zeros", "degree spaces", "degree newlines"])
def test_normalisation_is_linear_on_long_runs(s):
    start = time.monotonic()
    normalize_answer(s)
    assert time.monotonic() - start < 5.0


def test_verify_pair_reports_timeout():
    start = time.monotonic()
    ok, timed_out = verify_pair("9^{9^{9^{9}}}", "1", 0.5)
    assert (ok, timed_out) == (False, True)
    assert time.monotonic() - start < 5.0


# --------------------------------------------------------------- labelled data


def _jsonl(name):
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{path} not found (shared data lives in ../shared/data next to the repo)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _agreement(rows, fallback):
    """Fraction of rows where the verifier's verdict matches ``expected``."""
    texts, golds = [], []
    for r in rows:
        # Bare answers are boxed, as the project grades the last box; gold_plain is the plain gold.
        texts.append(r["prediction"] if r["kind"] == "response" else "\\boxed{" + r["prediction"] + "}")
        golds.append(r["gold_plain"] if r["gold_plain"] is not None else r["gold"])
    with MathVerifier(num_workers=2, fallback=fallback) as v:
        rewards, _ = v.score(texts, golds)
    agree = [(reward == 1.0) == r["expected"] for reward, r in zip(rewards, rows, strict=True)]
    return sum(agree) / len(rows), [r["id"] for r, a in zip(rows, agree, strict=True) if not a]


@pytest.mark.slow
# Measured on grader_cases.jsonl (core tier, 268 rows):
#   default settings (fallback "none"): 234/268 = 87.3%. All 136 bare answers agree; of the
#     132 responses, 33 disagree because they have no box at all (expected True: "The answer
#     is 4", "Answer \[ 9 \]", matrices in prose) and one (gc-0165) boxes intermediate values
#     and states the final answer after the last box.
#   responses that contain a box, plus bare answers: 100% minus gc-0165.
#   fallback "last_line": 267/268 = 99.6% (only gc-0165).
# Lenient tier (139 rows), fallback "last_line": 117/139 = 84%. Disagreements: European
#   decimal commas (1000,99), a prediction that is one of several gold answers (multi-answer
#   golds such as "(2, 2), (6, 2)" vs "(6, 2)"), golds written as code ("2*pi"), and a
#   summation identity.
def test_grader_cases_core_agreement():
    rows = [r for r in _jsonl("grader_cases.jsonl") if r["tier"] == "core"]
    boxed = [r for r in rows if r["kind"] == "answer" or "boxed" in r["prediction"] or "fbox" in r["prediction"]]
    rate, wrong = _agreement(boxed, "none")
    print(f"\ngrader_cases core, boxed or bare answers, default settings: {rate:.1%} of {len(boxed)}; {wrong}")
    assert rate >= 0.99
    rate, wrong = _agreement(rows, "none")
    print(f"grader_cases core, all, default settings: {rate:.1%} of {len(rows)}")
    assert rate >= 0.85
    rate, wrong = _agreement(rows, "last_line")
    print(f"grader_cases core, all, fallback=last_line: {rate:.1%} of {len(rows)}; {wrong}")
    assert rate >= 0.99


@pytest.mark.slow
def test_grader_cases_lenient_agreement():
    rows = [r for r in _jsonl("grader_cases.jsonl") if r["tier"] == "lenient"]
    rate, wrong = _agreement(rows, "last_line")
    print(f"\ngrader_cases lenient, fallback=last_line: {rate:.1%} of {len(rows)}; {wrong}")
    assert rate >= 0.80


# Measured on real_generations.jsonl: 874/874 agree (737+57 correct, 63+17 wrong), through
# score_math with default settings. No disagreements to categorise.
def test_real_generations_agreement():
    rows = _jsonl("real_generations.jsonl")
    got = [score_math(r["response"], r["gold"]) for r in rows]
    assert all(type(x) is float for x in got)
    agree = sum((x == 1.0) == r["label"] for x, r in zip(got, rows, strict=True))
    print(f"\nreal_generations, score_math: {agree}/{len(rows)} = {agree / len(rows):.1%}")
    assert agree / len(rows) >= 0.99
