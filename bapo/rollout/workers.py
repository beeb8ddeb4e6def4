"""Rollout workers in other processes: the learner's side of ``placement.mode=disaggregated``.

The learner process keeps the loop, the schedule and the weights; ``rollout.workers`` worker processes
(``python -m bapo.entry.worker``) each hold an engine, a reward pool and the prompt stream, and make
their share of every rollout batch with the weights the learner pushes. The in-process producer
(:class:`bapo.rollout.producer.Producer`) drives them unchanged: this module gives it a batch maker
(:class:`RemoteMaker`) and an engine to lend for evaluation (:class:`RemoteEngine`), so the schedule,
the queue, ``run()`` and the checkpoint format are the colocated run's.

Transport: libraries only. Requests and results (rollout batches, the maker's state) go over an
authenticated ``multiprocessing.connection`` to each worker (:class:`bapo.infra.listener.AuthListener`: the key's
challenge off the accept loop, timed, so a silent local client keeps no worker out; what the key protects and
what it does not is in its docstring and docs/offpolicy.md); weights go over a two-rank gloo process
group per worker (``torch.distributed.ProcessGroupGloo`` on a ``TCPStore``), one flat buffer per dtype,
the way a GPU trainer sends them over NCCL. One pair group per worker, so a worker can be replaced
without disturbing the others.

Determinism. Worker ``i`` of ``N`` is the rollout maker of rank ``i`` of ``N`` (``bapo.rollout.maker``):
every worker draws the same prompts and generates its share with its share's seed, and the shares are
joined in order. So a disaggregated run follows the schedule of the run's ``train.async_rollout`` and
``buffer.enforce`` exactly: in sync or admission mode it is reproducible and resumes exactly, and with one
worker it makes the batches a colocated run makes. Drop mode (free-running) generates with the newest
weights and is not reproducible, as in one process.

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
import dataclasses
import datetime
import errno
import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as tdist

from bapo.engines.base import RolloutEngine
from bapo.infra import stop
from bapo.infra.checks import ConfigError, RunFailed, require, resumable
from bapo.infra.listener import AuthListener
from bapo.rollout.placement import Placement, PlacementConfig, PlacementTraits, RolloutParts
from bapo.rollout.source import Interrupted
from bapo.samples import Prompt, RolloutBatch, Sample

GIVE_UP = ("make", "generate")  # waits a stop request abandons (the worker's work is discarded with it)
log = logging.getLogger(__name__)

AUTHKEY_ENV = "BAPO_WORKER_AUTHKEY"


def send(conn: Connection, obj: Any) -> None:
    """``obj`` over ``conn`` by value. (The connection's own ``send`` pickles with multiprocessing's reducers, which
    torch extends to pass tensors as shared-memory handles through a helper process; the standard pickler
    copies them, which both ends can always read.)"""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    """What :func:`send` sent (only between the learner and the workers it started: the connection is authenticated)."""
    return pickle.loads(conn.recv_bytes())  # noqa: S301


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
            raise ConfigError(f"rollout.workers: placement.mode=disaggregated needs at least 1 worker, got {count}")
        self.spec, self.count = spec, count
        self.host, self.timeout_s, self.start_timeout_s, self.max_restarts = host, timeout_s, start_timeout_s, restarts
        self.interrupt = interrupt if interrupt is not None else threading.Event()
        self.python = python or sys.executable
        self.restarts = 0  # replacements so far (rollout/worker_restarts)
        self.sync_s = 0.0  # seconds spent pushing weights since last asked
        self.authkey = secrets.token_bytes(32)
        self.listener = self._listen(host, port)
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

    def _listen(self, host: str, port: int) -> AuthListener:
        """The workers' listener on ``host:port``; a bad host or a busy port is one ConfigError naming its key."""
        where = f"placement.host: {host!r} for rollout workers"
        if not host.strip():
            raise ConfigError(f"{where}: the learner's address is needed (127.0.0.1 keeps the workers on this machine)")
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ConfigError(
                f"{where}: cannot resolve it ({e.strerror}); give an address or name of this machine"
            ) from None
        try:
            return AuthListener((host, port), self.authkey)  # the key's challenge off the accept loop, timed
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                raise ConfigError(
                    f"placement.port: cannot listen on {host}:{port} for rollout workers ({e.strerror}); choose a "
                    "free port, or 0 for any"
                ) from None
            raise ConfigError(f"{where}: cannot listen there ({e.strerror}); give an address of this machine") from None

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

        A worker at work sends a heartbeat about every second (:class:`bapo.rollout.worker.Heart`); with ``extend``
        each one restarts the silence window, so only a frozen or unreachable worker times out, not a slow one.
        Without it, ``timeout_s`` bounds the whole wait (a worker's start)."""
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


# ----------------------------------------------------------------------------- what the producer drives


def merge_shares(parts: list[RolloutBatch]) -> RolloutBatch:
    """The workers' shares of one batch as one batch (:func:`bapo.rollout.maker.join_shares`); one worker's
    share is the batch as it made it."""
    from bapo.rollout.maker import join_shares

    return parts[0] if len(parts) == 1 else join_shares(parts)


def gathered(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every entry of ``weights`` read once, in its own order, on this process's CPU. Under torchrun the
    learner's live weights are a streamed mapping whose reads are collectives: every rank reads them here
    together, and rank 0 keeps the copy it pushes to its workers."""
    return {n: t.detach().cpu() for n, t in weights.items()}


class RemoteMaker:
    """The batch maker of a disaggregated run (:class:`bapo.rollout.producer.BatchMaker`): batch t is made by every
    worker at once, each its share, with the weights of the version the schedule gave; a lost worker is
    replaced and its share made again from its last accepted state.

    Under torchrun only rank 0 holds the pool (``pool`` is None on the others). Every rank calls ``make``
    together in sync mode, so the weights of a new version are read on every rank (their reads are collectives,
    :func:`gathered`); rank 0 makes the batch, and ``gather``, on the learner's thread, broadcasts it. The
    versions are tracked alike on every rank, so that every rank takes the same branch."""

    def __init__(self, pool: WorkerPool | None, world: int = 1):
        self.pool, self.world = pool, world
        count = pool.count if pool is not None else 0
        self.states: list[dict | None] = [None] * count  # each worker's maker state after its last batch
        self.version: int | None = None  # the version of the weights the last batch read (every rank alike)
        self.copy: dict[str, torch.Tensor] | None = None  # rank 0 under torchrun: those weights, gathered
        self.held: int | None = None  # the version worker 0 holds, as every rank knows it (evaluation's)
        self.abandoned = False  # a stop gave a batch up: the workers still owe its replies, and end with the run

    def recover(self, w: Worker) -> None:
        """A replacement's maker state: the one its predecessor had after its last accepted batch."""
        state = self.states[w.index]
        if state is not None:
            self.pool.call(w, ("load_state", state))

    def read(self, weights: Mapping[str, torch.Tensor], version: int) -> Mapping[str, torch.Tensor]:
        """The weights to push for ``version``: as given in one process; under torchrun, read on every rank
        when the version is new, and kept on rank 0."""
        if self.world == 1:
            return weights
        if version != self.version:
            copy = gathered(weights)
            self.copy = copy if self.pool is not None else None
        self.version = version
        return self.copy if self.copy is not None else {}

    def make(self, t: int, version: int, weights: Mapping[str, torch.Tensor]) -> RolloutBatch | tuple:
        weights = self.read(weights, version)
        self.held = version
        pool = self.pool
        if pool is None:
            return ("made on rank 0", t, version)  # gather() brings rank 0's batch

        def start(w: Worker) -> None:
            if w.version != version:
                pool.push_weights(w, weights, version)
            pool._send(w, ("make", t, version))  # noqa: SLF001

        def share(w: Worker, fresh: bool, started: bool) -> tuple[RolloutBatch, dict]:
            if fresh or not started:
                start(w)
            return pool._reply(w, "make")  # noqa: SLF001

        with pool._lock, self._abandon_on_stop():  # noqa: SLF001
            t0 = time.perf_counter()
            pool.take_sync_s()  # from here on: this batch's weight pushes
            started = []
            for i in range(pool.count):  # every share starts before any is waited for
                try:
                    start(pool.workers[i])
                    started.append(True)
                except WorkerLost:
                    started.append(False)  # its retry below replaces it
            parts = []
            for i in range(pool.count):
                batch, state = pool.retrying(i, lambda w, fresh, i=i: share(w, fresh, started[i]), self.recover)
                parts.append(batch)
                self.states[i] = state
            out = merge_shares(parts)
            stats = dict(out.stats)
            stats["time/sync_s"] = pool.take_sync_s() + stats.get("time/sync_s", 0.0)
            stats["rollout/worker_restarts"] = float(pool.restarts)
            stats["time/worker_batch_s"] = time.perf_counter() - t0
            return dataclasses.replace(out, stats=stats)

    @contextlib.contextmanager
    def _abandon_on_stop(self):
        try:
            yield
        except Interrupted:
            self.abandoned = True
            raise

    def gather(self, item: RolloutBatch | tuple) -> RolloutBatch:
        """The batch on every rank (rank 0's, broadcast, under torchrun)."""
        if self.world == 1:
            return item
        from bapo.infra import dist

        return dist.broadcast_object(item if self.pool is not None else None)

    def state_dict(self) -> dict:
        """The rollout maker's state after the last batch made (every worker's prompt stream is at the same
        place; worker 0's is the one a resume gives them all). Before any batch: asked of worker 0. Under
        torchrun rank 0's checkpoint file carries it; the other ranks hold none."""
        if self.pool is None:
            return {}
        if self.states[0] is None:
            with self.pool._lock:  # noqa: SLF001
                self.states[0] = self.pool.retrying(0, lambda w, fresh: self.pool.call(w, ("state",)), self.recover)
        return self.states[0]

    def load_state_dict(self, state: dict) -> None:
        if self.pool is None:
            return
        if self.abandoned:  # after a stop: this side's record only (the busy workers end with the run)
            self.states = [state] * self.pool.count
            return
        if not state:
            raise ValueError(
                "this checkpoint's rollout-maker state is empty: resume it with the world size that wrote it"
            )
        with self.pool._lock:  # noqa: SLF001
            for i in range(self.pool.count):
                self.states[i] = state
                self.pool.retrying(i, lambda w, fresh: self.pool.call(w, ("load_state", state)), self.recover)


class RemoteEngine(RolloutEngine):
    """The engine a disaggregated run lends for evaluation: worker 0's, through its connection (the
    :class:`~bapo.engines.base.RolloutEngine` interface: its sampling defaults, no-op ``sleep`` and ``wake``).
    Loading weights keeps them (the learner does not update during an evaluation), so that a worker lost
    mid-evaluation is replaced and given them again. Under torchrun every rank is one generator
    (``tensor_parallel_size`` = the world): rank 0 asks worker 0, and broadcasts the samples."""

    def __init__(
        self,
        pool: WorkerPool | None,
        maker: RemoteMaker,
        *,
        n: int,
        temperature: float,
        pad_id: int,
        max_new_tokens: int,
        world: int = 1,
    ):
        self.pool, self.maker, self.world = pool, maker, world
        self.tensor_parallel_size = world
        self.n, self.temperature, self.pad_id, self.max_new_tokens = n, temperature, pad_id, max_new_tokens
        self._weights: Mapping[str, torch.Tensor] | None = None

    @property
    def version(self) -> int:  # type: ignore[override]  (worker 0's, as every rank knows it)
        return -1 if self.maker.held is None else self.maker.held

    def _recover(self, w: Worker) -> None:
        self.maker.recover(w)

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        if self.world > 1:
            weights = gathered(weights)  # every rank reads them (collectives); rank 0 pushes them
        self.maker.held = version
        if self.pool is None:
            return time.perf_counter() - t0
        self._weights = weights
        with self.pool._lock:  # noqa: SLF001
            self.pool.retrying(0, lambda w, fresh: self.pool.push_weights(w, weights, version), self._recover)
        return time.perf_counter() - t0

    def _generate(self, prompts: Sequence[Prompt], n: int, temperature: float, seed: int | None) -> list[Sample]:
        samples = None
        if self.pool is not None:
            version = self.version

            def gen(w: Worker, fresh: bool) -> list[Sample]:
                if fresh or w.version != version:
                    if self._weights is None:
                        raise RuntimeError("rollout worker 0 lacks the evaluation's weights and none are held")
                    self.pool.push_weights(w, self._weights, version)
                return self.pool.call(w, ("generate", list(prompts), n, temperature, seed))

            with self.pool._lock:  # noqa: SLF001
                samples = self.pool.retrying(0, gen, self._recover)
        if self.world == 1:
            return samples
        from bapo.infra import dist

        return dist.broadcast_object(samples)


@dataclass
class DisaggregatedConfig(PlacementConfig):
    """``placement`` of ``mode=disaggregated``: the keys of the worker processes, beside every placement's."""

    host: str = resumable("127.0.0.1")  # where the learner listens for its workers
    port: int = resumable(0)  # 0: any free port
    worker_threads: int = resumable(1)  # torch threads of each worker
    worker_timeout_s: float = resumable(900.0)  # a worker silent this long (no reply, no heartbeat) is replaced
    worker_start_timeout_s: float = resumable(300.0)  # to connect and load its model
    worker_restarts: int = resumable(3)  # failures in a row on one request before the run stops

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            0 <= self.port <= 65535, "placement.port", f"must be 0 (any free port) or a port number, got {self.port}"
        )
        require(self.worker_threads >= 1, "placement.worker_threads", f"must be >= 1, got {self.worker_threads}")
        require(self.worker_timeout_s > 0, "placement.worker_timeout_s", f"must be > 0, got {self.worker_timeout_s}")
        require(
            self.worker_start_timeout_s > 0,
            "placement.worker_start_timeout_s",
            f"must be > 0, got {self.worker_start_timeout_s}",
        )
        require(self.worker_restarts >= 0, "placement.worker_restarts", f"must be >= 0, got {self.worker_restarts}")


class Disaggregated(Placement):
    """Rollout in ``rollout.workers`` processes of its own (the module's doc): rank 0 spawns them before the learner
    is built, so they load their models meanwhile; the producer drives their :class:`RemoteMaker`, and evaluation
    borrows worker 0's engine. The held-out set and the verifier stay in the learner's process."""

    traits = PlacementTraits(in_workers=True)
    config = DisaggregatedConfig

    @staticmethod
    def check(rc: Any, world: int) -> None:
        from bapo.engines.registry import engine_traits

        require(
            engine_traits(rc.rollout.engine).runs_in_workers,
            "rollout.engine",
            f"{rc.rollout.engine} cannot run in rollout worker processes (placement.mode=disaggregated; its traits "
            "say runs_in_workers=False, hf's do); for vLLM in processes of its own use rollout=vllm_server",
        )
        require(
            not rc.behaviour.per_token or rc.rollout.workers == 1,
            "rollout.workers",
            f"rollout.partial_budget keeps its pool of unfinished responses in one worker; got {rc.rollout.workers}",
        )
        require(
            rc.train.prompts_per_step >= rc.rollout.workers,
            "rollout.workers",
            f"{rc.rollout.workers} workers for {rc.train.prompts_per_step} prompts a step: each needs at least one",
        )

    def __init__(self, rc: Any, cfg: Any, *, path: str, limit: int, interrupt: threading.Event) -> None:
        from bapo.infra import dist

        super().__init__(rc, cfg, path=path, limit=limit, interrupt=interrupt)
        self.pool = start_pool(rc, cfg, path=path, limit=limit, interrupt=interrupt) if dist.is_main() else None

    def rollout(self, parts: RolloutParts) -> tuple:
        if self.pool is not None:
            self.pool.wait()
        maker, engine = remote_maker(self.rc, self.pool, parts.tokenizer)
        heldout, report = parts.heldout()
        return maker, engine, parts.verifier(), report, heldout

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.stop()


def start_pool(rc: Any, cfg: Any, *, path: str, limit: int, interrupt: threading.Event) -> WorkerPool:
    """The workers of ``rc`` (``placement``, ``rollout.workers``), spawned; :meth:`WorkerPool.wait` readies them."""
    from omegaconf import OmegaConf

    if cfg is None:
        raise ValueError("placement.mode=disaggregated: the workers need the run's composed config (cfg)")
    p = rc.placement
    spec = WorkerSpec(
        config=OmegaConf.to_container(cfg, resolve=True),
        path=path,
        limit=limit,
        run_dir=str(rc.run_dir),
        threads=p.worker_threads,
    )
    pool = WorkerPool(
        spec,
        count=rc.rollout.workers,
        host=p.host,
        port=p.port,
        timeout_s=p.worker_timeout_s,
        start_timeout_s=p.worker_start_timeout_s,
        restarts=p.worker_restarts,
        interrupt=interrupt,
    )
    pool.spawn()
    return pool


def remote_maker(rc: Any, pool: WorkerPool | None, tokenizer: Any) -> tuple[RemoteMaker, RemoteEngine]:
    """The batch maker and the evaluation engine a disaggregated run's producer drives (``pool``: rank 0's
    workers; None on the other ranks of a torchrun job)."""
    from bapo.engines.base import pad_id_of
    from bapo.infra import dist

    world = dist.world_size()
    maker = RemoteMaker(pool, world)
    r = rc.rollout
    engine = RemoteEngine(
        pool,
        maker,
        n=r.n,
        temperature=r.temperature,
        pad_id=pad_id_of(tokenizer),
        max_new_tokens=r.max_new_tokens,
        world=world,
    )
    return maker, engine
