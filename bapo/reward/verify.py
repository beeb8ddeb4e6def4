"""Answer equivalence, and a pool of worker processes that runs it safely.

``is_equivalent`` first compares normalised strings (no sympy), then asks
math-verify (``parse`` + ``verify``) under a time limit. ``MathVerifier`` runs
that check in worker processes, because the time limit uses ``SIGALRM``, which
only works in a process's main thread, and because some inputs hang in C code
that no signal interrupts. A worker that overruns its hard deadline or dies is
replaced; its item scores 0 and is counted.

Where this departs from plain math-verify:

* ``normalize_answer`` fixes what math-verify 0.9.0 gets wrong (measured:
  ``10\\%`` or ``28 %`` vs ``10``/``28``, ``4:30 \\text{ p.m.}`` vs ``\\text{4:30 p.m.}``,
  ``90°``, unicode ``∈``), and makes most correct answers equal as strings
  (``\\dfrac``, ``\\left(``, ``^\\circ``, units, ``1,\\!000``, ``033``), so they
  skip sympy and the pool. Both sides are then boxed, because math-verify finds
  nothing in bare LaTeX such as ``\\frac12``; prose snippets from the text
  fallbacks go to math-verify's own extraction instead.
* One time budget covers a whole pair (both parses and the comparison), set with
  ``signal.setitimer`` so it may be fractional; math-verify's own per-call
  ``signal.alarm`` timeouts are switched off, since the two share one timer.
  math-verify's own limits would allow up to about 6x ``timeout_s`` per pair.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import multiprocessing as mp
import re
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait

from math_verify import parse, verify

from bapo.reward.extract import FALLBACKS, clean_answer, extract_answer, last_boxed


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
    (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![A-Za-z])"), ""),
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
    integer = re.fullmatch(r"(-?)0*(\d+)", s)  # AIME "033" -> "33", "-0" -> "0"; no int(): no digit limit
    if integer:
        s = "0" if integer.group(2) == "0" else integer.group(1) + integer.group(2)
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


def verify_pair(pred: str, gold: str, timeout_s: float | None) -> tuple[bool, bool]:
    """``(equivalent, timed_out)`` for an extracted answer and a gold answer."""
    if same_normalized(pred, gold):
        return True, False
    try:
        with _time_limit(timeout_s):
            gold_parsed = _parse(gold)
            pred_parsed = _parse(pred)
            ok = bool(gold_parsed and pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=None)
    except VerifyTimeout:
        return False, True
    return bool(ok), False


def is_equivalent(pred: str, gold: str, *, timeout_s: float | None = 5.0) -> bool:
    """Whether ``pred`` is the same answer as ``gold``.

    The time limit only works on the main thread; elsewhere there is none.
    """
    return verify_pair(pred, gold, timeout_s)[0]


# ---------------------------------------------------------------- the pool

Judge = Callable[[str, str, float | None], tuple[bool, bool]]
Job = tuple[int, str, str]  # (key, pred, gold)


@dataclass
class RewardStats:
    """Counts for one ``score`` call. ``no_answer + fast_path + verified == total``.

    ``timeouts`` counts pairs that ran out of time, whether the alarm fired or the
    worker was killed at its hard deadline; ``worker_failures`` counts worker
    processes lost (killed when hung, or crashed). A hang counts in both.
    """

    total: int = 0
    correct: int = 0
    no_answer: int = 0
    fast_path: int = 0
    verified: int = 0
    timeouts: int = 0
    worker_failures: int = 0
    verify_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        counts = {k: float(v) for k, v in vars(self).items() if k not in ("total", "correct")}
        return {"reward/accuracy": self.correct / max(self.total, 1)} | {f"reward/{k}": v for k, v in counts.items()}


@dataclass(frozen=True)
class Grade:
    """The verdict on one response: its reward, whether it is correct, and the answer taken from it."""

    reward: float
    correct: bool
    extracted: str | None


def _worker_main(conn, judge: Judge, timeout_s: float | None) -> None:
    """Judge ``[(key, pred, gold), ...]`` batches, answering each pair as soon as it is done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    judge("\\frac{1}{2}", "0.5", timeout_s)  # import and warm sympy before any clock runs
    conn.send("ready")
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the parent is gone
            return
        if batch is None:
            return
        for key, pred, gold in batch:
            try:
                ok, timed_out = judge(pred, gold, timeout_s)
            except Exception:
                ok, timed_out = False, False
            try:
                conn.send((key, bool(ok), bool(timed_out)))
            except OSError:  # the parent is gone
                return


class _Worker:
    """One verifier process. ``inflight`` holds the jobs sent to it and not yet answered, in order."""

    def __init__(self, ctx, judge: Judge, timeout_s: float | None):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, judge, timeout_s), name="bapo-reward", daemon=True)
        self.proc.start()
        child.close()
        self.inflight: deque[Job] = deque()
        self.deadline = math.inf

    def wait_ready(self, timeout_s: float) -> None:
        try:
            if self.conn.poll(timeout_s) and self.conn.recv() == "ready":
                return
        except (EOFError, OSError):
            pass
        self.stop()
        raise RuntimeError(
            "a reward worker process failed to start (its error, if any, is on stderr above). "
            "A script that scores at import time needs an `if __name__ == '__main__':` guard."
        )

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.proc.join(timeout=0.5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5.0)
        self.conn.close()


def _bootstrapping() -> bool:
    """True while a multiprocessing child imports the parent's ``__main__``.

    A script without an ``if __name__ == "__main__"`` guard that calls ``score_math``
    at top level runs that call again there, where starting processes is forbidden;
    it is verified in-process instead. (``_inheriting`` is private but long-stable.)
    """
    return bool(getattr(mp.current_process(), "_inheriting", False))


def _stop_all(workers: list[_Worker | None]) -> None:
    for i, w in enumerate(workers):
        if w is not None:
            w.stop()
            workers[i] = None


class MathVerifier:
    """Scores responses against gold answers; the slow checks run in worker processes.

    Extraction and the string fast path run in the caller. The remaining unique
    (pred, gold) pairs go, ``chunk_size`` at a time, to ``num_workers`` processes.
    A pair gets ``timeout_s`` (alarm in the worker); a worker that sends nothing
    for ``hard_timeout_s`` is killed, so a chunk never runs past ``chunk_size *
    hard_timeout_s``. Workers answer pair by pair, so the pair it was on is known:
    it scores 0, the rest of the chunk is re-run one pair at a time, and a fresh
    worker takes its place. The same happens when a worker crashes.

    Workers start with ``start_method`` ("forkserver": about 50 ms each once the
    server runs; "spawn": about 0.5 s). As with any spawn-style start, each worker
    imports the parent's ``__main__`` script, so entry scripts should stay thin.

    ``num_workers=0`` verifies in the calling process: the alarm works only on the
    main thread (off it there is no time limit), and nothing can stop a hang in C code.

    Rewards: 1.0 if correct, ``format_reward`` if an answer was extracted but is
    wrong, 0.0 if none was. ``judge`` is what the workers run on a pair (a
    module-level function, so it pickles); tests swap it to inject crashes.
    """

    def __init__(
        self,
        *,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        hard_timeout_s: float | None = None,
        chunk_size: int = 16,
        fallback: str = "none",
        format_reward: float = 0.0,
        start_method: str = "forkserver",
        startup_timeout_s: float = 60.0,
        judge: Judge = verify_pair,
    ):
        if fallback not in FALLBACKS:
            raise ValueError(f"reward.fallback must be one of {FALLBACKS}; got {fallback!r}")
        if num_workers < 0 or chunk_size < 1 or timeout_s <= 0:
            raise ValueError("need num_workers >= 0, chunk_size >= 1 and timeout_s > 0")
        if start_method not in ("forkserver", "spawn"):  # fork would copy the trainer's threads
            raise ValueError(f"start_method must be 'forkserver' or 'spawn'; got {start_method!r}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.hard_timeout_s = hard_timeout_s or timeout_s + max(1.0, 0.5 * timeout_s)
        self.chunk_size = chunk_size
        self.fallback = fallback
        self.format_reward = format_reward
        self.start_method = start_method
        self.startup_timeout_s = startup_timeout_s
        self.judge = judge
        self._workers: list[_Worker | None] = [None] * num_workers
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    # -- public

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[float], dict]:
        """Rewards for each response, and ``reward/...`` stats for the logger."""
        grades, stats = self.grade(responses, answers)
        return [g.reward for g in grades], stats.as_dict()

    def grade(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[Grade], RewardStats]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        start = time.perf_counter()
        stats = RewardStats(total=len(responses))
        extracted = [extract_answer(r, fallback=self.fallback) for r in responses]
        correct: list[bool] = [False] * len(responses)
        keys: dict[tuple[str, str], int] = {}  # identical pairs are verified once
        owner: list[int | None] = [None] * len(responses)
        for i, (pred, gold) in enumerate(zip(extracted, answers, strict=True)):
            if pred is None:
                stats.no_answer += 1
            elif same_normalized(pred, gold):
                stats.fast_path += 1
                correct[i] = True
            else:
                stats.verified += 1
                owner[i] = keys.setdefault((pred, gold), len(keys))
        jobs = [(key, pred, gold) for (pred, gold), key in keys.items()]
        with self._lock:
            pooled = self.num_workers > 0 and not _bootstrapping()
            verdicts = self._run_pool(jobs, stats) if pooled else self._run_inline(jobs, stats)
        grades = []
        for i, pred in enumerate(extracted):
            ok = correct[i] or (owner[i] is not None and verdicts.get(owner[i], False))
            reward = 1.0 if ok else (self.format_reward if pred is not None else 0.0)
            grades.append(Grade(reward=reward, correct=ok, extracted=pred))
        stats.correct = sum(g.correct for g in grades)
        stats.verify_s = time.perf_counter() - start
        return grades, stats

    def close(self) -> None:
        """Stop the worker processes; a later ``score`` starts new ones."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals

    def _run_inline(self, jobs: list[Job], stats: RewardStats) -> dict[int, bool]:
        verdicts = {}
        for key, pred, gold in jobs:
            try:
                verdicts[key], timed_out = self.judge(pred, gold, self.timeout_s)
            except Exception:
                verdicts[key], timed_out = False, False
            stats.timeouts += timed_out
        return verdicts

    def _refill(self) -> None:
        """Start workers in empty slots and in slots whose idle process has died."""
        if self._finalizer is None or not self._finalizer.alive:
            self._finalizer = weakref.finalize(self, _stop_all, self._workers)
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Children fork from a server that has sympy and math-verify imported: ~50 ms
            # per worker instead of ~0.5 s. Only takes effect before the server starts.
            ctx.set_forkserver_preload([__name__])
        fresh = []
        for i, w in enumerate(self._workers):
            if w is None or (not w.inflight and not w.proc.is_alive()):
                if w is not None:
                    w.stop()
                self._workers[i] = _Worker(ctx, self.judge, self.timeout_s)
                fresh.append(self._workers[i])
        for w in fresh:
            w.wait_ready(self.startup_timeout_s)

    def _run_pool(self, jobs: list[Job], stats: RewardStats) -> dict[int, bool]:
        queue = deque(jobs[i : i + self.chunk_size] for i in range(0, len(jobs), self.chunk_size))
        verdicts: dict[int, bool] = {}
        try:
            while queue or any(w is not None and w.inflight for w in self._workers):
                if queue:
                    self._dispatch(queue)
                busy = [w for w in self._workers if w is not None and w.inflight]
                timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
                wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout)
                for i, w in enumerate(self._workers):
                    if w is not None and w.inflight:
                        self._collect(i, w, queue, verdicts, stats)
        except BaseException:
            self.close()  # workers may be mid-batch; their answers must not leak into the next call
            raise
        return verdicts

    def _dispatch(self, queue: deque[list[Job]]) -> None:
        if any(w is None or (not w.inflight and not w.proc.is_alive()) for w in self._workers):
            self._refill()
        for w in self._workers:
            if queue and not w.inflight:
                batch = queue.popleft()
                w.inflight.extend(batch)
                w.deadline = time.monotonic() + self.hard_timeout_s
                try:
                    w.conn.send(batch)
                except OSError:  # died since _refill; _collect sees it and re-queues
                    pass

    def _collect(self, i: int, w: _Worker, queue, verdicts: dict[int, bool], stats: RewardStats) -> None:
        alive = True
        try:
            while w.inflight and w.conn.poll():
                key, ok, timed_out = w.conn.recv()
                w.inflight.popleft()
                verdicts[key] = ok
                stats.timeouts += timed_out
                w.deadline = time.monotonic() + self.hard_timeout_s
        except (EOFError, OSError):
            alive = False
        alive = alive and w.proc.is_alive()
        if not w.inflight or (alive and time.monotonic() < w.deadline):
            return
        # Crashed, or stuck where the alarm cannot reach: the pair it was on scores 0.
        key, _, _ = w.inflight.popleft()
        verdicts[key] = False
        stats.worker_failures += 1
        stats.timeouts += alive
        queue.extendleft([job] for job in reversed(w.inflight))  # re-run the rest one by one
        w.inflight.clear()
        w.stop()
        self._workers[i] = None


_default_verifier: MathVerifier | None = None
_default_lock = threading.Lock()


def score_math(response: str, answer: str) -> float:
    """1.0 if the last ``\\boxed{}`` in ``response`` equals ``answer``, else 0.0.

    Runs in a shared one-worker ``MathVerifier`` with the default settings.
    """
    global _default_verifier
    with _default_lock:
        if _default_verifier is None:
            _default_verifier = MathVerifier(num_workers=1)
    rewards, _ = _default_verifier.score([response], [answer])
    return rewards[0]
