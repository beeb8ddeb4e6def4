"""Data-parallel evaluation with a canned engine and a verifier that counts what it grades: what
e2e/eval_dp_worker.py runs on each rank, and its tests run in one process as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

from bapo.eval.evaluate import EvalSet, evaluate, evaluate_set
from bapo.reward import MathVerifier
from bapo.samples import Problem, Prompt, Sample

# Problem i's two responses. Each rank's share is every other problem, so rank 0 (problems 0, 2, 4)
# has 6 samples and one pair of distinct answers to compare (problem 4: 0.5 and 1/2), rank 1 4 samples.
RESPONSES = {
    "0": ["\\boxed{0}", "\\boxed{0}"],
    "1": ["\\boxed{1}", "no answer"],
    "2": ["\\boxed{2}", "\\boxed{2}"],
    "3": ["\\boxed{7}", "\\boxed{7}"],
    "4": ["\\boxed{0.5}", "\\boxed{\\frac{1}{2}}"],
}
GOLD = {"0": "0", "1": "1", "2": "2", "3": "3", "4": "1/2"}
PROMPTS = [Prompt(Problem(i, f"q{i}", GOLD[i]), f"q{i}", (5, 6, int(i) + 7)) for i in RESPONSES]
ORIGIN = ("share", "seed", "request")  # where a sample's randomness came from: differs with the world size


class CannedEngine:
    """k fixed responses per problem, as an engine returns them: grouped by prompt."""

    def __init__(self, tensor_parallel_size: int = 1):
        self.tensor_parallel_size = tensor_parallel_size
        self.version = 0

    def generate(self, prompts, *, n, temperature, seed=None):
        out = []
        for g, p in enumerate(prompts):
            for text in RESPONSES[p.problem.id][:n]:
                ids = torch.arange(len(text))
                out.append(Sample(p, g, ids, torch.zeros(len(text)), text, self.version, False))
        return out


class CountingVerifier(MathVerifier):
    """The training verifier, in-process, counting every response it grades."""

    def __init__(self):
        super().__init__(num_workers=0)
        self.graded = 0

    def grade(self, responses, answers):
        self.graded += len(responses)
        return super().grade(responses, answers)


def evaluate_all(tp: int = 1, prompts=PROMPTS) -> dict:
    """The set evaluation and the held-out check, each with the grades this process performed."""
    engine = CannedEngine(tp)
    with CountingVerifier() as verifier:
        res = evaluate_set(engine, verifier, EvalSet(prompts, skipped=1), k=2, temperature=1.0, seed=5)
        set_grades, verifier.graded = verifier.graded, 0
        heldout = evaluate(engine, verifier, prompts, n=2, temperature=1.0, prefix="eval/", seed=5)
        samples = [{k: v for k, v in row.items() if k not in ORIGIN} for row in res.samples]
        origin = [[row[k] for k in ORIGIN] for row in res.samples]
        return {
            "set_grades": set_grades,
            "heldout_grades": verifier.graded,
            "metrics": res.metrics,
            "problems": res.problems,
            "samples": samples,
            "origin": origin,
            "skipped": res.skipped,
            "heldout": heldout,
        }


def run_folder(path: Path, model, tok, *overrides: str, config_name: str = "config.yaml", export: bool = False):
    """A finished training run as bapo/loop.py leaves it: ``config.yaml`` (the resolved config) and ``export/``;
    ``export=True``: an export folder carrying the run's config as ``bapo_config.yaml`` instead."""
    from omegaconf import OmegaConf

    from tests.helpers.config import compose

    weights = path if export else path / "export"
    model.save_pretrained(weights)
    tok.save_pretrained(weights)
    (weights if export else path).joinpath(config_name).write_text(
        OmegaConf.to_yaml(compose("debug=smoke", *overrides), resolve=True)
    )
    return path
