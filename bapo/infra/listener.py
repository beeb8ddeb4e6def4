"""A port that only a process holding the key gets through, and that no other client can stall.

``multiprocessing.connection.Listener(address, authkey=...)`` runs the authkey's challenge inside ``accept()``, with
no timeout: a local process that connects and says nothing blocks ``accept()`` for as long as it likes, and the
process that was meant to connect never gets in. :class:`AuthListener` accepts on a thread of its own and runs each
connection's challenge (the library's ``deliver_challenge`` / ``answer_challenge``) on a thread per connection, which
the accept thread cuts off (a socket shutdown) once :data:`HANDSHAKE_S` has passed; only connections that proved
the key reach :meth:`AuthListener.accept`. A silent or garbling client costs one short-lived thread, and at most
:data:`MAX_PENDING` are admitted at once (more are closed at once).

What the key does and does not do (docs/gpu.md, "Rollout workers"): the challenge is an HMAC over a random nonce,
both ways, so a client that lacks the key never gets a connection, and the key never crosses the wire. It encrypts
nothing: what goes over an authenticated connection (pickled requests and rollout batches) can be read by anyone who
can read the traffic, and a process that holds the key can send pickles the other side loads. The key reaches the
workers in their environment, so processes of the same user (who can read ``/proc/<pid>/environ``) can hold it too:
it keeps out other users' processes and anything on the network, not the same user's own.

This module imports nothing of bapo above ``infra/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

log = logging.getLogger(__name__)

HANDSHAKE_S = 10.0  # a client on this machine answers the challenge in milliseconds
MAX_PENDING = 64  # challenges running at once; a connection beyond them is closed at once
POLL_S = 0.2  # how often the accept thread looks at the clock (a closed listener, an expired challenge)


class AuthListener:
    """A listening socket on ``address`` whose connections must prove ``authkey`` (module docstring). ``address``:
    its ``(host, port)`` (port 0 picked: :attr:`address` says which). Raises OSError as ``Listener`` does."""

    def __init__(self, address: tuple[str, int], authkey: bytes, *, handshake_s: float = HANDSHAKE_S) -> None:
        self._listener = Listener(address, backlog=MAX_PENDING)  # no authkey: the challenge runs per connection
        self.address = self._listener.address
        self.authkey, self.handshake_s = authkey, handshake_s
        self._ready: queue.Queue[Connection] = queue.Queue()
        self._pending: dict[Connection, float] = {}  # a connection in its challenge -> when it is cut off
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="bapo-listener", daemon=True)
        self._thread.start()

    def accept(self, timeout: float) -> Connection:
        """The next connection that proved the key; TimeoutError when none comes within ``timeout`` seconds."""
        try:
            return self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no connection within {timeout:g} s") from None

    def close(self) -> None:
        """Stop listening, cut off every challenge and close the connections nobody took. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=5 * POLL_S)
        with self._lock:
            for conn in self._pending:
                _cut(conn)
            self._pending.clear()
        while True:
            try:
                self._ready.get_nowait().close()
            except queue.Empty:
                break

    # ------------------------------------------------------------------ the threads

    def _serve(self) -> None:
        sock = self._listener._listener._socket  # noqa: SLF001 (multiprocessing's listener has no accept timeout)
        sock.settimeout(POLL_S)
        while not self._closed.is_set():
            self._expire()
            try:
                conn = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                continue
            with self._lock:
                full = len(self._pending) >= MAX_PENDING
                if not full:
                    self._pending[conn] = time.monotonic() + self.handshake_s
            if full:
                log.warning("listener %s: %d challenges running: closed a connection", self.address, MAX_PENDING)
                conn.close()
                continue
            threading.Thread(target=self._challenge, args=(conn,), name="bapo-listener-challenge", daemon=True).start()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for conn, deadline in list(self._pending.items()):
                if now > deadline:
                    del self._pending[conn]  # cut off: its challenge thread closes it
                    _cut(conn)

    def _challenge(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            ok = True
        except Exception as e:  # noqa: BLE001 (a wrong key, a client gone or cut off: EOFError, OSError, ...)
            ok = False
            log.warning("listener %s: refused a connection (%s)", self.address, type(e).__name__)
        with self._lock:
            in_time = self._pending.pop(conn, None) is not None  # not cut off meanwhile
        if ok and in_time and not self._closed.is_set():
            self._ready.put(conn)
        else:
            conn.close()


def _cut(conn: Connection) -> None:
    """Wake a thread blocked reading ``conn`` (a shutdown of the socket, through a duplicate of its descriptor)."""
    with contextlib.suppress(OSError, ValueError):
        s = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            s.shutdown(socket.SHUT_RDWR)
        finally:
            s.close()
