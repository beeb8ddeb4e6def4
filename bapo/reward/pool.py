"""Batch scoring: extraction in the caller, the slow checks in a pool of worker subprocesses.

Workers are ``python -m bapo.reward._worker`` subprocesses talking JSON lines over
pipes (see ``_worker.py``). They never import the caller's ``__main__``, unlike
multiprocessing's spawn/forkserver children, so a script with no
``if __name__ == "__main__":`` guard that calls ``score_math`` runs once. Each
worker is a fresh interpreter that imports sympy, so starting or replacing one
costs its start-up (``scripts/bench/bench_reward.py`` measures it; docs/perf.md).

The time limit uses ``SIGALRM``, which only works in a process's main thread, and
some inputs hang in C code that no signal interrupts: hence worker processes,
each with a hard deadline after which the parent kills and replaces it. The pair
it was on scores 0 and is counted.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

from bapo.reward.config import RewardConfig
from bapo.reward.extract import FALLBACKS, extract_answer
from bapo.reward.verify import load_judge, run_judge, same_normalized

Job = tuple[int, str, str]  # (key, pred, gold)

# The caller (the trainer) normalises only strings this short, so its share of the
# work stays small and bounded whatever the regexes do; longer ones go to a worker,
# under the time limit. Real answers are far shorter: the longest gold in the MATH
# training set is a few hundred characters.
FAST_PATH_MAX_CHARS = 1024


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


def _import_roots(modules: Sequence[str]) -> list[str]:
    """The sys.path folders that ``modules`` were found in, for the worker's PYTHONPATH."""
    roots: list[str] = []
    for name in modules:
        spec = importlib.util.find_spec(name.split(".")[0])
        if spec is None:
            continue
        places = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
        roots += [str(Path(p).resolve().parent) for p in places if p and os.path.exists(p)]
    return list(dict.fromkeys(roots))


def _worker_env(judge: str) -> dict[str, str]:
    roots = _import_roots(["bapo", judge.partition(":")[0]])
    path = os.pathsep.join(roots + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {**os.environ, "PYTHONPATH": path}


class _Worker:
    """One verifier subprocess. ``inflight`` holds the jobs sent to it and not yet answered, in order."""

    def __init__(self, judge: str, timeout_s: float, env: dict[str, str]):
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # the cwd must not shadow a module
        self.proc = subprocess.Popen(
            [sys.executable, *safe_path, "-m", "bapo.reward._worker", judge, repr(timeout_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.fd = self.proc.stdout.fileno()
        self._buf = b""
        self.closed = False  # its stdout reached end of file: it has exited
        self.inflight: deque[Job] = deque()
        self.deadline = math.inf

    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def send(self, batch: list[Job]) -> None:
        """Write one batch; OSError if the worker has died."""
        self.proc.stdin.write(json.dumps(batch).encode() + b"\n")
        self.proc.stdin.flush()

    def receive(self) -> list:
        """The messages that have arrived, without blocking; ``closed`` is set at the end of its output."""
        while not self.closed and wait([self.fd], 0):
            chunk = os.read(self.fd, 1 << 16)
            self.closed = not chunk
            self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines]

    def wait_ready(self, deadline: float) -> None:
        try:
            while not self.closed and time.monotonic() < deadline:
                wait([self.fd], deadline - time.monotonic())
                messages = self.receive()
                if messages == ["ready"]:
                    return
                if messages:
                    break
        except (OSError, ValueError):
            pass
        self.stop()
        raise RuntimeError(
            "a reward worker process failed to start or did not report ready in time "
            "(its error, if any, is on stderr above)"
        )

    def stop(self, *, kill: bool = False) -> None:
        """End the process: end of input lets an idle worker exit by itself; a stuck one is killed."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5.0)
        self.proc.stdout.close()


def _stop_all(workers: list[_Worker | None]) -> None:
    for i, w in enumerate(workers):
        if w is not None:
            w.stop()
            workers[i] = None


class MathVerifier:
    """Scores responses against gold answers; the slow checks run in worker processes.

    Extraction and the string fast path (for strings up to ``FAST_PATH_MAX_CHARS``)
    run in the caller. The remaining unique (pred, gold) pairs go, ``chunk_size``
    at a time, to ``num_workers`` subprocesses. A pair gets ``timeout_s`` (alarm in
    the worker, around the whole check); a worker that sends nothing for
    ``hard_timeout_s`` is killed, so a chunk never runs past ``chunk_size *
    hard_timeout_s``. Workers answer pair by pair, so the pair it was on is known:
    it scores 0, the rest of the chunk is re-run one pair at a time, and a fresh
    worker takes its place. The same happens when a worker crashes.

    ``num_workers=0`` verifies in the calling process, which must then be its main
    thread (the alarm works nowhere else), and nothing can stop a hang in C code.

    Rewards: 1.0 if correct, ``format_reward`` if an answer was extracted but is
    wrong, 0.0 if none was. ``judge`` names what runs on a pair as
    ``"module:function"`` (``function(pred, gold) -> bool``), importable in a fresh
    interpreter; tests swap it to inject crashes.
    """

    config = RewardConfig  # reward=math (conf/reward/math.yaml): the group's common keys are all it reads

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> MathVerifier:
        """The verifier ``reward=math`` describes (``bapo.reward.registry``)."""
        return cls(num_workers=cfg.num_workers, timeout_s=cfg.timeout_s, fallback=cfg.fallback,
                   format_reward=cfg.format_reward)  # fmt: skip

    def __init__(
        self,
        *,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        hard_timeout_s: float | None = None,
        chunk_size: int = 16,
        fallback: str = "none",
        format_reward: float = 0.0,
        startup_timeout_s: float = 60.0,
        judge: str = "bapo.reward.verify:check_pair",
    ):
        if fallback not in FALLBACKS:
            raise ValueError(f"reward.fallback must be one of {FALLBACKS}; got {fallback!r}")
        if num_workers < 0 or chunk_size < 1 or timeout_s <= 0:
            raise ValueError("need num_workers >= 0, chunk_size >= 1 and timeout_s > 0")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.hard_timeout_s = hard_timeout_s or timeout_s + max(1.0, 0.5 * timeout_s)
        self.chunk_size = chunk_size
        self.fallback = fallback
        self.format_reward = format_reward
        self.startup_timeout_s = startup_timeout_s
        self.judge = judge
        self._judge_fn = load_judge(judge)  # fails here, not in a worker, when the name is wrong
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
        if self.num_workers == 0 and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "reward.num_workers=0 verifies in the calling process, where the time limit (SIGALRM) works only "
                f"on the main thread; this call came from thread {threading.current_thread().name!r}, where one "
                "pathological answer could hang it for good. Set reward.num_workers >= 1."
            )
        start = time.perf_counter()
        stats = RewardStats(total=len(responses))
        extracted = [extract_answer(r, fallback=self.fallback) for r in responses]
        correct: list[bool] = [False] * len(responses)
        keys: dict[tuple[str, str], int] = {}  # identical pairs are verified once
        owner: list[int | None] = [None] * len(responses)
        for i, (pred, gold) in enumerate(zip(extracted, answers, strict=True)):
            if pred is None:
                stats.no_answer += 1
            elif max(len(pred), len(gold)) <= FAST_PATH_MAX_CHARS and same_normalized(pred, gold):
                stats.fast_path += 1
                correct[i] = True
            else:
                stats.verified += 1
                owner[i] = keys.setdefault((pred, gold), len(keys))
        jobs = [(key, pred, gold) for (pred, gold), key in keys.items()]
        with self._lock:
            verdicts = self._run_pool(jobs, stats) if self.num_workers > 0 else self._run_inline(jobs, stats)
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
                verdicts[key], timed_out = run_judge(self._judge_fn, pred, gold, self.timeout_s)
            except Exception:
                verdicts[key], timed_out = False, False
            stats.timeouts += timed_out
        return verdicts

    def _refill(self) -> None:
        """Start workers in empty slots and in slots whose idle process has died."""
        if self._finalizer is None or not self._finalizer.alive:
            self._finalizer = weakref.finalize(self, _stop_all, self._workers)
        env = _worker_env(self.judge)
        fresh = []
        for i, w in enumerate(self._workers):
            if w is None or (not w.inflight and not w.alive()):
                if w is not None:
                    w.stop()
                self._workers[i] = _Worker(self.judge, self.timeout_s, env)
                fresh.append(self._workers[i])
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            for w in fresh:  # they start in parallel; this waits for the slowest
                w.wait_ready(deadline)
        except RuntimeError:
            self.close()
            raise

    def _run_pool(self, jobs: list[Job], stats: RewardStats) -> dict[int, bool]:
        queue = deque(jobs[i : i + self.chunk_size] for i in range(0, len(jobs), self.chunk_size))
        verdicts: dict[int, bool] = {}
        try:
            while queue or any(w is not None and w.inflight for w in self._workers):
                if queue:
                    self._dispatch(queue)
                busy = [w for w in self._workers if w is not None and w.inflight]
                timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
                wait([w.fd for w in busy], timeout)  # an answer, an exit (EOF), or the nearest deadline
                for i, w in enumerate(self._workers):
                    if w is not None and w.inflight:
                        self._collect(i, w, queue, verdicts, stats)
        except BaseException:
            self.close()  # workers may be mid-batch; their answers must not leak into the next call
            raise
        return verdicts

    def _dispatch(self, queue: deque[list[Job]]) -> None:
        if any(w is None or (not w.inflight and not w.alive()) for w in self._workers):
            self._refill()
        for w in self._workers:
            if queue and not w.inflight:
                batch = queue.popleft()
                w.inflight.extend(batch)
                w.deadline = time.monotonic() + self.hard_timeout_s
                try:
                    w.send(batch)
                except OSError:  # died since _refill; _collect sees it and re-queues
                    pass

    def _collect(self, i: int, w: _Worker, queue, verdicts: dict[int, bool], stats: RewardStats) -> None:
        alive = True
        try:
            for key, ok, timed_out in w.receive():
                if not w.inflight or key != w.inflight[0][0]:
                    raise ValueError(f"reward worker answered key {key}, expected the head of {list(w.inflight)}")
                w.inflight.popleft()
                verdicts[key] = bool(ok)
                stats.timeouts += bool(timed_out)
                w.deadline = time.monotonic() + self.hard_timeout_s
        except (OSError, ValueError, TypeError):  # a garbled answer: treat the worker as lost
            alive = False
        alive = alive and w.alive()
        if not w.inflight or (alive and time.monotonic() < w.deadline):
            return
        # Crashed, or stuck where the alarm cannot reach: the pair it was on scores 0.
        key, _, _ = w.inflight.popleft()
        verdicts[key] = False
        stats.worker_failures += 1
        stats.timeouts += alive
        queue.extendleft([job] for job in reversed(w.inflight))  # re-run the rest one by one
        w.inflight.clear()
        w.stop(kill=True)
        self._workers[i] = None


_default_verifier: MathVerifier | None = None
_default_lock = threading.Lock()


def score_math(response: str, answer: str) -> float:
    """1.0 if the last ``\\boxed{}`` in ``response`` equals ``answer``, else 0.0.

    Runs in a shared one-worker ``MathVerifier`` with the default settings. Safe to
    call from a script with no ``if __name__ == "__main__":`` guard: the worker is a
    fresh interpreter that never imports the caller.
    """
    global _default_verifier
    if not isinstance(response, str) or not isinstance(answer, str):
        raise TypeError(
            f"score_math(response, answer) grades one response: both must be str, got {type(response).__name__} "
            f"and {type(answer).__name__}; for a batch use MathVerifier().score(responses, answers)"
        )
    with _default_lock:
        if _default_verifier is None:
            _default_verifier = MathVerifier(num_workers=1)
    rewards, _ = _default_verifier.score([response], [answer])
    return rewards[0]
