"""The learner's pool of rollout worker processes: started, fed, replaced and stopped.

:class:`WorkerPool` starts ``placement.workers`` processes (``python -m bapo.entry.worker``, whose life is
:mod:`bapo.rollout.disaggregated.worker`), sends them the run (:class:`WorkerSpec`), and answers for each request
with its reply or a :class:`WorkerLost`. Weights go over a two-rank gloo process group per worker
(``torch.distributed.ProcessGroupGloo`` on a ``TCPStore``), one flat buffer per dtype, the way a GPU trainer sends
them over NCCL; one pair group per worker, so a worker can be replaced without disturbing the others. Requests
and results go over :mod:`bapo.rollout.disaggregated.wire`.

Faults. A worker that exits, breaks its connection or stays silent past ``placement.worker_timeout_s``
(neither a reply nor a heartbeat: a worker at work beats about every second, so a slow request is not
a fault, a frozen, stopped or unreachable process is) is killed and replaced (``rollout/worker_restarts``
counts them); the replacement gets the maker state the worker had after its last accepted batch and the
weights of the batch it failed, and makes that batch again, so nothing accepted is lost and the batch
is the one it would have been.
After ``placement.worker_restarts`` failures in a row on one request the run stops with the last
reason (a :class:`WorkerError`: one line, exit status 1). A worker's log (a temporary file) is named in an
error or a restart warning only when it holds something to read (the traceback of a worker that failed), and
is then kept; the others are removed with the pool. A worker that reports an error of its own (a bad request,
a model that does not match the learner's) is not restarted: that error is the run's. Workers watch their
parent: if the learner dies, they remove their own logs and exit within about a second. They ignore SIGINT, so
Ctrl-C in a terminal reaches the learner, which stops them after its checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as tdist

from bapo.infra import stop
from bapo.infra.checks import ConfigError, RunFailed
from bapo.rollout.disaggregated.wire import AUTHKEY_ENV, listen, recv, send
from bapo.rollout.source import Interrupted

GIVE_UP = ("make", "generate")  # waits a stop request abandons (the worker's work is discarded with it)
log = logging.getLogger(__name__)


class WorkerError(RunFailed, RuntimeError):
    """The run's error from its workers (one line, exit status 1): a failure a worker reported itself (bad input,
    never retried), a worker that could not start, or one lost more times in a row than the restarts allow."""


class WorkerLost(Exception):
    """A worker exited, broke its connection or timed out: the pool replaces it."""


@dataclass
class WorkerSpec:
    """What every worker is started with (sent in its ``init`` message)."""

    config: dict  # the run's resolved config, as plain containers
    path: str  # the model folder the learner resolved
    limit: int  # the longest prompt (the learner's prompt_limit), so every process filters alike
    run_dir: str
    threads: int = 1


@dataclass
class Worker:
    """The learner's handle on one worker process."""

    index: int
    proc: subprocess.Popen
    log_path: str
    conn: Connection | None = None
    pg: Any = None
    version: int | None = None  # the weights it holds (None: not loaded by the learner yet)
    generation: int = 0  # bumped at each restart: names its process group in the store
    info: dict = field(default_factory=dict)
    keep_log: bool = False  # an error or warning named its log: the pool leaves the file in place

    def ended(self) -> str:
        """How its process ended: ``exited with code 1``, ``was killed by SIGKILL``."""
        code = self.proc.returncode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def reason(self) -> str:
        """``: <the error its log ends with> (log: <path>)`` when the log holds a traceback (the log is then kept);
        ``""`` otherwise: progress bars and info lines are no reason, and a killed process leaves none."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
                error = last_error(f.read().decode("utf-8", errors="replace"))
        except OSError:
            return ""
        return f": {error}{self.keep()}" if error else ""

    def keep(self) -> str:
        """`` (log: <path>)`` for a message that names the log, which the pool then leaves in place; ``""`` when
        the log is gone or empty."""
        try:
            if os.path.getsize(self.log_path) == 0:
                return ""
        except OSError:
            return ""
        self.keep_log = True
        return f" (log: {self.log_path})"


def last_error(log: str) -> str:
    """The exception line of the last traceback in a worker's ``log`` (``RuntimeError: boom``); ``""`` without one."""
    _, found, after = log.rpartition("Traceback (most recent call last):")
    if not found:
        return ""
    return next((x.strip() for x in after.splitlines() if x.strip() and not x[0].isspace()), "")


class WorkerPool:
    """``count`` rollout worker processes, started, fed, replaced and stopped by the learner."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        count: int,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 900.0,
        start_timeout_s: float = 300.0,
        restarts: int = 3,
        interrupt: threading.Event | None = None,
        python: str | None = None,
    ):
        if count < 1:
            raise ConfigError(f"placement.workers: placement.mode=disaggregated needs at least 1 worker, got {count}")
        self.spec, self.count = spec, count
        self.host, self.timeout_s, self.start_timeout_s, self.max_restarts = host, timeout_s, start_timeout_s, restarts
        self.interrupt = interrupt if interrupt is not None else threading.Event()
        self.python = python or sys.executable
        self.restarts = 0  # replacements so far (rollout/worker_restarts)
        self.sync_s = 0.0  # seconds spent pushing weights since last asked
        self.authkey = secrets.token_bytes(32)
        self.listener = listen(host, port, self.authkey)
        try:
            self.store = tdist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self._td(timeout_s))
        except Exception as e:  # noqa: BLE001 (the store's errors are RuntimeErrors without a type of their own)
            self.listener.close()
            raise ConfigError(f"placement.host: cannot start the weight store on {host}: {e}") from None
        self.workers: list[Worker] = []
        self._early: dict[tuple[int, int], Connection] = {}  # connections of workers not yet waited for
        self._lock = threading.RLock()  # one request at a time per pool (the producer thread, or borrow)
        self._closed = False
        atexit.register(self.stop)

    @staticmethod
    def _td(seconds: float) -> datetime.timedelta:
        return datetime.timedelta(seconds=seconds)

    # ------------------------------------------------------------------ starting

    def spawn(self) -> None:
        """Start every worker process (their models load in parallel, and beside the learner's)."""
        self.workers = [self._spawn(i) for i in range(self.count)]

    def wait(self) -> None:
        """Wait for each worker to be ready; a worker that cannot start stops them all (a WorkerError)."""
        try:
            for w in self.workers:
                self._handshake(w)
        except BaseException:
            self.stop()
            raise
        log.info("%d rollout worker(s) ready: pids %s", self.count, self.pids())

    def _spawn(self, index: int, generation: int = 0) -> Worker:
        fd, log_path = tempfile.mkstemp(prefix=f"bapo-rollout-worker{index}-", suffix=".log")
        host, port = self.listener.address
        env = dict(os.environ)
        env[AUTHKEY_ENV] = self.authkey.hex()
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(self.spec.threads)
        env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)  # not a torchrun rank
        cmd = [
            self.python,
            "-m",
            "bapo.entry.worker",
            "--connect",
            f"{host}:{port}",
            "--index",
            str(index),
            "--parent",
            str(os.getpid()),
            "--log",
            log_path,
        ]
        with os.fdopen(fd, "w") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
        return Worker(index, proc, log_path, generation=generation)

    def _accept(self, w: Worker, deadline: float) -> Connection:
        """The connection of worker ``w``'s process (the listener takes workers in any order; each says its index)."""
        while True:
            if (w.index, w.proc.pid) in self._early:
                return self._early.pop((w.index, w.proc.pid))
            if w.proc.poll() is not None:
                raise WorkerLost(f"{w.ended()} before connecting{w.reason()}")
            if time.monotonic() > deadline:
                raise WorkerLost(f"did not connect within {self.start_timeout_s:g} s")
            try:  # a connection that proved the key (any other is refused off this loop); polled for a dead worker
                conn = self.listener.accept(timeout=0.5)
            except TimeoutError:
                continue
            hello = recv(conn)
            if hello == ("hello", w.index, w.proc.pid):
                return conn
            if isinstance(hello, tuple) and len(hello) == 3 and hello[0] == "hello":
                self._early[(hello[1], hello[2])] = conn  # another worker, connected first: its turn comes
                continue
            conn.close()
            log.warning("rollout workers: ignored a connection that said %r", hello)

    def _handshake(self, w: Worker) -> None:
        """Connect to ``w``, send it the run, join its weight group; a worker that cannot start is the run's error."""
        deadline = time.monotonic() + self.start_timeout_s
        try:
            w.conn = self._accept(w, deadline)
            prefix = f"worker{w.index}/gen{w.generation}"
            init = vars(self.spec) | {"share": w.index, "shares": self.count, "timeout_s": self.timeout_s}
            send(w.conn, ("init", init | {"store": [self.host, self.store.port], "prefix": prefix}))
            kind, payload = self._recv(w, deadline - time.monotonic(), what="start", extend=False)
        except WorkerLost as e:
            self._kill(w)
            note = "" if w.keep_log else w.keep()
            raise WorkerError(f"rollout worker {w.index} could not start: {e}{note}") from None
        if kind == "error":
            self._kill(w)
            raise WorkerError(f"rollout worker {w.index} could not start: {payload}{w.keep()}")
        w.info = payload
        store = tdist.PrefixStore(prefix, self.store)
        w.pg = tdist.ProcessGroupGloo(store, 0, 2, self._td(self.timeout_s))
        kind, payload = self._recv(w, self.start_timeout_s, what="join", extend=False)
        if kind != "ready":
            self._kill(w)
            raise WorkerError(f"rollout worker {w.index} could not join its weight group: {payload}")

    # ------------------------------------------------------------------ requests

    def _recv(self, w: Worker, timeout_s: float, *, what: str, extend: bool = True) -> tuple[str, Any]:
        """The next reply of ``w``: (kind, payload). WorkerLost if it dies, breaks or stays silent for ``timeout_s``.

        A worker at work sends a heartbeat about every second (:class:`bapo.rollout.disaggregated.worker.Heart`);
        with ``extend`` each one restarts the silence window, so only a frozen or unreachable worker times out, not a
        slow one. Without it, ``timeout_s`` bounds the whole wait (a worker's start)."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        assert w.conn is not None
        while True:
            if what in GIVE_UP and stop.requested():
                raise Interrupted  # a stop gives the batch (or evaluation) up: the worker's reply is not awaited
            try:
                if w.conn.poll(0.2):
                    msg = recv(w.conn)
                    if msg[0] != "beat":
                        return msg
                    if extend:
                        deadline = time.monotonic() + timeout_s
                    continue
            except (EOFError, OSError) as e:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=2)  # a process that died closed its end: say how it ended
                if w.proc.returncode is not None:
                    raise WorkerLost(f"{w.ended()} during {what}{w.reason()}") from None
                raise WorkerLost(f"broke its connection during {what} ({type(e).__name__})") from None
            if w.proc.poll() is not None:
                raise WorkerLost(f"{w.ended()} during {what}{w.reason()}")
            if time.monotonic() > deadline:
                raise WorkerLost(f"sent nothing for {timeout_s:g} s during {what} (placement.worker_timeout_s)")

    def _send(self, w: Worker, msg: tuple) -> None:
        assert w.conn is not None
        try:
            send(w.conn, msg)
        except (OSError, ValueError) as e:
            raise WorkerLost(f"broke its connection on a {msg[0]!r} request ({type(e).__name__})") from None

    def _reply(self, w: Worker, what: str) -> Any:
        kind, payload = self._recv(w, self.timeout_s, what=what)
        if kind == "error":
            raise WorkerError(f"rollout worker {w.index}: {payload}")
        return payload

    def call(self, w: Worker, msg: tuple) -> Any:
        """Send one request to ``w`` and return its reply's payload."""
        self._send(w, msg)
        return self._reply(w, msg[0])

    def push_weights(self, w: Worker, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Send ``version``'s weights to ``w`` (one flat buffer per dtype over its gloo group); the seconds taken."""
        t0 = time.perf_counter()
        names = list(weights)
        tensors = [weights[n].detach() for n in names]
        meta = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in zip(names, tensors, strict=True)]
        self._send(w, ("weights", version, meta))
        try:
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                flat = torch.cat([t.reshape(-1).cpu() for t in tensors if t.dtype == dtype])
                w.pg.send([flat], 1, 0).wait()
        except RuntimeError as e:
            raise WorkerLost(f"failed to receive its weights ({str(e).splitlines()[0]})") from None
        self._reply(w, "weights")
        w.version = version
        dt = time.perf_counter() - t0
        self.sync_s += dt
        return dt

    # ------------------------------------------------------------------ faults and stopping

    def _kill(self, w: Worker) -> None:
        with contextlib.suppress(OSError):
            if w.conn is not None:
                w.conn.close()
        if w.proc.poll() is None:
            w.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=10)
        w.pg = None

    def replace(self, w: Worker, why: str) -> Worker:
        """Kill ``w`` and start its replacement (which holds no weights yet)."""
        if self._closed or self.interrupt.is_set():
            raise Interrupted
        self.restarts += 1
        log.warning(
            "rollout worker %d (pid %d) %s: restarting it (restart %d)", w.index, w.proc.pid, why, self.restarts
        )
        self._kill(w)
        self._drop_log(w)
        new = self._spawn(w.index, w.generation + 1)
        self.workers[w.index] = new
        try:
            self._handshake(new)
        except WorkerError as e:  # its replacement could not start: a failure in a row like any other
            raise WorkerLost(str(e).removeprefix(f"rollout worker {w.index} ")) from None
        return new

    def retrying(self, index: int, fn, recover) -> Any:
        """``fn(worker, fresh)`` on worker ``index``; when it is lost, replace it, ``recover(new)`` (its state), and
        call ``fn(new, True)``, up to ``placement.worker_restarts`` failures in a row."""
        failures, why = 0, None
        while True:
            try:
                if why is not None:
                    recover(self.replace(self.workers[index], why))
                return fn(self.workers[index], why is not None)
            except WorkerLost as e:
                failures, why = failures + 1, str(e)
                if failures > self.max_restarts:
                    raise WorkerError(self._given_up(index, failures, why)) from None

    def _given_up(self, index: int, failures: int, why: str) -> str:
        """Why the run stops after ``failures`` losses in a row of worker ``index`` (the last one: ``why``)."""
        if self.max_restarts == 0:
            return f"rollout worker {index} {why}, and placement.worker_restarts=0 allows no replacement"
        tried = f"{failures - 1} replacement{'s' if failures > 2 else ''}"
        return (
            f"rollout worker {index} failed {failures} times in a row, the worker and its {tried} "
            f"(placement.worker_restarts={self.max_restarts}); the last time it {why}"
        )

    @staticmethod
    def _drop_log(w: Worker) -> None:
        """Remove ``w``'s log unless an error or warning named it."""
        if not w.keep_log:
            with contextlib.suppress(OSError):
                os.unlink(w.log_path)

    def stop(self) -> None:
        """Ask every worker to exit, kill those that do not within 10 s, and free the ports. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            with contextlib.suppress(Exception):
                if w.conn is not None and w.proc.poll() is None:
                    send(w.conn, ("stop",))
        deadline = time.monotonic() + 10
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            self._kill(w)
            self._drop_log(w)  # its log has served, unless an error named it
        with contextlib.suppress(Exception):
            self.listener.close()
        self.store = None
        atexit.unregister(self.stop)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def take_sync_s(self) -> float:
        s, self.sync_s = self.sync_s, 0.0
        return s
