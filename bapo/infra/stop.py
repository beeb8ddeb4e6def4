"""A run's stop request: the signals that ask a run to save and stop, and the flag every long wait checks.

The signals (:data:`STOP_SIGNALS`) are the ones a user or a scheduler sends to end a run that should keep its work:

- ``SIGTERM``: ``kill``, ``scancel`` (SLURM, then SIGKILL after its KillWait), Kubernetes, the elastic launcher
  passing a stop on to its ranks;
- ``SIGINT``: Ctrl-C (a second Ctrl-C aborts at once, without saving);
- ``SIGHUP``: the terminal closed (an ssh session dropped);
- ``SIGUSR1``: SLURM's warning before a time limit or a preemption (``#SBATCH --signal=USR1@<seconds>``).

``SIGQUIT`` (Ctrl-\\) keeps Python's default, an immediate exit with no save; SIGKILL cannot be caught: the
periodic checkpoints (``checkpoint.every``, ``checkpoint.every_minutes``) bound what those lose.

A request sets one flag per process (a signal is the process's, not a thread's). What runs long checks it and
gives up its work, leaving the state it had before that work: a decode loop between tokens
(``bapo.engines.decode``), a vLLM engine or server between steps and chunks, the learner between micro-batches,
a wait for a batch. The code that gives up raises :class:`Interrupted`; the loop (``bapo.loop``) then saves the
last consistent state and exits.

Under torchrun the ranks must give up together, or one would wait in a collective the others never join. So in
a process group a rank never acts on its own flag alone: it asks :func:`agree` (an all-reduce of the flags) at
points every rank reaches in the same order (after a generation, before each micro-batch), and all ranks raise
there together. :func:`share` also copies a request to the other ranks through the process group's store,
within a second, for a signal that reached one rank only (``kill`` of one pid).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
STORE_KEY = "bapo/stop"  # the process group's store: set by the first rank that was asked to stop

_flag = threading.Event()
_signum: list[int] = []  # the first stop's signal number
_callbacks: list = []  # run once at the first request (wake what cannot poll the flag: a blocked socket read)


class Interrupted(Exception):
    """A stop request ended a wait or a piece of work before it finished (its results are not to be used)."""


def requested() -> bool:
    """Has this process been asked to stop?"""
    return _flag.is_set()


def signum() -> int | None:
    """The signal that asked for the stop (None: none yet, or a request that was not a signal)."""
    return _signum[0] if _signum else None


def request(sig: int = signal.SIGTERM) -> None:
    """Ask this process to stop (what the signal handler does; also the parent watch and the tests). The first
    request runs the :func:`on_request` callbacks."""
    first = not _flag.is_set()
    if not _signum:
        _signum.append(int(sig))
    _flag.set()
    if first:
        for fn in list(_callbacks):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a callback only wakes a wait; the stop goes on without it
                log.warning("stop callback %r failed: %s: %s", fn, type(e).__name__, e)


def on_request(fn) -> None:
    """Run ``fn()`` at the first stop request (from the signal handler: it must only close or set things, such as
    the sockets of streams to abandon). :func:`forget` takes it back."""
    _callbacks.append(fn)


def forget(fn) -> None:
    if fn in _callbacks:
        _callbacks.remove(fn)


def clear() -> None:
    """Forget a request (a new run in this process starts without one)."""
    _flag.clear()
    _signum.clear()


def check() -> None:
    """Raise :class:`Interrupted` if a stop was asked for (this process's flag only: see :func:`agree`)."""
    if _flag.is_set():
        raise Interrupted


def agree(local: bool = False) -> bool:
    """Whether any rank was asked to stop (or gave its work up: ``local``): this process's answer in one process,
    an all-reduce (MAX) of every rank's under torchrun. A collective: every rank calls it at the same point, and
    acts on the answer alike. A yes also sets this process's flag, so the rank stops with the others."""
    from bapo.infra import dist

    mine = local or _flag.is_set()
    if dist.active():
        import torch

        mine = bool(dist.reduce_max(torch.tensor([float(mine)])).item())
    if mine and not _flag.is_set():
        request(signal.SIGTERM)  # another rank's stop (or work given up): this rank saves and stops with it
    return mine


def check_agreed(local: bool = False) -> None:
    """:func:`agree`, raising :class:`Interrupted` on every rank when any was asked to stop."""
    if agree(local):
        raise Interrupted


class Handling:
    """While open (``with stop.handling(wake) as h:``), :data:`STOP_SIGNALS` request a stop instead of killing the
    process; a second SIGINT raises KeyboardInterrupt. Handlers are set only on the main thread; on exit they are
    put back and the request is cleared. ``callbacks`` run at the first request (:func:`on_request`)."""

    def __init__(self, *callbacks) -> None:
        self.callbacks = list(callbacks)
        self._old: dict[int, object] = {}

    def __enter__(self) -> Handling:
        clear()
        for fn in self.callbacks:
            on_request(fn)
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, sig, frame) -> None:
        if _flag.is_set() and sig == signal.SIGINT:
            raise KeyboardInterrupt
        if not _flag.is_set():
            log.warning("%s: stopping within seconds; the last consistent state is saved", signal.Signals(sig).name)
        request(sig)

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        for fn in self.callbacks:
            forget(fn)
        clear()

    def __bool__(self) -> bool:
        return requested()

    @property
    def signum(self) -> int | None:
        return signum()


def handling(*callbacks) -> Handling:
    return Handling(*callbacks)


@contextlib.contextmanager
def shared(poll_s: float = 0.5) -> Iterator[None]:
    """Under torchrun, for the block: a thread that copies this rank's request into the process group's store and
    requests a stop when another rank's is there (:data:`STORE_KEY`), every ``poll_s``. A no-op in one process.
    A store that stops answering (the launcher is gone) ends the thread quietly."""
    from bapo.infra import dist

    store = dist.store() if dist.active() else None
    if store is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        published = False
        while not done.wait(poll_s):
            try:
                if _flag.is_set() and not published:
                    store.set(STORE_KEY, str(signum() or int(signal.SIGTERM)))
                    published = True
                elif not _flag.is_set() and store.check([STORE_KEY]):
                    request(int(store.get(STORE_KEY).decode() or signal.SIGTERM))
                    log.warning("another rank was asked to stop: stopping with it")
            except Exception:  # noqa: BLE001 - the store is the launcher's: gone with it, nothing to share
                return

    thread = threading.Thread(target=watch, name="bapo-stop-share", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


def leave(code: int) -> None:
    """End a run that stopped for a signal, its checkpoint written and its stages closed, with exit status ``code``.

    A rank (``WORLD_SIZE`` set: torchrun, the plain launch, SLURM's tasks) leaves at once: the logs and the standard
    streams are flushed, then ``os._exit``. Its launcher's grace counts from the signal, and what a normal exit still
    does after the run (the interpreter's finalization: non-daemon threads joined, atexit handlers, a GPU's CUDA and
    NCCL state torn down) can outlast the grace on a loaded or GPU node; the launcher would then SIGKILL a rank whose
    work is saved. One process exits as usual (``sys.exit``), Hydra's job end included."""
    import os
    import sys

    if "WORLD_SIZE" not in os.environ:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
