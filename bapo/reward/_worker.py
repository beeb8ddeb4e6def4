"""A reward worker process: ``python -m bapo.reward._worker JUDGE TIMEOUT_S``.

Started by ``MathVerifier`` (``pool.py``) as a plain subprocess, so it imports
only this module, its imports and the judge's module; never the caller's
``__main__`` (a multiprocessing child re-imports it, and an unguarded script then
runs twice). It talks to the parent in JSON lines, so nothing is unpickled:

* worker -> parent, once: ``"ready"`` after a warm-up check (sympy is imported
  and warm before any deadline runs);
* parent -> worker: ``[[key, pred, gold], ...]``, a batch on one line, so the
  parent's write completes while the worker is waiting for it; end of input stops
  the worker;
* worker -> parent: ``[key, ok, timed_out]`` for each pair as soon as it is done,
  so the parent knows which pair a hung worker was on.

Each pair runs under ``timeout_s`` of ``SIGALRM``, normalisation included. A hang
the alarm cannot reach (long C code) is the parent's to end: it kills the worker.
The stop signals (``bapo.infra.stop.STOP_SIGNALS``) are ignored: a launcher's signal to
the whole process group must not turn the pairs in flight into wrong answers; the
worker ends at the end of its input (the parent closed it, or died).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from bapo.reward.verify import load_judge, run_judge


def _protocol_out():
    """A private copy of stdout for the protocol; fd 1 then points at stderr, so stray prints cannot corrupt it."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="ascii", newline="\n")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return out


def main(argv: list[str]) -> None:
    judge_name, timeout_arg = argv
    timeout_s = float(timeout_arg)
    out = _protocol_out()
    # A stop (Ctrl-C, a launcher's or a scheduler's signal to the process group) is the parent's to handle: the pairs
    # in flight are graded, and the parent ends this process (end of input, or a kill) when it is done with it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)

    def send(message) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    judge = load_judge(judge_name)
    run_judge(judge, "\\frac{1}{2}", "0.5", timeout_s)  # import and warm sympy before any clock runs
    send("ready")
    for line in sys.stdin.buffer:
        for key, pred, gold in json.loads(line):
            try:
                ok, timed_out = run_judge(judge, pred, gold, timeout_s)
            except Exception:  # a judge bug is a wrong answer, not a lost worker
                ok, timed_out = False, False
            try:
                send([key, ok, timed_out])
            except OSError:  # the parent is gone
                return


if __name__ == "__main__":
    main(sys.argv[1:])
