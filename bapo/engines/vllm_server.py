"""vLLM's OpenAI-compatible server as the generation engine (``rollout=vllm_server``): generation in processes
of its own (on a GPU node, GPUs of its own), the learner talking to it over HTTP.

The engine either starts a server (``python -m bapo.engines.vllm_server_process``, which runs vLLM's
``vllm.entrypoints.openai.api_server`` under a parent watch, bound to ``rollout.host``) or connects to one a user
started (``rollout.url``). Either way it first asks the server's workers what model they hold (``/collective_rpc``
with the worker extension :class:`~bapo.engines.vllm_extension.WeightLoader`) and refuses, in one line, a server
of another model, one too short for prompt + response, one that returns untempered log-probs (not
``--logprobs-mode processed_logprobs``) or fills omitted sampling keys from the checkpoint (not
``--generation-config vllm``). A server given by URL may hold any weights: it gets the learner's before its first
batch.

Generation: one streamed ``POST /v1/completions`` per prompt, token ids in (``prompt``) and out
(``return_token_ids``), the sampled token's log-prob under the tempered distribution, this project's stop ids
(``stop_token_ids``, ``ignore_eos``), every sampling key sent explicitly (no penalties, no top-k, no min-p), and
``seed`` per prompt (vLLM seeds child j of a request with seed + j, so prompts are spaced ``n`` apart). Requests
are admitted while the KV cache their responses are expected to hold fits ``rollout.kv_overcommit`` x the server's
(its blocks x block size) and ``max_num_seqs`` (:mod:`bapo.engines.admission`); each response's share is released
at its ``finish_reason``. vLLM's scheduler queues what does not fit and preempts when the cache runs short, so a
request may wait, silent, before its first token: ``rollout.request_timeout_s`` bounds the *silence* of a request
that has started (a stuck server, whatever the generation's length), and of the server as a whole while none of
the requests in flight has started.

Weight sync. vLLM 0.32's native weight transfer (``--weight-transfer-config '{"backend": "nccl"}'``) needs
NCCL, which the CPU build lacks and this lab cannot run, so the engine uses the path vLLM offers on every
platform: the learner stages its weights as safetensors with a manifest of fingerprints
(:mod:`bapo.engines.staging`), the server's workers reload that folder in place
(:meth:`~bapo.engines.vllm_extension.WeightLoader.bapo_reload`: each tensor fingerprinted as it is handed to vLLM's
reload, a parameter left without weights refused, the CPU build's tied output layer re-packed) and answer with what
they read, the learner refuses a sync whose answer differs, then resets the prefix cache (and checks that it was
reset). A version's folder is removed as soon as its server has loaded it, so a server's staging holds one copy at
its peak. When every rank syncs at once (sync mode, and evaluations: the streamed weights are a collective) the
ranks of one node share one staged copy, written by the node's first rank. Space is checked at start for the
copies the mode stages at once on a node (one in sync mode, one a rank in async mode; ``/dev/shm`` in a container
is 64 MB by default), and a server's watch removes its staging when the learner dies.
``time/sync_{write,reload,reset,wait}_s`` split the sync's time. docs/offpolicy.md ("vLLM's server") says what
this costs at 7B and what NCCL would save.

Under torchrun every rank has its own server (``rollout.url``: one URL, or one per rank, comma-separated;
``rollout.gpus``: the launched servers' devices, indices into this process's ``CUDA_VISIBLE_DEVICES``, split over
the local ranks).

Process hygiene. A launched server runs in a session of its own (a Ctrl-C at the terminal reaches the
learner only, which stops, saves and then stops the server); :meth:`VLLMServerRollout.close` (run at the
loop's teardown and at exit) sends SIGTERM to the server's whole process group and SIGKILL after a grace
period; and the server's wrapper watches its parent, so a learner killed by SIGKILL takes its server (and its
staged weights) down too.

This module holds the engine: its config, the server's start and model check, the weight sync and the requests.
The HTTP under them is :mod:`bapo.engines.vllm_server_http`, the server's process (its wrapper, the parent watch,
the group stop) :mod:`bapo.engines.vllm_server_process`, and what runs in the server's workers
:mod:`bapo.engines.vllm_extension`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bapo.engines.admission import Admission
from bapo.engines.base import RolloutEngine, SamplingDefaults, make_sample
from bapo.engines.config import RolloutCommon
from bapo.engines.registry import EngineTraits
from bapo.engines.staging import (
    StagingError,
    check_reply,
    check_space,
    make_root,
    model_bytes,
    save_weights,
)
from bapo.engines.vllm import checkpoint_generation_config, cpu_compile_cache, request_seed, vllm_installed
from bapo.engines.vllm_extension import IDENTITY, WeightLoader
from bapo.engines.vllm_server_http import ServerError, ServerHTTP, _Open
from bapo.engines.vllm_server_process import _bind_error, _free_port, _last_line, _stop_group, server_devices
from bapo.infra import dist, stop
from bapo.infra.checks import ConfigError, require, resumable
from bapo.samples import Prompt, Sample

SERVED_NAME = "bapo-policy"
EXTENSION = f"{WeightLoader.__module__}.{WeightLoader.__qualname__}"  # the server's --worker-extension-cls
UNSYNCED = -1  # the version of a server given by URL before its first sync: it may hold any weights
RESET_TRIES = 20  # the prefix cache refuses a reset while blocks are held; it is retried this many times
UNIX_PATH_MAX = 107  # the longest path a unix socket may bind (sun_path: 108 bytes, its NUL included)


def _socket_folder(env: dict) -> Path | None:
    """A folder of the server's own for vLLM's ZMQ sockets (``ipc://<VLLM_RPC_BASE_PATH>/<uuid4>``), set in the
    server's ``env``, so that a start leaves none in the temporary folder. None (vLLM's default kept) where the user
    set ``VLLM_RPC_BASE_PATH`` or a socket's path in the folder would be too long to bind."""
    if "VLLM_RPC_BASE_PATH" in env:
        return None
    folder = Path(tempfile.mkdtemp(prefix="bapo-vllm-ipc-"))
    if len(os.fsencode(folder)) + 1 + 36 > UNIX_PATH_MAX:  # "/" and a uuid4
        folder.rmdir()
        return None
    env["VLLM_RPC_BASE_PATH"] = str(folder)
    return folder


def _stop_server(proc: subprocess.Popen, sockets: Path | None) -> None:
    """Stop a started server's process group, then remove its sockets' folder."""
    try:
        _stop_group(proc)
    finally:
        if sockets is not None:
            shutil.rmtree(sockets, ignore_errors=True)


@dataclass
class VLLMServerConfig(RolloutCommon):
    """``rollout=vllm_server`` (conf/rollout/vllm_server.yaml): vLLM's OpenAI-compatible server."""

    url: str | None = resumable()  # a running server (or one per torchrun rank, comma-separated); null: start one
    host: str = resumable()  # where a started server listens (and the address the learner reaches it at)
    port: int = resumable()  # a started server's port (0: any free one; under torchrun, port + local rank)
    gpus: str | None = resumable()  # started servers' devices (indices into CUDA_VISIBLE_DEVICES), split over ranks
    gpu_memory_utilization: float = resumable()
    tensor_parallel_size: int = resumable()
    enforce_eager: bool = resumable()
    server_args: list[str] = resumable()  # more `vllm serve` flags for a started server
    start_timeout_s: float = resumable()
    request_timeout_s: float = resumable()  # a running request silent this long means a stuck server
    kv_overcommit: float = resumable()  # the share of a server's KV cache its requests are expected to fill
    weights_dir: str | None = resumable()  # where the weight folders go (null: /dev/shm where it exists, else tmp)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port < 65536, "rollout.port", f"must be 0 (any free port) or a port, got {self.port}")
        require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
        require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")
        require(self.start_timeout_s > 0, "rollout.start_timeout_s", "must be > 0 seconds")
        require(self.request_timeout_s > 0, "rollout.request_timeout_s", "must be > 0 seconds")
        require(
            0 < self.kv_overcommit <= 4,
            "rollout.kv_overcommit",
            f"must be in (0, 4] (the share of a server's KV cache to fill), got {self.kv_overcommit}",
        )
        if self.url is not None:
            for u in self.url.split(","):
                require(
                    u.strip().startswith(("http://", "https://")),
                    "rollout.url",
                    f"must be http://host:port (a vLLM server), got {u!r}",
                )


def staged_copies(node_ranks: int, local: int, together: bool) -> int:
    """The staged copies of the weights local rank ``local`` of a node of ``node_ranks`` makes room for: the first
    rank the node's peak (one shared copy where every rank syncs at once, ``together``; else one a rank, written
    at the same time), the others their own copy where they write one (not ``together``)."""
    if local == 0:
        return 1 if together else node_ranks
    return 0 if together else 1


class VLLMServerRollout(RolloutEngine, ServerHTTP):
    """Sampling through vLLM's OpenAI-compatible server."""

    traits = EngineTraits(
        needs_model_copy=False,
        can_sleep=False,
        behaviour_logprobs=True,
        weights="transport",
        spans_ranks=False,
        continues=True,
        gpu_memory="vllm_own_gpus",
        eval_engine="vllm",  # eval.py checkpoint=<run>: vLLM in each eval rank, on its own GPU
    )
    config = VLLMServerConfig

    @classmethod
    def preflight(cls, cfg: VLLMServerConfig) -> None:
        if cfg.url is None:  # a server to start here; one given by URL runs wherever it runs
            vllm_installed("vllm_server")

    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        gpus: str | None = None,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        server_args: Sequence[str] = (),
        start_timeout_s: float = 300.0,
        request_timeout_s: float = 900.0,
        kv_overcommit: float = 1.0,
        weights_dir: str | None = None,
        syncs_together: bool = False,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        **sampling: Any,
    ):
        """It starts a server on ``model_path`` (or connects to ``url``), seeded with ``seed``, holding
        ``max_model_len`` tokens. ``syncs_together``: every rank loads each version at once (sync mode), so every
        sync shares the node's staged copy. ``sampling``: the :class:`~bapo.engines.base.SamplingDefaults`."""
        defaults = SamplingDefaults(**sampling)
        self._hold_sampling(tokenizer, checkpoint_generation_config(str(model_path)), defaults)
        self.model_path = str(model_path)
        self.timeout = request_timeout_s
        self.dtype = getattr(torch, dtype)
        self.proc: subprocess.Popen | None = None
        self.sync_parts: dict[str, float] = {}
        # a host snapshot (async mode) is cast and fingerprinted on this rank's GPU, where it has one
        self.stage_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        rank, world, local = dist.rank(), dist.world_size(), dist.local_rank()
        self.local = local
        self.node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.syncs_together = syncs_together
        # the weight folders: this rank's own, and the node's shared one for syncs every rank makes at once
        self.dir = make_root(weights_dir, "bapo-vllm-server-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        key = dist.broadcast_object(uuid.uuid4().hex[:12]) if dist.active() else None
        self.node_dir = None if key is None or self.node_ranks < 2 else self.dir.parent / f"bapo-vllm-node-{key}"
        if self.node_dir is not None and local == 0:
            self.node_dir.mkdir(exist_ok=True)
            self._node_cleanup = weakref.finalize(self, shutil.rmtree, self.node_dir, True)
        need = staged_copies(self.node_ranks, local, syncs_together) * _checkpoint_bytes(self.model_path, self.dtype)
        if need:
            check_space(self.dir, need)
        if url is not None:
            urls = [u.strip().rstrip("/") for u in url.split(",")]
            require(
                len(urls) == world,
                "rollout.url",
                f"{len(urls)} server URL(s) for {world} torchrun ranks: give one per rank (each rank loads its "
                "server's weights), or null to start them",
            )
            self.url = urls[rank]
            self.version = UNSYNCED  # a server we did not start may hold any weights: sync before the first batch
        else:
            vllm_installed("vllm_server")
            flags = [
                "--dtype", dtype, "--seed", str(seed), "--gpu-memory-utilization", str(gpu_memory_utilization),
                "--tensor-parallel-size", str(tensor_parallel_size),
                *(["--max-model-len", str(max_model_len)] if max_model_len else []),
                *(["--enforce-eager"] if enforce_eager else []),
                *server_args,
            ]  # fmt: skip
            port = port + local if port else _free_port(host)
            self.url = self._start(host, port, gpus, tensor_parallel_size, flags, start_timeout_s)
        described = self._check_model(max_model_len)
        seqs = int(described.get("max_num_seqs") or 256)
        self.admission = Admission(described.get("kv_tokens"), seqs, kv_overcommit)
        self._streams: set[_Open] = set()  # requests in flight (their sockets: an abort shuts them)
        self._streams_lock = threading.Lock()
        self._last_heard = time.monotonic()  # when the server last sent a byte on any stream
        self.positional = bool(described.get("positional_draws"))  # seeds of a response's segments: vllm.py's docstring
        # a thread per request in flight or waiting for admission: as many as the server may run (n = 1 segments)
        self.pool = ThreadPoolExecutor(max_workers=max(64, seqs), thread_name_prefix="bapo-vllm-http")
        stop.on_request(self._abandon_streams)  # a stop shuts the streams in flight: the server aborts them
        dist.before_teardown(self.close)

    # ------------------------------------------------------------------ the server process

    def _start(self, host: str, port: int, gpus: str | None, tp: int, flags: list[str], timeout_s: float) -> str:
        """Start this rank's server on ``host:port`` (its devices: its share of ``gpus``, ``tp`` each) with the
        engine's ``vllm serve`` ``flags`` (last, so that ``rollout.server_args`` may override), and wait for it."""
        why = _bind_error(host, port)
        if why is not None:
            raise ConfigError(why)
        local = self.local
        staging = [str(self.dir)] + ([str(self.node_dir)] if self.node_dir is not None and local == 0 else [])
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # /collective_rpc and /reset_prefix_cache
        self.ipc_dir = _socket_folder(env)
        if self.ipc_dir is not None:
            staging.append(str(self.ipc_dir))  # the wrapper removes it if the learner dies by SIGKILL
        args = [
            sys.executable, "-m", "bapo.engines.vllm_server_process", "--parent", str(os.getpid()),
            *(a for d in staging for a in ("--staging", d)), "--",
            "--model", self.model_path, "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port),
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            "--worker-extension-cls", EXTENSION, "--disable-log-stats", *flags,
        ]  # fmt: skip
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cpu_compile_cache(env)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)  # the server is not a torchrun rank
        if gpus:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = server_devices(gpus, visible, self.node_ranks, local, tp)
        elif self.node_ranks > 1 and torch.cuda.is_available():
            raise ConfigError(
                f"rollout.gpus: {self.node_ranks} learner ranks on this node would each start a server on GPU 0, "
                f"beside learner rank 0; give each server GPUs of its own, e.g. rollout.gpus="
                f"'{','.join(str(self.node_ranks + i) for i in range(self.node_ranks))}'"
            )
        self.log = self.dir / "server.log"
        try:
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(
                    args,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        except BaseException:
            if self.ipc_dir is not None:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)
            raise
        self._stopper = weakref.finalize(self, _stop_server, self.proc, self.ipc_dir)
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                keep = Path(tempfile.gettempdir()) / f"bapo-vllm-server-{os.getpid()}.log"
                shutil.copy(self.log, keep)
                self._stopper()  # what is left of its group, and its sockets' folder
                raise ConfigError(
                    f"rollout=vllm_server: the server exited with code {self.proc.returncode} before it was ready: "
                    f"{_last_line(self.log)} (its log: {keep})"
                )
            try:
                self._get(url + "/v1/models", timeout=2)
                return url
            except (OSError, ServerError):
                time.sleep(0.5)
        self._stopper()
        raise ConfigError(
            f"rollout.start_timeout_s: the server on {url} was not ready within {timeout_s:g} s "
            f"({_last_line(self.log)})"
        )

    def close(self) -> None:
        """Stop a started server (and its engine process) and remove the weight folders."""
        stop.forget(self._abandon_streams)
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.proc is not None:
            self._stopper()
        self._cleanup()
        if getattr(self, "_node_cleanup", None) is not None:
            self._node_cleanup()

    def _check_model(self, max_model_len: int | None) -> dict:
        """Refuse a server whose model is not this run's, or too short, or sampling otherwise than the learner
        scores (untempered log-probs, the checkpoint's sampling defaults), or without the control routes."""
        from transformers import AutoConfig

        try:
            models = self._get(self.url + "/v1/models", timeout=10)
        except (OSError, ServerError) as e:
            raise ConfigError(f"rollout.url: no vLLM server answers at {self.url} ({e})") from None
        self.served = models["data"][0]["id"]
        flags = f"--worker-extension-cls {EXTENSION} --logprobs-mode processed_logprobs --generation-config vllm"
        try:
            described = self._rpc("bapo_describe")
        except ServerError as e:
            raise ConfigError(
                f"rollout.url: {self.url} cannot reload weights ({e}); start it with VLLM_SERVER_DEV_MODE=1 and {flags}"
            ) from None
        theirs = described[0] if isinstance(described, list) else described
        ours = AutoConfig.from_pretrained(self.model_path).to_dict()
        differ = [k for k in IDENTITY if ours.get(k) != theirs.get(k)]
        require(
            not differ,
            "rollout.url",
            f"the server at {self.url} serves {self.served!r}, another model than this run's {self.model_path} "
            f"({', '.join(f'{k} {theirs.get(k)} != {ours.get(k)}' for k in differ)}); start it with --model "
            f"{self.model_path}",
        )
        need = max_model_len or 0
        require(
            theirs["max_model_len"] >= need,
            "rollout.url",
            f"the server at {self.url} holds {theirs['max_model_len']} tokens, this run needs {need} "
            "(prompt + rollout.max_new_tokens): restart it with a larger --max-model-len",
        )
        mode = theirs.get("logprobs_mode")
        require(
            not self.logprobs or mode == "processed_logprobs",
            "rollout.url",
            f"the server at {self.url} returns {mode} (log-probs before temperature), the learner scores the "
            f"tempered distribution: restart it with {flags}",
        )
        require(
            theirs.get("generation_config") == "vllm",
            "rollout.url",
            f"the server at {self.url} runs with --generation-config {theirs.get('generation_config')}: keys a "
            f"request omits would take the checkpoint's defaults; restart it with {flags}",
        )
        return theirs

    # ------------------------------------------------------------------ the engine interface

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Stage the learner's weights, have the server's workers reload them, check what they read, reset the
        prefix cache. Where every rank syncs at once (sync mode, or ``weights.collective``), one rank a node
        writes."""
        t0 = time.perf_counter()
        shared = self.node_dir is not None and (self.syncs_together or bool(getattr(weights, "collective", False)))
        folder = (self.node_dir if shared else self.dir) / f"v{version:08d}"
        err: BaseException | None = None
        staged = None
        try:
            # shared: the node's first rank writes; the others read the stream (a collective) and check the reply
            staged = save_weights(
                weights, folder, self.dtype, write=not shared or self.local == 0, device=self.stage_device
            )
        except BaseException as e:  # noqa: BLE001 (re-raised below, on every rank together when shared)
            err = e
        t_write = time.perf_counter()
        if shared:
            _together(err, f"staging weights version {version}")
        elif err is not None:
            raise err
        t1 = t2 = t3 = time.perf_counter()
        try:
            reply = self._rpc("bapo_reload", path=str(folder))
            check_reply(staged, reply, f"rollout=vllm_server at {self.url}")
            self._last_reply = reply
            t2 = time.perf_counter()
            self._reset_prefix_cache()
            t3 = time.perf_counter()
        except (StagingError, ServerError) as e:
            err = e
        if shared:
            _together(err, f"reloading weights version {version}")
            if self.local == 0:
                shutil.rmtree(folder, ignore_errors=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)  # the server holds them now: no copy stays in tmpfs
            if err is not None:
                raise err
        t4 = time.perf_counter()
        # wait: the node's ranks waiting for each other in a shared sync (and removing the folder)
        self.sync_parts = {
            "write": t_write - t0,
            "reload": t2 - t1,
            "reset": t3 - t2,
            "wait": (t1 - t_write) + (t4 - t3),
        }
        self.version = version
        return t4 - t0

    def _reset_prefix_cache(self) -> None:
        """Drop the prefix cache (its KV was computed by the old weights); vLLM refuses while blocks are held."""
        for _ in range(RESET_TRIES):
            out = self._post("/reset_prefix_cache")
            if not isinstance(out, dict) or out.get("success", True):
                return
            time.sleep(0.1)
        raise ServerError(
            f"rollout=vllm_server: the server at {self.url} refused to reset its prefix cache {RESET_TRIES} times "
            "(blocks still held): its cached prompts would keep the old weights' KV"
        )

    def fingerprint(self) -> list[dict] | None:
        """What the server's workers read at the last sync (one count and digest per worker), or None before any."""
        return getattr(self, "_last_reply", None)

    def _complete(self, ids: list[int], n: int, temperature: float, max_tokens: int, seed: int | None):
        body = {
            "model": self.served,
            "prompt": ids,
            "n": n,
            "temperature": max(temperature, 0.0),
            "top_p": self.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "min_tokens": 0,
            "max_tokens": max_tokens,
            "stop": [],
            "stop_token_ids": list(self.stop_ids),
            "ignore_eos": True,  # stop on exactly these ids, as the HF engine does
            "return_token_ids": True,
            "skip_special_tokens": False,
            "logprobs": 0 if self.logprobs else None,  # the sampled token's only
            "seed": seed,
        }
        toks: dict[int, list[int]] = {i: [] for i in range(n)}
        lps: dict[int, list[float]] = {i: [] for i in range(n)}
        with self.admission.request(len(ids), n, max_tokens, learn=max_tokens == self.max_new_tokens) as ticket:
            for event in self._stream("/v1/completions", body):
                for c in event.get("choices", []):
                    i = c["index"]
                    toks[i] += list(c.get("token_ids") or [])
                    if self.logprobs and c.get("logprobs"):
                        lps[i] += list(c["logprobs"]["token_logprobs"])
                    if c.get("finish_reason") is not None:  # this child's part of the KV cache is free
                        ticket.finish(i, len(toks[i]))
        out = []
        for i in range(n):
            if self.logprobs and len(lps[i]) != len(toks[i]):
                raise ServerError(f"rollout=vllm_server: {len(lps[i])} log-probs for {len(toks[i])} tokens")
            out.append((toks[i], lps[i] if self.logprobs else None))
        return out

    def _generate(self, prompts: Sequence[Prompt], n: int, temperature: float, seed: int | None) -> list[Sample]:
        """``n`` responses per prompt; request p carries seed ``request_seed(seed, p * n)``, so response j of prompt
        p is drawn with ``request_seed(seed, p * n) + j`` (vLLM's child seeds): reproducible, and no two alike."""
        jobs = [
            self.pool.submit(
                self._complete, list(p.ids), n, temperature, self.max_new_tokens,
                None if seed is None else request_seed(seed, i * n),
            )
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        samples = []
        for i, result in enumerate(self._collect(jobs)):
            for toks, lp in result:
                samples.append(make_sample(prompts[i], i, toks, lp, self.stop_ids, self.version, self.tokenizer))
        return samples

    def _segments(
        self, rows: list[list[int]], caps: list[int], seeds: list[int], offsets: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`RolloutEngine._segments`: one request per row (prompt + prefix), seeded by its response's seed (and
        its offset where the server's draws are not keyed by position: bapo/engines/vllm.py's docstring)."""
        jobs = [
            self.pool.submit(self._complete, r, 1, self.temperature, cap, request_seed(s, 0 if self.positional else o))
            for r, cap, s, o in zip(rows, caps, seeds, offsets, strict=True)
        ]
        out = []
        for ((toks, lp),) in self._collect(jobs):
            out.append((torch.tensor(toks, dtype=torch.long), torch.tensor(lp, dtype=torch.float32)))
        return out


def _checkpoint_bytes(model_path: str, dtype: torch.dtype) -> int:
    """Bytes of one staged copy of the model at ``model_path`` in ``dtype`` (counted on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return model_bytes(dict(model.state_dict(keep_vars=True)), dtype)


def _together(err: BaseException | None, doing: str) -> None:
    """A failure on any rank of a shared sync fails every rank (none is left waiting at a collective)."""
    mine = None if err is None else f"{type(err).__name__}: {err}"
    failed = [(r, m) for r, m in enumerate(dist.all_gather_object(mine)) if m is not None]
    if err is not None:
        raise err
    if failed:
        raise ServerError(f"rollout=vllm_server: {doing} failed on rank {failed[0][0]}: {failed[0][1]}")
