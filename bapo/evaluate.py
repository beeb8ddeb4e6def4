"""Held-out evaluation with the training engines: the rollout engine samples,
the reward stage grades, with the same code that produces training rewards."""

from __future__ import annotations

from collections.abc import Sequence

from bapo.types import Prompt


def evaluate(
    rollout, verifier, prompts: Sequence[Prompt], *, n: int, temperature: float, prefix: str
) -> dict:
    """avg@n accuracy (mean per-sample correctness), pass@n, mean length and truncation rate."""
    samples = rollout.generate(prompts, n=n, temperature=temperature)
    grades, _ = verifier.grade([s.text for s in samples], [s.prompt.problem.answer for s in samples])
    correct = [g.correct for g in grades]
    per_problem = [any(correct[i * n : (i + 1) * n]) for i in range(len(prompts))]
    return {
        f"{prefix}accuracy": sum(correct) / len(correct),
        f"{prefix}pass@{n}": sum(per_problem) / len(per_problem),
        f"{prefix}response_len": sum(len(s.response_ids) for s in samples) / len(samples),
        f"{prefix}truncated": sum(s.truncated for s in samples) / len(samples),
    }
