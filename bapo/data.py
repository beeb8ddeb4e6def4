"""Problem sources and prompt rendering.

Three sources, one interface (an iterable of :class:`Problem`):

* ``arith``: a synthetic arithmetic generator with its own seed. Train and
  held-out problems are split by a hash of the problem text, so the two splits
  never overlap however many problems are drawn.
* ``jsonl``: local JSONL files with ``problem`` and ``answer`` fields. A
  malformed row is reported with its file and line, skipped and counted.
* ``hub``: any ``datasets`` dataset, by hub name or local path.

Prompts go through the tokenizer's chat template with an instruction to put the
final answer in ``\\boxed{}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bapo.types import Problem, Prompt

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = "Put the final answer in \\boxed{}."


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
    make the warm-start teacher imperfect (see scripts/build_tiny_model.py)."""
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


# ----------------------------------------------------------------------------- files and hub


@dataclass
class LoadReport:
    """What a loader read, and what it had to skip."""

    rows: int = 0
    skipped: int = 0


def _row_to_problem(row: object, where: str, problem_key: str, answer_key: str, idx: int) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in (problem_key, answer_key):
        if key not in row:
            raise ValueError(f"{where}: missing field {key!r} (has {sorted(row)})")
    prob, ans = row[problem_key], row[answer_key]
    if not isinstance(prob, str) or not prob.strip():
        raise ValueError(f"{where}: field {problem_key!r} must be a non-empty string")
    if isinstance(ans, bool) or not isinstance(ans, str | int | float):
        raise ValueError(f"{where}: field {answer_key!r} must be a string or number, got {ans!r}")
    return Problem(id=str(row.get("id", idx)), problem=prob, answer=str(ans), source=str(row.get("source", "")))


def load_jsonl(
    path: str | Path,
    *,
    problem_key: str = "problem",
    answer_key: str = "answer",
    report: LoadReport | None = None,
) -> list[Problem]:
    """Read problems from a JSONL file. Malformed rows are logged with file:line and skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    report = report if report is not None else LoadReport()
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                out.append(_row_to_problem(json.loads(line), where, problem_key, answer_key, lineno))
                report.rows += 1
            except (json.JSONDecodeError, ValueError) as e:
                report.skipped += 1
                msg = f"{where}: invalid JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
                log.warning("skipping malformed row: %s", msg)
    if not out:
        raise ValueError(f"{path}: no valid rows ({report.skipped} skipped)")
    return out


def load_hub(
    name: str,
    *,
    split: str,
    subset: str | None = None,
    problem_key: str = "problem",
    answer_key: str = "answer",
    report: LoadReport | None = None,
) -> list[Problem]:
    """Load problems through ``datasets`` (a hub name, a local folder, or a data file)."""
    import datasets

    report = report if report is not None else LoadReport()
    p = Path(name)
    if p.is_file():
        ds = datasets.load_dataset(p.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(p), split=split)
    else:
        ds = datasets.load_dataset(name, subset, split=split)
    out = []
    for i, row in enumerate(ds):
        try:
            out.append(_row_to_problem(row, f"{name}[{split}] row {i}", problem_key, answer_key, i))
            report.rows += 1
        except ValueError as e:
            report.skipped += 1
            log.warning("skipping malformed row: %s", e)
    if not out:
        raise ValueError(f"{name}[{split}]: no valid rows ({report.skipped} skipped)")
    return out


class ListSource:
    """Endless, reshuffled-per-epoch stream over a fixed list of problems."""

    def __init__(self, problems: Sequence[Problem], *, seed: int, shuffle: bool = True):
        self.problems = list(problems)
        self.rng = random.Random(seed)
        self.shuffle = shuffle
        self.epoch, self.pos = 0, 0
        self.order = self._new_order()

    def _new_order(self) -> list[int]:
        order = list(range(len(self.problems)))
        if self.shuffle:
            self.rng.shuffle(order)
        return order

    def __iter__(self) -> Iterator[Problem]:
        return self

    def __next__(self) -> Problem:
        if self.pos == len(self.order):
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = self._new_order()
        self.pos += 1
        return self.problems[self.order[self.pos - 1]]

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "epoch": self.epoch, "pos": self.pos, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        st = state["rng"]
        self.rng.setstate((st[0], tuple(st[1]), st[2]))
        self.epoch, self.pos, self.order = state["epoch"], state["pos"], list(state["order"])


# ----------------------------------------------------------------------------- prompts


def render_prompt(problem: Problem, tokenizer, *, instruction: str = DEFAULT_INSTRUCTION) -> Prompt:
    """Render a problem through the chat template and tokenize it."""
    content = f"{problem.problem}\n{instruction}" if instruction else problem.problem
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(problem=problem, text=text, ids=tuple(ids))


# ----------------------------------------------------------------------------- assembly


def gsm8k_answer(p: Problem) -> Problem:
    """GSM8K's hub rows end their worked answer with '#### 72'; keep the number."""
    ans = p.answer.split("####")[-1].strip().replace(",", "")
    return Problem(id=p.id, problem=p.problem, answer=ans, source=p.source)


def problem_sources(
    *,
    kind: str,
    arith: ArithSpec,
    train_seed: int,
    heldout_seed: int,
    heldout_frac: float,
    heldout_size: int,
    path: str | None,
    eval_path: str | None,
    split: str,
    eval_split: str | None,
    subset: str | None,
    problem_key: str,
    answer_key: str,
    answer_format: str,
) -> tuple[Iterator[Problem], list[Problem], LoadReport]:
    """The training stream, the fixed held-out set, and what loading skipped."""
    report = LoadReport()
    if kind == "arith":
        train = ArithSource(seed=train_seed, split="train", heldout_frac=heldout_frac, spec=arith)
        return (
            train,
            arith_heldout(heldout_size, seed=heldout_seed, heldout_frac=heldout_frac, spec=arith),
            report,
        )

    def load(where: str, which: str) -> list[Problem]:
        keys = dict(problem_key=problem_key, answer_key=answer_key, report=report)
        if kind == "jsonl":
            rows = load_jsonl(where, **keys)
        else:
            rows = load_hub(where, split=which, subset=subset, **keys)
        return [gsm8k_answer(p) for p in rows] if answer_format == "gsm8k" else rows

    rows = load(path, split)
    if eval_path or (kind == "hub" and eval_split):
        train_rows, held = rows, load(eval_path or path, eval_split or split)
    else:  # hold out a hash-chosen slice of the training rows
        train_rows = [p for p in rows if not is_heldout(p.problem, heldout_frac)]
        held = [p for p in rows if is_heldout(p.problem, heldout_frac)]
    if not train_rows or not held:
        raise ValueError(f"data.path={path}: {len(train_rows)} training and {len(held)} held-out rows; need both")
    rng = random.Random(heldout_seed)
    held = rng.sample(held, min(heldout_size, len(held)))
    return ListSource(train_rows, seed=train_seed), held, report
