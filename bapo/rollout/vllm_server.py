"""vLLM's OpenAI-compatible server as the generation engine (``rollout=vllm_server``): generation in processes
of its own (on a GPU node, GPUs of its own), the learner talking to it over HTTP.

The engine either starts a server (``python -m bapo.rollout.vllm_server``, which runs vLLM's
``vllm.entrypoints.openai.api_server`` under a parent watch) or connects to one a user started
(``rollout.url``). Either way it first asks the server's workers what model they hold (``/collective_rpc``
with this module's :class:`WeightLoader` extension) and refuses a server of another model, or one too short
for prompt + response, with a one-line error.

Generation: one ``POST /v1/completions`` per prompt, all in flight together (the server batches them),
token ids in (``prompt``) and out (``return_token_ids``), the sampled token's log-prob under the tempered
distribution (the server runs with ``--logprobs-mode processed_logprobs``), this project's stop ids
(``stop_token_ids``, ``ignore_eos``), ``seed`` per prompt (vLLM seeds child j of a request with seed + j, so
prompts are spaced ``n`` apart: every response has its own seed).

Weight sync. vLLM 0.32's native weight transfer (``--weight-transfer-config '{"backend": "nccl"}'``) needs
NCCL, which the CPU build lacks and this lab cannot run, so the engine uses the path vLLM offers on every
platform: the learner writes its weights as safetensors into a fresh folder (staged, then renamed), and the
server's workers reload that folder in place (:meth:`WeightLoader.bapo_reload`: vLLM's ``reload_weights``
from a checkpoint-format folder, then the CPU build's tied output layer re-packed), after which the prefix
cache is reset. docs/offpolicy.md ("vLLM's server") says what this costs at 7B and what NCCL would save.

Under torchrun every rank has its own server (``rollout.url``: one URL, or one per rank, comma-separated;
``rollout.gpus``: the launched servers' devices, split over the local ranks).

Process hygiene. A launched server runs in a session of its own (a Ctrl-C at the terminal reaches the
learner only, which stops, saves and then stops the server); :meth:`VLLMServerRollout.close` (run at the
loop's teardown and at exit) sends SIGTERM to the server's whole process group and SIGKILL after a grace
period; and the server's wrapper watches its parent, so a learner killed by SIGKILL takes its server down too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from bapo import dist
from bapo.checks import ConfigError, require, resumable
from bapo.rollout.base import EngineContext, RolloutEngine, check_top_p, make_sample
from bapo.rollout.config import RolloutCommon
from bapo.rollout.registry import EngineTraits
from bapo.rollout.vllm import checkpoint_generation_config, request_seed, save_weights
from bapo.samples import Prompt, Sample

SERVED_NAME = "bapo-policy"
# what must agree between the learner's checkpoint and the server's model (config.json keys)
IDENTITY = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


@dataclass
class VLLMServerConfig(RolloutCommon):
    """``rollout=vllm_server`` (conf/rollout/vllm_server.yaml): vLLM's OpenAI-compatible server."""

    url: str | None = resumable()  # a running server (or one per torchrun rank, comma-separated); null: start one
    host: str = resumable()  # where a started server listens
    port: int = resumable()  # a started server's port (0: any free one; under torchrun, port + local rank)
    gpus: str | None = resumable()  # started servers' devices (CUDA_VISIBLE_DEVICES), split evenly over local ranks
    gpu_memory_utilization: float = resumable()
    tensor_parallel_size: int = resumable()
    enforce_eager: bool = resumable()
    server_args: list[str] = resumable()  # more `vllm serve` flags for a started server
    start_timeout_s: float = resumable()
    request_timeout_s: float = resumable()
    weights_dir: str | None = resumable()  # where the weight folders go (null: /dev/shm where it exists, else tmp)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port < 65536, "rollout.port", f"must be 0 (any free port) or a port, got {self.port}")
        require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
        require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")
        require(self.start_timeout_s > 0, "rollout.start_timeout_s", "must be > 0 seconds")
        require(self.request_timeout_s > 0, "rollout.request_timeout_s", "must be > 0 seconds")
        if self.url is not None:
            for u in self.url.split(","):
                require(
                    u.strip().startswith(("http://", "https://")),
                    "rollout.url",
                    f"must be http://host:port (a vLLM server), got {u!r}",
                )


class WeightLoader:
    """vLLM worker extension (``--worker-extension-cls bapo.rollout.vllm_server.WeightLoader``): methods the
    engine calls on every worker of the server through ``POST /collective_rpc``."""

    def bapo_describe(self) -> dict:
        cfg = self.model_runner.model_config
        hf = cfg.hf_config.to_dict()
        return {"max_model_len": int(cfg.max_model_len)} | {k: hf.get(k) for k in IDENTITY}

    def bapo_reload(self, path: str) -> None:
        from vllm.platforms import current_platform

        from bapo.rollout.vllm import _repack_lm_head

        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        if current_platform.is_cpu():  # a tied output layer keeps its old packed copy on CPU
            _repack_lm_head(self)


class ServerError(RuntimeError):
    """The server failed a request, or died; the message is one line."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["(empty log)"])[-1][:400]


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the server's process group (vLLM shuts its engine down), SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the engine core may outlive the API process by a moment
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class VLLMServerRollout(RolloutEngine):
    """Sampling through vLLM's OpenAI-compatible server."""

    traits = EngineTraits(
        needs_model_copy=False, can_sleep=False, behaviour_logprobs=True, weights="transport", spans_ranks=False
    )
    config = VLLMServerConfig

    @classmethod
    def from_config(cls, cfg: VLLMServerConfig, ctx: EngineContext) -> VLLMServerRollout:
        """The engine of ``rollout=vllm_server``: it starts a server on ``ctx.path`` (or connects to
        ``cfg.url``), seeded with ``ctx.seed``, holding ``ctx.max_model_len`` tokens."""
        return cls(
            ctx.path,
            ctx.tokenizer,
            n=cfg.n,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            url=cfg.url,
            host=cfg.host,
            port=cfg.port,
            gpus=cfg.gpus,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enforce_eager=cfg.enforce_eager,
            server_args=list(cfg.server_args),
            start_timeout_s=cfg.start_timeout_s,
            request_timeout_s=cfg.request_timeout_s,
            weights_dir=cfg.weights_dir,
            dtype=ctx.dtype,
            seed=ctx.seed,
            top_p=ctx.top_p,
            logprobs=ctx.logprobs,
            max_model_len=ctx.max_model_len,
        )

    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        n: int,
        temperature: float = 1.0,
        max_new_tokens: int = 64,
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
        weights_dir: str | None = None,
        dtype: str = "float32",
        seed: int = 0,
        top_p: float = 1.0,
        logprobs: bool = True,
        max_model_len: int | None = None,
    ):
        check_top_p(top_p, logprobs)
        self._hold_sampling(
            tokenizer,
            checkpoint_generation_config(str(model_path)),
            n=n,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            top_p=top_p,
            logprobs=logprobs,
        )
        self.model_path = str(model_path)
        self.timeout = request_timeout_s
        self.dtype = getattr(torch, dtype)
        self.proc: subprocess.Popen | None = None
        base = weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.dir = Path(tempfile.mkdtemp(prefix="bapo-vllm-server-", dir=base))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        rank, world, local = dist.rank(), dist.world_size(), dist.local_rank()
        if url is not None:
            urls = [u.strip().rstrip("/") for u in url.split(",")]
            require(
                len(urls) == world,
                "rollout.url",
                f"{len(urls)} server URL(s) for {world} torchrun ranks: give one per rank (each rank loads its "
                "server's weights), or null to start them",
            )
            self.url = urls[rank]
        else:
            self.url = self._start(
                host=host,
                port=port + local if port else _free_port(host),
                gpus=gpus,
                local=local,
                dtype=dtype,
                seed=seed,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                enforce_eager=enforce_eager,
                server_args=server_args,
                start_timeout_s=start_timeout_s,
            )
        self._check_model(max_model_len)
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="bapo-vllm-http")
        dist.before_teardown(self.close)

    # ------------------------------------------------------------------ the server process

    def _start(self, *, host, port, gpus, local, dtype, seed, max_model_len, gpu_memory_utilization,
               tensor_parallel_size, enforce_eager, server_args, start_timeout_s) -> str:  # fmt: skip
        if _port_in_use(host, port):
            raise ConfigError(f"rollout.port: {host}:{port} is in use; choose another port, or 0 for any free one")
        args = [
            sys.executable, "-m", "bapo.rollout.vllm_server", "--parent", str(os.getpid()), "--",
            "--model", self.model_path, "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port),
            "--dtype", dtype, "--seed", str(seed), "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm", "--worker-extension-cls", f"{__name__}.WeightLoader",
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--tensor-parallel-size", str(tensor_parallel_size), "--disable-log-stats",
        ]  # fmt: skip
        if max_model_len:
            args += ["--max-model-len", str(max_model_len)]
        if enforce_eager:
            args.append("--enforce-eager")
        args += list(server_args)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # /collective_rpc and /reset_prefix_cache
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)  # the server is not a torchrun rank
        if gpus:
            ids = [g.strip() for g in gpus.split(",") if g.strip()]
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size()))
            per = len(ids) // ranks
            require(
                per >= tensor_parallel_size and len(ids) % ranks == 0,
                "rollout.gpus",
                f"{gpus!r} has {len(ids)} devices for {ranks} local ranks' servers: give a multiple of {ranks}, "
                f"at least rollout.tensor_parallel_size={tensor_parallel_size} each",
            )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[per * local : per * (local + 1)])
        self.log = self.dir / "server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self._stopper = weakref.finalize(self, _stop_group, self.proc)
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                keep = Path(tempfile.gettempdir()) / f"bapo-vllm-server-{os.getpid()}.log"
                shutil.copy(self.log, keep)
                raise ServerError(
                    f"rollout=vllm_server: the server exited with code {self.proc.returncode} before it was ready: "
                    f"{_last_line(self.log)} (its log: {keep})"
                )
            try:
                self._get(url + "/v1/models", timeout=2)
                return url
            except (OSError, ServerError):
                time.sleep(0.5)
        _stop_group(self.proc)
        raise ServerError(
            f"rollout.start_timeout_s: the server on {url} was not ready within {start_timeout_s:g} s "
            f"({_last_line(self.log)})"
        )

    def close(self) -> None:
        """Stop a started server (and its engine process) and remove the weight folders."""
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.proc is not None:
            self._stopper()
        self._cleanup()

    # ------------------------------------------------------------------ HTTP

    def _get(self, url: str, timeout: float | None = None):
        try:
            with urllib.request.urlopen(url, timeout=timeout or self.timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise ServerError(f"GET {url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None

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
            died = self.proc is not None and self.proc.poll() is not None
            why = f"the server exited with code {self.proc.returncode}: {_last_line(self.log)}" if died else str(e)
            raise ServerError(f"rollout=vllm_server: POST {self.url}{path} failed: {why}") from None

    def _rpc(self, method: str, **kwargs):
        out = self._post("/collective_rpc", {"method": method, "kwargs": kwargs})
        return out.get("results", out) if isinstance(out, dict) else out

    def _check_model(self, max_model_len: int | None) -> None:
        """Refuse a server whose model is not this run's, or too short, or without the control routes."""
        from transformers import AutoConfig

        try:
            models = self._get(self.url + "/v1/models", timeout=10)
        except (OSError, ServerError) as e:
            raise ConfigError(f"rollout.url: no vLLM server answers at {self.url} ({e})") from None
        self.served = models["data"][0]["id"]
        try:
            described = self._rpc("bapo_describe")
        except ServerError as e:
            raise ConfigError(
                f"rollout.url: {self.url} cannot reload weights ({e}); start it with VLLM_SERVER_DEV_MODE=1 and "
                f"--worker-extension-cls {__name__}.WeightLoader --logprobs-mode processed_logprobs"
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

    # ------------------------------------------------------------------ the engine interface

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Write the learner's weights into a fresh folder and have the server's workers reload it."""
        t0 = time.perf_counter()
        folder = self.dir / f"v{version:08d}"
        save_weights(weights, folder, self.dtype)
        self._rpc("bapo_reload", path=str(folder))
        self._post("/reset_prefix_cache")  # cached prompt KV was computed by the old weights
        for old in self.dir.glob("v*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self.version = version
        return time.perf_counter() - t0

    def _complete(self, ids: list[int], n: int, temperature: float, max_tokens: int, seed: int | None):
        body = {
            "model": self.served,
            "prompt": ids,
            "n": n,
            "temperature": max(temperature, 0.0),
            "top_p": self.top_p,
            "top_k": -1,
            "max_tokens": max_tokens,
            "stop_token_ids": list(self.stop_ids),
            "ignore_eos": True,  # stop on exactly these ids, as the HF engine does
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if self.logprobs:
            body["logprobs"] = 0  # the sampled token's only
        if seed is not None:
            body["seed"] = seed
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        out = []
        for c in choices:
            toks = list(c["token_ids"])
            lp = c["logprobs"]["token_logprobs"] if self.logprobs else None
            if lp is not None and len(lp) != len(toks):
                raise ServerError(f"rollout=vllm_server: {len(lp)} log-probs for {len(toks)} tokens")
            out.append((toks, lp))
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
        for i, job in enumerate(jobs):
            for toks, lp in job.result():
                samples.append(make_sample(prompts[i], i, toks, lp, self.stop_ids, self.version, self.tokenizer))
        return samples

    def _segments(
        self, rows: list[list[int]], caps: list[int], seeds: list[int], offsets: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`RolloutEngine._segments`: one request per row (prompt + prefix), seeded by (its seed, its offset)."""
        jobs = [
            self.pool.submit(self._complete, r, 1, self.temperature, cap, request_seed(s, o))
            for r, cap, s, o in zip(rows, caps, seeds, offsets, strict=True)
        ]
        out = []
        for job in jobs:
            ((toks, lp),) = job.result()
            out.append((torch.tensor(toks, dtype=torch.long), torch.tensor(lp, dtype=torch.float32)))
        return out


# ---------------------------------------------------------------------- the server's wrapper


def _watch_parent(parent: int) -> None:
    """In the server: once the learner is gone (even by SIGKILL), stop as SIGTERM would, then the whole group."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=loop, name="bapo-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """``python -m bapo.rollout.vllm_server --parent PID -- <vllm serve flags>``: vLLM's OpenAI server, stopped
    when process PID (the learner) is gone."""
    import runpy

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] != "--parent" or argv[2] != "--":
        raise SystemExit("usage: python -m bapo.rollout.vllm_server --parent PID -- <vllm serve flags>")
    _watch_parent(int(argv[1]))
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv[3:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
