"""The shared-prompt layout's 4-D attention mask: built on the learner's device, one layout per micro-batch for
every pass of an update, and the same mask (so the same log-probs) however it was built or reused.

The mask of a paper_7b micro-batch is 2 x 8.3k x 8.3k: built on the host it cost 0.6-1.2 s and a 131 MiB copy
per pass (``scripts/bench/bench_mask.py``)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from bapo.algos import surrogate_objective
from bapo.learner import Learner, batching, collate
from bapo.learner.batching import pack_shared
from bapo.samples import Problem, Prompt, Sample, ScoredSample
from tests.helpers import fsdp as W


def grouped_batch(seed: int, groups: int = 4, n: int = 3):
    """``groups`` prompts with ``n`` responses each (some empty), shuffled, as a right-padded batch."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(groups):
        p = int(torch.randint(1, 9, (1,), generator=g))
        prompt = Prompt(Problem(str(i), "p", "1"), "p", tuple(torch.randint(3, 300, (p,), generator=g).tolist()))
        for _ in range(n):
            r = int(torch.randint(0, 12, (1,), generator=g))
            resp = torch.randint(3, 300, (r,), generator=g)
            s = Sample(prompt, i, resp, torch.full((r,), -1.0), "", 0, False)
            rows.append(ScoredSample(s, 0.0, float(torch.randn(1, generator=g)), False))
    order = torch.randperm(len(rows), generator=g).tolist()
    return collate([rows[k] for k in order], pad_id=0)


def defined_mask(sp) -> torch.Tensor:
    """The mask by its definition (SharedPrompts): one segment, a key not after the query, and the key a prompt
    token or in the query's own response."""
    seg, pos, branch = sp.segment, sp.position_ids, sp.branch  # [R, W] each
    allowed = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])  # [R, W, W]
    return allowed & ((branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_width", [4, 16, 256])
def test_the_block_built_mask_equals_its_definition(seed, max_width):
    sp = pack_shared(grouped_batch(seed), max_width=max_width)
    assert torch.equal(batching.shared_mask(sp), defined_mask(sp))


class CreatedOnHost(TorchFunctionMode):
    """Records every [R, W, W] tensor (the mask's shape, at least 2 wide) a torch function returns on the CPU."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 3 and out.device.type == "cpu":
            if out.shape[-1] == out.shape[-2] > 1:
                self.shapes.append(tuple(out.shape))
        return out


class Spy(torch.nn.Module):
    """A model that records the attention masks it is given and returns zero logits where its inputs are."""

    def __init__(self, vocab: int = 7):
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation="sdpa")
        self.vocab, self.masks = vocab, []

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, **kw):
        self.masks.append(attention_mask)
        return SimpleNamespace(logits=torch.zeros((*input_ids.shape, self.vocab), device=input_ids.device))


def learner(model, **fields) -> Learner:
    cfg = W.learner_config(packing=True, micro_batch_size=64) if not fields else W.learner_config(**fields)
    return Learner(model, cfg, objective=W.objective(), pad_id=0, max_response_len=40)


def test_the_mask_is_built_on_the_learners_device():
    """With the learner's device set to meta, the model gets its mask there and no tensor of the mask's shape is
    ever made on the host (before: built on the CPU by pack_shared, then copied with .to(device))."""
    from bapo.modeling import load_model

    lrn = learner(load_model(str(W.TINY)))
    lrn.device = torch.device("meta")  # a device that is not the host's
    batch = grouped_batch(0)
    spy = Spy()
    with torch.no_grad(), CreatedOnHost() as seen:
        lrn._forward(spy, batch, entropy=False)
    (mask,) = spy.masks
    R, W_ = pack_shared(batch).input_ids.shape
    assert mask.device.type == "meta" and tuple(mask.shape) == (R, 1, W_, W_)
    assert not [s for s in seen.shapes if s[-1] == W_], seen.shapes


@pytest.fixture(scope="module")
def tiny():
    from bapo.modeling import load_model

    return load_model(str(W.TINY))


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_a_reused_layout_and_mask_give_the_log_probs_of_fresh_ones(tiny, kernel):
    model = copy.deepcopy(tiny)
    model.config._attn_implementation = kernel
    lrn = learner(model)
    batch = grouped_batch(1, groups=5, n=4)
    with torch.no_grad():
        fresh = lrn._forward(model, batch)[0]  # its own layout and mask
        inputs = lrn._inputs(batch)
        first = lrn._forward(model, inputs)[0]
        again = lrn._forward(model, inputs)[0]  # the same layout and the same mask tensor (a reference's forward)
        inputs.release()
        rebuilt = lrn._forward(model, inputs)[0]  # the layout kept, the mask built again (the next pass)
    assert fresh.abs().sum() > 0
    for got in (first, again, rebuilt):
        assert torch.equal(got, fresh)


def test_an_update_lays_each_micro_batch_out_once_and_builds_its_mask_once_per_pass(tiny, monkeypatch):
    """BAPO's pre-pass, the training pass and the KL reference's forward: one layout per micro-batch (before:
    three), one mask per micro-batch and pass (the reference shares the training pass's), and the same loss and
    gradients as a learner that builds everything afresh for every forward."""
    from bapo.learner import forward as fwd

    objective = surrogate_objective("bapo", kl_coef=0.1)
    assert objective.prepass
    batch = grouped_batch(2, groups=6, n=4)

    def run(counting: bool):
        model = copy.deepcopy(tiny)
        lrn = Learner(model, W.learner_config(packing=True, micro_batch_size=7), objective=objective, pad_id=0,
                      max_response_len=40, ref_model=copy.deepcopy(tiny))  # fmt: skip
        calls = {"layout": 0, "mask": 0}
        if counting:
            for name, key in (("pack_shared", "layout"), ("shared_mask", "mask")):
                real = getattr(batching, name)

                def counted(*a, _real=real, _key=key, **kw):
                    calls[_key] += 1
                    return _real(*a, **kw)

                monkeypatch.setattr(fwd, name, counted)
        else:  # every forward lays its micro-batch out afresh
            monkeypatch.setattr(Learner, "_forward", lambda self, m, mb, entropy=True: fwd.forward(
                m, self._inputs(getattr(mb, "mb", mb)), self._logp_entropy, entropy=entropy))  # fmt: skip
        metrics = lrn.accumulate(batch)
        monkeypatch.undo()
        return metrics, {k: p.grad for k, p in model.named_parameters()}, calls, len(lrn.micro_batches(batch))

    (m_new, g_new, calls, n), (m_old, g_old, _, _) = run(True), run(False)
    assert n == 4 and calls == {"layout": n, "mask": 2 * n}
    assert m_new == m_old
    assert all(torch.equal(g_new[k], g_old[k]) for k in g_old)


def test_a_layout_moved_to_a_device_keeps_its_blocks():
    sp = pack_shared(grouped_batch(3))
    moved = sp.to("meta")
    assert {t.device.type for t in (moved.input_ids, moved.keep, moved.segment, moved.branch)} == {"meta"}
    assert moved.causal == sp.causal and moved.sees == sp.sees
