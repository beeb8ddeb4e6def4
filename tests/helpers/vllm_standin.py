"""A loopback stand-in for vLLM's OpenAI-compatible server (no vLLM needed): what ``rollout=vllm_server``'s HTTP side
is tested against (tests/e2e/engines/test_vllm_server_http.py) and what scripts/bench/bench_admission.py measures.

It answers the routes the engine uses: ``/v1/models``, ``/collective_rpc`` (``bapo_describe``, and ``bapo_reload``,
which reads the staged folder with the real :class:`bapo.engines.staging.Reader`), ``/v1/completions`` (streamed,
token ids and log-probs in vLLM's chunk format) and ``/reset_prefix_cache``. Two ways to answer a completion:

- by default every response is ``Fake.tokens`` tokens, one chunk every ``gap_s`` (the behaviour a test sets);
- with a :class:`KVScheduler`, as vLLM's scheduler would run it: each response has a length of its own (drawn), the
  sequences run while their KV cache fits, the rest wait or are preempted, and time passes in ticks, each running
  sequence generating the same number of tokens a tick (decode is memory-bound: a sequence's speed does not depend
  on how many run, up to a batch of a few hundred at 7B).
"""

from __future__ import annotations

import collections
import json
import queue
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bapo.engines.staging import Reader
from tests.helpers.paths import TINY

IDENTITY_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")  # fmt: skip


class Fake:
    """The stand-in's behaviour, set per test."""

    def __init__(self, **kw):
        identity = json.loads((TINY / "config.json").read_text())
        self.describe = {
            "max_model_len": 256,
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",
            "kv_tokens": None,
            "max_num_seqs": 256,
        } | {k: identity.get(k) for k in IDENTITY_KEYS}
        self.tokens = 6  # per response
        self.gap_s = 0.0  # between streamed chunks
        self.keepalive_s = None  # send ": keep-alive" comments this often while waiting
        self.silent = False  # never answer a completion
        self.stall_after: int | None = None  # go silent after this many tokens of each response
        self.fail_request: int | None = None  # answer the completion request of this arrival index with an error
        self.reset_ok = True
        self.scheduler: KVScheduler | None = None  # answer completions as vLLM's scheduler would run them
        self.bodies: list[dict] = []
        self.reloads: list[str] = []
        self.in_flight = self.most_in_flight = 0  # requests that have not sent their last finish_reason
        self.lock = threading.Lock()
        self.__dict__.update(kw)

    def done(self) -> None:
        with self.lock:
            self.in_flight -= 1


def _handler(fake: Fake):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, obj, code=200):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._json({"data": [{"id": "bapo-policy"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/collective_rpc":
                if body["method"] == "bapo_describe":
                    return self._json({"results": [fake.describe]})
                reader = Reader(body["kwargs"]["path"])
                for _ in reader:
                    pass
                fake.reloads.append(body["kwargs"]["path"])
                return self._json({"results": [reader.check()]})
            if self.path == "/reset_prefix_cache":
                return self._json({"success": fake.reset_ok})
            fake.bodies.append(body)
            if len(fake.bodies) - 1 == fake.fail_request:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(b'data: {"error": {"message": "the stand-in fails this request"}}\n\n')
                return
            with fake.lock:
                fake.in_flight += 1
                fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if fake.scheduler is not None:
                return fake.scheduler.serve(self, body, fake.done)
            self._complete(body)

        def event(self, choices: list[dict]) -> None:
            self.wfile.write(f"data: {json.dumps({'choices': choices})}\n\n".encode())
            self.wfile.flush()

        def _complete(self, body):
            if fake.silent:
                time.sleep(30)
                return
            for k in range(fake.tokens):
                if k == fake.stall_after:
                    time.sleep(30)
                    return
                waited = 0.0
                while waited < fake.gap_s:  # a long first token (queueing, prefill) or a slow decode
                    step = min(fake.keepalive_s or fake.gap_s, fake.gap_s - waited)
                    time.sleep(step)
                    waited += step
                    if fake.keepalive_s:
                        self.wfile.write(b": keep-alive\n\n")
                        self.wfile.flush()
                last = k == fake.tokens - 1
                if last:
                    fake.done()  # the last finish_reason goes out now
                for i in range(body["n"]):
                    self.event([{"index": i, "token_ids": [10 + k], "finish_reason": "length" if last else None,
                                 "logprobs": {"token_logprobs": [-0.5]}}])  # fmt: skip
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # an engine opens a connection per request in flight at once


def serve(fake: Fake) -> tuple[ThreadingHTTPServer, str]:
    """The stand-in for ``fake`` on a free loopback port, serving from a thread: (the server, its URL)."""
    httpd = _Server(("127.0.0.1", 0), _handler(fake))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


class _Seq:
    def __init__(self, out: queue.Queue, index: int, prompt: int, target: int, stop: bool):
        self.out, self.index, self.prompt, self.target, self.stop = out, index, prompt, target, stop
        self.generated = 0

    @property
    def kv(self) -> int:
        return self.prompt + self.generated


class KVScheduler:
    """vLLM's scheduler in miniature, in ticks of ``tick_s``: every tick each running sequence generates
    ``per_tick`` tokens (fewer at its end); a finished one frees its KV cache (its prompt and its tokens); when the
    running sequences outgrow ``kv_tokens`` the newest are preempted (back to the head of the queue, keeping their
    tokens, as vLLM's recompute preemption does); then queued sequences start in order while their KV cache fits
    and ``max_num_seqs`` allows. Child ``i`` of a request seeded ``s`` has the length ``length(s, i)`` (capped at
    the request's ``max_tokens``; below it, it ends on the request's first stop id).

    :attr:`occupancy` counts, over the ticks with work, the running sequences and the KV cache they hold; a
    request that waits longer than ``max_wait_s`` for its first token (the engine sent more than the scheduler
    could run) is counted in :attr:`waited_long`."""

    def __init__(self, kv_tokens: int, max_num_seqs: int, length: Callable[[int, int], int], *, per_tick: int = 4,
                 tick_s: float = 0.02):  # fmt: skip
        self.kv_tokens, self.max_num_seqs, self.length = kv_tokens, max_num_seqs, length
        self.per_tick, self.tick_s = per_tick, tick_s
        self.running: list[_Seq] = []
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.lock = threading.Lock()
        self.ticks = self.seq_ticks = self.kv_ticks = self.preempted = self.most_running = 0
        self.stopped = threading.Event()
        threading.Thread(target=self._run, name="kv-scheduler", daemon=True).start()

    def close(self) -> None:
        self.stopped.set()

    @property
    def occupancy(self) -> dict:
        busy = max(1, self.ticks)
        return {"ticks": self.ticks, "seq_ticks": self.seq_ticks, "mean_running": self.seq_ticks / busy,
                "most_running": self.most_running, "mean_kv_share": self.kv_ticks / busy / self.kv_tokens,
                "preemptions": self.preempted}  # fmt: skip

    def serve(self, handler, body: dict, done: Callable[[], None]) -> None:
        """Answer one streamed completion: its children join the queue, their tokens are written as they come."""
        out: queue.Queue = queue.Queue()
        n, cap, seed = body["n"], body["max_tokens"], int(body.get("seed") or 0)
        stop_id = (body.get("stop_token_ids") or [0])[0]
        with self.lock:
            for i in range(n):
                target = min(cap, max(1, self.length(seed, i)))
                self.waiting.append(_Seq(out, i, len(body["prompt"]), target, stop=target < cap))
        left = n
        while left:
            events = [out.get()]
            while not out.empty():  # what this tick produced for the request's children, in one event
                events.append(out.get_nowait())
            choices = []
            for seq, k, finished in events:
                ids = [10] * k
                if finished and seq.stop:
                    ids[-1] = stop_id
                reason = ("stop" if seq.stop else "length") if finished else None
                choices.append({"index": seq.index, "token_ids": ids, "finish_reason": reason,
                                "logprobs": {"token_logprobs": [-0.5] * k}})  # fmt: skip
                left -= finished
            if not left:
                done()
            handler.event(choices)
        handler.wfile.write(b"data: [DONE]\n\n")

    def _run(self) -> None:
        while not self.stopped.is_set():
            time.sleep(self.tick_s)
            with self.lock:
                self._tick()

    def _tick(self) -> None:
        for seq in list(self.running):
            k = min(self.per_tick, seq.target - seq.generated)
            seq.generated += k
            finished = seq.generated >= seq.target
            seq.out.put((seq, k, finished))
            if finished:
                self.running.remove(seq)
        while self.running and sum(s.kv for s in self.running) > self.kv_tokens:
            self.waiting.appendleft(self.running.pop())  # the newest: vLLM preempts by priority, then arrival
            self.preempted += 1
        used = sum(s.kv for s in self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            nxt = self.waiting[0]
            if self.running and used + nxt.kv + self.per_tick > self.kv_tokens:
                break
            self.running.append(self.waiting.popleft())
            used += nxt.kv
        if self.running or self.waiting:
            self.ticks += 1
            self.seq_ticks += len(self.running)
            self.kv_ticks += used
            self.most_running = max(self.most_running, len(self.running))
