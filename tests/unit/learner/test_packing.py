"""Sequence packing and token-budget micro-batches: the loss and its gradients must not change.

The reference is one padded pass over the whole mini-batch. Every other layout (fixed-size
micro-batches, token budgets, packed or padded, extra empty micro-batches, prompts shared by
their group under a 4-D mask, with the sdpa and the eager kernel) is compared with it in
float64 (only summation order may differ) and in float32 (the production case).
"""

import copy
import dataclasses

import pytest
import torch

from bapo.algos import surrogate_objective
from bapo.learner import Learner, collate
from bapo.learner.batching import pack, pack_shared, shared_mask, split_by_tokens, unpack
from bapo.samples import Problem, Prompt, Sample, ScoredSample
from tests.helpers import fsdp as W

LAYOUTS = {  # name: learner-config fields
    "padded/3 rows": dict(micro_batch_size=3),
    "padded/budget 100": dict(max_tokens_per_micro_batch=100),
    "packed/3 rows": dict(packing=True, micro_batch_size=3),
    "packed/budget 60": dict(packing=True, max_tokens_per_micro_batch=60),
    "packed/all": dict(packing=True, micro_batch_size=64),
}


def sample(prompt, response, adv=1.0):
    prompt = Prompt(Problem("0", "p", "1"), "p", tuple(prompt))
    s = Sample(prompt, 0, torch.tensor(response, dtype=torch.long), torch.full((len(response),), -1.0), "", 0, False)
    return ScoredSample(s, 0.0, adv, False)


@pytest.fixture(scope="module")
def data():
    from bapo.modeling import load_model

    model = load_model(str(W.TINY)).double()
    return model, W.samples(model)  # 11 sequences of 4 to 50 tokens


@pytest.fixture(scope="module")
def grouped(data):
    """The same 11 sequences, their prompts replaced so that groups of 4, 4 and 3 share one (as GRPO's do)."""
    model, samples = data
    out = []
    for i, s in enumerate(samples):
        prompt = samples[i // 4 * 4].sample.prompt
        out.append(ScoredSample(dataclasses.replace(s.sample, prompt=prompt), s.reward, s.advantage, False))
    return model, out


def make(model, objective=None, ref_model=None, reduce_max=None, **fields) -> Learner:
    """A single-process learner with the worker's settings and ``fields`` of the learner config."""
    lrn = Learner(model, W.learner_config(**fields), objective=objective or W.objective(), pad_id=0,
                  max_response_len=40, ref_model=ref_model)  # fmt: skip
    if reduce_max is not None:  # as a data-parallel rank would agree on a number of micro-batches
        lrn.strategy.reduce_max = reduce_max
    return lrn


def run(model, batch, *, dtype, objective=None, ref=None, reduce_max=None, **kw):
    """(metrics, gradients) of one accumulate on a copy of ``model`` in ``dtype``."""
    m = copy.deepcopy(model).to(dtype)
    fields = dict(micro_batch_size=len(batch)) | kw
    ref_model = None if ref is None else copy.deepcopy(ref).to(dtype)
    lrn = make(m, objective=objective, ref_model=ref_model, reduce_max=reduce_max, **fields)
    metrics = lrn.accumulate(batch)
    return metrics, {k: p.grad for k, p in m.named_parameters()}


def assert_same(a, b, rtol, what=""):
    (ma, ga), (mb, gb) = a, b
    assert ma["learner/loss"] == pytest.approx(mb["learner/loss"], rel=rtol), what
    assert (ma["clip/low"], ma["clip/high"]) == (mb["clip/low"], mb["clip/high"]), what
    for k in gb:  # relative to the tensor's largest entry
        assert float((ga[k] - gb[k]).abs().max()) <= rtol * float(gb[k].abs().max()), f"{what}: {k}"


def assert_every_layout_matches(model, samples, *, dtype, rtol, objective=None):
    """Each of LAYOUTS gives the loss and gradients of the reference, one padded pass over the whole mini-batch."""
    batch = collate(samples, pad_id=0)
    ref = run(model, batch, dtype=dtype, objective=objective)
    for name, kw in LAYOUTS.items():
        assert_same(run(model, batch, dtype=dtype, objective=objective, **kw), ref, rtol=rtol, what=name)


def test_pack_hand_example():
    # rows: [5 6 | 7 8 9], [10 11 12 | -] (no response: dropped), [13 | 14 15]
    batch = collate([sample([5, 6], [7, 8, 9]), sample([10, 11, 12], []), sample([13], [14, 15])], pad_id=0)
    pk = pack(batch)
    assert pk.input_ids.tolist() == [[5, 6, 7, 8, 9, 13, 14, 15]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    # logits at packed positions 1, 2, 3 predict 7, 8, 9; at 5, 6 they predict 14, 15
    assert pk.keep.tolist() == [1, 2, 3, 5, 6] and pk.targets.tolist() == [7, 8, 9, 14, 15]
    assert pk.cu_seqlens.tolist() == [0, 5, 8] and pk.max_seqlen == 5
    back = unpack(torch.arange(1.0, 6.0), batch.mask)  # [3, 4]
    assert back.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0], [4, 5, 0, 0]]


def test_pack_keeps_one_row_when_there_is_no_response_token():
    batch = collate([sample([5, 6], []), sample([7], [])], pad_id=0)
    pk = pack(batch)
    assert pk.input_ids.tolist() == [[5, 6]] and pk.keep.numel() == 0


@pytest.mark.parametrize("layout", [pack, pack_shared])
def test_pack_refuses_left_padding(layout):
    batch = collate([sample([5, 6], [7, 8]), sample([9], [10])], pad_id=0)
    left = type(batch)(
        batch.input_ids.flip(1), batch.attention_mask.flip(1), batch.mask, batch.old_logp, batch.adv, batch.versions
    )
    with pytest.raises(ValueError, match=f"^{layout.__name__} needs right-padded rows"):
        layout(left)


def test_pack_shared_hand_example():
    # rows: [5 6 | 7 8], [5 6 | 9], [4 | 3 2], [5 6 | -] (no response: dropped)
    rows = [sample([5, 6], [7, 8]), sample([5, 6], [9]), sample([4], [3, 2]), sample([5, 6], [])]
    batch = collate(rows, pad_id=0)
    sp = pack_shared(batch)
    # segment 0: prompt 5 6 once, then 7 8 (row 0) and 9 (row 1): 5 tokens, the row width;
    # segment 1 (4 3 2) does not fit beside it and takes a second row, padded
    assert sp.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 0, 0]]
    assert sp.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 0, 0]]  # 9 sits where it does in its own row
    # the prompt's last token (flat position 1) predicts both first tokens, 7 and 9; 7 predicts 8; row 2 from 5
    assert sp.keep.tolist() == [1, 2, 1, 5, 6] and sp.targets.tolist() == [7, 8, 9, 3, 2]
    a = shared_mask(sp).int()
    assert a[0, 4].tolist() == [1, 1, 0, 0, 1]  # 9 sees its prompt and itself, not the other response
    assert a[0, 3].tolist() == [1, 1, 1, 1, 0]  # 8 sees 5 6 7 8
    assert a[1, 2].tolist() == [1, 1, 1, 0, 0] and a[1, 3].tolist() == [0, 0, 0, 1, 0]  # padding sees itself
    back = unpack(torch.arange(1.0, 6.0), batch.mask)  # [4, 3]
    assert back.tolist() == [[0, 1, 2], [0, 3, 0], [4, 5, 0], [0, 0, 0]]


def test_pack_shared_splits_a_group_wider_than_the_cap_and_fills_rows():
    rows = [sample([5, 6, 7], [1] * 4) for _ in range(3)] + [sample([8], [2])]
    sp = pack_shared(collate(rows, pad_id=0), max_width=8)
    # the group of three 7-token rows: prompt + 4 + 4 = 11 > 8, so segments [3 + 4], [3 + 4], [3 + 4];
    # rows are 7 wide, and the 2-token segment does not fit beside any of them: a fourth row with padding
    assert sp.input_ids.shape == (4, 7)
    assert sp.input_ids[3].tolist() == [8, 2, 0, 0, 0, 0, 0]
    assert torch.equal(shared_mask(sp)[3, 2:, 2:], torch.eye(5, dtype=torch.bool))  # padding sees only itself
    wide = pack_shared(collate(rows, pad_id=0), max_width=32)  # the group fits: its prompt once, 15 tokens
    assert wide.input_ids.shape == (2, 3 + 3 * 4) and wide.input_ids[0].tolist() == [5, 6, 7] + [1] * 12


def test_pack_shared_keeps_one_row_when_there_is_no_response_token():
    sp = pack_shared(collate([sample([5, 6], []), sample([7], [])], pad_id=0))
    assert sp.input_ids.tolist() == [[5, 6]] and sp.keep.numel() == 0


def test_split_by_tokens_respects_the_budget():
    lengths = [5, 9, 3, 12, 4, 4]
    batch = collate([sample([1] * (n - 1), [2]) for n in lengths], pad_id=0)
    packed = split_by_tokens(batch, 14, packed=True)  # real tokens, in order: 5 + 9 fits, 3 + 12 does not
    assert [mb.attention_mask.sum(1).tolist() for mb in packed] == [[5, 9], [3], [12], [4, 4]]
    padded = split_by_tokens(batch, 14, packed=False)  # rows x longest: [5 9] costs 18 > 14
    assert [mb.attention_mask.sum(1).tolist() for mb in padded] == [[5], [9], [3], [12], [4, 4]]
    alone = split_by_tokens(batch, 8, packed=True)  # 9 and 12 exceed the budget: each goes alone
    assert [mb.attention_mask.sum(1).tolist() for mb in alone] == [[5], [9], [3], [12], [4, 4]]
    assert all(mb.attention_mask[:, -1].any() for mb in packed + padded + alone)  # each trimmed to its longest row


def test_packed_forward_equals_padded(data):
    model, samples = data
    batch = collate(samples, pad_id=0)
    m = copy.deepcopy(model).float()
    padded, packed = (make(m, packing=p) for p in (False, True))
    with torch.no_grad():
        (lp_pad, ent_pad), (lp_pack, ent_pack) = padded._forward(m, batch), packed._forward(m, batch)
    mask = batch.mask.bool()
    assert lp_pack.shape == lp_pad.shape == batch.mask.shape
    torch.testing.assert_close(lp_pack[mask], lp_pad[mask], rtol=0, atol=2e-5)  # fp32, different kernels
    torch.testing.assert_close(ent_pack[mask], ent_pad[mask], rtol=0, atol=2e-5)
    assert torch.all(lp_pack[~mask] == 0) and torch.all(ent_pack[~mask] == 0)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_shared_prompt_forward_equals_padded(grouped, kernel):
    model, samples = grouped
    batch = collate(samples, pad_id=0)
    assert len(pack_shared(batch).input_ids.flatten()) < int(batch.attention_mask.sum())  # the prompts are shared
    m = copy.deepcopy(model).float()
    m.config._attn_implementation = kernel
    padded, packed = (make(m, packing=p) for p in (False, True))
    with torch.no_grad():
        (lp_pad, ent_pad), (lp_pack, ent_pack) = padded._forward(m, batch), packed._forward(m, batch)
    mask = batch.mask.bool()
    torch.testing.assert_close(lp_pack[mask], lp_pad[mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(ent_pack[mask], ent_pad[mask], rtol=0, atol=2e-5)
    assert torch.all(lp_pack[~mask] == 0) and torch.all(ent_pack[~mask] == 0)


def _rms_norm_in_input_dtype(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def test_shared_prompts_give_the_same_loss_and_gradients_float64(grouped, monkeypatch):
    """HF's RMSNorm computes in float32 even in a float64 model: the shared prompt's gradient, summed over its
    responses before that norm's backward, then differs from the padded rows' by float32 rounding (1e-7
    relative). With the norm in the input's dtype the layouts agree to float64 rounding."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)
    objective = surrogate_objective("bapo", agg="seq-mean-token-sum", entropy_coef=0.01)
    assert_every_layout_matches(*grouped, dtype=torch.float64, rtol=1e-11, objective=objective)


def test_shared_prompts_give_the_same_loss_and_gradients_float32(grouped):
    assert_every_layout_matches(*grouped, dtype=torch.float32, rtol=2e-5)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_and_gradients_equal_for_every_layout_float64(data, agg):
    objective = surrogate_objective("bapo", agg=agg, entropy_coef=0.01)
    assert_every_layout_matches(*data, dtype=torch.float64, rtol=1e-11, objective=objective)


def test_loss_and_gradients_equal_for_every_layout_float32(data):
    assert_every_layout_matches(*data, dtype=torch.float32, rtol=2e-5)


def test_kl_to_reference_is_the_same_packed(data):
    model, samples = data
    batch = collate(samples, pad_id=0)
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    objective = surrogate_objective("bapo", kl_coef=0.1)
    a = run(model, batch, dtype=torch.float64, objective=objective, ref=ref_model, micro_batch_size=3)
    b = run(model, batch, dtype=torch.float64, objective=objective, ref=ref_model, packing=True, micro_batch_size=4)
    assert a[0]["learner/kl_ref"] > 0
    assert a[0]["learner/kl_ref"] == pytest.approx(b[0]["learner/kl_ref"], rel=1e-11)
    assert_same(b, a, rtol=1e-11)


@pytest.mark.parametrize("packing", [False, True])
def test_empty_micro_batches_for_rank_sync_change_nothing(data, packing):
    """What a data-parallel rank with fewer micro-batches runs: passes with no response token."""
    model, samples = data
    batch = collate(samples, pad_id=0)
    lrn = make(copy.deepcopy(model), micro_batch_size=4, reduce_max=lambda t: t + 2)
    micro = lrn.micro_batches(batch)
    assert len(micro) == 5 and micro[-1].num_tokens == 0 and micro[-2].num_tokens == 0
    base = run(model, batch, dtype=torch.float64, micro_batch_size=4, packing=packing)
    padded = run(model, batch, dtype=torch.float64, micro_batch_size=4, packing=packing, reduce_max=lambda t: t + 2)
    assert padded[0]["learner/loss"] == base[0]["learner/loss"]
    assert all(torch.equal(padded[1][k], base[1][k]) for k in base[1])


def test_engine_logp_matches_the_shared_prompt_learner(tiny_model, tiny_tok):
    """The rollout engine's behaviour log-probs against the learner's with the default layout (prompts shared)."""
    from bapo.data.loading import render_prompt
    from bapo.data.tasks import ArithSpec, arith_heldout
    from bapo.engines import HFRollout

    prompts = [render_prompt(p, tiny_tok) for p in arith_heldout(6, seed=1, heldout_frac=0.1, spec=ArithSpec())]
    samples = HFRollout(tiny_model, tiny_tok, n=4, max_new_tokens=32).generate(prompts, seed=1)
    lrn = Learner(tiny_model, W.learner_config(packing=True, micro_batch_size=256), objective=W.objective(),
                  pad_id=tiny_tok.pad_token_id)  # fmt: skip
    assert len(pack_shared(collate(samples, pad_id=0)).input_ids.flatten()) < sum(
        len(s.prompt.ids) + len(s.response_ids) for s in samples
    )  # the layout under test: each prompt once
    got = lrn.response_logp(samples)  # [B, T]
    diff = max((got[i, : len(s.logp)] - s.logp).abs().max().item() for i, s in enumerate(samples))
    assert diff < 1e-4, diff
