"""eval.py's job: its typed config (the run keys, the sets of conf/eval/), checked with errors that name the
key, each set's problems loaded, and the longest prompt it evaluates.

:func:`build_job` validates the composed config into an :class:`EvalJob`; :func:`named_set` composes one set
outside eval.py's config (the training loop's ``eval.sets``); :func:`load_evalset` reads a set's problems (a JSONL
file, a hub set, or the synthetic arithmetic set); :func:`eval_prompt_limit` is training's prompt limit in
eval.py's keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bapo.config import (
    DATA,
    ENGINE_CONFIGS,
    ArithConfig,
    ConfigError,
    EvalConfig,
    ModelConfig,
    RewardConfig,
    prompt_limit,
)
from bapo.data.config import ANSWER_FORMATS, check_arith
from bapo.data.hub import load_hub
from bapo.data.loading import DataFileError, load_jsonl, row_fields
from bapo.data.tasks import ArithSpec, arith_heldout
from bapo.infra.checks import choice, require, to_plain, typed, variant
from bapo.infra.paths import EVAL_DIR, HELDOUT, eval_sets
from bapo.reward import REWARD_CONFIGS
from bapo.samples import Problem


@dataclass
class ArithSetConfig(ArithConfig):
    """The synthetic held-out set: the spec of conf/data/arith.yaml, its seed, split fraction and size."""

    seed: int = MISSING
    heldout_frac: float = MISSING
    size: int = MISSING

    def __post_init__(self) -> None:
        pass  # checked by its set, which knows its key (eval.<name>.arith)


@dataclass
class EvalSetConfig:
    """One evaluation set (conf/eval/<name>.yaml); ``name`` is filled in from its key."""

    name: str = MISSING
    kind: str = MISSING  # jsonl | hub | arith
    path: str | None = MISSING  # the JSONL file; for kind=hub, a hub name, local folder or data file
    split: str = MISSING  # hub only
    subset: str | None = MISSING  # hub only
    problem_key: str = MISSING  # the row mapping: bapo.data.rows.RowFields (dotted keys, chat prompts)
    answer_key: str = MISSING
    answer_format: str = MISSING  # plain | gsm8k ("... #### 72") | json_list
    strip_instructions: list[str] = MISSING  # the set's own instruction, cut from each problem
    arith: ArithSetConfig | None = MISSING

    def __post_init__(self) -> None:
        key = f"eval.{self.name}"
        choice(self.kind, f"{key}.kind", tuple(DATA))
        choice(self.answer_format, f"{key}.answer_format", ANSWER_FORMATS)
        if self.kind == "arith":
            a = self.arith
            require(a is not None, f"{key}.arith", "required for kind=arith")
            check_arith(a, f"{key}.arith")
            require(0 < a.heldout_frac < 1, f"{key}.arith.heldout_frac", "must be in (0, 1)")
            require(a.size >= 1, f"{key}.arith.size", f"must be >= 1, got {a.size}")
        else:
            require(bool(self.path), f"{key}.path", f"required for kind={self.kind} (a file or hub name)")


@dataclass
class EvalRunConfig:
    """The top-level keys of conf/eval_config.yaml, and ``eval.limit``."""

    seed: int = MISSING
    checkpoint: str | None = MISSING
    k: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    max_new_tokens: int = MISSING
    max_prompt_tokens: int | None = MISSING  # null: only the model's context limits a prompt
    limit: int | None = MISSING
    device: str = MISSING
    instruction: str = MISSING
    maj_max_distinct: int = MISSING

    def __post_init__(self) -> None:
        require(self.k >= 1, "k", f"must be >= 1, got {self.k}")
        require(self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        require(self.temperature > 0 or self.k == 1, "k", "greedy decoding (temperature=0) gives k equal samples")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.max_new_tokens > 0, "max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        require(
            self.max_prompt_tokens is None or self.max_prompt_tokens > 0,
            "max_prompt_tokens",
            f"must be null or > 0, got {self.max_prompt_tokens}",
        )
        require(self.limit is None or self.limit >= 1, "eval.limit", f"must be null or >= 1, got {self.limit}")
        require(self.maj_max_distinct >= 1, "maj_max_distinct", f"must be >= 1, got {self.maj_max_distinct}")
        check_device(self.device)


def check_device(device: str) -> None:
    """``device``: auto, cpu, cuda or cuda:N, and a CUDA device only where this torch sees one."""
    try:
        dev = torch.device("cpu" if device == "auto" else device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device: {device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    choice(dev.type, "device", ("cpu", "cuda"))
    if dev.type == "cuda":
        require(
            torch.cuda.is_available(), "device", f"{device!r} but this torch build sees no CUDA device (device=auto)"
        )
        count = torch.cuda.device_count()
        require(dev.index is None or dev.index < count, "device", f"{device!r} but only {count} CUDA device(s)")


@dataclass(frozen=True)
class EvalJob:
    """The validated eval config: run settings, model, reward, engine and the sets to run."""

    run: EvalRunConfig
    model: ModelConfig
    reward: RewardConfig
    engine: str
    rollout: Any  # the engine's typed rollout config (its schema in bapo.engines.registry), what build_rollout takes
    sets: dict[str, EvalSetConfig]


def _not_a_set(chosen: Mapping[str, Any]) -> None:
    """Refuse training's held-out config (conf/eval/heldout.yaml), which eval=heldout composes, naming what it is."""
    sets = eval_sets()
    if set(chosen) & set(EvalConfig.__dataclass_fields__) and any(not isinstance(v, dict) for v in chosen.values()):
        raise ConfigError(
            f"eval: {HELDOUT} is training's held-out config (conf/eval/{HELDOUT}.yaml: eval.every, eval.n, ... of "
            f"train.py), not an eval set; choose eval=<set> or eval=[<set>,...] from {sets}"
        )
    for name, node in chosen.items():
        require(
            isinstance(node, dict) and "kind" in node,
            f"eval.{name}",
            f"not an eval set (conf/eval/); choose from {sets}",
        )


def build_job(cfg: DictConfig) -> EvalJob:
    """Validate the composed eval config; errors name the key."""
    plain = to_plain(cfg)
    chosen = dict(plain["eval"])
    limit = chosen.pop("limit")
    run = typed(
        "", {f: plain[f] for f in EvalRunConfig.__dataclass_fields__ if f != "limit"} | {"limit": limit}, EvalRunConfig
    )
    require(bool(chosen), "eval", "choose at least one set, e.g. eval=[aime24,math500]")
    _not_a_set(chosen)
    rollout = plain["rollout"]
    choice(rollout["engine"], "rollout.engine", tuple(ENGINE_CONFIGS))
    # The engine's knobs through training's schema. Its sampling keys are eval's own (k, temperature,
    # max_new_tokens: checked above, where greedy is allowed), so they go in after the schema's check.
    engine = typed("rollout", rollout | {"temperature": 1.0}, ENGINE_CONFIGS[rollout["engine"]])
    engine.temperature = rollout["temperature"]
    sets = {name: typed(f"eval.{name}", node | {"name": name}, EvalSetConfig) for name, node in chosen.items()}
    return EvalJob(
        run=run,
        model=typed("model", plain["model"], ModelConfig),
        reward=variant("reward", plain["reward"], "kind", REWARD_CONFIGS),
        engine=rollout["engine"],
        rollout=engine,
        sets=sets,
    )


def named_set(name: str) -> EvalSetConfig:
    """conf/eval/<name>.yaml as eval.py composes it: how the training loop runs eval.py's sets (``eval.sets``)
    outside eval.py's config."""
    node = OmegaConf.create({"eval": {name: OmegaConf.load(EVAL_DIR / f"{name}.yaml")}})
    try:
        plain = OmegaConf.to_container(node, resolve=True)["eval"][name]
    except OmegaConfBaseException as e:
        raise ConfigError(f"eval.{name}: {str(e).splitlines()[0]}") from None
    return typed(f"eval.{name}", plain | {"name": name}, EvalSetConfig)


def load_evalset(s: EvalSetConfig, *, limit: int | None = None) -> list[Problem]:
    """The problems of one set, in file order (the first ``limit`` if given). A file or hub set that cannot be read
    is one ConfigError naming the set's key (``eval.<name>.path``), the path tried, or the hub set and the ways to
    give it locally (``bapo.data.hub``)."""
    key = f"eval.{s.name}.path"
    try:
        if s.kind == "arith":
            a = s.arith
            spec = ArithSpec(a.min_terms, a.max_terms, a.min_value, a.max_value, a.ops)
            rows = arith_heldout(a.size, seed=a.seed, heldout_frac=a.heldout_frac, spec=spec)
        elif s.kind == "jsonl":
            rows = load_jsonl(s.path, fields=row_fields(s), key=key)
        else:
            rows = load_hub(s.path, split=s.split, subset=s.subset, fields=row_fields(s), key=key)
    except DataFileError as e:
        raise ConfigError(str(e)) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {s.path}: {e}") from None
    return rows[:limit] if limit else rows


def model_context(path: str, *, trust_remote_code: bool) -> int | None:
    """The model's context (``max_position_embeddings`` of its config), None if its config has none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return getattr(config, "max_position_embeddings", None)


def eval_prompt_limit(max_prompt_tokens: int | None, max_new_tokens: int, context: int | None) -> int | None:
    """The longest prompt evaluated: training's limit (``bapo.config.prompt_limit``) with eval.py's keys;
    ``max_prompt_tokens=None`` leaves only the context's (None: no limit at all)."""
    if context is not None:
        require(
            max_new_tokens < context,
            "max_new_tokens",
            f"{max_new_tokens} leaves no room for a prompt in the model's context of {context} tokens",
        )
    if max_prompt_tokens is None:
        return None if context is None else context - max_new_tokens
    return prompt_limit(max_prompt_tokens, max_new_tokens, context)
