"""A single-process learner on real sequences, its gradients, and the unchunked log-prob chain the learner's
chunked one is checked against."""

import torch

from bapo.algos import surrogate_objective, token_logp
from bapo.learner import Learner, collate
from bapo.samples import Problem, Prompt, Sample, ScoredSample
from tests.helpers.config import learner_cfg


def fake_batch(tok, model, n=8, seed=0):
    """Real sequences with behaviour log-probs from a slightly perturbed policy (so ratios != 1)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt_ids = tuple(torch.randint(3, len(tok), (5 + i % 3,), generator=g).tolist())
        resp = torch.randint(3, len(tok), (4 + (i * 5) % 9,), generator=g)
        x = torch.tensor([prompt_ids + tuple(resp.tolist())])
        with torch.no_grad():
            lp = token_logp(model(input_ids=x).logits[:, :-1].float(), x[:, 1:])[0, len(prompt_ids) - 1 :]
        lp = lp + 0.3 * torch.randn(lp.shape, generator=g)
        prompt = Prompt(Problem(str(i), "p", "1"), "p", prompt_ids)
        s = Sample(prompt, i // 4, resp, lp.float(), "t", 0, False)
        samples.append(ScoredSample(s, 0.0, float(torch.randn(1, generator=g)), False))
    return collate(samples, pad_id=tok.pad_token_id)


LEARNER_KEYS = ("lr", "micro_batch_size", "max_tokens_per_micro_batch", "packing", "grad_clip", "warmup_steps")


def make_learner(model, agg="token-mean", bounds="bapo", scope="mini_batch", **kw):
    """A single-process learner; learner-config fields in ``kw`` (lr, micro_batch_size, ...) go to its config."""
    fixed = {"ratio_low": 0.8, "ratio_high": 1.2} if bounds == "fixed" else {}
    scoped = {"scope": scope} if bounds == "bapo" else {}
    cfg = learner_cfg(**({"lr": 1e-3, "micro_batch_size": 3} | {k: kw.pop(k) for k in LEARNER_KEYS if k in kw}))
    args = dict(objective=surrogate_objective(bounds, agg=agg, **fixed, **scoped), pad_id=0, agg=agg, device="cpu")
    args.update(kw)
    return Learner(model, cfg, **args)


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def reference(logits, targets, temperature=1.0, entropy_grad=True):
    """The unchunked chain under autograd."""
    z = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)  # [..., V]
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = logp_all.exp()
        ent = -torch.where(probs > 0, probs * logp_all, torch.zeros_like(probs)).sum(-1)
    return logp, ent
