"""Answer extraction: pull the final answer out of a model response.

Pure string functions, no sympy: they run in the trainer process and cost
microseconds. The project grades the last ``\\boxed{...}`` (or ``\\fbox{...}``).
A response with no box gets no answer unless a fallback is asked for:

* ``"last_number"``: the last number in the text (``1,000.5``, ``-3``, ``3/4``,
  ``\\frac{3}{4}``), for small models that never box.
* ``"final_answer"``: the text after the last "final answer is" / "answer is" /
  "Answer:", up to the end of that sentence.
* ``"last_line"``: the last non-empty line (widened to a whole display-math block
  when the line only closes one).

The two text fallbacks return a snippet of prose, not a clean answer; the
verifier hands such snippets to math-verify's own extraction (see ``verify.py``).

Deliberate choice: the *last* ``\\boxed`` decides. If it is unclosed (a truncated
response) there is no answer, rather than falling back to an earlier box.
"""

from __future__ import annotations

import re

FALLBACKS = ("none", "last_number", "final_answer", "last_line")

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_NUMBER_RE = re.compile(
    r"\\[dtc]?frac\{\s*(?P<fnum>-?\d+)\s*\}\{\s*(?P<fden>\d+)\s*\}"  # \frac{3}{4}
    r"|(?<![A-Za-z\d.])"  # not the tail of a word (x2) or of another number
    r"(?P<sign>(?<![\w)\]}])-)?"  # a minus that is a sign, not a subtraction
    r"(?P<num>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+)(?!\d|\.\d))?"  # 3/4
)
_ANSWER_PHRASE_RE = re.compile(r"(?:final\s+answer\s+is|answer\s+is|answer\s*:)\s*:?", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?=\s|$)")
# Inline or display math wrapped around the whole answer.
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _match_brace(text: str, open_pos: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_pos``; None if unclosed.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` (set braces)
    do not count, and ``\\\\`` (a LaTeX line break) is skipped as a pair.
    """
    depth = 0
    i = open_pos
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed 5`` in ``text``.

    Returns None when there is no box, or when the last one is unclosed or empty.
    """
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        close = _match_brace(text, i)
        if close is None:
            return None
        content = text[i + 1 : close]
    else:  # \boxed 5: one token, up to whitespace or the end of the math
        token = re.match(r"[^\s$]+", text[i:])
        content = token.group(0) if token else ""
    content = clean_answer(content)
    return content or None


def clean_answer(s: str) -> str:
    """Strip whitespace, math delimiters around the whole string and trailing punctuation."""
    s = s.strip()
    for _ in range(4):  # wrappers nest a level or two; a bound keeps "$$$$..." linear
        changed = False
        for left, right in _WRAPPERS:
            inner = s[len(left) : len(s) - len(right)]
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                if left == "$" and "$" in inner:
                    continue  # "$a$ and $b$" is not one math span
                s, changed = inner.strip(), True
                break
        end = len(s)  # trailing punctuation and any whitespace (str.isspace: NEL, NBSP, ... too)
        while end and (s[end - 1].isspace() or s[end - 1] in ".,;:!"):
            end -= 1
        stripped = s[:end]
        if stripped != s:
            # "3\." and "3\," are LaTeX spacing, not punctuation we should split.
            if not stripped.endswith("\\"):
                s, changed = stripped, True
        if not changed or not s:
            break
    return s


def last_number(text: str) -> str | None:
    """The last number in ``text`` as a plain string (commas dropped, ``\\frac{a}{b}`` -> ``a/b``)."""
    matches = list(_NUMBER_RE.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    if last.group("fnum") is not None:
        return f"{last.group('fnum')}/{last.group('fden')}"
    num = (last.group("sign") or "") + last.group("num").replace(",", "")
    if last.group("den") is not None:
        num += "/" + last.group("den")
    return num


def _balanced_span(lines: list[str], anchor: int, step: int) -> str | None:
    """Lines from ``anchor`` walking by ``step`` until ``\\[``/``\\]`` and ``$$`` balance."""
    depth = dollars = 0
    i = anchor
    while 0 <= i < len(lines):
        depth += lines[i].count("\\[") - lines[i].count("\\]")
        dollars += lines[i].count("$$")
        if (depth <= 0 if step > 0 else depth >= 0) and dollars % 2 == 0:
            lo, hi = sorted((anchor, i))
            return "\n".join(lines[lo : hi + 1])
        i += step
    return None


def _after_answer_phrase(text: str) -> str | None:
    matches = list(_ANSWER_PHRASE_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].lstrip()
    lines = rest.split("\n")
    # Keep a display block that opens on the phrase's line (Answer: \[ ... \]).
    first = lines[0]
    if first.strip() in ("\\[", "$$") or first.count("\\[") > first.count("\\]"):
        block = _balanced_span(lines, 0, 1)
        if block is not None:
            return clean_answer(block) or None
    stop = _SENTENCE_END_RE.search(first)
    return clean_answer(first[: stop.start()] if stop else first) or None


def _last_line(text: str) -> str | None:
    lines = text.rstrip().split("\n")
    for end in range(len(lines) - 1, -1, -1):
        if lines[end].strip():
            return clean_answer(_balanced_span(lines, end, -1) or lines[end]) or None
    return None


def extract_answer(text: str, *, fallback: str = "none") -> str | None:
    """The answer the response commits to, or None.

    The last box wins. Without a box, ``fallback`` decides (see the module docstring).
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {', '.join(map(repr, FALLBACKS))}; got {fallback!r}")
    boxed = last_boxed(text)
    if boxed is not None or _BOX_RE.search(text) or fallback == "none":
        return boxed
    if fallback == "last_number":
        return last_number(text)
    if fallback == "final_answer":
        return _after_answer_phrase(text)
    return _last_line(text)
