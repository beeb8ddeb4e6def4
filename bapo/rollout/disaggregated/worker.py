"""A rollout worker: one process of a disaggregated run (``placement.mode=disaggregated``; the learner's side
is :mod:`bapo.rollout.disaggregated.pool`). The learner starts it as
``python -m bapo.entry.worker --connect host:port --index i`` (the process's entry, which hands :func:`main` the
builder of its side, ``bapo.build.worker_side``).

It connects back to the learner (an authenticated ``multiprocessing.connection``; the key comes in the
environment), receives the run's config, builds the rollout side exactly as a colocated run builds it
(``bapo.build.build_maker``: engine, reward pool, prompt stream, rollout maker as share ``i`` of
``placement.workers``), joins a two-rank gloo group for weights, and then serves requests one at a time:

- ``weights`` (version, names, shapes, dtypes): receive one flat buffer per dtype and load them;
- ``make`` (t, version): make its share of rollout batch t; reply with it and the maker's state after it;
- ``state`` / ``load_state``: the maker's state (the data cursor, the partial-rollout pool);
- ``generate`` (prompts, n, temperature, seed): an evaluation's samples;
- ``checksum``: the sum of each weight the engine holds (a check of the transfer);
- ``stop``.

While it builds and while it serves a request, a thread of its own sends a heartbeat every second or
so (``beat``), so the learner tells a slow worker from a frozen or unreachable one: silence past
``placement.worker_timeout_s`` is a lost worker, however long a request takes. A request that fails
replies with a one-line error (the traceback goes to this worker's log), which the learner raises as the
run's error. The worker ignores the stop signals (the learner stops it after its checkpoint) and exits on its own
within about a second when the learner's process is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client

import torch

from bapo.infra.stop import STOP_SIGNALS
from bapo.rollout.disaggregated.wire import AUTHKEY_ENV, recv, send

log = logging.getLogger(__name__)


def watch_parent(parent: int, period_s: float = 0.5, own_log: str | None = None) -> None:
    """Exit this process once ``parent`` is no longer its parent (the learner died, even by SIGKILL). ``own_log``:
    this process's log file, removed first: the pool that would have removed it (or kept it, naming it in an
    error) died with the learner, and a learner killed by SIGKILL left one file per worker in /tmp."""

    def loop() -> None:
        while True:
            if os.getppid() != parent:
                _orphaned(own_log)
            time.sleep(period_s)

    threading.Thread(target=loop, name="bapo-parent-watch", daemon=True).start()


def await_parent_exit(parent: int, own_log: str | None, wait_s: float = 5.0) -> None:
    """The learner's connection ended without a stop. A learner killed by SIGKILL closes its sockets a moment
    before its children are handed on, so the parent watch may not have seen it yet: end as the watch does once
    ``parent`` is gone. Returns if it is still there after ``wait_s`` (it dropped this worker)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            _orphaned(own_log)
        time.sleep(0.02)


def _orphaned(own_log: str | None) -> None:
    if own_log is not None:
        with contextlib.suppress(OSError):
            os.unlink(own_log)
    os._exit(3)


class Heart:
    """The worker's end of ``conn``: replies and heartbeats, sent one at a time.

    While :attr:`busy` is set, a daemon thread sends ``("beat", None)`` every ``period_s``. It beats only while the
    worker works, so an idle worker's socket never fills while the learner is busy elsewhere."""

    def __init__(self, conn, period_s: float):
        self.conn, self.period_s = conn, period_s
        self.busy = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._beat, name="bapo-heartbeat", daemon=True).start()

    def send(self, msg) -> None:
        with self._lock:
            send(self.conn, msg)

    def reply(self, msg) -> None:
        """The work is done: stop beating and send its answer."""
        self.busy.clear()
        self.send(msg)

    def _beat(self) -> None:
        while True:
            time.sleep(self.period_s)
            if self.busy.is_set():
                try:
                    self.send(("beat", None))
                except (OSError, ValueError):  # the learner is gone: the parent watch ends this process
                    return


def beat_period(timeout_s: float) -> float:
    """Heartbeats come every second, or 5 to a timeout shorter than 5 s."""
    return min(1.0, timeout_s / 5)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def expected_weights(engine_model) -> dict[str, tuple[int, ...]] | None:
    if engine_model is None:
        return None
    return {k: tuple(v.shape) for k, v in engine_model.state_dict().items()}


def check_weights(meta: list, expected: dict | None) -> None:
    """A ValueError naming the first difference between the learner's weights and this worker's model."""
    if expected is None:
        return
    got = {n: tuple(shape) for n, shape, _ in meta}
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise ValueError(
            f"the learner's weights do not fit this worker's model: {len(missing)} missing (e.g. "
            f"{missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]}): the worker loaded a different model"
        )
    for n, shape in got.items():
        if expected[n] != shape:
            raise ValueError(
                f"the learner's weight {n} has shape {list(shape)}, this worker's model {list(expected[n])}"
            )


def receive_weights(pg, meta: list) -> dict[str, torch.Tensor]:
    """The flat buffers of :meth:`bapo.rollout.disaggregated.pool.WorkerPool.push_weights`, cut back into named
    tensors."""
    out: dict[str, torch.Tensor] = {}
    for dtype_name in sorted({d for _, _, d in meta}):
        dtype = getattr(torch, dtype_name)
        rows = [(n, shape) for n, shape, d in meta if d == dtype_name]
        sizes = [int(torch.Size(shape).numel()) for _, shape in rows]
        flat = torch.empty(sum(sizes), dtype=dtype)
        pg.recv([flat], 0, 0).wait()
        for (n, shape), piece in zip(rows, torch.split(flat, sizes), strict=True):
            out[n] = piece.view(shape)
    return out


def serve(conn, heart: Heart, pg, maker, engine, expected) -> bool:
    """Answer the learner's requests until it says stop (True) or goes away (False)."""
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            return False
        kind = msg[0]
        if kind == "stop":
            return True
        heart.busy.set()
        try:
            if kind == "weights":
                _, version, meta = msg
                check_weights(meta, expected)
                weights = receive_weights(pg, meta)
                reply = engine.load_weights(weights, int(version))
            elif kind == "make":
                _, t, version = msg
                if engine.version != version:
                    raise RuntimeError(f"batch {t} asks for version {version}, this worker holds {engine.version}")
                batch = maker.make(int(t), int(version), None)
                reply = (batch, maker.state_dict())
            elif kind == "checksum":  # what the engine holds, for a test of the transfer
                reply = {k: float(v.double().sum()) for k, v in engine.model.state_dict().items()}
            elif kind == "state":
                reply = maker.state_dict()
            elif kind == "load_state":
                maker.load_state_dict(msg[1])
                reply = None
            elif kind == "generate":
                _, prompts, n, temperature, seed = msg
                reply = engine.generate(prompts, n=n, temperature=temperature, seed=seed)
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as e:  # noqa: BLE001 (every failure goes back to the learner as one line)
            traceback.print_exc()
            sys.stderr.flush()
            heart.reply(("error", one_line(e)))
            continue
        heart.reply(("ok", reply))


def main(argv: list[str] | None, build: Callable[[dict], tuple]) -> int:
    """The worker's life (module docstring). ``build(init)``: its side of the run in ``init``, as (maker, engine,
    verifier, the engine's model or None)."""
    parser = argparse.ArgumentParser(
        description="a rollout worker of a disaggregated bapo run (started by the learner)"
    )
    parser.add_argument("--connect", required=True, metavar="HOST:PORT")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--parent", type=int, default=None, help="the learner's pid (default: this process's parent)")
    parser.add_argument("--log", default=None, help="this process's log file, removed if the learner dies")
    args = parser.parse_args(argv)
    for sig in STOP_SIGNALS:  # a stop is the learner's: it ends us after its checkpoint (a group signal reaches us too)
        signal.signal(sig, signal.SIG_IGN)
    parent = args.parent or os.getppid()
    watch_parent(parent, own_log=args.log)  # a learner gone before this line is noticed too
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{args.index} %(levelname)s %(message)s")
    host, port = args.connect.rsplit(":", 1)
    key = os.environ.pop(AUTHKEY_ENV, "")
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    send(conn, ("hello", args.index, os.getpid()))
    try:
        kind, init = recv(conn)
    except (EOFError, OSError):
        await_parent_exit(parent, args.log)
        return 1
    if kind != "init":
        return 2
    timeout_s = float(init.get("timeout_s", 900))
    heart = Heart(conn, beat_period(timeout_s))
    heart.busy.set()
    try:
        maker, engine, verifier, engine_model = build(init)
    except Exception as e:  # noqa: BLE001 (a worker that cannot start says why in one line)
        traceback.print_exc()
        heart.reply(("error", one_line(e)))
        return 1
    heart.send(("started", {"pid": os.getpid(), "threads": torch.get_num_threads()}))
    import torch.distributed as tdist

    store_host, store_port = init["store"]
    timeout = datetime.timedelta(seconds=timeout_s)
    store = tdist.TCPStore(store_host, int(store_port), is_master=False, timeout=timeout)
    pg = tdist.ProcessGroupGloo(tdist.PrefixStore(init["prefix"], store), 1, 2, timeout)
    heart.reply(("ready", None))
    try:
        stopped = serve(conn, heart, pg, maker, engine, expected_weights(engine_model))
    finally:
        verifier.close()
    if not stopped:
        await_parent_exit(parent, args.log)
    return 0
