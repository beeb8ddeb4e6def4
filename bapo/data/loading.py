"""Problem sources and prompt rendering.

Three sources, one interface (an iterable of :class:`Problem`):

* ``arith`` and ``mixops``: the synthetic tasks of :mod:`bapo.data.tasks`, each with its own seed.
* ``jsonl``: local JSONL files with ``problem`` and ``answer`` fields. The file
  is read as bytes and each line decoded on its own, so one bad row never sinks
  the load: a malformed row (invalid UTF-8, invalid JSON, a missing or empty
  field, an answer that is not a finite number or a string, a row nested too
  deeply to parse, an integer too long to convert, a lone surrogate such as JSON's ``"\\ud800"``, a
  line over :data:`MAX_ROW_BYTES`, which is never held whole) is logged with its
  ``file:line``, skipped and counted in :class:`LoadReport`; past the first
  :data:`ROWS_LOGGED` of a file the rest are logged as one count, and a file with
  no valid row (a binary file) logs none: its one error gives the count and the first. A UTF-8
  byte-order mark before row 1 is dropped. JSON's ``NaN`` and ``Infinity`` are
  refused: no answer can be graded against them.
* ``hub``: any ``datasets`` dataset, by hub name or local path. ``datasets``
  parses a local file as a whole, so an empty or unparsable file is a
  :class:`DataFileError` naming the file (use ``jsonl`` to skip bad rows one by one);
  rows that parse but lack a field are skipped and counted as above.

Prompts go through the tokenizer's chat template (rendered in Jinja's sandbox with bounds on
time, size and output: :mod:`bapo.infra.chat_template`) with an instruction to put the
final answer in ``\\boxed{}``. A prompt longer than ``max_prompt_tokens`` tokens
is skipped like a malformed row (counted in ``skipped`` and in ``too_long``,
logged once with its problem id): :func:`render_prompts` for fixed sets,
:class:`PromptStream` for the training stream. Absurd inputs are never
tokenized: a problem over ``MAX_CHARS_PER_TOKEN * max_prompt_tokens``
characters is skipped on its length alone (see :data:`MAX_CHARS_PER_TOKEN`).
``max_prompt_tokens=None`` means no limit.

A file that cannot serve at all (missing, a folder, empty, no valid row) and a limit no prompt fits
under are a :class:`DataFileError`, one line naming the config key, the absolute path and, for a
path under ``paths.data_dir``, where that folder came from (``$BAPO_DATA_DIR`` or the default).
:func:`check_files` finds the first three before anything is loaded.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import math
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo.data.tasks import ArithSource, ArithSpec, arith_heldout, is_heldout
from bapo.infra.artifacts import line_too_long, read_lines
from bapo.infra.chat_template import render_chat
from bapo.infra.checks import ConfigError
from bapo.infra.paths import ROOT, resolve_path
from bapo.samples import Problem, Prompt

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = "Put the final answer in \\boxed{}."

# Rows with more than this many characters per allowed prompt token are skipped without
# tokenizing. It is a policy, not a proof: characters alone cannot bound the token count
# from above (a character can be several byte-level tokens), and a very long vocabulary
# entry could in principle cover more than 64 characters. Real tokenizers average 3-5
# characters per token on English and LaTeX, so a row this long is over the limit by a
# wide margin; the cap keeps a 1 MB row from reaching the tokenizer (and the rollout).
MAX_CHARS_PER_TOKEN = 64
# A JSONL row longer than this is skipped unread (counted like any malformed row): a problem a thousand times longer
# than any real one, and a file of one 2 GB line is read in bounded pieces. A data file has no bound in all: it is
# the run's own choice, and every row of it is kept.
MAX_ROW_BYTES = 8 << 20
# What the prompt limit is, for the error when nothing fits under it.
LIMIT_NOTE = (
    " (the limit is data.max_prompt_tokens, or less: the model's context minus rollout.max_new_tokens; "
    "raise data.max_prompt_tokens, or lower model.max_new_tokens)"
)
# A source with no known epoch (an endless generator) whose next this many draws are all
# too long has a limit nothing fits under; raise rather than spin.
MAX_SKIP_STREAK = 10_000


# ----------------------------------------------------------------------------- files and hub


class DataFileError(ConfigError):
    """A data file that a config key points at is missing, a folder, empty, or holds no usable row, or no
    prompt fits the length limit. One line: the key, the absolute path, and what to change."""


def _tried(value: str) -> str:
    """The absolute path a data path is looked for at (:func:`bapo.config.resolve_path`): from the working
    directory, else from the repository root."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return os.path.normpath(path)
    here = os.path.normpath(Path.cwd() / path)
    root = os.path.normpath(ROOT / path)
    return here if here == root else f"{here} (nor {root})"


def _origin(value: str, data_dir: str | None) -> str:
    """Where a path under ``paths.data_dir`` came from, and what to set, for a message about it."""
    if not data_dir or not value.startswith(data_dir.rstrip("/") + "/"):
        return ""
    env = os.environ.get("BAPO_DATA_DIR")
    src = f"$BAPO_DATA_DIR={env}" if env is not None else "the default (BAPO_DATA_DIR is not set)"
    return (
        f"; it is under paths.data_dir={data_dir}, from {src}: point BAPO_DATA_DIR or paths.data_dir at the "
        "folder that holds it"
    )


def file_problem(key: str, value: str, data_dir: str | None = None) -> DataFileError | None:
    """Why the data file ``value`` (of config key ``key``) cannot be read, or None when it can."""
    path = Path(resolve_path(value))
    origin = _origin(value, data_dir)
    if not path.exists():
        return DataFileError(f"{key}: no such file: {_tried(value)}{origin}")
    if path.is_dir():
        return DataFileError(f"{key}: {os.path.normpath(path.absolute())} is a folder, not a JSONL file{origin}")
    if path.stat().st_size == 0:
        return DataFileError(f"{key}: {os.path.normpath(path.absolute())} is empty{origin}")
    if path.suffix.lower() not in BINARY_SUFFIXES:
        with open(path, "rb") as f:
            if b"\0" in f.read(8192):  # no text format holds a NUL byte
                return DataFileError(f"{key}: {os.path.normpath(path.absolute())} is a binary file, not JSONL{origin}")
    return None


BINARY_SUFFIXES = (".parquet", ".arrow")


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")


def check_files(cfg, data_dir: str | None = None) -> None:
    """Raise :class:`DataFileError` for the first data file of the typed ``data`` group that is missing, a folder
    or empty (``data.path``, ``data.eval_path``). A ``hub`` path is checked when it is a local folder or names a
    data file (by its suffix); anything else is a hub name, which only loading can check."""
    if cfg.kind == "arith":
        return
    for key in ("data.path", "data.eval_path"):
        value = getattr(cfg, key.split(".")[1])
        if not value:
            continue
        if cfg.kind == "hub" and Path(resolve_path(value)).is_dir():
            continue  # a dataset folder: datasets reads it
        if cfg.kind == "hub" and Path(value).suffix.lower() not in DATA_SUFFIXES:
            continue
        if (err := file_problem(key, value, data_dir)) is not None:
            raise err


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


ROWS_LOGGED = 5  # malformed rows of one file logged one by one; the rest as one count


def _log_skipped(source: object, whys: list[str], count: int) -> None:
    """The malformed rows of a file that had valid rows too, logged once it is read: the first :data:`ROWS_LOGGED`
    (``whys``) each with its ``file:line``, then the rest of the ``count`` in one line."""
    for why in whys:
        log.warning("skipping malformed row: %s", why)
    if count > len(whys):
        log.warning("skipping malformed rows: %d more in %s (%d in all)", count - len(whys), source, count)


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
        raise ValueError(f"{where}: field {answer_key!r} must be a string or number, got {_short(ans)}")
    if isinstance(ans, float) and not math.isfinite(ans):
        raise ValueError(f"{where}: field {answer_key!r} is {ans!r}, which no answer can equal")
    if isinstance(ans, str) and not ans.strip():
        raise ValueError(f"{where}: field {answer_key!r} is an empty string")
    for key in (problem_key, answer_key, "id", "source"):
        if isinstance(row.get(key), str):
            _check_text(row[key], where, key)
    return Problem(id=str(row.get("id", idx)), problem=prob, answer=str(ans), source=str(row.get("source", "")))


def _check_text(text: str, where: str, key: str) -> None:
    """Refuse a string that is not text: JSON's ``"\\ud800"`` decodes to a lone surrogate, which no tokenizer,
    file or log can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: field {key!r} holds a lone surrogate ({text[e.start : e.end]!a} at character {e.start + 1}), "
            "which is not text"
        ) from None


def _short(value: object, n: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= n else f"{r[:n]}... ({len(r)} characters)"


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number an answer can be graded against")


def _parse_row(line: str) -> object:
    """``json.loads`` of one row, without NaN/Infinity (refused), and with nesting bounded: a row nested deeper
    than Python's recursion limit is a RecursionError, reported like any other malformed row."""
    return json.loads(line, parse_constant=_refuse_constant)


def _row_error(where: str, e: Exception) -> str:
    """One line for the log: where, and what was wrong with the row."""
    if isinstance(e, UnicodeDecodeError):
        return f"{where}: invalid UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1})"
    if isinstance(e, json.JSONDecodeError):
        return f"{where}: invalid JSON ({e.msg})"
    if isinstance(e, RecursionError):
        return f"{where}: nested too deeply to parse"
    msg = str(e).split("\n")[0]
    return msg if msg.startswith(where) else f"{where}: {msg}"  # json's own (a too-long integer, NaN) lack it


def load_jsonl(
    path: str | Path,
    *,
    problem_key: str = "problem",
    answer_key: str = "answer",
    report: LoadReport | None = None,
    key: str = "data.path",
) -> list[Problem]:
    """Read problems from a JSONL file. Malformed rows are logged with file:line and skipped.

    Lines are decoded one at a time (bytes, then UTF-8), so an invalid byte costs its own
    row only; a byte-order mark before row 1 is dropped rather than spoiling that row.
    ``key``: the config key that names the file, for the :class:`DataFileError` of a file
    that is missing, a folder, empty, or has no valid row.
    """
    if (err := file_problem(key, str(path))) is not None:
        raise err
    path = Path(resolve_path(str(path)))
    report = report if report is not None else LoadReport()
    out, whys, skipped = [], [], 0
    with path.open("rb") as f:
        for lineno, raw in read_lines(f, path, max_line=MAX_ROW_BYTES, max_total=None):
            where = f"{path}:{lineno}"
            if raw is None:  # never held whole: a bounded read
                report.skipped += 1
                skipped += 1
                if len(whys) < ROWS_LOGGED:
                    whys.append(line_too_long(where, MAX_ROW_BYTES))
                continue
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
                out.append(_row_to_problem(_parse_row(line), where, problem_key, answer_key, lineno))
                report.rows += 1
            except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError are ValueErrors
                report.skipped += 1
                skipped += 1
                if len(whys) < ROWS_LOGGED:
                    whys.append(_row_error(where, e))
    if not out:
        first = f"; the first: {whys[0]}" if whys else ""
        raise DataFileError(f"{key}: {path.absolute()}: no valid rows ({skipped} skipped{first})")
    _log_skipped(path, whys, skipped)
    return out


def load_hub(
    name: str,
    *,
    split: str,
    subset: str | None = None,
    problem_key: str = "problem",
    answer_key: str = "answer",
    report: LoadReport | None = None,
    key: str = "data.path",
) -> list[Problem]:
    """Load problems through ``datasets`` (a hub name, a local folder, or a data file).

    ``datasets`` parses a local file as a whole: an empty or unparsable file is a
    :class:`DataFileError` that names it and ``key`` (``datasets`` itself raises a bare
    ``StopIteration`` on an empty JSONL file), and so is a name that is neither a local path
    nor loadable from the hub. Rows that parse but are malformed are skipped and counted.
    """
    import datasets

    report = report if report is not None else LoadReport()
    p = Path(name)
    if p.is_file():
        if p.stat().st_size == 0:
            raise DataFileError(f"{key}: {p.absolute()}: the data file is empty")
        try:
            ds = datasets.load_dataset(p.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(p), split=split)
        except Exception as e:  # StopIteration, ValueError, DatasetGenerationError, ...: all mean "this file"
            msg = str(e).split("\n")[0]
            raise DataFileError(
                f"{key}: {p.absolute()}: datasets could not load split {split!r} from this file ({type(e).__name__}: "
                f"{msg}); data.kind=jsonl reads a JSONL file row by row and skips malformed rows"
            ) from e
    else:
        try:
            ds = datasets.load_dataset(name, subset, split=split)
        except Exception as e:  # a name that is neither a local file or folder nor reachable on the hub
            msg = str(e).split("\n")[0]
            raise DataFileError(
                f"{key}: {name!r} is not a local file or folder (tried {_tried(name)}), and datasets could not load "
                f"it as a hub name ({type(e).__name__}: {msg})"
            ) from None
    out, whys, skipped = [], [], 0
    for i, row in enumerate(ds):
        try:
            out.append(_row_to_problem(row, f"{name}[{split}] row {i}", problem_key, answer_key, i))
            report.rows += 1
        except ValueError as e:
            report.skipped += 1
            skipped += 1
            if len(whys) < ROWS_LOGGED:
                whys.append(str(e).split("\n")[0])
    if not out:
        first = f"; the first: {whys[0]}" if whys else ""
        raise DataFileError(f"{key}: {name}[{split}]: no valid rows ({skipped} skipped{first})")
    _log_skipped(f"{name}[{split}]", whys, skipped)
    return out


class ListSource:
    """Endless, reshuffled-per-epoch stream over a fixed list of problems."""

    def __init__(self, problems: Sequence[Problem], *, seed: int, shuffle: bool = True):
        self.problems = list(problems)
        self.rng = random.Random(seed)
        self.shuffle = shuffle
        self.epoch, self.pos = 0, 0
        self.order = self._new_order()

    @property
    def epoch_size(self) -> int:
        """Problems per epoch; :class:`PromptStream` uses it to tell when nothing fits."""
        return len(self.problems)

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
    text = render_chat(tokenizer, messages)  # the sandbox, bounded: a model folder's template is code
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(problem=problem, text=text, ids=tuple(ids))


def _check_limit(max_prompt_tokens: int | None) -> None:
    if max_prompt_tokens is not None and (isinstance(max_prompt_tokens, bool) or max_prompt_tokens < 1):
        raise ValueError(f"max_prompt_tokens must be a positive integer or None, got {max_prompt_tokens!r}")


@dataclass
class PromptFit:
    """How problems become prompts under the length limit, for :func:`render_prompts` and :class:`PromptStream`
    alike: rendered through ``tokenizer``'s chat template with ``instruction``, or skipped when over
    ``max_prompt_tokens`` (None: no limit), logged with the problem's id and counted in ``report.skipped`` and
    ``report.too_long``. ``limit_key`` is the config key a :class:`DataFileError` names when nothing fits.

    A problem over ``MAX_CHARS_PER_TOKEN * max_prompt_tokens`` characters is rejected before the chat
    template or the tokenizer ever see it."""

    tokenizer: Any
    max_prompt_tokens: int | None
    instruction: str = DEFAULT_INSTRUCTION
    report: LoadReport | None = None  # None: a report of its own
    limit_key: str = "data.max_prompt_tokens"

    def __post_init__(self) -> None:
        _check_limit(self.max_prompt_tokens)
        if self.report is None:
            self.report = LoadReport()

    def fit(self, problem: Problem) -> tuple[Prompt | None, str]:
        """The rendered prompt, or ``None`` and why it is over the limit."""
        limit = self.max_prompt_tokens
        if limit is None:
            return render_prompt(problem, self.tokenizer, instruction=self.instruction), ""
        n_chars, char_cap = len(problem.problem), MAX_CHARS_PER_TOKEN * limit
        if n_chars > char_cap:
            return None, f"{n_chars} characters > {MAX_CHARS_PER_TOKEN} x max_prompt_tokens={limit}, not tokenized"
        prompt = render_prompt(problem, self.tokenizer, instruction=self.instruction)
        if len(prompt.ids) > limit:
            return None, f"{len(prompt.ids)} tokens > max_prompt_tokens={limit}"
        return prompt, ""

    def skip(self, problem: Problem, why: str) -> None:
        """Count and log one problem over the limit."""
        self.report.skipped += 1
        self.report.too_long += 1
        source = f" ({problem.source})" if problem.source else ""
        log.warning("skipping over-long prompt: problem %r%s: %s", problem.id, source, why)

    def nothing_fits(self, what: str) -> DataFileError:
        return DataFileError(f"{self.limit_key}: {what}{LIMIT_NOTE}")


def render_prompts(problems: Iterable[Problem], tokenizer, **fit: Any) -> list[Prompt]:
    """Render a fixed set (held-out, eval), skipping (and counting) prompts over the limit; ``fit``:
    :class:`PromptFit`'s keywords (``max_prompt_tokens``, required; ``instruction``, ``report``, ``limit_key``).

    A non-empty set with nothing under the limit is a :class:`DataFileError` naming ``limit_key``:
    evaluating on nothing would look like a result.
    """
    fitter = PromptFit(tokenizer, **fit)
    out, n = [], 0
    for problem in problems:
        n += 1
        prompt, why = fitter.fit(problem)
        if prompt is None:
            fitter.skip(problem, why)
        else:
            out.append(prompt)
    if n and not out:
        raise fitter.nothing_fits(f"all {n} prompts are longer than {fitter.max_prompt_tokens} tokens")
    return out


class PromptStream:
    """The training stream of prompts: renders each problem of ``problems_iter`` and skips
    those over the limit, as :func:`render_prompts` does (``fit``: :class:`PromptFit`'s keywords).

    The stream holds no state of its own that the output depends on and draws nothing
    ahead, so ``state_dict``/``load_state_dict`` are the source's, and a resumed stream
    continues exactly. Over an endless source a problem comes back every epoch; it is
    logged and counted once per stream (a set of row digests remembers which).

    Nothing fits under the limit: with a source that has an ``epoch_size`` (a
    :class:`ListSource` of N rows), ``2N - 1`` skips in a row contain one whole epoch
    (wherever the streak started), so every row is too long and that raises; with a
    source of unknown size (``ArithSource``) :data:`MAX_SKIP_STREAK` skips in a row raise.
    A finite plain iterator simply ends.
    """

    def __init__(self, problems_iter: Iterable[Problem], tokenizer, **fit: Any):
        self.fitter = PromptFit(tokenizer, **fit)
        self.source = problems_iter
        self._it = iter(problems_iter)
        epoch = getattr(problems_iter, "epoch_size", None)
        self._max_streak = 2 * epoch - 1 if epoch else MAX_SKIP_STREAK
        self._streak_means = f"a whole epoch of the {epoch} rows" if epoch else "a source of unknown size"
        self._counted: set[bytes] = set()

    @property
    def report(self) -> LoadReport:
        return self.fitter.report

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        for _ in range(self._max_streak):
            problem = next(self._it)
            prompt, why = self.fitter.fit(problem)
            if prompt is not None:
                return prompt
            key = hashlib.sha1(f"{problem.id}\0{problem.problem}".encode()).digest()
            if key not in self._counted:
                self._counted.add(key)
                self.fitter.skip(problem, why)
        raise self.fitter.nothing_fits(
            f"no prompt fits in {self.fitter.max_prompt_tokens} tokens: the last {self._max_streak} "
            f"problems drawn ({self._streak_means}) were all longer"
        )

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)


# ----------------------------------------------------------------------------- assembly


def gsm8k_answer(p: Problem) -> Problem:
    """GSM8K's hub rows end their worked answer with '#### 72'; keep the number."""
    ans = p.answer.split("####")[-1].strip().replace(",", "")
    return Problem(id=p.id, problem=p.problem, answer=ans, source=p.source)


def problem_sources(cfg) -> tuple[Iterator[Problem], list[Problem], LoadReport]:
    """The training stream, the fixed held-out set, and what loading skipped, for the typed ``data`` group.

    ``cfg``: ``bapo.config.ArithDataConfig`` (kind arith), ``FileDataConfig`` (jsonl) or ``HubDataConfig`` (hub).
    """
    report = LoadReport()
    if cfg.kind == "arith":
        spec = ArithSpec(**vars(cfg.arith))
        train = ArithSource(seed=cfg.train_seed, split="train", heldout_frac=cfg.heldout_frac, spec=spec)
        held = arith_heldout(cfg.heldout_size, seed=cfg.heldout_seed, heldout_frac=cfg.heldout_frac, spec=spec)
        return train, held, report
    hub = cfg.kind == "hub"

    def load(where: str, which: str | None, key: str) -> list[Problem]:
        keys = dict(problem_key=cfg.problem_key, answer_key=cfg.answer_key, report=report, key=key)
        if hub:
            rows = load_hub(where, split=which, subset=cfg.subset, **keys)
        else:  # a relative path that is not under the working directory is taken from the repo root
            rows = load_jsonl(where, **keys)
        return [gsm8k_answer(p) for p in rows] if cfg.answer_format == "gsm8k" else rows

    rows = load(cfg.path, cfg.split if hub else None, "data.path")
    eval_split = cfg.eval_split if hub else None
    if cfg.eval_path or eval_split:
        eval_key = "data.eval_path" if cfg.eval_path else "data.path"
        train_rows, held = rows, load(cfg.eval_path or cfg.path, eval_split or (cfg.split if hub else None), eval_key)
    else:  # hold out a hash-chosen slice of the training rows
        train_rows = [p for p in rows if not is_heldout(p.problem, cfg.heldout_frac)]
        held = [p for p in rows if is_heldout(p.problem, cfg.heldout_frac)]
    if not train_rows or not held:
        raise DataFileError(
            f"data.path: {cfg.path}: {len(train_rows)} training and {len(held)} held-out rows; need both "
            "(set data.eval_path, or a data.heldout_frac that leaves rows on both sides)"
        )
    rng = random.Random(cfg.heldout_seed)
    held = rng.sample(held, min(cfg.heldout_size, len(held)))
    return ListSource(train_rows, seed=cfg.train_seed), held, report
