"""Answer equivalence for one (prediction, gold) pair, under a time limit.

``check_pair`` first compares normalised strings (no sympy), then asks
math-verify (``parse`` + ``verify``); it has no time limit of its own.
``verify_pair`` / ``is_equivalent`` run it under ``SIGALRM``, which only works in
a process's main thread. The worker pool in ``pool.py`` runs the same check in
subprocesses (see ``_worker.py``), with the whole check, normalisation included,
under the alarm there.

Where this departs from plain math-verify:

* ``normalize_answer`` fixes what math-verify 0.9.0 gets wrong (measured:
  ``10\\%`` or ``28 %`` vs ``10``/``28``, ``4:30 \\text{ p.m.}`` vs ``\\text{4:30 p.m.}``,
  ``90°``, unicode ``∈``), and makes most correct answers equal as strings
  (``\\dfrac``, ``\\left(``, ``^\\circ``, units, ``1,\\!000``, ``033``), so they
  skip sympy and the pool. Both sides are then boxed, because math-verify finds
  nothing in bare LaTeX such as ``\\frac12``; prose snippets from the text
  fallbacks go to math-verify's own extraction instead.
* One time budget covers a whole pair (normalisation, both parses and the
  comparison), set with ``signal.setitimer`` so it may be fractional;
  math-verify's own per-call ``signal.alarm`` timeouts are switched off, since
  the two share one timer. math-verify's own limits would allow up to about 6x
  ``timeout_s`` per pair.
* Every regex here and in ``extract.py`` was timed on long adversarial runs
  (digits, zeros, spaces, backslashes, braces, ``\\frac{``, ``\\text{``, ...) at n
  and 4n characters. Two backtracked quadratically (leading zeros, and the
  degree sign after a run of spaces: 73 s and 20 s at 100k characters) and are
  rewritten; ``tests/unit/reward`` and ``tests/e2e/reward`` guard them. The pool still sends long strings to
  a worker rather than normalising them in the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import re
import signal
import threading
from collections.abc import Callable

from math_verify import parse, verify

from bapo.reward.extract import clean_answer, last_boxed


class _DisabledTimeoutNote(logging.Filter):
    """Drop math-verify's note that its own timeouts are off: ours replace them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DisabledTimeoutNote())

# ---------------------------------------------------------------- normalisation

_TEXT_CMD = r"\\(?:text|textnormal|textrm|textbf|mbox|mathrm)"
_UNIT_RE = re.compile(r"(?<=[\d}])\s*" + _TEXT_CMD + r"\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?[23]\}?)?\s*$")
_TEXT_RE = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_PLAIN_UNIT_RE = re.compile(r"^(-?[\d.:,/]+)\s+[A-Za-z][A-Za-z .]*$")  # "4:30 p.m." inside \text{}
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_UNICODE = {"∈": "\\in ", "≤": "\\le ", "≥": "\\ge ", "≠": "\\ne ", "π": "\\pi ", "∞": "\\infty ",
            "√": "\\sqrt", "−": "-", "×": "\\times ", "·": "\\cdot "}  # fmt: skip
_SUBS = [
    (re.compile("|".join(_UNICODE)), lambda m: _UNICODE[m.group(0)]),
    (re.compile(r"(?<=\d)(?:,\\!\s*|\{,\})(?=\d{3}(?!\d))"), ""),  # 11,\! 111 and 10{,}000: thousands
    (re.compile(r"\\\$"), ""),  # \$10
    (re.compile(r"\$"), ""),  # "12 $ and $13": math closed and reopened inside a box
    (re.compile(r"\\left\.|\\right\."), ""),  # invisible delimiters
    (re.compile(r"\\(?:left|right)(?![A-Za-z])"), ""),
    (re.compile(r"\\[dtc]frac(?![A-Za-z])"), r"\\frac"),
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),  # \frac12
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),  # \frac3{4}
    (re.compile(r"\\frac\{([^{}]*)\}\s*(\d)"), r"\\frac{\1}{\2}"),  # \frac{3}4
    (re.compile(r"\\sqrt\s*(\d)"), r"\\sqrt{\1}"),  # \sqrt3
    (re.compile(r"\^\s*(?:\{\s*)?\\circ\s*\}?|°|\\degree(?![A-Za-z])"), ""),  # one \s* per gap: linear
    (re.compile(r"\\?%"), ""),
    (re.compile(r"\\!|\\displaystyle|\\mathrm\{\s*\}"), ""),
    (re.compile(r"\{,\}"), ","),  # 10{,}000
    (re.compile(r"(\\\\)|\\[,;: ]|~"), lambda m: m.group(1) or " "),  # spacing, but keep \\ rows
]


def normalize_answer(s: str) -> str:
    """A canonical string for an answer; equal strings mean equal answers.

    Handles what math-verify gets wrong or is too strict on; the result is
    still LaTeX that math-verify can parse.
    """
    # Golds repeat across a group's samples; long strings are not worth the memory.
    return _normalize_cached(s) if len(s) <= 512 else _normalize(s)


def _normalize(s: str) -> str:
    s = clean_answer(s)
    if "\\boxed" in s or "\\fbox" in s:
        s = last_boxed(s) or s
    for pattern, repl in _SUBS:
        s = pattern.sub(repl, s)
    all_text = _TEXT_RE.fullmatch(s) is not None
    s = _UNIT_RE.sub("", s)  # "5 \text{ cm}^2" -> "5"; a lone "\text{Evelyn}" stays
    s = _TEXT_RE.sub(r"\1", s)
    s = clean_answer(re.sub(r"\s+", " ", s))
    if all_text:  # "\text{4:30 p.m.}" -> "4:30"
        s = _PLAIN_UNIT_RE.sub(r"\1", s)
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    # AIME "033" -> "33", "-0" -> "0". No int(): no digit limit. No "0*(\d+)": quadratic on "000...0x".
    integer = re.fullmatch(r"(-?)(\d+)", s)
    if integer:
        digits = integer.group(2).lstrip("0") or "0"
        s = digits if digits == "0" else integer.group(1) + digits
    s = re.sub(r"^\(([A-Ea-e])\)$", r"\1", s)  # multiple choice "(C)" -> "C"
    return s


_normalize_cached = functools.lru_cache(maxsize=4096)(_normalize)


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def same_normalized(pred: str, gold: str) -> bool:
    """The fast path: identical after normalisation, ignoring whitespace."""
    a = _squash(normalize_answer(pred))
    return bool(a) and a == _squash(normalize_answer(gold))


# ---------------------------------------------------------------- one pair


class VerifyTimeout(BaseException):
    """Raised by the alarm. A BaseException so math-verify's ``except Exception`` lets it through."""


def _on_alarm(signum, frame):
    raise VerifyTimeout


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise VerifyTimeout after ``seconds`` of wall time; a no-op off the main thread."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)


def _looks_like_prose(answer: str) -> bool:
    """A fallback snippet ("The largest $n$ is 34") rather than a bare answer."""
    if re.search(r"(?<!\\)\$|\\\(|\\\[", answer):
        return True
    # Drop \text{...}, commands and their letter-only argument (\begin{pmatrix}) first.
    bare = re.sub(r"\\[A-Za-z]+(?:\{[A-Za-z*]*\})?", " ", _TEXT_RE.sub(" ", answer)).strip()
    words = [w for w in re.findall(r"[A-Za-z]{3,}", bare) if w.lower() != "and"]
    return len(words) >= 2 or (len(words) == 1 and re.search(r"\s", bare) is not None)


def _parse(answer: str) -> list:
    """Parse an answer: boxed when it is bare LaTeX, math-verify's own extraction for prose."""
    norm = normalize_answer(answer)
    boxed = lambda: parse("\\boxed{" + norm + "}", parsing_timeout=None)  # noqa: E731
    raw = lambda: parse(answer, parsing_timeout=None)  # noqa: E731
    first, second = (raw, boxed) if _looks_like_prose(answer) else (boxed, raw)
    return first() or second()


def check_pair(pred: str, gold: str) -> bool:
    """Whether ``pred`` is the same answer as ``gold``, with no time limit: callers set one.

    The default judge of the worker pool (``"bapo.reward.verify:check_pair"``).
    """
    if same_normalized(pred, gold):
        return True
    gold_parsed = _parse(gold)
    pred_parsed = _parse(pred)
    return bool(gold_parsed and pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


Judge = Callable[[str, str], bool]


def run_judge(judge: Judge, pred: str, gold: str, timeout_s: float | None) -> tuple[bool, bool]:
    """``(equivalent, timed_out)``: the whole of ``judge(pred, gold)`` runs under one time limit."""
    try:
        with _time_limit(timeout_s):
            return bool(judge(pred, gold)), False
    except VerifyTimeout:
        return False, True


def verify_pair(pred: str, gold: str, timeout_s: float | None) -> tuple[bool, bool]:
    """``(equivalent, timed_out)`` for an extracted answer and a gold answer."""
    return run_judge(check_pair, pred, gold, timeout_s)


def is_equivalent(pred: str, gold: str, *, timeout_s: float | None = 5.0) -> bool:
    """Whether ``pred`` is the same answer as ``gold``.

    The time limit only works on the main thread; elsewhere there is none.
    """
    return verify_pair(pred, gold, timeout_s)[0]


def load_judge(name: str) -> Judge:
    """The function named ``"module:function"``, which a worker process can import by that name."""
    module, sep, attr = name.partition(":")
    if not (sep and module and attr):
        raise ValueError(f"judge must be named as 'module:function'; got {name!r}")
    if module == "__main__":
        raise ValueError(f"judge {name!r} lives in __main__, which worker processes never import; move it to a module")
    try:
        fn = getattr(importlib.import_module(module), attr, None)
    except ImportError as e:
        raise ValueError(f"judge {name!r}: cannot import module {module!r} ({e})") from e
    if not callable(fn):
        raise ValueError(f"judge {name!r}: module {module!r} has no function {attr!r}")
    return fn
