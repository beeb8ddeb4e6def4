"""Evaluation with the training engines: the rollout engine samples and the reward
stage grades, with the same code that produces training rewards.

* :func:`evaluate`: the training loop's held-out check (avg@n, pass@n, length).
* :func:`evaluate_problems`: k samples per problem on one set; avg@k, pass@k for
  the powers of two up to k, maj@k, mean length, truncation rate, and every
  sample and problem for the reports. :func:`evaluate_sets` flattens the
  metrics of several sets to ``eval/<set>/<metric>`` for a logger.
* The eval entry (``eval.py``) also uses the typed config (:func:`build_job`),
  the set loader (:func:`load_evalset`) and the report writers here.

Data-parallel. Under torchrun every rank (every tensor-parallel group of a vLLM engine split over
``t`` ranks) samples its share of the problems, ``prompts[g::G]``, with its own seed
(:func:`share_seed`), and the shares are gathered back into problem order on every rank, so the
metrics are the same on every rank and rank 0 writes them. Each sample's row records the seed of
its generate call and its request index in that call, which is all the engines sample from: a
rerun with the same seed, world size and engine reproduces every sample, and so avg@k, exactly.

maj@k groups answers written differently (``\\frac{1}{2}`` and ``0.5``): answers
are normalised first, then the most frequent distinct ones are compared in
pairs with the verifier's equivalence, run in its worker pool like any grade
(see bapo/metrics.py for the cap and the tie-break).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bapo import dist
from bapo import metrics as M
from bapo.config import EVAL_SETS_DIR, ConfigError, ModelConfig, RewardConfig, resolve_path
from bapo.data import ArithSpec, arith_heldout, gsm8k_answer, load_hub, load_jsonl, render_prompt
from bapo.reward import normalize_answer
from bapo.seeding import derive_seed
from bapo.types import Problem, Prompt, Sample


def shares_of(rollout) -> tuple[int, int]:
    """(this rank's share, number of shares) of the problems: one share per engine (tensor-parallel group)."""
    if not dist.active():
        return 0, 1
    tp = int(getattr(rollout, "tensor_parallel_size", 1))
    return dist.rank() // tp, dist.world_size() // tp


def share_seed(seed: int | None, share: int, shares: int) -> int | None:
    """The seed of share ``share``'s generate call: ``seed`` itself in one process."""
    return seed if seed is None or shares == 1 else derive_seed(seed, "eval/share", share)


def generate_shared(
    rollout, prompts: Sequence[Prompt], *, n: int, temperature: float, seed: int | None
) -> tuple[list[Sample], list[dict]]:
    """``n`` samples per prompt, grouped by prompt, generated data-parallel over the ranks (module docstring).

    Returns the samples (the same on every rank) and, per sample, where its randomness came from:
    ``{"share", "seed", "request"}`` (the share's call seed, the index of the request in that call).
    A collective under torchrun: every rank calls it with the same prompts."""
    share, shares = shares_of(rollout)
    mine = list(prompts[share::shares])
    call_seed = share_seed(seed, share, shares)
    local = rollout.generate(mine, n=n, temperature=temperature, seed=call_seed) if mine else []
    if len(local) != len(mine) * n:
        raise RuntimeError(f"the rollout engine returned {len(local)} samples for {len(mine)} prompts x n={n}")
    if shares == 1:
        return local, [{"share": 0, "seed": call_seed, "request": j} for j in range(len(local))]
    rows = [(torch.as_tensor(s.response_ids).tolist(), s.text, s.truncated, s.version, call_seed) for s in local]
    parts = dist.all_gather_object(rows)  # plain lists and strings: a small pickle per rank, once per set
    samples: list[Sample | None] = [None] * (len(prompts) * n)
    origin: list[dict | None] = [None] * (len(prompts) * n)
    for rank, part in enumerate(parts):
        if rank % (len(parts) // shares):  # the other ranks of a tensor-parallel group: the same samples again
            continue
        g = rank // (len(parts) // shares)
        for j, (ids, text, truncated, version, used_seed) in enumerate(part):
            i = (g + shares * (j // n)) * n + j % n  # the prompt's place in the whole list, then the sample's
            p = prompts[i // n]
            samples[i] = Sample(p, i // n, torch.tensor(ids, dtype=torch.long), torch.full((len(ids),), math.nan),
                                text, version, truncated)  # fmt: skip
            origin[i] = {"share": g, "seed": used_seed, "request": j}
    return samples, origin


def evaluate(
    rollout, verifier, prompts: Sequence[Prompt], *, n: int, temperature: float, prefix: str, seed: int | None = None
) -> dict:
    """avg@n accuracy (mean per-sample correctness), pass@n, mean length and truncation rate.

    Data-parallel under torchrun (:func:`generate_shared`): every rank calls it and gets the same metrics."""
    samples, _ = generate_shared(rollout, prompts, n=n, temperature=temperature, seed=seed)
    grades, _ = verifier.grade([s.text for s in samples], [s.prompt.problem.answer for s in samples])
    correct = [g.correct for g in grades]
    per_problem = [any(correct[i * n : (i + 1) * n]) for i in range(len(prompts))]
    return {
        f"{prefix}accuracy": sum(correct) / len(correct),
        f"{prefix}pass@{n}": sum(per_problem) / len(per_problem),
        f"{prefix}response_len": sum(len(s.response_ids) for s in samples) / len(samples),
        f"{prefix}truncated": sum(s.truncated for s in samples) / len(samples),
    }


# ----------------------------------------------------------------------------- one set


@dataclass
class SetResult:
    """One set's metrics, one row per problem, and one row per sample."""

    metrics: dict[str, float]
    problems: list[dict]
    samples: list[dict]


def _equivalence(verifier, answers: Sequence[Sequence[str | None]], raw: Mapping[str, str], max_distinct: int):
    """``equivalent(a, b)`` over normalised answers, for every pair :func:`metrics.vote` may ask about.

    The pairs of all problems are judged in one batch through the verifier: ``raw[b]``
    boxed as the response, ``raw[a]`` as the gold, so they get the pool's timeouts.
    """
    pairs = sorted({pair for ans in answers for pair in M.vote_pairs(ans, max_distinct=max_distinct)})
    verdict: dict[tuple[str, str], bool] = {}
    if pairs:
        grades, _ = verifier.grade([f"\\boxed{{{raw[b]}}}" for _, b in pairs], [raw[a] for a, _ in pairs])
        verdict = {pair: g.correct for pair, g in zip(pairs, grades, strict=True)}
    return lambda a, b: verdict[(a, b)]


def evaluate_problems(
    rollout,
    verifier,
    tokenizer,
    problems: Sequence[Problem],
    *,
    k: int,
    temperature: float,
    instruction: str,
    max_distinct: int = 8,
    seed: int | None = None,
) -> SetResult:
    """Sample ``k`` responses per problem, grade them, and compute the set's metrics.

    With ``seed`` the generator is reseeded first, so a set's samples do not depend
    on which sets ran before it. Data-parallel under torchrun (:func:`generate_shared`): every
    rank calls it and gets the same result; each sample row records its seed and request index.
    """
    prompts = [render_prompt(p, tokenizer, instruction=instruction) for p in problems]
    samples, origin = generate_shared(rollout, prompts, n=k, temperature=temperature, seed=seed)
    grades, _ = verifier.grade([s.text for s in samples], [s.prompt.problem.answer for s in samples])
    rows = [range(i * k, (i + 1) * k) for i in range(len(prompts))]  # samples come grouped by prompt
    correct = [[grades[j].correct for j in r] for r in rows]
    extracted = [g.extracted for g in grades]
    answers = [[None if extracted[j] is None else normalize_answer(extracted[j]) for j in r] for r in rows]
    raw: dict[str, str] = {}  # normalised answer -> the first extracted string written that way
    for key, e in zip((a for ans in answers for a in ans), extracted, strict=True):
        if key is not None:
            raw.setdefault(key, e)
    equivalent = _equivalence(verifier, answers, raw, max_distinct)
    majority = [M.majority(ans, equivalent, max_distinct=max_distinct) for ans in answers]

    out = {f"avg@{k}": M.avg_at_k(correct)}
    out |= {f"pass@{j}": M.mean_pass_at_k(correct, j) for j in M.pass_ks(k)}
    out[f"maj@{k}"] = M.maj_at_k(answers, correct, equivalent, max_distinct=max_distinct)
    out["response_len"] = sum(len(s.response_ids) for s in samples) / len(samples)
    out["truncated"] = sum(s.truncated for s in samples) / len(samples)
    out["no_answer"] = sum(g.extracted is None for g in grades) / len(grades)

    per_problem = [
        {
            "id": p.problem.id,
            "gold": p.problem.answer,
            "n_correct": sum(correct[i]),
            "majority": None if majority[i] is None else extracted[rows[i][majority[i]]],
            "majority_correct": majority[i] is not None and correct[i][majority[i]],
        }
        for i, p in enumerate(prompts)
    ]
    per_sample = [
        {
            "id": s.prompt.problem.id,
            "sample": j % k,
            "prompt": s.prompt.text,
            "response": s.text,
            "extracted": g.extracted,
            "gold": s.prompt.problem.answer,
            "correct": g.correct,
            "length": len(s.response_ids),
            "truncated": s.truncated,
        }
        | origin[j]
        for j, (s, g) in enumerate(zip(samples, grades, strict=True))
    ]
    return SetResult(out, per_problem, per_sample)


def evaluate_sets(
    rollout,
    verifier,
    tokenizer,
    sets: Mapping[str, Sequence[Problem]],
    *,
    k: int,
    temperature: float,
    instruction: str,
    max_distinct: int = 8,
    seed: int | None = None,
) -> dict[str, float]:
    """Every set's metrics, flat: ``eval/<set>/avg@k``, ``eval/<set>/pass@1``, ``eval/<set>/maj@k``, ..."""
    out = {}
    for name, problems in sets.items():
        res = evaluate_problems(
            rollout, verifier, tokenizer, problems, k=k, temperature=temperature,
            instruction=instruction, max_distinct=max_distinct, seed=seed,
        )  # fmt: skip
        out |= {f"eval/{name}/{m}": v for m, v in res.metrics.items()}
    return out


# ----------------------------------------------------------------------------- config


@dataclass
class ArithSetConfig:
    """The synthetic held-out set: the spec of conf/data/arith.yaml, its seed, split fraction and size."""

    min_terms: int = MISSING
    max_terms: int = MISSING
    min_value: int = MISSING
    max_value: int = MISSING
    ops: str = MISSING
    seed: int = MISSING
    heldout_frac: float = MISSING
    size: int = MISSING


@dataclass
class EvalSetConfig:
    """One evaluation set (conf/evaluation/eval/<name>.yaml); ``name`` is filled in from its key."""

    name: str = MISSING
    kind: str = MISSING  # jsonl | hub | arith
    path: str | None = MISSING  # the JSONL file; for kind=hub, a hub name, local folder or data file
    split: str = MISSING  # hub only
    subset: str | None = MISSING  # hub only
    problem_key: str = MISSING
    answer_key: str = MISSING
    answer_format: str = MISSING  # plain | gsm8k ("... #### 72")
    arith: ArithSetConfig | None = MISSING

    def __post_init__(self) -> None:
        key = f"eval.{self.name}"
        _choice(self.kind, f"{key}.kind", ("jsonl", "hub", "arith"))
        _choice(self.answer_format, f"{key}.answer_format", ("plain", "gsm8k"))
        if self.kind == "arith":
            a = self.arith
            _require(a is not None, f"{key}.arith", "required for kind=arith")
            _require(2 <= a.min_terms <= a.max_terms, f"{key}.arith.min_terms", "need 2 <= min_terms <= max_terms")
            _require(a.min_value <= a.max_value, f"{key}.arith.min_value", "need min_value <= max_value")
            _require(bool(a.ops) and set(a.ops) <= set("+-*"), f"{key}.arith.ops", "use characters from '+-*'")
            _require(0 < a.heldout_frac < 1, f"{key}.arith.heldout_frac", "must be in (0, 1)")
            _require(a.size >= 1, f"{key}.arith.size", f"must be >= 1, got {a.size}")
        else:
            _require(bool(self.path), f"{key}.path", f"required for kind={self.kind} (a file or hub name)")


@dataclass
class EvalRunConfig:
    """The top-level keys of conf/eval_config.yaml, and ``eval.limit``."""

    seed: int = MISSING
    checkpoint: str | None = MISSING
    k: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    max_new_tokens: int = MISSING
    limit: int | None = MISSING
    device: str = MISSING
    instruction: str = MISSING
    maj_max_distinct: int = MISSING

    def __post_init__(self) -> None:
        _require(self.k >= 1, "k", f"must be >= 1, got {self.k}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        _require(self.temperature > 0 or self.k == 1, "k", "greedy decoding (temperature=0) gives k equal samples")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.max_new_tokens > 0, "max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        _require(self.limit is None or self.limit >= 1, "eval.limit", f"must be null or >= 1, got {self.limit}")
        _require(self.maj_max_distinct >= 1, "maj_max_distinct", f"must be >= 1, got {self.maj_max_distinct}")


@dataclass(frozen=True)
class EvalJob:
    """The validated eval config: run settings, model, reward, engine and the sets to run."""

    run: EvalRunConfig
    model: ModelConfig
    reward: RewardConfig
    engine: str
    batch_size: int | None
    sets: dict[str, EvalSetConfig]


def build_job(cfg: DictConfig) -> EvalJob:
    """Validate the composed eval config; errors name the key."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.full_key or 'config'}: {str(e).splitlines()[0]}") from None
    chosen = dict(plain["eval"])
    limit = chosen.pop("limit")
    run = _typed(
        "", {f: plain[f] for f in EvalRunConfig.__dataclass_fields__ if f != "limit"} | {"limit": limit}, EvalRunConfig
    )
    _require(bool(chosen), "eval", "choose at least one set, e.g. eval=[aime24,math500]")
    for name, node in chosen.items():
        _require(
            isinstance(node, dict) and "kind" in node, f"eval.{name}", "not an eval set (see conf/evaluation/eval/)"
        )
    rollout = plain["rollout"]
    _choice(rollout["engine"], "rollout.engine", ("hf", "vllm"))
    if rollout["engine"] == "hf":
        _require(rollout["batch_size"] > 0, "rollout.batch_size", "must be > 0")
    sets = {name: _typed(f"eval.{name}", node | {"name": name}, EvalSetConfig) for name, node in chosen.items()}
    return EvalJob(
        run=run,
        model=_typed("model", plain["model"], ModelConfig),
        reward=_typed("reward", plain["reward"], RewardConfig),
        engine=rollout["engine"],
        batch_size=rollout.get("batch_size"),  # hf only
        sets=sets,
    )


def resolve_checkpoint(path: str) -> str:
    """The HF folder to load for ``checkpoint=``: a training run's ``export/``, or the folder itself."""
    p = Path(resolve_path(path))
    for folder in (p / "export", p):
        if (folder / "config.json").is_file():
            return str(folder)
    raise ConfigError(
        f"checkpoint: {path} is neither a training run folder (with export/) nor an HF model folder (config.json)"
    )


def named_set(name: str, *, data_dir: str) -> EvalSetConfig:
    """conf/evaluation/eval/<name>.yaml as eval.py composes it, with ``paths.data_dir`` given:
    how the training loop runs eval.py's sets (``eval.sets``) outside eval.py's config."""
    node = OmegaConf.merge(
        {"paths": {"data_dir": data_dir}}, {"eval": {name: OmegaConf.load(EVAL_SETS_DIR / f"{name}.yaml")}}
    )
    try:
        plain = OmegaConf.to_container(node, resolve=True)["eval"][name]
    except OmegaConfBaseException as e:
        raise ConfigError(f"eval.{name}: {str(e).splitlines()[0]}") from None
    return _typed(f"eval.{name}", plain | {"name": name}, EvalSetConfig)


def load_evalset(s: EvalSetConfig, *, limit: int | None = None) -> list[Problem]:
    """The problems of one set, in file order (the first ``limit`` if given)."""
    if s.kind == "arith":
        a = s.arith
        spec = ArithSpec(a.min_terms, a.max_terms, a.min_value, a.max_value, a.ops)
        rows = arith_heldout(a.size, seed=a.seed, heldout_frac=a.heldout_frac, spec=spec)
    elif s.kind == "jsonl":
        rows = load_jsonl(resolve_path(s.path), problem_key=s.problem_key, answer_key=s.answer_key)
    else:
        keys = dict(problem_key=s.problem_key, answer_key=s.answer_key)
        rows = load_hub(resolve_path(s.path), split=s.split, subset=s.subset, **keys)
    if s.answer_format == "gsm8k":
        rows = [gsm8k_answer(p) for p in rows]
    return rows[:limit] if limit else rows


# ----------------------------------------------------------------------------- reports


def write_samples(path: str | Path, samples: Sequence[dict]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for row in samples:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_results(run_dir: str | Path, results: Mapping[str, SetResult], *, k: int, config: dict) -> None:
    """``results.json`` (metrics and per-problem rows of every set, and the config) and ``results.md``."""
    run_dir = Path(run_dir)
    sets = {
        name: {"n_problems": len(r.problems), "k": k, "metrics": r.metrics, "problems": r.problems}
        for name, r in results.items()
    }
    (run_dir / "results.json").write_text(json.dumps({"sets": sets, "config": config}, indent=2))
    (run_dir / "results.md").write_text(results_table(results, k=k))


def results_table(results: Mapping[str, SetResult], *, k: int) -> str:
    """A Markdown table, one row per set; accuracies and the truncation rate in percent."""
    cols = [f"avg@{k}", *(f"pass@{j}" for j in M.pass_ks(k)), f"maj@{k}"]
    lines = [
        "| set | n | k | " + " | ".join(cols) + " | len | trunc % |",
        "|---|---:|---:|" + "---:|" * len(cols) + "---:|---:|",
    ]
    for name, r in results.items():
        acc = " | ".join(f"{100 * r.metrics[c]:.1f}" for c in cols)
        m = r.metrics
        lines.append(
            f"| {name} | {len(r.problems)} | {k} | {acc} | {m['response_len']:.0f} | {100 * m['truncated']:.1f} |"
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- helpers


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")


def _typed(key: str, node: Any, schema: type) -> Any:
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as e:
        full = ".".join(x for x in (key, getattr(e, "full_key", None)) if x) or "config"
        raise ConfigError(f"{full}: {str(e).splitlines()[0]}") from None
