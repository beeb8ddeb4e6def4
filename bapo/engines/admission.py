"""What ``rollout=vllm_server`` sends a server at once (bapo/engines/vllm_server.py): requests admitted while the KV
cache their responses are expected to hold fits the server's, each response's share released as it finishes.

vLLM's scheduler runs what fits its KV cache, queues the rest and preempts (then resumes) running sequences when the
cache runs short. Sending it everything at once would keep it full too, but with requests waiting silently in its
queue (a stuck server cannot be told from a busy one) and a storm of preemptions at each batch's start; reserving a
response's whole budget until its request's slowest response ends (n x (prompt + max_tokens)) keeps it at a fraction
of what it can run, since most responses are far shorter than the budget. scripts/bench/bench_admission.py measures
the three at paper_7b's shape (docs/gpu.md, "Admission").
"""

from __future__ import annotations

import collections
import threading


class Stopped(RuntimeError):
    """The batch failed while this request waited for admission (one line)."""


class Admission:
    """The requests in flight on one server. A request of ``n`` children is admitted while the KV cache its children
    are expected to hold fits ``overcommit`` x the server's cache (``tokens``; None: unknown, not checked) and their
    count ``max_num_seqs`` (``seqs``); a request larger than the whole cache still runs, alone.

    A running child is expected to hold its prompt and, on average over the time it runs, half its response weighted
    by how long it runs: ``E[L^2] / (2 E[L])`` over the last ``window`` responses that finished whole (a response of
    length L holds each length up to L in turn, and a long one runs longer, so it is met more often); ``max_tokens``
    until ``min_seen`` have finished. Each child's reservation is released when its ``finish_reason`` arrives."""

    def __init__(self, tokens: int | None, seqs: int, overcommit: float = 1.0, window: int = 1024, min_seen: int = 32):
        self.tokens, self.seqs, self.overcommit = tokens, seqs, overcommit
        self.min_seen = min_seen
        self.used_tokens = 0.0
        self.used_seqs = 0
        self.lengths: collections.deque[int] = collections.deque(maxlen=window)
        self.aborted = False
        self.cond = threading.Condition()

    def held(self, max_tokens: int) -> float:
        """Response tokens a running child is expected to hold in the KV cache, on average over its run."""
        with self.cond:
            if len(self.lengths) < self.min_seen:
                return float(max_tokens)
            m1 = sum(self.lengths) / len(self.lengths)
            m2 = sum(x * x for x in self.lengths) / len(self.lengths)
        return min(float(max_tokens), m2 / (2 * m1) if m1 else 1.0)

    def fits(self, tokens: float, seqs: int) -> bool:
        idle = self.used_seqs == 0  # a request larger than the whole cache still runs, alone
        tok_ok = self.tokens is None or self.used_tokens + tokens <= self.overcommit * self.tokens
        return idle or (tok_ok and self.used_seqs + seqs <= self.seqs)

    def request(self, prompt: int, n: int, max_tokens: int, learn: bool) -> Ticket:
        """The reservation of a request (a context manager that waits for room, sized by what is known when the room
        comes; :meth:`Ticket.finish` releases a child's part). ``learn``: its finished responses are whole ones (not
        segments under a smaller cap) and teach the mean."""
        return Ticket(self, prompt, n, max_tokens, learn)

    def abort(self) -> None:
        """Every request waiting for admission raises (the batch failed); :meth:`reopen` admits again."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def reopen(self) -> None:
        with self.cond:
            self.aborted = False


class Ticket:
    """One request's reservation: ``per`` tokens for each of its ``n`` children (its prompt and the response tokens
    a child is expected to hold, as known when it is admitted)."""

    def __init__(self, admission: Admission, prompt: int, n: int, max_tokens: int, learn: bool):
        self.a, self.prompt, self.max_tokens, self.learn = admission, prompt, max_tokens, learn
        self.per = 0.0
        self.open = set(range(n))

    def _fits(self) -> bool:
        self.per = self.prompt + self.a.held(self.max_tokens)
        return self.a.fits(self.per * len(self.open), len(self.open))

    def __enter__(self) -> Ticket:
        a, n = self.a, len(self.open)
        with a.cond:  # a re-entrant lock: held() takes it again
            a.cond.wait_for(lambda: a.aborted or self._fits())
            if a.aborted:
                raise Stopped("rollout=vllm_server: the batch was stopped before this request was sent")
            a.used_tokens += self.per * n
            a.used_seqs += n
        return self

    def finish(self, index: int, length: int) -> None:
        """Child ``index`` has finished with ``length`` tokens: its part of the cache is free."""
        a = self.a
        with a.cond:
            if index not in self.open:
                return
            self.open.discard(index)
            a.used_tokens -= self.per
            a.used_seqs -= 1
            if self.learn:
                a.lengths.append(length)
            a.cond.notify_all()

    def __exit__(self, *exc) -> None:
        a = self.a
        with a.cond:  # children that never finished (the request failed): released unlearned
            a.used_tokens -= self.per * len(self.open)
            a.used_seqs -= len(self.open)
            self.open.clear()
            a.cond.notify_all()
