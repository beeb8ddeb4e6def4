"""Typed, validated views of the composed Hydra config.

Defaults live in the YAML files under ``conf/``; the dataclasses here carry no
defaults of their own (every field is mandatory), only types and range checks.
Each config group is merged into its schema, so a missing key, an unknown key,
a value of the wrong type or a value out of range fails at startup with a
message that names the key, e.g. ``rollout.temperature: must be > 0, got -1``.

:func:`derive_sizes` computes the batch arithmetic once, after composition.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

ROOT = Path(__file__).resolve().parents[1]
EVAL_SETS_DIR = ROOT / "conf" / "evaluation" / "eval"  # eval.py's `eval` group; training runs them by name


class ConfigError(ValueError):
    """A config key has a bad value; the message names the key."""


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")


@dataclass
class CriticConfig:
    """The value model of ``advantage: gae`` (PPO): GAE and the clipped value loss."""

    lr: float = MISSING
    gamma: float = MISSING
    lam: float = MISSING
    vf_clip: float | None = MISSING

    def __post_init__(self) -> None:
        _require(self.lr > 0, "algo.critic.lr", f"must be > 0, got {self.lr}")
        _require(0 < self.gamma <= 1, "algo.critic.gamma", f"must be in (0, 1], got {self.gamma}")
        _require(0 <= self.lam <= 1, "algo.critic.lam", f"must be in [0, 1], got {self.lam}")
        _require(self.vf_clip is None or self.vf_clip > 0, "algo.critic.vf_clip", "must be null or > 0")


@dataclass
class CardConfig:
    """The card heuristic's eps rule (NOT the paper's method; see bapo/algos/card.py)."""

    eps: float = MISSING
    eps_min: float = MISSING
    eps_max: float = MISSING
    grow: float = MISSING
    shrink: float = MISSING
    g_high: float = MISSING
    g_low: float = MISSING
    widen: float = MISSING

    def __post_init__(self) -> None:
        _require(
            0 < self.eps_min <= self.eps <= self.eps_max < 1, "algo.card.eps", "need 0 < eps_min <= eps <= eps_max < 1"
        )
        _require(self.grow >= 1, "algo.card.grow", f"must be >= 1, got {self.grow}")
        _require(0 < self.shrink <= 1, "algo.card.shrink", f"must be in (0, 1], got {self.shrink}")
        _require(0 <= self.g_low <= self.g_high, "algo.card.g_low", "need 0 <= g_low <= g_high")
        _require(self.widen >= 0, "algo.card.widen", f"must be >= 0, got {self.widen}")


@dataclass
class AlgoConfig:
    name: str = MISSING
    loss: str = MISSING  # surrogate | card
    advantage: str = MISSING  # grpo | gae
    norm_std: bool = MISSING
    bounds: str = MISSING  # bapo | fixed
    ratio_low: float = MISSING
    ratio_high: float = MISSING
    rho0: float = MISSING
    low_range: list[float] = MISSING
    high_range: list[float] = MISSING
    low_step: float = MISSING
    high_step: float = MISSING
    contribution: str = MISSING
    weight: str = MISSING
    variant: str = MISSING
    scope: str = MISSING
    dual_clip: float | None = MISSING
    agg: str = MISSING
    entropy_coef: float = MISSING
    kl_coef: float = MISSING
    kl_estimator: str = MISSING
    critic: CriticConfig = MISSING
    card: CardConfig = MISSING

    def __post_init__(self) -> None:
        _choice(self.loss, "algo.loss", ("surrogate", "card"))
        _choice(self.advantage, "algo.advantage", ("grpo", "gae"))
        _choice(self.bounds, "algo.bounds", ("bapo", "fixed"))
        _require(0 < self.ratio_low < 1 < self.ratio_high, "algo.ratio_low/ratio_high", "need 0 < low < 1 < high")
        _require(0 < self.rho0 < (1 if self.variant == "paper" else 100), "algo.rho0", f"out of range: {self.rho0}")
        for k in ("low_range", "high_range"):
            r = getattr(self, k)
            _require(len(r) == 2 and r[0] <= r[1], f"algo.{k}", f"must be [start, end] with start <= end, got {r}")
        _require(0 < self.low_range[0] and self.low_range[1] < 1, "algo.low_range", "must lie inside (0, 1)")
        _require(self.high_range[0] > 1, "algo.high_range", "must lie above 1")
        _require(self.low_step > 0 and self.high_step > 0, "algo.low_step/high_step", "must be > 0")
        _choice(self.contribution, "algo.contribution", ("loss_value", "gradient"))
        _choice(self.weight, "algo.weight", ("behavior_prob", "none"))
        _choice(self.variant, "algo.variant", ("paper", "recipe"))
        _choice(self.scope, "algo.scope", ("mini_batch", "micro_batch"))
        _require(self.dual_clip is None or self.dual_clip > 1, "algo.dual_clip", "must be null or > 1")
        _choice(
            self.agg,
            "algo.agg",
            ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        )
        _require(self.entropy_coef >= 0, "algo.entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        _require(self.kl_coef >= 0, "algo.kl_coef", f"must be >= 0 (0 = no reference model), got {self.kl_coef}")
        _choice(self.kl_estimator, "algo.kl_estimator", ("k1", "k2", "k3"))


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    dtype: str = MISSING
    trust_remote_code: bool = MISSING
    gguf_package: str | None = MISSING
    gguf_file: str | None = MISSING
    answer_fallback: str = MISSING
    max_new_tokens: int = MISSING
    init: str = MISSING  # pretrained | random (model.arch's shape, random weights: nothing to download)
    arch: Any = MISSING  # null or config.json fields (model_type, hidden_size, ...)

    def __post_init__(self) -> None:
        _choice(self.dtype, "model.dtype", ("float32", "bfloat16", "float16"))
        _choice(self.init, "model.init", ("pretrained", "random"))
        _require(
            self.init == "pretrained" or (isinstance(self.arch, dict) and "model_type" in self.arch),
            "model.arch",
            "model.init=random needs model.arch with at least model_type (config.json fields)",
        )
        _require(self.max_new_tokens > 0, "model.max_new_tokens", "must be > 0")
        _require((self.gguf_package is None) == (self.gguf_file is None), "model.gguf_file", "set both or neither")


@dataclass
class ArithConfig:
    min_terms: int = MISSING
    max_terms: int = MISSING
    min_value: int = MISSING
    max_value: int = MISSING
    ops: str = MISSING

    def __post_init__(self) -> None:
        _require(2 <= self.min_terms <= self.max_terms, "data.arith.min_terms", "need 2 <= min_terms <= max_terms")
        _require(self.min_value <= self.max_value, "data.arith.min_value", "need min_value <= max_value")
        _require(bool(self.ops) and set(self.ops) <= set("+-*"), "data.arith.ops", "use characters from '+-*'")


@dataclass
class DataConfig:
    kind: str = MISSING  # arith | jsonl | hub
    arith: ArithConfig = MISSING
    train_seed: int = MISSING
    heldout_seed: int = MISSING
    heldout_frac: float = MISSING
    heldout_size: int = MISSING
    path: str | None = MISSING
    eval_path: str | None = MISSING
    split: str = MISSING
    eval_split: str | None = MISSING
    subset: str | None = MISSING
    problem_key: str = MISSING
    answer_key: str = MISSING
    answer_format: str = MISSING
    instruction: str = MISSING

    def __post_init__(self) -> None:
        _choice(self.kind, "data.kind", ("arith", "jsonl", "hub"))
        _choice(self.answer_format, "data.answer_format", ("plain", "gsm8k"))
        _require(0 < self.heldout_frac < 1, "data.heldout_frac", "must be in (0, 1)")
        _require(self.heldout_size > 0, "data.heldout_size", "must be > 0")
        if self.kind != "arith":
            _require(bool(self.path), "data.path", f"required for data.kind={self.kind} (a file or hub name)")


@dataclass
class RolloutConfig:
    engine: str = MISSING
    n: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    max_new_tokens: int = MISSING
    batch_size: int = MISSING
    gpu_memory_utilization: float = MISSING
    tensor_parallel_size: int = MISSING
    enable_sleep_mode: bool = MISSING  # vLLM: free weights + KV cache during learner updates (GPU, sync mode)
    enforce_eager: bool = MISSING  # vLLM: no torch.compile / CUDA graphs

    def __post_init__(self) -> None:
        _choice(self.engine, "rollout.engine", ("hf", "vllm"))
        _require(self.n >= 1, "rollout.n", f"must be >= 1, got {self.n}")
        _require(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")
        _require(self.batch_size > 0, "rollout.batch_size", "must be > 0")


@dataclass
class RewardConfig:
    num_workers: int = MISSING
    timeout_s: float = MISSING
    fallback: str = MISSING
    format_reward: float = MISSING  # for an extracted but wrong answer
    overlong_buffer: int = MISSING  # DAPO's soft overlong penalty zone, in tokens; 0 = off

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, "reward.num_workers", "must be >= 0")
        _require(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        _choice(self.fallback, "reward.fallback", ("none", "last_number", "final_answer", "last_line"))
        _require(-1 <= self.format_reward < 1, "reward.format_reward", f"must be in [-1, 1), got {self.format_reward}")
        _require(self.overlong_buffer >= 0, "reward.overlong_buffer", f"must be >= 0, got {self.overlong_buffer}")


@dataclass
class BufferConfig:
    max_staleness: int = MISSING
    enforce: str = MISSING  # admission (producer waits) | drop (stale samples are dropped)
    capacity: int = MISSING
    sampling: str = MISSING

    def __post_init__(self) -> None:
        _require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            "buffer.max_staleness",
            f"must be an integer >= 0, got {self.max_staleness!r}",
        )
        _choice(self.enforce, "buffer.enforce", ("admission", "drop"))
        _require(self.capacity > 0, "buffer.capacity", "must be > 0")
        _choice(self.sampling, "buffer.sampling", ("fifo", "uniform"))


@dataclass
class LearnerConfig:
    kind: str = MISSING
    device: str = MISSING
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
    activation_checkpointing: bool = MISSING
    cpu_offload: bool = MISSING
    packing: bool = MISSING  # concatenate sequences (restarting position ids): no padding in the learner
    mixed_precision: str = MISSING  # auto (bf16 params + fp32 reduce on GPU, fp32 on CPU) | bf16 | fp32
    old_logp: str = MISSING  # rollout: the engine's recorded log-probs | recompute: the learner's, same version
    max_consecutive_skips: int = MISSING  # stop after this many non-finite updates in a row

    def __post_init__(self) -> None:
        _choice(self.kind, "learner.kind", ("single", "fsdp"))
        _choice(self.old_logp, "learner.old_logp", ("rollout", "recompute"))
        _choice(self.mixed_precision, "learner.mixed_precision", ("auto", "bf16", "fp32"))
        _require(self.max_consecutive_skips >= 1, "learner.max_consecutive_skips", "must be >= 1")
        _require(self.lr > 0, "learner.lr", f"must be > 0, got {self.lr}")
        _require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "learner.betas",
            "two values in [0, 1)",
        )
        _require(self.grad_clip > 0, "learner.grad_clip", "must be > 0")
        _require(self.ppo_epochs >= 1, "learner.ppo_epochs", "must be >= 1")
        _require(self.mini_batches_per_rollout >= 1, "learner.mini_batches_per_rollout", "must be >= 1")
        _require(self.micro_batch_size >= 1, "learner.micro_batch_size", "must be >= 1")
        _require(
            self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
            "learner.max_tokens_per_micro_batch",
            "must be null or >= 1",
        )


@dataclass
class LoggerConfig:
    wandb: bool = MISSING
    project: str = MISSING
    mode: str = MISSING
    group: str | None = MISSING
    tags: list[str] = MISSING
    progress: bool = MISSING

    def __post_init__(self) -> None:
        _choice(self.mode, "logger.mode", ("offline", "online", "disabled"))


@dataclass
class EvalConfig:
    every: int = MISSING
    n: int = MISSING
    temperature: float = MISSING
    greedy: bool = MISSING
    sets: list[str] = MISSING  # eval.py's sets, by name (conf/evaluation/eval/<name>.yaml)
    sets_k: int = MISSING
    sets_limit: int | None = MISSING
    data_dir: str = MISSING

    def __post_init__(self) -> None:
        _require(self.every >= 0, "eval.every", "must be >= 0 (0 = only at start and end)")
        _require(self.n >= 1, "eval.n", "must be >= 1")
        _require(self.temperature >= 0, "eval.temperature", "must be >= 0 (0 = greedy)")
        known = sorted(p.stem for p in EVAL_SETS_DIR.glob("*.yaml"))
        for name in self.sets:
            _require(name in known, "eval.sets", f"unknown set {name!r}; choose from {known}")
        _require(self.sets_k >= 1, "eval.sets_k", f"must be >= 1, got {self.sets_k}")
        _require(
            self.temperature > 0 or self.sets_k == 1 or not self.sets,
            "eval.sets_k",
            "greedy decoding (eval.temperature=0) gives sets_k equal samples; use eval.sets_k=1",
        )
        _require(self.sets_limit is None or self.sets_limit >= 1, "eval.sets_limit", "must be null or >= 1")


@dataclass
class TrainConfig:
    steps: int = MISSING
    prompts_per_step: int = MISSING
    sync_every: int = MISSING
    async_rollout: bool = MISSING  # generate on a background thread, ahead of the learner (bapo/offpolicy.py)

    def __post_init__(self) -> None:
        _require(self.steps >= 0, "train.steps", "must be >= 0")
        _require(self.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
        _require(self.sync_every >= 1, "train.sync_every", "must be >= 1")


@dataclass
class MonitorConfig:
    """Training-health warnings (bapo/monitor.py)."""

    entropy_frac: float = MISSING
    entropy_window: int = MISSING
    clip_threshold: float = MISSING
    clip_patience: int = MISSING

    def __post_init__(self) -> None:
        _require(0 < self.entropy_frac < 1, "monitor.entropy_frac", f"must be in (0, 1), got {self.entropy_frac}")
        _require(self.entropy_window >= 1, "monitor.entropy_window", "must be >= 1")
        _require(0 <= self.clip_threshold < 1, "monitor.clip_threshold", "must be in [0, 1)")
        _require(self.clip_patience >= 1, "monitor.clip_patience", "must be >= 1")


@dataclass
class CheckpointConfig:
    every: int = MISSING  # steps; 0 = only on SIGTERM / Ctrl-C and at the end
    keep: int = MISSING  # newest checkpoints kept

    def __post_init__(self) -> None:
        _require(self.every >= 0, "checkpoint.every", "must be >= 0")
        _require(self.keep >= 1, "checkpoint.keep", "must be >= 1")


SCHEMAS: dict[str, type] = {
    "algo": AlgoConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "buffer": BufferConfig,
    "learner": LearnerConfig,
    "logger": LoggerConfig,
    "eval": EvalConfig,
    "train": TrainConfig,
    "monitor": MonitorConfig,
    "checkpoint": CheckpointConfig,
}


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
    algo: AlgoConfig
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    reward: RewardConfig
    buffer: BufferConfig
    learner: LearnerConfig
    logger: LoggerConfig
    eval: EvalConfig
    train: TrainConfig
    monitor: MonitorConfig
    checkpoint: CheckpointConfig
    sizes: Sizes
    resume: str | None = None  # null | auto | a run folder or checkpoint folder


def _typed(group: str, node: Any, schema: type) -> Any:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = f"{group}.{e.full_key}" if getattr(e, "full_key", None) else group
        msg = str(e).split("\n")[0]
        raise ConfigError(f"{key}: {msg}") from None


def derive_sizes(train: TrainConfig, rollout: RolloutConfig, learner: LearnerConfig, buffer: BufferConfig) -> Sizes:
    """All batch arithmetic, once, with errors that name the keys involved."""
    samples = train.prompts_per_step * rollout.n
    mb = learner.mini_batches_per_rollout
    _require(
        train.prompts_per_step % mb == 0,
        "learner.mini_batches_per_rollout",
        f"train.prompts_per_step={train.prompts_per_step} must split into {mb} mini-batches of whole prompt groups",
    )
    updates = learner.ppo_epochs * mb
    reuse = updates - 1
    need = reuse + train.sync_every - 1  # = bapo.offpolicy.min_staleness
    _require(
        need <= buffer.max_staleness,
        "buffer.max_staleness",
        f"learner.ppo_epochs={learner.ppo_epochs} x learner.mini_batches_per_rollout={mb} means up to {reuse} "
        f"updates on one rollout batch, and train.sync_every={train.sync_every} lets the engine lag "
        f"{train.sync_every - 1} more, so buffer.max_staleness must be >= {need} (got {buffer.max_staleness})",
    )
    return Sizes(samples, samples // mb, updates, reuse)


def build(cfg: DictConfig, run_dir: str | Path) -> RunConfig:
    """Validate the composed config and return typed stage configs."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.full_key or 'config'}: {str(e).splitlines()[0]}") from None
    known = set(SCHEMAS) | {"seed", "paths", "resume"}
    extra = sorted(set(plain) - known)
    _require(not extra, extra[0] if extra else "", f"unknown top-level key(s) {extra}")
    typed = {g: _typed(g, plain[g], s) for g, s in SCHEMAS.items()}
    buf, max_new = typed["reward"].overlong_buffer, typed["rollout"].max_new_tokens
    _require(buf < max_new, "reward.overlong_buffer", f"must be < rollout.max_new_tokens ({max_new}), got {buf}")
    sizes = derive_sizes(typed["train"], typed["rollout"], typed["learner"], typed["buffer"])
    resume = plain.get("resume")
    _require(resume is None or isinstance(resume, str), "resume", f"must be null, auto or a path, got {resume!r}")
    return RunConfig(seed=int(plain["seed"]), run_dir=Path(run_dir), sizes=sizes, resume=resume, **typed)


def resolve_path(p: str) -> str:
    """A relative path that exists from the working directory, else from the repo root, else unchanged."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return str(path)
    if (ROOT / path).exists():
        return str(ROOT / path)
    return p


def as_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)
