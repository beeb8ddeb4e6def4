"""The synthetic tasks: problem generators with worked solutions, for the RL task and the build scripts.

* ``arith``: sums and differences of a few integers (:class:`ArithSpec`), the default task. A worked
  solution has one line per operation; :func:`careless` is the warm-start teacher's deliberate slip
  (no carry or borrow), which the outcome reward can teach the tiny model to stop making.
* ``mixops``: 3-5 operands with ``+ - *`` and the usual precedence (:class:`MixedSpec`); its solutions vary
  in order and strategy, and :func:`mixed_long_lines` writes products out by repeated addition (the
  long-CoT testbed's long, slip-prone style).

Train and held-out problems are split by a hash of the problem text (:func:`is_heldout`), so the splits never
overlap however many problems are drawn. The loaders and the prompt stream are :mod:`bapo.data.loading`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from bapo.samples import Problem

# ----------------------------------------------------------------------------- arithmetic


@dataclass(frozen=True)
class ArithSpec:
    """A family of arithmetic problems: ``num_terms`` operands in [min_value, max_value]."""

    min_terms: int = 2
    max_terms: int = 3
    min_value: int = 1
    max_value: int = 50
    ops: str = "+-"


def careless(op: str, a: int, b: int) -> int:
    """The classic slips: adding digit by digit without carrying, and subtracting the
    smaller digit from the larger in each column instead of borrowing. Used only to
    make the warm-start teacher imperfect (see scripts/build/build_tiny_model.py)."""
    if a < 0 or b < 0 or op not in "+-":
        return a + b if op == "+" else a - b if op == "-" else a * b
    if op == "-" and a < b:
        return -careless("-", b, a)
    da, db = str(a)[::-1], str(b)[::-1]
    digits = []
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        digits.append((x + y) % 10 if op == "+" else abs(x - y))
    return int("".join(map(str, digits))[::-1])


def arith_problem(rng: random.Random, spec: ArithSpec, slip_rate: float = 0.0) -> tuple[str, list[str], int]:
    """Draw one problem. Returns (expression, worked steps, final result of the steps).

    With ``slip_rate > 0`` each step is done carelessly with that probability, and the
    error carries into later steps, as a student's would.
    """
    n = rng.randint(spec.min_terms, spec.max_terms)
    values = [rng.randint(spec.min_value, spec.max_value) for _ in range(n)]
    ops = [rng.choice(spec.ops) for _ in range(n - 1)]
    expr = str(values[0])
    acc = values[0]
    steps = []
    for op, v in zip(ops, values[1:], strict=True):
        if slip_rate > 0 and rng.random() < slip_rate:
            new = careless(op, acc, v)
        else:
            new = acc + v if op == "+" else acc - v if op == "-" else acc * v
        steps.append(f"{acc} {op} {v} = {new}")
        expr += f" {op} {v}"
        acc = new
    return expr, steps, acc


def arith_solution(steps: Sequence[str], answer: int) -> str:
    """The worked solution the warm-start teaches: one line per step, then the box."""
    return "\n".join(steps) + f"\nThe answer is \\boxed{{{answer}}}."


def is_heldout(text: str, heldout_frac: float) -> bool:
    """Deterministic split by content hash (independent of seeds and draw order)."""
    h = int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")
    return (h % 10_000) < heldout_frac * 10_000


class ArithSource:
    """Endless stream of arithmetic problems from one split."""

    def __init__(self, *, seed: int, split: str, heldout_frac: float, spec: ArithSpec):
        if split not in ("train", "heldout"):
            raise ValueError(f"arith split must be 'train' or 'heldout', got {split!r}")
        self.rng = random.Random(seed)
        self.split = split
        self.heldout_frac = heldout_frac
        self.spec = spec

    def __iter__(self) -> Iterator[Problem]:
        return self

    def __next__(self) -> Problem:
        while True:
            expr, _, ans = arith_problem(self.rng, self.spec)
            text = f"What is {expr}?"
            if is_heldout(text, self.heldout_frac) == (self.split == "heldout"):
                pid = hashlib.sha1(text.encode()).hexdigest()[:12]
                return Problem(id=f"arith-{pid}", problem=text, answer=str(ans), source="arith")

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        st = state["rng"]
        self.rng.setstate((st[0], tuple(st[1]), st[2]))


def arith_heldout(n: int, *, seed: int, heldout_frac: float, spec: ArithSpec) -> list[Problem]:
    """A fixed, de-duplicated held-out set of n problems."""
    src = ArithSource(seed=seed, split="heldout", heldout_frac=heldout_frac, spec=spec)
    seen: dict[str, Problem] = {}
    for p in src:
        seen.setdefault(p.problem, p)
        if len(seen) == n:
            break
    return list(seen.values())


# ----------------------------------------------------------------------------- mixed operations


@dataclass(frozen=True)
class MixedSpec:
    """The ``mixops`` task: ``num_terms`` operands joined by ``+``, ``-`` and ``*`` with the usual precedence.

    Sums use operands in [1, max_value]; a factor of a product is in [2, max_factor], so products stay
    small and the work is the order of operations, not long multiplication.
    """

    min_terms: int = 3
    max_terms: int = 5
    max_value: int = 20
    max_factor: int = 9
    p_mul: float = 0.35  # the share of operators that are '*'


def _products(expr: str) -> tuple[list[list[int]], list[int]]:
    """A ``mixops`` expression's products (each a list of factors) and their signs."""
    parts = expr.split()
    values, ops = [int(v) for v in parts[::2]], parts[1::2]
    if len(ops) != len(values) - 1 or any(op not in "+-*" for op in ops):
        raise ValueError(f"not a mixops expression: {expr!r}")
    groups, signs = [[values[0]]], [1]
    for op, v in zip(ops, values[1:], strict=True):
        if op == "*":
            groups[-1].append(v)
        else:
            groups.append([v])
            signs.append(1 if op == "+" else -1)
    return groups, signs


def _left_to_right(terms: list[int], signs: list[int], lines: list[str]) -> int:
    """Combine signed terms left to right, one line per step appended to ``lines``; returns the value."""
    value = terms[0]
    for t, s in zip(terms[1:], signs[1:], strict=True):
        new = value + s * t
        lines.append(f"{value}{'+' if s > 0 else '-'}{t}={new}")
        value = new
    return value


def _worked(groups: list[list[int]], signs: list[int], rng: random.Random) -> tuple[list[str], int]:
    """The worked lines and value of signed products: the products in a random order, then the terms combined
    left to right or positives and negatives apart (probability 1/2 each). The one solver of both generators."""
    lines: list[str] = []
    terms = [g[0] for g in groups]
    products = [i for i, g in enumerate(groups) if len(g) > 1]
    rng.shuffle(products)
    for i in products:
        acc = groups[i][0]
        for f in groups[i][1:]:
            lines.append(f"{acc}*{f}={acc * f}")
            acc *= f
        terms[i] = acc
    if len(terms) > 1 and rng.random() < 0.5:  # positives and negatives apart, then the difference
        pos = [t for t, s in zip(terms, signs, strict=True) if s > 0]
        neg = [t for t, s in zip(terms, signs, strict=True) if s < 0]
        sums = []
        for part in (pos, neg):
            acc = part[0] if part else 0
            for t in part[1:]:
                lines.append(f"{acc}+{t}={acc + t}")
                acc += t
            sums.append(acc)
        value = sums[0] - sums[1]
        if neg:
            lines.append(f"{sums[0]}-{sums[1]}={value}")
    else:  # left to right
        value = _left_to_right(terms, signs, lines)
    return lines, value


def mixed_problem(rng: random.Random, spec: MixedSpec) -> tuple[str, list[str], int]:
    """Draw one expression and a correct worked solution by one of several strategies.

    Returns (expression, solution lines, value). The products are worked out first, in a random order;
    the remaining signed terms are then combined either left to right, or by adding up the positive
    terms and the negative terms separately and taking the difference. Both strategies are right: the
    solution's length and its order of steps vary, which is where a warm-started policy keeps real
    uncertainty (``scripts/build/build_tiny_explore_model.py``).
    """
    n = rng.randint(spec.min_terms, spec.max_terms)
    ops = ["*" if rng.random() < spec.p_mul else rng.choice("+-") for _ in range(n - 1)]
    # Group the operands into products: a run of '*' joins neighbours into one factor list.
    groups: list[list[int]] = [[]]
    signs = [1]
    values = []
    for i in range(n):
        is_factor = (i > 0 and ops[i - 1] == "*") or (i < n - 1 and ops[i] == "*")
        v = rng.randint(2, spec.max_factor) if is_factor else rng.randint(1, spec.max_value)
        values.append(v)
        if i > 0 and ops[i - 1] != "*":
            groups.append([])
            signs.append(1 if ops[i - 1] == "+" else -1)
        groups[-1].append(v)
    expr = str(values[0]) + "".join(f" {op} {v}" for op, v in zip(ops, values[1:], strict=True))
    lines, value = _worked(groups, signs, rng)
    return expr, lines, value


def mixed_long_lines(expr: str, rng: random.Random | None = None) -> tuple[list[str], int]:
    """A long, slip-prone worked solution of a ``mixops`` expression: products by repeated addition.

    ``7 * 8`` becomes ``8+8=16``, ``16+8=24``, ... ``48+8=56`` (the larger factor added, one line per
    addition; with ``rng``, either of two one-digit factors, at random, so ``7 * 8`` may also take 7 lines
    of ``+7``), then
    the signed terms are combined left to right. Every line is true, but a solution has
    several times the steps of :func:`mixed_problem`'s, so a model that slips now and then is wrong
    more often on it and its failures are long: the long-chain-of-thought regime of the BAPO paper, where
    failed responses outnumber the right ones in tokens (``model=tiny_longcot``).
    """
    groups, signs = _products(expr)
    lines: list[str] = []
    terms = []
    for g in groups:
        acc = g[0]
        for f in g[1:]:
            base, count = max(acc, f), min(acc, f)
            if rng is not None and acc < 10 and rng.random() < 0.5:  # two one-digit factors
                base, count = count, base
            total = base
            for _ in range(count - 1):
                lines.append(f"{total}+{base}={total + base}")
                total += base
            acc *= f
        terms.append(acc)
    return lines, _left_to_right(terms, signs, lines)


def mixed_lines(expr: str, rng: random.Random) -> tuple[list[str], int]:
    """A fresh correct worked solution of a given ``mixops`` expression, by :func:`mixed_problem`'s strategies.

    The products first, in a random order, then the signed terms left to right or the positive and the negative
    terms apart and their difference (each with probability 1/2), as :func:`mixed_problem` solves the expression
    it draws. A second attempt at the same problem, as the rambling style of the warm start writes one after
    another (``scripts/build/build_tiny_explore_model.py --ramble-share``). Returns (solution lines, value).
    """
    groups, signs = _products(expr)
    return _worked(groups, signs, rng)


def mixed_solution(lines: Sequence[str], answer: int) -> str:
    """The worked solution the ``mixops`` warm start teaches: one line per step, then the box."""
    return "\n".join([*lines, f"\\boxed{{{answer}}}"])


def mixed_split(n: int, *, seed: int, split: str, heldout_frac: float, spec: MixedSpec) -> list[Problem]:
    """``n`` distinct ``mixops`` problems of one split (by the hash of their text, as :func:`is_heldout`)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"mixops split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(seed)
    seen: dict[str, Problem] = {}
    while len(seen) < n:
        expr, _, ans = mixed_problem(rng, spec)
        text = f"What is {expr}?"
        if is_heldout(text, heldout_frac) == (split == "heldout") and text not in seen:
            pid = hashlib.sha1(text.encode()).hexdigest()[:12]
            seen[text] = Problem(id=f"mixops-{pid}", problem=text, answer=str(ans), source="mixops")
    return list(seen.values())
