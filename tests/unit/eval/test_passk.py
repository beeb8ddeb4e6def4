"""pass@k, avg@k and maj@k: hand-computed cases, brute force over subsets, properties."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bapo.eval import passk as M
from bapo.reward import is_equivalent, normalize_answer


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 1, 0.3),  # pass@1 = c/n
        (6, 2, 3, 0.8),  # 1 - C(4,3)/C(6,3) = 1 - 4/20
        (10, 0, 5, 0.0),  # nothing correct
        (10, 10, 1, 1.0),  # everything correct
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
        (16, 1, 16, 1.0),  # k = n: any correct sample is drawn
        (1024, 1, 512, 0.5),  # 1 - C(1023,512)/C(1024,512) = 1 - 512/1024; the binomials overflow a float
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert M.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError):
        M.pass_at_k(n, c, k)


def test_pass_at_k_matches_subset_enumeration():
    """The estimator is the fraction of k-subsets of the n samples that hold a correct one."""
    for n in range(1, 9):
        for c in range(n + 1):
            verdicts = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(verdicts, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert M.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
                assert math.comb(n, k) == len(subsets)


@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_a_probability_and_monotone(nck):
    n, c, k = nck
    p = M.pass_at_k(n, c, k)
    assert 0.0 <= p <= 1.0
    if k < n:
        assert M.pass_at_k(n, c, k + 1) >= p
    if c < n:
        assert M.pass_at_k(n, c + 1, k) >= p
    assert M.pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_ks_are_powers_of_two_and_k():
    assert M.pass_ks(1) == [1]
    assert M.pass_ks(2) == [1, 2]
    assert M.pass_ks(6) == [1, 2, 4, 6]
    assert M.pass_ks(16) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError):
        M.pass_ks(0)


def test_avg_and_mean_pass_over_problems():
    correct = [[True, False, False, False], [True, True, True, True], [False] * 4]
    assert M.avg_at_k(correct) == pytest.approx((0.25 + 1 + 0) / 3)
    # pass@2 per problem: 0.5 (n=4, c=1), 1, 0
    assert M.mean_pass_at_k(correct, 2) == pytest.approx(1.5 / 3)
    assert M.mean_pass_at_k(correct, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        M.avg_at_k([])


def _math_equal(rep: str, cand: str) -> bool:
    return is_equivalent(cand, rep, timeout_s=None)


def test_maj_groups_answers_written_differently():
    raw = ["0.5", "3", "\\frac{1}{2}", "3", "\\dfrac12", None]
    keys = [None if a is None else normalize_answer(a) for a in raw]
    assert keys[2] == keys[4] != keys[0]  # \dfrac12 normalises to \frac{1}{2}; 0.5 needs math-verify
    groups = M.vote(keys, _math_equal)
    # {0.5, \frac{1}{2}, \dfrac12} has 3 votes, beating 3's two; the sample with no answer votes for nothing
    assert groups == [[0, 2, 4], [1, 3]]
    assert M.majority(keys, _math_equal) == 0
    gold_half = [a is not None and a != "3" for a in raw]
    assert M.maj_at_k([keys], [gold_half], _math_equal) == 1.0
    # without the equivalence, 3 (two votes) beats each spelling of 1/2 (\frac{1}{2} has two, but 3 came first)
    assert M.majority(keys, lambda a, b: False) == 1


def test_maj_ties_go_to_the_answer_given_first():
    assert M.vote(["3", "4", "4", "3"], lambda a, b: False) == [[0, 3], [1, 2]]
    assert M.majority(["4", "3", "3", "4"], lambda a, b: False) == 0
    assert M.majority([None, "7", "8"], lambda a, b: False) == 1
    assert M.majority([None, None], lambda a, b: False) is None
    # a problem with no answers counts as wrong
    assert M.maj_at_k([[None, None], ["1", "1"]], [[False, False], [True, True]], lambda a, b: False) == 0.5


def test_maj_caps_the_pairwise_work():
    asked = []

    def spy(a, b):
        asked.append((a, b))
        return a.lstrip("0") == b.lstrip("0")

    answers = ["1", "1", "1", "2", "2", "3", "01", "001"]
    groups = M.vote(answers, spy, max_distinct=3)
    # ranked: 1 (3 votes), 2 (2), 3, 01, 001; only the top 3 are compared, so 01 and 001 stay apart
    assert len(asked) <= 3 and set(asked) <= set(M.vote_pairs(answers, max_distinct=3))
    assert groups == [[0, 1, 2], [3, 4], [5], [6], [7]]
    asked.clear()
    assert M.vote(answers, spy, max_distinct=8)[0] == [0, 1, 2, 6, 7]
    assert set(asked) <= set(M.vote_pairs(answers, max_distinct=8))
    assert len(M.vote_pairs(answers, max_distinct=8)) == 10  # 5 distinct answers: C(5, 2) pairs at most
