"""The run's typed config: every group's schema merged and checked, the batch arithmetic, the cross-checks.

Each group's schema lives beside its owner (``bapo/algos/config.py``; each engine's module in
``bapo/engines/``, with the keys every engine has in ``bapo/engines/config.py``; ``bapo/learner/config.py``,
``bapo/reward/config.py``, ``bapo/data/config.py``, and the small ones in ``buffer``, ``tracking``,
``monitor``, ``checkpoint``); the defaults live in ``conf/``; the error helpers in
``bapo/infra/checks.py``. A group with variants has one schema per variant, picked by its selector key, and
each variant holds only the keys it reads. :func:`build` merges each group into its schema, so a
missing, unknown, mistyped or out-of-range key fails at startup naming it (``rollout.temperature: must be
> 0, got -1.0``); :func:`derive_sizes` computes the batch arithmetic once, :func:`check_combinations`
refuses what no stage supports, and :func:`resumable_keys` lists what a resume may change.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING, DictConfig

from bapo.algos.config import AlgoConfig, algo_config
from bapo.checkpoint import CheckpointConfig
from bapo.data.config import DATA, ArithConfig, ArithDataConfig, FileDataConfig, HubDataConfig
from bapo.engines.config import RolloutCommon
from bapo.engines.registry import ENGINE_CONFIGS, engine_traits
from bapo.experience.behaviour import BehaviourPolicy
from bapo.experience.buffer import BufferConfig
from bapo.infra.checks import (
    ConfigError,
    check_finite,
    did_you_mean,
    require,
    resumable,
    resumable_fields,
    to_plain,
    typed,
    variant,
)
from bapo.infra.dist import LauncherConfig
from bapo.infra.paths import HELDOUT, ROOT, eval_sets, exported_max_new_tokens, resolve_path
from bapo.infra.tracking import LoggerConfig
from bapo.learner.config import LEARNER, FSDPLearnerConfig, LearnerCommon, SingleLearnerConfig
from bapo.modeling import ModelConfig
from bapo.monitor import MonitorConfig
from bapo.reward.config import RewardConfig
from bapo.reward.registry import REWARD_CONFIGS
from bapo.rollout.placement import PLACEMENT_CONFIGS, PlacementConfig, placement_class
from bapo.rollout.schedule import partial_lag

# Re-exported: the names the stages, scripts and tests import from this module.
__all__ = ["ROOT", "ArithConfig", "ConfigError", "FSDPLearnerConfig", "ModelConfig", "RunConfig", "SingleLearnerConfig"]
__all__ += ["build", "check_combinations", "derive_sizes", "did_you_mean", "prompt_limit", "resolve_path"]
__all__ += ["ENGINE_CONFIGS", "engine_traits"]  # each engine's schema and traits, by rollout.engine (bapo.engines)


# ----------------------------------------------------------------------------- run-level groups


@dataclass
class EvalConfig:
    every: int = resumable()
    n: int = resumable()
    temperature: float = resumable()
    greedy: bool = resumable()
    sets: list[str] = resumable()  # eval.py's sets, by name (conf/eval/<name>.yaml)
    sets_k: int = resumable()
    sets_limit: int | None = resumable()

    def __post_init__(self) -> None:
        require(self.every >= 0, "eval.every", "must be >= 0 (0 = only at start and end)")
        require(self.n >= 1, "eval.n", "must be >= 1")
        require(self.temperature >= 0, "eval.temperature", "must be >= 0 (0 = greedy)")
        known = eval_sets()
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
    steps: int = resumable()
    prompts_per_step: int = MISSING
    sync_every: int = MISSING
    async_rollout: bool = MISSING  # generate on a background thread, ahead of the learner (bapo/rollout/producer.py)

    def __post_init__(self) -> None:
        require(self.steps >= 0, "train.steps", "must be >= 0")
        require(self.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
        require(self.sync_every >= 1, "train.sync_every", "must be >= 1")


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
    rollout: RolloutCommon  # the schema of the engine rollout.engine names (bapo.engines.registry)
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
    behaviour: BehaviourPolicy  # pi_old: the engine's log-probs or the learner's recompute (bapo.experience.behaviour)
    resume: str | None = None  # null | auto | a run folder or checkpoint folder
    overwrite: bool = False  # a fresh start may replace another run's files in run_dir
    launcher: LauncherConfig | None = None  # how the run was launched (bapo/entry/launch.py)

    @property
    def mode(self) -> str:
        """The off-policy schedule (bapo/rollout/producer.py): sync, or the async enforcement."""
        return self.buffer.enforce if self.train.async_rollout else "sync"


PLAIN: dict[str, type] = {
    "model": ModelConfig,
    "buffer": BufferConfig,
    "logger": LoggerConfig,
    "eval": EvalConfig,
    "train": TrainConfig,
    "monitor": MonitorConfig,
    "checkpoint": CheckpointConfig,
    "launcher": LauncherConfig,  # how a plain `python train.py` starts its ranks (bapo/entry/launch.py)
}
VARIANTS: dict[str, tuple[str, Mapping[str, type]]] = {
    "data": ("kind", DATA),
    "reward": ("kind", REWARD_CONFIGS),  # what grades (bapo.reward.registry)
    "rollout": ("engine", ENGINE_CONFIGS),
    "learner": ("kind", LEARNER),
    "placement": ("mode", PLACEMENT_CONFIGS),  # where rollout runs (bapo.rollout.placement)
}
UNSET_SELECTOR = {
    "placement": "colocated"
}  # a placement YAML that names no mode keeps rollout in the learner's process
TOP_LEVEL = set(PLAIN) | set(VARIANTS) | {"algo", "seed", "paths", "resume", "overwrite"}


def resumable_keys() -> tuple[str, ...]:
    """The keys of the stage groups that a resume may change, from the schemas' ``resumable`` marks: ``group.*``
    when every field of every variant of the group is marked."""
    out: list[str] = []
    for group, schemas in [(g, [s]) for g, s in PLAIN.items()] + [(g, [*v.values()]) for g, (_, v) in VARIANTS.items()]:
        fields = {f.name for s in schemas for f in dataclasses.fields(s)}
        marked = set().union(*(resumable_fields(s) for s in schemas))
        out += [f"{group}.*"] if marked == fields else [f"{group}.{k}" for k in sorted(marked)]
    return tuple(out)


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
    # a token may wait `lag` more batches for its response's last segment (partial rollouts: bapo.rollout.schedule)
    b, L = rollout.partial_budget, rollout.max_new_tokens
    lag = partial_lag(L, b)
    need = reuse + train.sync_every - 1 + lag * updates  # = bapo.rollout.schedule.min_staleness, plus that lag
    segments = (
        f"rollout.partial_budget={b} of rollout.max_new_tokens={L} gives a response up to {lag + 1} segments, one "
        f"per step, so its first tokens wait {lag} steps x {updates} updates more; "
        if lag
        else ""
    )
    require(
        need <= buffer.max_staleness,
        "buffer.max_staleness",
        f"{segments}learner.ppo_epochs={learner.ppo_epochs} x learner.mini_batches_per_rollout={mb} means up to "
        f"{reuse} updates on one rollout batch, and train.sync_every={train.sync_every} lets the engine lag "
        f"{train.sync_every - 1} more, so buffer.max_staleness must be >= {need} (got {buffer.max_staleness})",
    )
    return Sizes(samples, samples // mb, updates, reuse)


def check_combinations(rc: RunConfig, world: int | None = None) -> None:
    """Combinations of keys that no stage supports, refused at startup with every key involved named.

    ``world``: the number of torchrun ranks (default: ``$WORLD_SIZE``, 1 without torchrun). Whether the run fits
    the GPUs it is given is the memory plan's to say (``bapo.plan.verdict.check_one_gpu``, the launch), not the
    config's."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    fsdp = rc.learner.kind == "fsdp"
    sleeps = engine_traits(rc.rollout.engine).can_sleep and getattr(rc.rollout, "enable_sleep_mode", False)
    require(
        not (rc.train.async_rollout and sleeps),
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
        corr not in ("tis", "mis", "geo_reject") or rc.behaviour.recompute,
        "algo.correction",
        f"{corr} weighs the engine's log-probs against the learner's at the generating version: it needs "
        f"learner.old_logp=recompute (got {rc.learner.old_logp})",
    )
    placement_class(rc.placement.mode).check(rc, world)
    partial = rc.behaviour.per_token  # its pool of unfinished responses lives in one process
    require(not partial or world == 1, "rollout.partial_budget", f"one process only; torchrun started {world} ranks")
    require(
        not (partial and rc.algo.filter_groups),
        "algo.filter_groups",
        "its refills draw extra rounds of a step from the rollout maker, and rollout.partial_budget gives each "
        "unfinished response one segment per round: use one or the other",
    )
    require(
        rc.reward.overlong_buffer < rc.rollout.max_new_tokens,
        "reward.overlong_buffer",
        f"must be < rollout.max_new_tokens ({rc.rollout.max_new_tokens}), got {rc.reward.overlong_buffer}",
    )


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
    require(type(seed) is int and 0 <= seed < 2**32, "seed", f"must be an integer in [0, 2**32), got {seed!r}")
    resume = plain.get("resume")
    require(resume is None or isinstance(resume, str), "resume", f"must be null, auto or a path, got {resume!r}")
    overwrite = plain.get("overwrite", False)
    require(isinstance(overwrite, bool), "overwrite", f"must be true or false, got {overwrite!r}")
    sets = sorted(set(plain.get("eval") or {}) & set(eval_sets()))
    require(
        not sets,
        "eval",
        f"{sets[0] if sets else ''} is an eval.py set; training keeps eval={HELDOUT} and runs sets at its held-out "
        f"checks with eval.sets=[{','.join(sets)}]",
    )
    groups = {g: typed(g, plain.get(g), s) for g, s in PLAIN.items()}
    groups["algo"] = algo_config(plain.get("algo"))
    groups |= {
        g: variant(g, plain.get(g), selector, schemas, default=UNSET_SELECTOR.get(g))
        for g, (selector, schemas) in VARIANTS.items()
    }
    sizes = derive_sizes(groups["train"], groups["rollout"], groups["learner"], groups["buffer"])
    data_dir = str((plain.get("paths") or {}).get("data_dir", ""))
    behaviour = BehaviourPolicy.of(groups["learner"], groups["rollout"])
    rc = RunConfig(
        seed=seed, run_dir=Path(run_dir), data_dir=data_dir, sizes=sizes, behaviour=behaviour, resume=resume,
        overwrite=overwrite, **groups,
    )  # fmt: skip
    check_combinations(rc)
    return rc
