"""How ``rollout=vllm_server`` talks to its server: :class:`ServerHTTP`, the engine's side of the HTTP (JSON
``GET`` and ``POST``, ``/collective_rpc`` calls, streamed completions read as server-sent events as they come) and
the streams in flight. A request may wait in the server's queue, silent, before its first token, so
``rollout.request_timeout_s`` bounds the silence of a stream that has started (its socket's timeout) and, while none
of the requests in flight has started, of the server as a whole (:meth:`ServerHTTP._collect`). The first failure
stops every request in flight; a stop request (:mod:`bapo.infra.stop`) shuts the streams, and the server aborts
their requests.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from pathlib import Path

from bapo.engines.admission import Admission
from bapo.engines.vllm_server_process import _last_line
from bapo.infra import stop


class ServerError(RuntimeError):
    """The server failed a request, or died; the message is one line."""


@dataclass(eq=False)
class _Open:
    """A streamed request in flight: its socket, and whether its first event came (the server runs it)."""

    sock: socket.socket
    started: bool = False


class ServerHTTP:
    """The engine's requests to its server, a base of :class:`~bapo.engines.vllm_server.VLLMServerRollout`, which
    sets the attributes below."""

    url: str  # the server's base URL
    timeout: float  # rollout.request_timeout_s
    admission: Admission  # what is sent at once (an abort refuses the requests waiting for it)
    proc: subprocess.Popen | None  # a started server's wrapper; None for a server given by URL
    log: Path  # a started server's log
    _streams: set[_Open]  # the requests in flight (their sockets: an abort shuts them)
    _streams_lock: threading.Lock
    _last_heard: float  # when the server last sent a byte on any stream (time.monotonic)

    def _abandon_streams(self) -> None:
        """Close every stream in flight (a stop request): the server aborts their requests, the readers give up."""
        with self._streams_lock:
            streams = list(self._streams)
        for stream in streams:
            with contextlib.suppress(OSError):
                stream.sock.shutdown(socket.SHUT_RDWR)

    def _get(self, url: str, timeout: float | None = None):
        try:
            with urllib.request.urlopen(url, timeout=timeout or self.timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise ServerError(f"GET {url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None

    def _died(self, e: BaseException) -> str:
        died = self.proc is not None and self.proc.poll() is not None
        return f"the server exited with code {self.proc.returncode}: {_last_line(self.log)}" if died else str(e)

    def _post(self, path: str, body: dict | None = None):
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            detail = e.read()[:400].decode(errors="replace").replace("\n", " ")
            raise ServerError(f"rollout=vllm_server: POST {self.url}{path}: HTTP {e.code}: {detail}") from None
        except OSError as e:
            raise ServerError(f"rollout=vllm_server: POST {self.url}{path} failed: {self._died(e)}") from None

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        """``POST path`` with ``"stream": true``: every server-sent ``data:`` event, in order, as it comes. Until its
        first event the request may wait in the server's queue, silent (:meth:`_collect` bounds how long the server
        as a whole may stay silent); from then on the socket's timeout bounds this stream's silence (any byte, a
        keep-alive comment included, restarts it)."""
        u = urllib.parse.urlsplit(self.url)
        conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(u.hostname, u.port, timeout=self.timeout)
        stream, done = None, False
        try:
            stop.check()  # a stop request: no new stream
            conn.request("POST", path, json.dumps(body | {"stream": True}), {"Content-Type": "application/json"})
            stream = _Open(conn.sock)  # the response reads this socket (the connection may hand it over)
            with self._streams_lock:
                self._streams.add(stream)
                self._last_heard = time.monotonic()
            resp = conn.getresponse()
            if resp.status != 200:
                detail = resp.read()[:400].decode(errors="replace").replace("\n", " ")
                raise ServerError(f"rollout=vllm_server: POST {self.url}{path}: HTTP {resp.status}: {detail}")
            stream.sock.settimeout(None)  # queued: silent until the scheduler runs it
            for raw in resp:
                if stop.requested():
                    raise stop.Interrupted  # closing the connection (below) makes the server abort the request
                self._last_heard = time.monotonic()
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                if not stream.started:  # running now: from here on, silence means a stuck server
                    stream.started = True
                    stream.sock.settimeout(self.timeout)
                event = json.loads(data)
                if "error" in event:
                    raise ServerError(f"rollout=vllm_server: {self.url}{path}: {str(event['error'])[:400]}")
                yield event
        except (TimeoutError, OSError, http.client.HTTPException) as e:
            if stop.requested():  # the stop shut the stream: the batch is given up, not failed
                raise stop.Interrupted from None
            if isinstance(e, TimeoutError):
                raise ServerError(
                    f"rollout.request_timeout_s: the server at {self.url} sent nothing for {self.timeout:g} s on a "
                    "running request (stuck or overloaded); raise rollout.request_timeout_s if it is only slow"
                ) from None
            raise ServerError(f"rollout=vllm_server: POST {self.url}{path} failed: {self._died(e)}") from None
        finally:
            if stream is not None:
                with self._streams_lock:
                    self._streams.discard(stream)
            conn.close()
        if not done:
            raise ServerError(f"rollout=vllm_server: POST {self.url}{path}: the stream ended before [DONE]")

    def _silent(self) -> ServerError | None:
        """The error of a server that sent nothing on any stream for ``rollout.request_timeout_s`` while requests
        were in flight and none of them had started (a started one times out on its own socket)."""
        with self._streams_lock:
            waiting = [s for s in self._streams if not s.started]
            if not waiting or len(waiting) < len(self._streams):
                return None
            quiet = time.monotonic() - self._last_heard
        if quiet < self.timeout:
            return None
        return ServerError(
            f"rollout.request_timeout_s: the server at {self.url} sent nothing for {self.timeout:g} s on any of "
            f"{len(waiting)} request(s) in flight, none of them started (stuck); raise rollout.request_timeout_s "
            "if it is only slow"
        )

    def _collect(self, jobs: list[Future]) -> list:
        """The jobs' results, in order. At the first failure, or a server silent on every stream while none has
        started (:meth:`_silent`), every request in flight is stopped (its socket shut, a request waiting for
        admission refused) and that error is raised."""
        pending = set(jobs)
        while pending:
            _, pending = wait(pending, timeout=min(1.0, self.timeout / 4), return_when=FIRST_EXCEPTION)
            failed = next((j for j in jobs if j.done() and not j.cancelled() and j.exception() is not None), None)
            err = failed.exception() if failed is not None else self._silent()
            if err is not None:
                self._abort(pending)
                raise err
        return [j.result() for j in jobs]

    def _abort(self, pending: set[Future]) -> None:
        """Stop the requests of ``pending``: queued ones cancelled, those waiting for admission refused, those in
        flight cut off (a shut socket ends its read at once, and one opened meanwhile is shut at the next look);
        returns when none is left running."""
        for j in pending:
            j.cancel()
        self.admission.abort()
        try:
            while pending:
                with self._streams_lock:
                    streams = list(self._streams)
                for stream in streams:
                    with contextlib.suppress(OSError):
                        stream.sock.shutdown(socket.SHUT_RDWR)
                _, pending = wait(pending, timeout=0.5)
        finally:
            self.admission.reopen()

    def _rpc(self, method: str, **kwargs):
        out = self._post("/collective_rpc", {"method": method, "kwargs": kwargs})
        return out.get("results", out) if isinstance(out, dict) else out
