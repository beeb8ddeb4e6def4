"""DAPO's overlong penalty, by hand: max_len=20, buffer=4, so the soft zone is 17..20 tokens."""

import pytest

from bapo.reward import overlong_penalty


@pytest.mark.parametrize(
    "length,expected",
    [
        (0, 0.0),
        (10, 0.0),
        (16, 0.0),  # 16 <= 20 - 4: no penalty
        (17, -0.25),  # (20 - 4 - 17) / 4
        (18, -0.5),  # (16 - 18) / 4
        (19, -0.75),  # (16 - 19) / 4
        (20, -1.0),  # (16 - 20) / 4: the whole budget used
        (21, -1.0),  # past max_len
        (500, -1.0),
    ],
)
def test_overlong_penalty_by_hand(length, expected):
    assert overlong_penalty(length, max_len=20, buffer=4) == pytest.approx(expected)


def test_overlong_penalty_off_and_odd_buffers():
    assert overlong_penalty(10_000, max_len=20, buffer=0) == 0.0  # buffer 0 = off, even past max_len
    assert overlong_penalty(20, max_len=20, buffer=1) == -1.0  # (19 - 20) / 1
    assert overlong_penalty(19, max_len=20, buffer=1) == 0.0
    assert overlong_penalty(5, max_len=20, buffer=20) == pytest.approx(-0.25)  # (0 - 5) / 20


def test_overlong_penalty_is_monotone_and_bounded():
    values = [overlong_penalty(n, max_len=64, buffer=16) for n in range(100)]
    assert all(-1.0 <= v <= 0.0 for v in values)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
