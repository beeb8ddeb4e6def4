"""The statistics of study v5's pre-registered analysis (docs/study/v5/PLAN.md): pure functions of numbers.

- :func:`sign_flip_p`: the exact two-sided paired sign-flip permutation p-value, every one of the 2^n sign vectors
  enumerated (n = 20: 1,048,576), in vectorised chunks;
- :func:`fisher_exact`: Fisher's exact two-sided p for a 2 x 2 table, in integers (no rounding);
- :func:`mde`: the smallest paired mean difference a test at ``alpha`` detects with ``power``, from the spread of
  the differences (the usual t approximation);
- :func:`verdict`: a level's verdict word from its two contrasts, as the plan defines it.

Student-t intervals and Holm's correction are ``scripts/study_stats.py``'s (``t_interval``, ``paired_t``,
``holm``). ``tests/unit/scripts/test_study_v5.py`` checks each function against hand-computed values and an independent
reference (a plain loop over sign vectors, the exact distribution by convolution, Fisher by enumeration of tables).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts/ is read as a namespace package, as report.py does
from scripts.study.study_stats import Interval, t_quantile  # noqa: E402

ALPHA = 0.05  # Holm over the six primary tests
EQUIVALENCE = 0.02  # INERT: both 90% intervals inside (-0.02, +0.02)
EQUIVALENCE_LEVEL = 0.90  # a 90% interval inside the margin is two one-sided tests at 5% (TOST)
POWER = 0.80
N_TESTS = 6  # bapo - clip_higher and bapo - grpo at L1, L2, L3
MAX_EXACT_N = 24  # 2^24 sign vectors: beyond that the enumeration is too slow to be the default
CHUNK = 1 << 16  # sign vectors per matrix product
TIE_TOLERANCE = 1e-9  # accuracies are multiples of 1/2000: sums that equal the observed one differ only by rounding

HELPS, HURTS, INERT, INCONCLUSIVE = "HELPS", "HURTS", "INERT", "INCONCLUSIVE"


def sign_flip_p(diffs) -> float:
    """Exact two-sided p of the paired sign-flip permutation test of mean 0.

    Under the null each paired difference d_i is as likely to have come out -d_i, so every sign vector s in
    {-1, +1}^n is equally likely; the statistic is |sum_i s_i d_i| (the mean times n), and

        p = #{s : |sum_i s_i d_i| >= |sum_i d_i|} / 2^n,

    the identity included (p >= 2^-(n-1) when no d_i is 0, and p = 1 when every d_i is). A sum within
    TIE_TOLERANCE of the observed one counts as a tie (>=). NaNs are dropped; no value gives NaN.
    """
    d = np.asarray([x for x in diffs if math.isfinite(x)], dtype=np.float64)
    n = len(d)
    if n == 0:
        return math.nan
    if n > MAX_EXACT_N:
        raise ValueError(f"sign_flip_p enumerates 2^n sign vectors; n = {n} > {MAX_EXACT_N}")
    observed = abs(float(d.sum()))
    bits = np.arange(n, dtype=np.int64)  # bit i of a vector's index is the sign of d_i (1: flipped)
    total, count = 1 << n, 0
    for start in range(0, total, CHUNK):
        index = np.arange(start, min(start + CHUNK, total), dtype=np.int64)  # [C]
        signs = 1.0 - 2.0 * ((index[:, None] >> bits) & 1)  # [C, n] in {+1, -1}
        sums = np.abs(signs @ d)  # [C]
        count += int(np.count_nonzero(sums >= observed - TIE_TOLERANCE))
    return count / total


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Fisher's exact two-sided p for the table [[a, b], [c, d]] (rows: the two arms; columns: collapsed or not).

    With the margins fixed, the top-left cell x is hypergeometric: P(x) = C(a+b, x) C(c+d, a+c-x) / C(n, a+c).
    p sums P(x) over every x no more likely than the observed a (the usual two-sided rule). The numerators are
    integers over one denominator, so "no more likely" is compared exactly.
    """
    if min(a, b, c, d) < 0:
        raise ValueError(f"a table of counts, got {[[a, b], [c, d]]}")
    row1, row2, col1 = a + b, c + d, a + c
    n = row1 + row2
    if n == 0:
        return 1.0

    def weight(x: int) -> int:
        return math.comb(row1, x) * math.comb(row2, col1 - x)

    observed = weight(a)
    support = range(max(0, col1 - row2), min(row1, col1) + 1)
    return sum(w for w in (weight(x) for x in support) if w <= observed) / math.comb(n, col1)


def mde(sd: float, n: int, *, alpha: float = ALPHA / N_TESTS, power: float = POWER) -> float:
    """The paired mean difference a two-sided test at ``alpha`` detects with probability ``power``:

        (t_{1 - alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n),

    ``sd`` the standard deviation of the paired differences. The plan's alpha is 0.05 / 6, the strictest step of
    Holm over six (what the smallest p must beat); the sign-flip test's power is close to the t test's here.
    """
    if n < 2 or not math.isfinite(sd):
        return math.nan
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


class Contrast(NamedTuple):
    """One primary contrast (bapo minus a baseline, paired by seed) as the verdict reads it."""

    mean: float
    p_holm: float  # Holm-adjusted exact sign-flip p
    ci90: Interval  # paired-t 90% interval


def verdict(contrasts: list[Contrast], *, alpha: float = ALPHA, margin: float = EQUIVALENCE) -> str:
    """A level's verdict from its two contrasts (bapo - clip_higher, bapo - grpo), in the plan's order:

    - HELPS: both positive and significant (Holm-adjusted p < alpha);
    - HURTS: either negative and significant;
    - INERT: both 90% intervals inside (-margin, +margin) (equivalence);
    - INCONCLUSIVE: otherwise.

    HELPS and HURTS exclude each other; a significant contrast inside the margin with the other not significant
    is INERT.
    """
    sig = [c.p_holm < alpha for c in contrasts]
    if contrasts and all(s and c.mean > 0 for s, c in zip(sig, contrasts, strict=True)):
        return HELPS
    if any(s and c.mean < 0 for s, c in zip(sig, contrasts, strict=True)):
        return HURTS
    if contrasts and all(-margin < c.ci90.lo and c.ci90.hi < margin for c in contrasts):
        return INERT
    return INCONCLUSIVE
