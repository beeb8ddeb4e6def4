"""What learner/fsdp_worker.py runs on each rank and the single-process tests run as its reference: the learner
config of either kind, the learner, the objective, and variable-length samples from a model."""

from __future__ import annotations

import torch

from bapo.algos import surrogate_objective, token_logp
from bapo.learner import Learner
from bapo.samples import Problem, Prompt, Sample, ScoredSample
from tests.helpers.paths import TINY  # noqa: F401 (W.TINY: the model the worker and its references load)

LEARNER_KW = dict(lr=1e-3, micro_batch_size=3)


def learner_config(kind: str = "single", **fields):
    """The typed learner group of ``learner=<kind>`` with the test's settings and ``fields``."""
    import dataclasses

    from bapo.config import FSDPLearnerConfig, SingleLearnerConfig

    common = dict(
        lr=1e-3, betas=[0.9, 0.999], weight_decay=0.0, eps=1e-8, warmup_steps=0, grad_clip=1.0, ppo_epochs=1,
        mini_batches_per_rollout=1, micro_batch_size=3, max_tokens_per_micro_batch=None, packing=False,
        old_logp="rollout", logp_check_share=0.0625, max_consecutive_skips=10,
    )  # fmt: skip
    if kind == "fsdp":
        cfg = FSDPLearnerConfig(kind="fsdp", mixed_precision="auto", activation_checkpointing=False, cpu_offload=False,
                                **common)  # fmt: skip
    else:
        cfg = SingleLearnerConfig(kind="single", device="cpu", **common)
    return dataclasses.replace(cfg, **fields)


def make_learner(model, kind: str = "single", **fields) -> Learner:
    return Learner(model, learner_config(kind, **fields), objective=objective(), pad_id=0, max_response_len=40)


def objective():
    """BAPO with its search on (paper defaults), plus entropy and the real aggregation."""
    return surrogate_objective("bapo", agg="seq-mean-token-mean", entropy_coef=0.01)


@torch.no_grad()
def samples(model, n: int = 11, seed: int = 0, adv_shift: float = 0.0, noise: float = 1.2) -> list[ScoredSample]:
    """Variable-length responses sampled from ``model``, behaviour log-probs of a perturbed policy
    (so ratios != 1), advantages mostly negative (so BAPO's search has to move the bounds)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(3, 12, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randint(3, 340, (1, p), generator=g)
        for _ in range(r):
            probs = torch.softmax(model(input_ids=ids).logits[0, -1].double(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)[None]], 1)
        lp = token_logp(model(input_ids=ids).logits[:, :-1].double(), ids[:, 1:])[0, p - 1 :]
        lp = lp + noise * torch.randn(lp.shape, generator=g, dtype=lp.dtype)
        prompt_ids = tuple(ids[0, :p].tolist())
        prompt = Prompt(Problem(str(i), "p", "1"), "p", prompt_ids)
        s = Sample(prompt, i // 4, ids[0, p:].clone(), lp.float(), "t", 0, False)
        out.append(ScoredSample(s, 0.0, float(torch.randn(1, generator=g)) + adv_shift, False))
    return out


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for k, p in model.named_parameters():
        g = p.grad
        out[k] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu().clone()
    return out
