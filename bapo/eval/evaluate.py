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

The eval entry (``eval.py``) builds its job with :mod:`bapo.eval.job` (the typed config, the set loader),
takes a training run's settings with :mod:`bapo.eval.adopt` and writes its reports with
:mod:`bapo.eval.report`.

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

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from bapo.config import ConfigError
from bapo.data.loading import DataFileError, LoadReport, render_prompts
from bapo.eval import passk as M
from bapo.infra import dist, stop
from bapo.infra.seeding import derive_seed
from bapo.reward import normalize_answer
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
