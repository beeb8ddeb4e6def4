"""The statistics of a study report (``scripts/study/report.py``): Student-t intervals over seeds, the paired t of an
arm against its reference over shared seeds, and Holm-Bonferroni over a table's comparisons.

Pure functions of numbers, with no plotting or file reading, so ``tests/unit/scripts/test_report_stats.py`` checks
them against printed tables, an independent integral and a coverage simulation.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

LEVEL = 0.95  # every interval in the report
MIN_CLAIM_N = 5  # fewer seeds (or pairs): intervals are printed, and read as descriptive only
FLOOR_SHARE = 0.02  # a mean accuracy below this (fewer right answers than 2% of the eval samples): at the floor


def t_abs_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with an integer number of degrees of freedom ``df`` >= 1.

    The finite series of Abramowitz & Stegun 26.7.3-26.7.4, exact for integer df (seed counts make df = n - 1
    an integer). With theta = atan(t / sqrt(df)), c = cos(theta), s = sin(theta):

        df odd:  (2/pi) (theta + s (c + (2/3) c^3 + (2*4)/(3*5) c^5 + ... + c^(df-2) term)), theta alone at df = 1
        df even: s (1 + (1/2) c^2 + (1*3)/(2*4) c^4 + ... + c^(df-2) term)

    df = 1 gives 2 atan(t) / pi (the Cauchy), df = 2 gives t / sqrt(2 + t^2).
    """
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a positive integer, got {df}")
    t = abs(t)
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2 == 0:
        term = total = 1.0
        for k in range(1, df // 2):  # coefficients (1*3*...*(2k-1)) / (2*4*...*2k), powers c^2k
            term *= (2 * k - 1) / (2 * k) * c * c
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = c
    for k in range(1, (df - 1) // 2):  # coefficients (2*4*...*2k) / (3*5*...*(2k+1)), powers c^(2k+1)
        term *= 2 * k / (2 * k + 1) * c * c
        total += term
    return 2 / math.pi * (theta + s * total)


@functools.lru_cache(maxsize=256)
def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom, for 0.5 <= q < 1: the t with
    P(|T| <= t) = 2q - 1, found by bisection on :func:`t_abs_cdf` (monotone in t) to machine precision."""
    if not 0.5 <= q < 1:
        raise ValueError(f"q must be in [0.5, 1), got {q}")
    target = 2 * q - 1
    lo, hi = 0.0, 1.0
    while t_abs_cdf(hi, df) < target:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_abs_cdf(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


class Interval(NamedTuple):
    """A mean over seeds and its two-sided interval; ``p`` tests mean = 0 (the paired tables use it)."""

    mean: float
    lo: float
    hi: float
    n: int
    p: float


def t_interval(xs, *, level: float = LEVEL) -> Interval:
    """The mean of ``xs`` and its Student-t interval: mean ± t_{(1+level)/2, n-1} · s / sqrt(n), with s the
    sample standard deviation (ddof = 1), and the two-sided p-value of a t test of mean 0.

    Exact coverage for normal data at every n >= 2; skewed data cover less at small n (the coverage test in
    tests/unit/scripts/test_report_stats.py has the figures). Non-finite values are dropped. No value: NaNs; one
    value: the mean and no interval (NaN bounds); zero spread: a zero-width interval, p = 1 if the mean is 0
    and 0 otherwise.
    """
    x = np.asarray([v for v in xs if math.isfinite(v)], dtype=float)
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, math.nan)
    mean = float(x.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1, math.nan)
    se = float(x.std(ddof=1)) / math.sqrt(n)
    if se == 0:
        return Interval(mean, mean, mean, n, 1.0 if mean == 0 else 0.0)
    half = t_quantile((1 + level) / 2, n - 1) * se
    return Interval(mean, mean - half, mean + half, n, max(0.0, 1 - t_abs_cdf(mean / se, n - 1)))


def paired_t(arm: dict, reference: dict, *, level: float = LEVEL) -> Interval:
    """:func:`t_interval` of ``arm[s] - reference[s]`` over the seeds s both have (finite): the paired t.

    ``arm`` and ``reference`` map a seed to a value. Pairing by seed removes what the seed does to both runs
    alike (the same prompts, the same initial samples), so the interval is on the difference itself.
    """
    seeds = sorted(s for s in set(arm) & set(reference) if math.isfinite(arm[s]) and math.isfinite(reference[s]))
    return t_interval([arm[s] - reference[s] for s in seeds], level=level)


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the order given; NaN entries stay NaN and are not counted.

    With the m finite p-values sorted, p_(1) <= ... <= p_(m), the adjusted p_(i) is
    min(1, max_{j <= i} (m - j + 1) p_(j)). Rejecting where the adjusted p is below alpha keeps the chance of any
    false rejection among the m at most alpha, whatever their dependence.
    """
    order = sorted((p, i) for i, p in enumerate(pvalues) if math.isfinite(p))
    m = len(order)
    out = [math.nan] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out
