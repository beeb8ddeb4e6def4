"""Evaluation with the training engines: the rollout engine samples and the reward
stage grades, with the same code that produces training rewards.

* :func:`evaluate`: the training loop's held-out check (avg@n, pass@n, length).
* :func:`prepare_set` renders a set's prompts once and skips, and counts, those over the
  prompt limit, exactly as training treats its held-out set (``bapo.data.loading.render_prompts``;
  the limit is ``bapo.config.prompt_limit``'s: the model's context minus the response budget,
  and ``max_prompt_tokens``). :func:`evaluate_set` then takes k samples per prompt; avg@k,
  pass@k for the powers of two up to k, maj@k, mean length, truncation and no-answer rates,
  and every sample and problem for the reports. :func:`evaluate_sets` flattens the metrics
  of several sets to ``eval/<set>/<metric>`` (with ``eval/<set>/skipped``) for a logger.
* The eval entry (``eval.py``) also uses the typed config (:func:`build_job`), the
  adoption of a training run's settings (:func:`adopt_run`), the set loader
  (:func:`load_evalset`) and the report writers here.

Data-parallel. Under torchrun every rank (every tensor-parallel group of a vLLM engine split over
``t`` ranks) samples its share of the problems, ``prompts[g::G]``, with its own seed
(:func:`share_seed`), grades only that share (one rank per tensor-parallel group), and the
graded records are gathered back into problem order on every rank, so the metrics are the
same on every rank and rank 0 writes them. Each sample's row records the seed of its
generate call and its request index in that call, which is all the engines sample from: a
rerun with the same seed, world size and engine reproduces every sample, and so avg@k, exactly.

maj@k groups answers written differently (``\\frac{1}{2}`` and ``0.5``): answers
are normalised first, then the most frequent distinct ones of each problem are compared
in pairs with the verifier's equivalence, run in its worker pool like any grade
(see bapo/eval/passk.py for the cap and the tie-break).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from bapo.config import (
    DATA,
    ENGINE_CONFIGS,
    ArithConfig,
    ConfigError,
    EvalConfig,
    ModelConfig,
    RewardConfig,
    engine_traits,
    prompt_limit,
    resolve_path,
)
from bapo.data.config import ANSWER_FORMATS, check_arith
from bapo.data.hub import load_hub
from bapo.data.loading import DataFileError, LoadReport, load_jsonl, render_prompts, row_fields
from bapo.data.tasks import ArithSpec, arith_heldout
from bapo.eval import passk as M
from bapo.infra import dist, stop
from bapo.infra.artifacts import ArtifactError, load_config
from bapo.infra.checks import choice, require, to_plain, typed, variant
from bapo.infra.paths import EVAL_DIR, EXPORT_CONFIG, HELDOUT, compose_option, eval_sets
from bapo.infra.seeding import derive_seed
from bapo.reward import REWARD_CONFIGS, normalize_answer
from bapo.samples import Problem, Prompt, Sample

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- data-parallel shares


def _tp(rollout) -> int:
    return int(getattr(rollout, "tensor_parallel_size", 1)) if dist.active() else 1


def shares_of(rollout) -> tuple[int, int]:
    """(this rank's share, number of shares) of the problems: one share per engine (tensor-parallel group)."""
    if not dist.active():
        return 0, 1
    tp = _tp(rollout)
    return dist.rank() // tp, dist.world_size() // tp


def share_seed(seed: int | None, share: int, shares: int) -> int | None:
    """The seed of share ``share``'s generate call: ``seed`` itself in one process."""
    return seed if seed is None or shares == 1 else derive_seed(seed, "eval/share", share)


def generate_local(
    rollout, prompts: Sequence[Prompt], *, n: int, temperature: float, seed: int | None
) -> tuple[list[Sample], int | None]:
    """This share's samples, ``n`` per prompt of ``prompts[share::shares]``, grouped by prompt, and its call seed.

    A stop request gives the generation up (:class:`bapo.infra.stop.Interrupted`), on every rank together under
    torchrun (an agreement follows the generation)."""
    share, shares = shares_of(rollout)
    mine = list(prompts[share::shares])
    call_seed = share_seed(seed, share, shares)
    try:
        local = rollout.generate(mine, n=n, temperature=temperature, seed=call_seed) if mine else []
    except stop.Interrupted:
        local = None
    stop.check_agreed(local is None)
    if len(local) != len(mine) * n:
        raise RuntimeError(f"the rollout engine returned {len(local)} samples for {len(mine)} prompts x n={n}")
    return local, call_seed


def grades_here(rollout) -> bool:
    """Whether this rank grades its share: the first rank of each tensor-parallel group (its others hold the same)."""
    return dist.rank() % _tp(rollout) == 0


def gather_prompts(local: list | None, rollout, n_prompts: int) -> list:
    """Per-prompt records of every share, back in prompt order, on every rank.

    ``local`` holds one record per prompt of this rank's share (``prompts[share::shares]``), or is None
    on a rank that does not grade (:func:`grades_here`). Prompt ``i`` is record ``i // shares`` of share
    ``i % shares``. A collective under torchrun: one small pickle per rank, once per set."""
    if not dist.active():
        return list(local)
    tp, (_, shares) = _tp(rollout), shares_of(rollout)
    parts = dist.all_gather_object(local if grades_here(rollout) else None)
    out: list = [None] * n_prompts
    for g in range(shares):
        for j, record in enumerate(parts[g * tp]):
            out[g + shares * j] = record
    return out


def _by_prompt(items: Sequence, n: int) -> list[list]:
    return [list(items[i : i + n]) for i in range(0, len(items), n)]


def generate_shared(
    rollout, prompts: Sequence[Prompt], *, n: int, temperature: float, seed: int | None
) -> tuple[list[Sample], list[dict]]:
    """``n`` samples per prompt, grouped by prompt, generated data-parallel over the ranks (module docstring).

    Returns the samples (the same on every rank) and, per sample, where its randomness came from:
    ``{"share", "seed", "request"}`` (the share's call seed, the index of the request in that call).
    A collective under torchrun: every rank calls it with the same prompts."""
    local, call_seed = generate_local(rollout, prompts, n=n, temperature=temperature, seed=seed)
    share, _ = shares_of(rollout)
    if not dist.active():
        return local, [{"share": 0, "seed": call_seed, "request": j} for j in range(len(local))]
    rows = [(torch.as_tensor(s.response_ids).tolist(), s.text, s.truncated, s.version) for s in local]
    records = [
        {"share": share, "seed": call_seed, "first": j * n, "rows": r} for j, r in enumerate(_by_prompt(rows, n))
    ]
    samples, origin = [], []
    for i, rec in enumerate(gather_prompts(records, rollout, len(prompts))):
        for j, (ids, text, truncated, version) in enumerate(rec["rows"]):
            logp = torch.full((len(ids),), math.nan)
            samples.append(Sample(prompts[i], i, torch.tensor(ids, dtype=torch.long), logp, text, version, truncated))
            origin.append({"share": rec["share"], "seed": rec["seed"], "request": rec["first"] + j})
    return samples, origin


def evaluate(
    rollout, verifier, prompts: Sequence[Prompt], *, n: int, temperature: float, prefix: str, seed: int | None = None
) -> dict:
    """avg@n accuracy (mean per-sample correctness), pass@n, mean length and truncation rate.

    Data-parallel under torchrun: every rank calls it, grades its own share and gets the same metrics."""
    local, _ = generate_local(rollout, prompts, n=n, temperature=temperature, seed=seed)
    records = None
    if grades_here(rollout):
        grades = verifier.grade([s.text for s in local], [s.prompt.problem.answer for s in local])[0] if local else []
        rows = [(g.correct, len(s.response_ids), s.truncated) for s, g in zip(local, grades, strict=True)]
        records = _by_prompt(rows, n)
    per_prompt = gather_prompts(records, rollout, len(prompts))
    flat = [row for rec in per_prompt for row in rec]
    return {
        f"{prefix}accuracy": sum(c for c, _, _ in flat) / len(flat),
        f"{prefix}pass@{n}": sum(any(c for c, _, _ in rec) for rec in per_prompt) / len(per_prompt),
        f"{prefix}response_len": sum(length for _, length, _ in flat) / len(flat),
        f"{prefix}truncated": sum(t for _, _, t in flat) / len(flat),
    }


# ----------------------------------------------------------------------------- one set


@dataclass(frozen=True)
class EvalSet:
    """One set's prompts, rendered and length-checked once, and how many of its problems were skipped
    because their prompt was over the limit."""

    prompts: list[Prompt]
    skipped: int = 0


def prepare_set(
    name: str,
    problems: Sequence[Problem],
    tokenizer,
    *,
    instruction: str,
    max_prompt_tokens: int | None,
    limit_keys: str = "",
) -> EvalSet:
    """Render a set through the chat template, skipping (logged, counted) prompts over ``max_prompt_tokens``,
    as training renders its held-out set. A set with nothing under the limit is a ConfigError naming the set
    and ``limit_keys`` (the keys that set the limit): evaluating on nothing would look like a result."""
    report = LoadReport()
    try:
        prompts = render_prompts(
            problems, tokenizer, instruction=instruction, max_prompt_tokens=max_prompt_tokens, report=report
        )
    except DataFileError:  # nothing under the limit: said in this set's own keys, not training's
        why = f" ({limit_keys})" if limit_keys else ""
        raise ConfigError(
            f"eval.{name}: all {len(problems)} prompts are longer than {max_prompt_tokens} tokens{why}"
        ) from None
    if report.too_long:
        log.warning(
            "eval.%s: %d of %d prompts are longer than %s tokens and are skipped", name, report.too_long,
            len(problems), max_prompt_tokens,
        )  # fmt: skip
    return EvalSet(prompts, report.too_long)


@dataclass
class SetResult:
    """One set's metrics, one row per problem evaluated, one row per sample, and the problems skipped as too long."""

    metrics: dict[str, float]
    problems: list[dict]
    samples: list[dict]
    skipped: int = 0


def _majorities(verifier, answers: Sequence[Sequence[str | None]], extracted: Sequence[Sequence[str | None]],
                max_distinct: int) -> list[int | None]:  # fmt: skip
    """The first sample of each problem's majority answer (:func:`metrics.majority`), answers grouped by the
    verifier's equivalence.

    Every pair :func:`metrics.vote` may ask about is judged in one batch through the verifier: the later
    answer as written (its problem's first extracted string that normalises to it) boxed as the response,
    the earlier one as the gold, so they get the pool's timeouts; a pair written alike is judged once."""
    written = []  # per problem: normalised answer -> the first extracted string written that way
    pairs: set[tuple[str, str]] = set()
    for ans, ext in zip(answers, extracted, strict=True):
        raw: dict[str, str] = {}
        for a, e in zip(ans, ext, strict=True):
            if a is not None:
                raw.setdefault(a, e)
        written.append(raw)
        pairs |= {(raw[a], raw[b]) for a, b in M.vote_pairs(ans, max_distinct=max_distinct)}
    order = sorted(pairs)
    verdict: dict[tuple[str, str], bool] = {}
    if order:
        grades, _ = verifier.grade([f"\\boxed{{{b}}}" for _, b in order], [a for a, _ in order])
        verdict = {pair: g.correct for pair, g in zip(order, grades, strict=True)}
    return [
        M.majority(ans, lambda a, b, raw=raw: verdict[(raw[a], raw[b])], max_distinct=max_distinct)
        for ans, raw in zip(answers, written, strict=True)
    ]


def _grade_share(verifier, local: Sequence[Sample], *, k: int, share: int, seed: int | None, max_distinct: int):
    """This share's graded records, one per prompt: its samples' verdicts and its majority sample."""
    grades = verifier.grade([s.text for s in local], [s.prompt.problem.answer for s in local])[0] if local else []
    extracted = _by_prompt([g.extracted for g in grades], k)
    answers = [[None if e is None else normalize_answer(e) for e in ext] for ext in extracted]
    majority = _majorities(verifier, answers, extracted, max_distinct)
    rows = [
        {"response": s.text, "extracted": g.extracted, "correct": g.correct, "length": len(s.response_ids),
         "truncated": s.truncated, "share": share, "seed": seed, "request": j}
        for j, (s, g) in enumerate(zip(local, grades, strict=True))
    ]  # fmt: skip
    return [{"samples": r, "majority": m} for r, m in zip(_by_prompt(rows, k), majority, strict=True)]


def evaluate_set(
    rollout, verifier, s: EvalSet, *, k: int, temperature: float, max_distinct: int = 8, seed: int | None = None
) -> SetResult:
    """Sample ``k`` responses per prompt, grade them, and compute the set's metrics.

    With ``seed`` the generator is reseeded first, so a set's samples do not depend
    on which sets ran before it. Data-parallel under torchrun (module docstring): every rank
    calls it, grades its own share, and gets the same result; each sample row records its seed
    and request index.
    """
    prompts = s.prompts
    local, call_seed = generate_local(rollout, prompts, n=k, temperature=temperature, seed=seed)
    share, _ = shares_of(rollout)
    records = None
    if grades_here(rollout):
        records = _grade_share(verifier, local, k=k, share=share, seed=call_seed, max_distinct=max_distinct)
    per_prompt = gather_prompts(records, rollout, len(prompts))
    correct = [[x["correct"] for x in rec["samples"]] for rec in per_prompt]
    majority = [rec["majority"] for rec in per_prompt]
    flat = [x for rec in per_prompt for x in rec["samples"]]

    out = {f"avg@{k}": M.avg_at_k(correct)}
    out |= {f"pass@{j}": M.mean_pass_at_k(correct, j) for j in M.pass_ks(k)}
    out[f"maj@{k}"] = M.majority_accuracy(majority, correct)
    out["response_len"] = sum(x["length"] for x in flat) / len(flat)
    out["truncated"] = sum(x["truncated"] for x in flat) / len(flat)
    out["no_answer"] = sum(x["extracted"] is None for x in flat) / len(flat)

    per_problem = [
        {
            "id": p.problem.id,
            "gold": p.problem.answer,
            "n_correct": sum(correct[i]),
            "majority": None if majority[i] is None else per_prompt[i]["samples"][majority[i]]["extracted"],
            "majority_correct": majority[i] is not None and correct[i][majority[i]],
        }
        for i, p in enumerate(prompts)
    ]
    per_sample = [
        {"id": p.problem.id, "sample": j, "prompt": p.text, "response": x["response"], "extracted": x["extracted"],
         "gold": p.problem.answer} | x
        for p, rec in zip(prompts, per_prompt, strict=True)
        for j, x in enumerate(rec["samples"])
    ]  # fmt: skip
    return SetResult(out, per_problem, per_sample, s.skipped)


def evaluate_sets(
    rollout,
    verifier,
    sets: Mapping[str, EvalSet],
    *,
    k: int,
    temperature: float,
    max_distinct: int = 8,
    seed: int | None = None,
) -> dict[str, float]:
    """Every set's metrics, flat: ``eval/<set>/avg@k``, ``eval/<set>/pass@1``, ``eval/<set>/maj@k``, ...,
    and ``eval/<set>/skipped``, the problems left out because their prompt was over the limit."""
    out = {}
    for name, s in sets.items():
        res = evaluate_set(rollout, verifier, s, k=k, temperature=temperature, max_distinct=max_distinct, seed=seed)
        out |= {f"eval/{name}/{m}": v for m, v in res.metrics.items()}
        out[f"eval/{name}/skipped"] = float(res.skipped)
    return out


# ----------------------------------------------------------------------------- config


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


# ----------------------------------------------------------------------------- a training run's settings

RUN_CONFIG = "config.yaml"  # a training run folder's resolved config (bapo/loop.py writes it)
SAMPLING = ("engine", "n", "temperature", "max_new_tokens")  # eval.py's own rollout keys (k, temperature, ...)
NOT_FROM_RUN = ("name_or_path", "init", "gguf")  # model keys the checkpoint itself decides
# Keys an artifact never decides: a downloaded run folder or export saying trust_remote_code: true would make
# transformers import the modeling_*.py its config.json's auto_map names. Only the command line turns it on.
NEVER_FROM_RUN = ("trust_remote_code",)
RUN_PLACEMENT = ("url", "gpus")  # where the run's engine ran: its servers, the training node's GPUs


@dataclass
class RunSettings:
    """A checkpoint, and what evaluation took from the training config it carries (if it carries one).

    ``taken``: eval key -> the run's value, applied. ``kept``: eval key -> (the command line's value, the
    run's), where an explicit override won. ``withheld``: eval key -> the run's value, never taken from an
    artifact (:data:`NEVER_FROM_RUN`); the command line's or eval.py's own value applies."""

    weights: Path  # the HF folder to load
    config_file: Path | None  # the run's config.yaml, or the export's bapo_config.yaml; None: a bare HF folder
    taken: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    withheld: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict:
        """What results.json's config says about the checkpoint."""
        kept = {key: {"command_line": cli, "run": ours} for key, (cli, ours) in self.kept.items()}
        cfg = None if self.config_file is None else str(self.config_file)
        return {
            "model_path": str(self.weights),
            "run_config": cfg,
            "from_run": self.taken,
            "overridden": kept,
            "not_from_run": self.withheld,
        }


def find_checkpoint(path: str) -> tuple[Path, Path | None]:
    """(the HF folder to load, the training config that came with it) for ``checkpoint=``.

    A training run folder holds its weights in ``export/`` and its config in ``config.yaml``; an
    export folder may carry the run's config as ``bapo_config.yaml``; a bare HF folder has neither."""
    p = Path(resolve_path(path))
    require(p.exists(), "checkpoint", f"{p.absolute()} does not exist")
    export = p / "export"
    if (export / "config.json").is_file():
        for cfg in (p / RUN_CONFIG, export / EXPORT_CONFIG):
            if cfg.is_file():
                return export, cfg
        return export, None
    if (p / "config.json").is_file():
        return p, (p / EXPORT_CONFIG) if (p / EXPORT_CONFIG).is_file() else None
    require(
        not (p / RUN_CONFIG).is_file(),
        "checkpoint",
        f"{p} is a training run without an export (export/config.json): a run writes it when it completes; "
        "evaluate a finished run, or an export folder",
    )
    raise ConfigError(
        f"checkpoint: {path} is neither a training run folder (with export/) nor an HF model folder (config.json)"
    )


def _cli_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys (and groups) an override on the command line sets: ``model``, ``max_new_tokens``, ..."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}


def _on_command_line(key: str, cli: set[str]) -> bool:
    """Whether ``key`` was set on the command line: itself, or a group above it. ``rollout=<engine>`` picks
    the engine only (it is how a knob of the run's engine can be set at all); ``placement=`` picks both."""
    if key.startswith("rollout."):
        return "placement" in cli or key in cli or (key == "rollout.engine" and "rollout" in cli)
    parts = key.split(".")
    return any(".".join(parts[:i]) in cli for i in range(1, len(parts) + 1))


def evaluated_engine(run: dict) -> str:
    """The engine an evaluation of ``run`` (its config) uses: the run's, or the one its traits name for the eval
    ranks' own GPUs (``EngineTraits.eval_engine``: vLLM's servers ran on GPUs of their own, which an
    evaluation's ranks take)."""
    trained = run["rollout"]["engine"]
    return engine_traits(trained).eval_engine or trained


def _from_run(cfg: DictConfig, run: dict, engine: str) -> dict[str, Any]:
    """Eval key -> the run's value: the model group, the response budget, the prompt and the placement."""
    model = {k: v for k, v in run["model"].items() if k in cfg.model and k not in NOT_FROM_RUN + NEVER_FROM_RUN}
    out = {f"model.{k}": v for k, v in model.items()}
    out |= {
        "max_new_tokens": run["rollout"]["max_new_tokens"],
        "instruction": run["data"]["instruction"],
        "max_prompt_tokens": run["data"]["max_prompt_tokens"],
        "rollout.engine": evaluated_engine(run),
    }
    if engine in (run["rollout"]["engine"], evaluated_engine(run)):  # the knobs (a key the engine lacks is skipped;
        # its sleep settings mean nothing here, nor where the run's servers were: they hold the run's latest weights,
        # or another run's, not this checkpoint's, and their GPUs are the training node's layout, not the eval's)
        knobs = {k: v for k, v in run["rollout"].items() if k not in SAMPLING + RUN_PLACEMENT and "sleep" not in k}
        out |= {f"rollout.{k}": v for k, v in knobs.items()}
    return out


def checkpoint_weights(path: str | Path) -> dict:
    """The tensors of the checkpoint folder ``path`` (its safetensors files), for an engine that must be given them
    (a vLLM server started by someone else holds other weights)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    require(bool(files), "checkpoint", f"{path} holds no safetensors files to give the rollout engine")
    return {k: v for f in files for k, v in load_file(f).items()}


def _switch_engine(cfg: DictConfig, engine: str) -> None:
    """Replace ``cfg.rollout`` with the ``engine`` group's defaults, keeping eval.py's sampling keys."""
    sampling = {k: v for k, v in OmegaConf.to_container(cfg.rollout).items() if k in SAMPLING}
    node = OmegaConf.merge(compose_option("rollout", engine), sampling | {"engine": engine})
    with open_dict(cfg):
        cfg.rollout = node


def adopt_run(cfg: DictConfig, overrides: Sequence[str] = ()) -> RunSettings | None:
    """Evaluate a training run the way it was trained: ``cfg`` (composed, edited in place) takes the run's
    model group (weights from the checkpoint), ``rollout.max_new_tokens`` as ``max_new_tokens``,
    ``data.instruction`` and ``data.max_prompt_tokens``, and its rollout engine with that engine's knobs
    (GPU memory share, tensor parallelism, eager mode; not its sleep settings, which only training uses, nor
    where it ran: a server's URL and GPUs). An engine that ran on GPUs of its own (the vLLM servers of
    ``placement=gpu_node_split``) is replaced by the one its traits name for the eval ranks' own GPUs (in-process
    vLLM), with the knobs the two share.
    A key set on the command line (``overrides``, Hydra's task overrides) wins, and is logged: a group
    covers its keys (``model=tiny``: eval.py's whole model group), except that ``rollout=<engine>`` picks
    the engine only, so ``rollout=vllm rollout.enforce_eager=false`` keeps the run's other vLLM knobs.

    ``model.trust_remote_code`` is never taken from the run (:data:`NEVER_FROM_RUN`): a shared run folder or
    export must not decide to run code; only ``model.trust_remote_code=true`` on the command line does.

    None without ``checkpoint=``; for a bare HF folder, the settings are eval.py's own, as composed."""
    if cfg.checkpoint is None:
        return None
    require(
        isinstance(cfg.checkpoint, str) and cfg.checkpoint.strip() != "",
        "checkpoint",
        f"{cfg.checkpoint!r} is not a path: give a training run folder or an export (make eval RUN=<run>), or leave "
        "checkpoint out to evaluate model.name_or_path",
    )
    weights, config_file = find_checkpoint(cfg.checkpoint)
    settings = RunSettings(weights, config_file)
    if config_file is None:
        return settings
    run = _load_run_config(config_file)
    cli = _cli_keys(overrides)
    engine = cfg.rollout.engine if _on_command_line("rollout.engine", cli) else evaluated_engine(run)
    if engine != cfg.rollout.engine:
        _switch_engine(cfg, engine)
    if engine != run["rollout"]["engine"] and engine == evaluated_engine(run):
        log.info("checkpoint=%s: trained with rollout.engine=%s on GPUs of its own; evaluated with rollout.engine=%s "
                 "on the eval ranks' own GPUs", cfg.checkpoint, run["rollout"]["engine"], engine)  # fmt: skip
    for key, value in _from_run(cfg, run, engine).items():
        here = OmegaConf.select(cfg, key, default=_ABSENT)
        if here is _ABSENT:
            continue  # a key this eval config does not have (a newer or older run)
        if _on_command_line(key, cli):
            settings.kept[key] = (_plain(here), value)
            continue
        OmegaConf.update(cfg, key, value, merge=False)
        settings.taken[key] = value
    for key in NEVER_FROM_RUN:  # the command line's value, or eval.py's own; the run's is only reported
        ours, here = run["model"].get(key), cfg.model.get(key)
        if _on_command_line(f"model.{key}", cli):
            settings.kept[f"model.{key}"] = (here, ours)
        elif ours is not None and ours != here:
            settings.withheld[f"model.{key}"] = ours
            log.warning(
                "checkpoint=%s: its config says model.%s=%s; a run folder or export never decides that: model.%s=%s "
                "(pass model.%s=%s on the command line if you trust the code in %s)",
                cfg.checkpoint, key, json.dumps(ours), key, json.dumps(here), key, json.dumps(ours), weights,
            )  # fmt: skip
    OmegaConf.update(cfg, "model.name_or_path", str(weights), merge=False)
    lines = [f"  {key}={_show(v)}" for key, v in settings.taken.items()]
    lines += [
        f"  {key}={_show(given)} (command line) "
        + (f"overrides the run's {_show(ours)}" if given != ours else "as in the run")
        for key, (given, ours) in settings.kept.items()
    ]
    log.info("checkpoint=%s: evaluating as trained, with %s:\n%s", cfg.checkpoint, config_file, "\n".join(lines))
    return settings


def _load_run_config(path: Path) -> dict:
    """A run's config (bapo.infra.artifacts: read as data, never resolved; an interpolation in it is refused), with
    the groups evaluation reads; a damaged file is a ConfigError naming it."""
    try:
        run = load_config(path)
    except ArtifactError as e:
        raise ConfigError(f"checkpoint: {e}") from None
    need = {"model": ("dtype",), "rollout": ("engine", "max_new_tokens"), "data": ("instruction", "max_prompt_tokens")}
    for group, keys in need.items():
        node = run.get(group)
        missing = [f"{group}.{k}" for k in keys if not isinstance(node, dict) or k not in node]
        if missing:
            raise ConfigError(f"checkpoint: {path} is not a training run's config: it has no {missing[0]}")
    return run


_ABSENT = object()


def _plain(v: Any) -> Any:
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, dict | list) or v is None else str(v)


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


# ----------------------------------------------------------------------------- reports


def write_samples(path: str | Path, samples: Sequence[dict]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for row in samples:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_results(run_dir: str | Path, results: Mapping[str, SetResult], *, k: int, config: dict) -> None:
    """``results.json`` (metrics and per-problem rows of every set, what was skipped, and the config) and
    ``results.md``."""
    run_dir = Path(run_dir)
    sets = {
        name: {"n_problems": len(r.problems), "n_skipped": r.skipped, "k": k, "metrics": r.metrics,
               "problems": r.problems}
        for name, r in results.items()
    }  # fmt: skip
    (run_dir / "results.json").write_text(json.dumps({"sets": sets, "config": config}, indent=2))
    (run_dir / "results.md").write_text(results_table(results, k=k))


def results_table(results: Mapping[str, SetResult], *, k: int) -> str:
    """A Markdown table, one row per set; accuracies and the truncation rate in percent. ``n`` counts the
    problems evaluated, ``skipped`` those left out because their prompt was over the limit."""
    cols = [f"avg@{k}", *(f"pass@{j}" for j in M.pass_ks(k)), f"maj@{k}"]
    lines = [
        "| set | n | skipped | k | " + " | ".join(cols) + " | len | trunc % |",
        "|---|---:|---:|---:|" + "---:|" * len(cols) + "---:|---:|",
    ]
    for name, r in results.items():
        acc = " | ".join(f"{100 * r.metrics[c]:.1f}" for c in cols)
        m = r.metrics
        lines.append(
            f"| {name} | {len(r.problems)} | {r.skipped} | {k} | {acc} | {m['response_len']:.0f} "
            f"| {100 * m['truncated']:.1f} |"
        )
    return "\n".join(lines) + "\n"
