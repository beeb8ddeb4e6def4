"""The wire between the learner and its rollout workers: the messages, the key, the learner's listener.

Requests and replies (the worker's requests are listed in :mod:`bapo.rollout.disaggregated.worker`) are tuples
pickled by value (:func:`send`, :func:`recv`) over a ``multiprocessing.connection`` that proved a key: the learner
draws one per pool and hands it to each worker in its environment (:data:`AUTHKEY_ENV`), and listens with
:class:`bapo.infra.listener.AuthListener` (:func:`listen`), which runs the key's challenge off its accept loop, timed,
so a silent local client keeps no worker out. What the key protects and what it does not is in that class's
docstring and docs/offpolicy.md. Weights do not go over this wire: the pool sends them over a gloo pair group
(:meth:`bapo.rollout.disaggregated.pool.WorkerPool.push_weights`).
"""

from __future__ import annotations

import errno
import pickle
import socket
from multiprocessing.connection import Connection
from typing import Any

from bapo.infra.checks import ConfigError
from bapo.infra.listener import AuthListener

AUTHKEY_ENV = "BAPO_WORKER_AUTHKEY"


def send(conn: Connection, obj: Any) -> None:
    """``obj`` over ``conn`` by value. (The connection's own ``send`` pickles with multiprocessing's reducers, which
    torch extends to pass tensors as shared-memory handles through a helper process; the standard pickler
    copies them, which both ends can always read.)"""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    """What :func:`send` sent (only between the learner and the workers it started: the connection is authenticated)."""
    return pickle.loads(conn.recv_bytes())  # noqa: S301


def listen(host: str, port: int, authkey: bytes) -> AuthListener:
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
        return AuthListener((host, port), authkey)  # the key's challenge off the accept loop, timed
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            raise ConfigError(
                f"placement.port: cannot listen on {host}:{port} for rollout workers ({e.strerror}); choose a "
                "free port, or 0 for any"
            ) from None
        raise ConfigError(f"{where}: cannot listen there ({e.strerror}); give an address of this machine") from None
