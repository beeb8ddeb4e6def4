"""Sampling metrics for evaluation: pass@k, avg@k and maj@k.

Pure functions over per-sample verdicts and extracted answers; no I/O, no model.

* ``pass@k``: the unbiased estimator of Chen et al. (2021), from ``n >= k``
  samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``, the chance
  that at least one of ``k`` samples drawn without replacement is correct.
  It is computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which needs no
  binomials (``C(1024, 512)`` overflows a float).
* ``avg@k``: the mean per-sample accuracy (the mean over problems of ``c/n``).
* ``maj@k``: the answer given most often, with answers written differently
  (``\\frac{1}{2}`` and ``0.5``) grouped by an equivalence callable. Ties go to
  the answer that appears first among the samples: the samples are i.i.d., so
  this is as fair as a coin and reproducible.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (needs ``1 <= k <= n``)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k): the chance that k draws are all wrong
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_ks(k: int) -> list[int]:
    """The k values pass@ is reported for: the powers of two below ``k``, and ``k``."""
    if k < 1:
        raise ValueError(f"need k >= 1, got {k}")
    ks = [1 << i for i in range(k.bit_length()) if (1 << i) < k]
    return [*ks, k]


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems; ``correct[i]`` holds problem i's per-sample verdicts."""
    return _mean([pass_at_k(len(row), sum(row), k) for row in correct])


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Mean per-sample accuracy: the mean over problems of the fraction of correct samples."""
    return _mean([sum(row) / len(row) for row in correct])


def ranked_answers(answers: Sequence[str | None]) -> list[str]:
    """The distinct answers, most frequent first, ties by first appearance; None (no answer) left out."""
    counts = Counter(a for a in answers if a is not None)
    first = {}
    for i, a in enumerate(answers):
        if a is not None:
            first.setdefault(a, i)
    return sorted(counts, key=lambda a: (-counts[a], first[a]))


def vote_pairs(answers: Sequence[str | None], *, max_distinct: int) -> list[tuple[str, str]]:
    """Every pair :func:`vote` may ask ``equivalent`` about, so a caller can judge them in one batch."""
    top = ranked_answers(answers)[:max_distinct]
    return [(a, b) for i, a in enumerate(top) for b in top[i + 1 :]]


def vote(
    answers: Sequence[str | None], equivalent: Callable[[str, str], bool], *, max_distinct: int = 8
) -> list[list[int]]:
    """Group one problem's samples by answer; returns sample indices per group, majority first.

    ``answers`` should already be normalised, so that equal strings are equal
    answers. The ``max_distinct`` most frequent distinct answers are then merged
    with ``equivalent(earlier, later)``: each joins the first group whose
    representative (its most frequent answer) it equals. That caps the pairwise
    work at ``max_distinct * (max_distinct - 1) / 2`` calls; rarer answers only
    group by string. Groups are ordered by size, then by their first sample.
    """
    ranked = ranked_answers(answers)
    reps: list[str] = []
    group_of: dict[str, int] = {}
    for j, a in enumerate(ranked):
        match = next((g for g, r in enumerate(reps) if equivalent(r, a)), None) if j < max_distinct else None
        if match is None:
            match = len(reps)
            reps.append(a)
        group_of[a] = match
    groups: list[list[int]] = [[] for _ in reps]
    for i, a in enumerate(answers):
        if a is not None:
            groups[group_of[a]].append(i)
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def majority(
    answers: Sequence[str | None], equivalent: Callable[[str, str], bool], *, max_distinct: int = 8
) -> int | None:
    """Index of the first sample that gave the majority answer; None if no sample gave an answer."""
    groups = vote(answers, equivalent, max_distinct=max_distinct)
    return groups[0][0] if groups else None


def maj_at_k(
    answers: Sequence[Sequence[str | None]],
    correct: Sequence[Sequence[bool]],
    equivalent: Callable[[str, str], bool],
    *,
    max_distinct: int = 8,
) -> float:
    """Fraction of problems whose majority answer is correct (judged by the verdict of its first sample)."""
    return majority_accuracy([majority(ans, equivalent, max_distinct=max_distinct) for ans in answers], correct)


def majority_accuracy(majorities: Sequence[int | None], correct: Sequence[Sequence[bool]]) -> float:
    """maj@k from each problem's majority sample (:func:`majority`; None: no answer at all) and the verdicts."""
    return _mean([i is not None and bool(ok[i]) for i, ok in zip(majorities, correct, strict=True)])


def _mean(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("no problems to average over")
    return sum(xs) / len(xs)
