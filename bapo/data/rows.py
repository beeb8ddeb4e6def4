"""One row of a data file or a ``datasets`` set as a :class:`Problem`, and why a row is refused.

:class:`RowFields` says where a row keeps its problem and its answer, so one mapping reads plain JSONL
(``problem``, ``answer``), DeepScaleR's ``problem``/``answer``/``solution`` and verl's layout alike:

* a key is a dotted path into nested fields (``reward_model.ground_truth``); a key that exists as it is wins;
* a problem field that is a chat (a list of ``{role, content}`` messages, verl's ``prompt``) gives the content
  of its last user message; a system message is dropped (the model's own chat template applies);
* ``strip_instructions``: texts cut from the start or the end of the problem, however often they occur there
  (the set's own instruction, so that the project's ``data.instruction`` is not doubled);
* ``answer_format``: ``plain``; ``gsm8k`` keeps the number after ``####``; ``json_list`` decodes a string that
  holds a JSON list of accepted answers (Skywork-OR1's ``ground_truth``), and takes any other string as it is.
  An answer that is a list (a JSON list, or a list column) must hold one answer, or equal ones: the verifier
  grades against one gold string.

A row whose problem or answer cannot be read or graded raises ``ValueError`` with ``where`` (``file:line`` or
``set[split] row i``) and the reason; the loaders skip it and count it in :class:`LoadReport` (``data/skipped_rows``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bapo.infra.checks import ConfigError
from bapo.infra.paths import ROOT
from bapo.samples import Problem

log = logging.getLogger(__name__)

ANSWER_FORMATS = ("plain", "gsm8k", "json_list")
ROWS_LOGGED = 5  # malformed rows of one file logged one by one; the rest as one count


class DataFileError(ConfigError):
    """A data file or set that a config key points at is missing, a folder, empty, unreachable, or holds no usable
    row, or no prompt fits the length limit. One line: the key, the absolute path or set, and what to change."""


@dataclass
class LoadReport:
    """What the loaders read, and what they and the prompt renderers had to skip.

    ``rows`` counts rows the loaders parsed. ``skipped`` counts every row dropped for any
    reason, in a loader or at rendering; ``too_long`` counts those of them dropped because
    the prompt was over ``max_prompt_tokens``.
    """

    rows: int = 0
    skipped: int = 0
    too_long: int = 0


@dataclass(frozen=True)
class RowFields:
    """Where a row keeps its problem and its answer, and how to read them (module docstring)."""

    problem_key: str = "problem"
    answer_key: str = "answer"
    answer_format: str = "plain"
    strip_instructions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {list(ANSWER_FORMATS)}, got {self.answer_format!r}")
        object.__setattr__(self, "strip_instructions", tuple(s.strip() for s in self.strip_instructions if s.strip()))

    def columns(self) -> tuple[str, ...]:
        """The top-level fields a row's problem and answer come from."""
        return tuple(dict.fromkeys(k.split(".")[0] for k in (self.problem_key, self.answer_key)))

    def problem_of(self, row: object, where: str, idx: int) -> Problem:
        """The row as a Problem, or ``ValueError`` naming ``where`` and what is wrong with it."""
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        text = self._problem_text(field_at(row, self.problem_key, where), where)
        answer = answer_text(field_at(row, self.answer_key, where), self.answer_key, self.answer_format, where)
        source = row.get("source", row.get("data_source", ""))
        out = Problem(id=str(row.get("id", idx)), problem=text, answer=answer, source=str(source or ""))
        for key, value in (("problem", out.problem), ("answer", out.answer), ("id", out.id), ("source", out.source)):
            check_text(value, where, key)
        return out

    def _problem_text(self, value: object, where: str) -> str:
        key = self.problem_key
        if isinstance(value, list):
            value = user_message(value, key, where)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: field {key!r} must be a non-empty string or a chat with a user message")
        text = strip_texts(value, self.strip_instructions)
        if not text:
            raise ValueError(f"{where}: field {key!r} holds nothing but its instruction")
        return text


def check_text(text: str, where: str, key: str) -> None:
    """Refuse a string that is not text: JSON's ``"\\ud800"`` decodes to a lone surrogate, which no tokenizer,
    file or log can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: field {key!r} holds a lone surrogate ({text[e.start : e.end]!a} at character {e.start + 1}), "
            "which is not text"
        ) from None


def field_at(row: Mapping, key: str, where: str) -> object:
    """``row[key]``, or the nested field a dotted ``key`` names (``reward_model.ground_truth``)."""
    if key in row:
        return row[key]
    node: object = row
    for i, part in enumerate(key.split(".")):
        if not isinstance(node, Mapping) or part not in node:
            at = ".".join(key.split(".")[:i])
            has = sorted(node) if isinstance(node, Mapping) else type(node).__name__
            inside = f" ({at} has {has})" if at else f" (has {has})"
            raise ValueError(f"{where}: missing field {key!r}{inside}")
        node = node[part]
    return node


def user_message(chat: list, key: str, where: str) -> object:
    """The content of the last user message of a chat (a list of ``{role, content}``)."""
    if not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in chat):
        raise ValueError(f"{where}: field {key!r} is a list but not a chat (a list of {{role, content}} messages)")
    users = [m["content"] for m in chat if m["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: field {key!r} is a chat with no user message")
    return users[-1]


def strip_texts(text: str, texts: Sequence[str]) -> str:
    """``text`` without any of ``texts`` at its start or end (each as often as it occurs there), and trimmed."""
    text, before = text.strip(), None
    while text != before:
        before = text
        for s in texts:
            if text.startswith(s):
                text = text[len(s) :].strip()
            if text.endswith(s):
                text = text[: -len(s)].strip()
    return text


def answer_text(value: object, key: str, answer_format: str, where: str) -> str:
    """The gold answer string of a row's answer field, or ``ValueError`` when nothing gradable is there."""
    if answer_format == "json_list" and isinstance(value, str):
        try:
            value = json.loads(value, parse_constant=_refuse_constant)
        except json.JSONDecodeError:
            pass  # not JSON: a plain answer
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{where}: field {key!r}: {str(e).splitlines()[0]}") from None
    if isinstance(value, list | tuple):
        distinct = list(dict.fromkeys(str(v) if _scalar(v) else repr(v) for v in value))
        if not distinct:
            raise ValueError(f"{where}: field {key!r} is an empty list of answers")
        if len(distinct) > 1:
            raise ValueError(
                f"{where}: field {key!r} lists {len(distinct)} different answers {_short(distinct)}; the verifier "
                "grades against one"
            )
        value = value[0]
    if isinstance(value, bool) or not _scalar(value):
        raise ValueError(f"{where}: field {key!r} must be a string or number, got {_short(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: field {key!r} is {value!r}, which no answer can equal")
    text = str(value)
    if answer_format == "gsm8k":
        text = gsm8k_number(text)
    if not text.strip():
        what = "has nothing after '####'" if answer_format == "gsm8k" else "is an empty string"
        raise ValueError(f"{where}: field {key!r} {what}")
    return text


def gsm8k_number(answer: str) -> str:
    """GSM8K's hub rows end their worked answer with '#### 72'; keep the number (commas removed)."""
    return answer.split("####")[-1].strip().replace(",", "")


def _scalar(value: object) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _short(value: object, n: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= n else f"{r[:n]}... ({len(r)} characters)"


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number an answer can be graded against")


def parse_row(line: str) -> object:
    """``json.loads`` of one row, without NaN/Infinity (refused), and with nesting bounded: a row nested deeper
    than Python's recursion limit is a RecursionError, reported like any other malformed row."""
    return json.loads(line, parse_constant=_refuse_constant)


def row_error(where: str, e: Exception) -> str:
    """One line for the log: where, and what was wrong with the row."""
    if isinstance(e, UnicodeDecodeError):
        return f"{where}: invalid UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1})"
    if isinstance(e, json.JSONDecodeError):
        return f"{where}: invalid JSON ({e.msg})"
    if isinstance(e, RecursionError):
        return f"{where}: nested too deeply to parse"
    msg = str(e).split("\n")[0]
    return msg if msg.startswith(where) else f"{where}: {msg}"  # json's own (a too-long integer, NaN) lack it


def log_skipped(source: object, whys: list[str], count: int) -> None:
    """The malformed rows of a file that had valid rows too, logged once it is read: the first :data:`ROWS_LOGGED`
    (``whys``) each with its ``file:line``, then the rest of the ``count`` in one line."""
    for why in whys:
        log.warning("skipping malformed row: %s", why)
    if count > len(whys):
        log.warning("skipping malformed rows: %d more in %s (%d in all)", count - len(whys), source, count)


def tried(value: str) -> str:
    """The absolute path a data path is looked for at (:func:`bapo.infra.paths.resolve_path`): from the working
    directory, else from the repository root."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return os.path.normpath(path)
    here = os.path.normpath(Path.cwd() / path)
    root = os.path.normpath(ROOT / path)
    return here if here == root else f"{here} (nor {root})"
