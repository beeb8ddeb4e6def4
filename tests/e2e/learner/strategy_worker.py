"""Run under torchrun (2 gloo ranks) by tests/e2e/learner/test_strategy.py; writes ``$OUT/rank{r}.json``.

Each check records ``[ok, detail]`` under its name, so the test reports every check on its own:

- ``meta_load``: a model built on the meta device and sharded reads exactly the shards that loading the
  whole checkpoint and sharding it gives (fp32 checkpoint, and a bf16 one into fp32 master shards).
- ``stream_values``: :class:`StreamedWeights` yields the full weights, every state-dict name, in order.
- ``stream_one_at_a_time``: a consumer that drops each tensor never has two full parameters alive
  (a tied alias is the same tensor), and each parameter is gathered once.
- ``snapshot``: a CPU copy with the full weights, unchanged by a later update; tied names share a tensor.
- ``eval_shared``: data-parallel evaluation gathers both ranks' shares into problem order, the same on
  both ranks, with each sample's seed recorded; with a 2-rank tensor-parallel engine there is one share.
- ``maker_tp``: a rollout batch made by one 2-rank tensor-parallel engine holds each prompt once.
- ``stream_bf16``: weights asked for in bf16 are cast on the shard, so the all-gather moves bf16; values are the
  bf16 of the full weights; snapshots too.
- ``export_bf16``: the HF export holds the model's dtype (bf16), says so in config.json, carries the extra files.
- ``recompute_sharded``: recompute's log-probs: each rank runs the forward of its half of the samples only, and
  every rank gets all rows, equal to one process computing them all.
- ``kl_reference``: the KL reference is sharded (1/W of it per rank), frozen, and its log-probs equal an
  unsharded copy's.
"""

from __future__ import annotations

import json
import sys
import traceback
import weakref
from pathlib import Path

import torch

from bapo.infra import dist
from bapo.learner import fsdp
from bapo.learner.strategy import FSDPStrategy
from bapo.learner.weights import StreamedWeights
from bapo.modeling import load_model


def local_shards(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def check_meta_load(src: Path, device) -> str:
    # Every collective (wrap, forward) runs on both ranks before any assertion, so a failure on one rank
    # cannot leave the other waiting in a collective.
    runs = []
    for folder in (src / "fp32", src / "bf16"):
        eager = fsdp.wrap(load_model(str(folder)).float(), device=device)
        lazy = load_model(str(folder), device="meta")
        was_meta = all(p.is_meta for p in lazy.parameters()) and not any(b.is_meta for b in lazy.buffers())
        lazy = fsdp.wrap(lazy, device=device)
        x = torch.tensor([[3, 4, 5]])
        shards = local_shards(eager), local_shards(lazy)  # before the forward: the root stays unsharded after it
        runs.append((folder.name, was_meta, eager, lazy, *shards, eager(x).logits, lazy(x).logits))
    for name, was_meta, eager, lazy, a, b, eager_logits, lazy_logits in runs:
        assert was_meta, f"{name}: parameters not on meta, or buffers on meta"
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        for k in a:
            assert b[k].dtype == torch.float32, (k, b[k].dtype)
            assert torch.equal(a[k], b[k]), f"{name}: shard of {k} differs"
        bufs = dict(eager.named_buffers())
        for k, v in lazy.named_buffers():
            assert torch.equal(v, bufs[k]), f"buffer {k} differs"
        assert torch.equal(eager_logits, lazy_logits), f"{name}: logits differ"
    return "fp32 and bf16 checkpoints: lazy shards == eager shards (fp32)"


def check_stream(src: Path, device) -> tuple[str, str]:
    ref = load_model(str(src / "tied"))
    model = fsdp.wrap(load_model(str(src / "tied"), device="meta"), device=device)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    full = fsdp.full_state_dict(model, rank0_only=False)
    names, alive_max, gathers = [], 0, 0
    from torch.distributed.tensor import DTensor

    original = DTensor.full_tensor

    def counting(self, *a, **k):
        nonlocal gathers
        gathers += 1
        return original(self, *a, **k)

    DTensor.full_tensor = counting
    refs: list[weakref.ref] = []
    wrong: list[str] = []  # asserted after the loop: every gather (a collective) runs on both ranks first
    try:
        for name, t in StreamedWeights(model, device).items():
            if not (torch.equal(t, full[name]) and torch.equal(t, ref.state_dict()[name])):
                wrong.append(name)
            names.append(name)
            refs.append(weakref.ref(t))
            del t
            alive = {id(r()) for r in refs if r() is not None}
            alive_max = max(alive_max, len(alive))
    finally:
        DTensor.full_tensor = original
    assert not wrong, f"values differ: {wrong}"
    assert names == list(full), "names or order differ from the state dict"
    n_params = len(list(model.parameters()))  # tied: counted once
    assert gathers == n_params, f"{gathers} gathers for {n_params} parameters"
    assert alive_max <= 2, f"{alive_max} full tensors alive at once"  # the current one + the tied embedding
    values = f"{len(names)} names in state-dict order, equal to the gathered state dict"
    return values, f"{gathers} gathers for {n_params} parameters, at most {alive_max} alive"


def check_snapshot(src: Path, device) -> str:
    model = fsdp.wrap(load_model(str(src / "tied"), device="meta"), device=device)
    strat = FSDPStrategy.__new__(FSDPStrategy)
    strat.device = device
    snap = strat.snapshot(model)
    before = {k: v.clone() for k, v in snap.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    after = dict(StreamedWeights(model, device).items())  # the last collective: assertions follow
    assert all(v.device.type == "cpu" for v in snap.values())
    assert snap["lm_head.weight"] is snap["model.embed_tokens.weight"]
    assert all(torch.equal(before[k], snap[k]) for k in snap), "the snapshot changed with the model"
    assert all(torch.equal(after[k], before[k] + 1.0) for k in snap if snap[k].is_floating_point())
    return f"{len(snap)} CPU tensors, a copy; tied names share one"


class FakeEngine:
    """Response ids encode (prompt, request, seed), so the gather's order can be checked."""

    version = 0
    pad_id = 0

    def __init__(self, tp: int = 1):
        self.tensor_parallel_size = tp
        self.calls: list[tuple[int, int | None]] = []

    def generate(self, prompts, *, n=None, temperature=None, seed=None):
        from bapo.samples import Sample

        n = 2 if n is None else n
        self.calls.append((len(prompts), seed))
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                ids = torch.tensor([int(p.problem.id), i * n + j, (seed or 0) % 1000, 2])
                out.append(Sample(p, i, ids, torch.zeros(4), f"{p.problem.id}", self.version, False))
        return out

    def load_weights(self, weights, version):
        return 0.0


def prompts(count: int):
    from bapo.samples import Problem, Prompt

    return [Prompt(Problem(str(i), f"q{i}", str(i)), f"q{i}", (5, 6, i + 7)) for i in range(count)]


def check_eval_shared() -> str:
    from bapo.eval.evaluate import generate_shared

    ps = prompts(5)
    samples, origin = generate_shared(FakeEngine(), ps, n=3, temperature=1.0, seed=11)
    everyone = dist.all_gather_object([(s.response_ids.tolist(), o) for s, o in zip(samples, origin, strict=True)])
    got = [(int(s.response_ids[0]), s.prompt.problem.id) for s in samples]
    assert got == [(i // 3, str(i // 3)) for i in range(15)], got
    for i, o in enumerate(origin):
        assert o["share"] == (i // 3) % 2 and int(samples[i].response_ids[1]) == o["request"], (i, o)
        assert int(samples[i].response_ids[2]) == o["seed"] % 1000
    seeds = {o["share"]: o["seed"] for o in origin}
    assert seeds[0] != seeds[1], "both shares sampled with one seed"
    assert everyone[0] == everyone[1], "the ranks disagree on the gathered samples"
    tp_engine = FakeEngine(tp=2)
    samples, origin = generate_shared(tp_engine, ps, n=2, temperature=1.0, seed=11)
    assert tp_engine.calls == [(5, 11)], tp_engine.calls  # one share: every prompt, the run's own seed
    assert [int(s.response_ids[0]) for s in samples] == [i // 2 for i in range(10)]
    return "2 shares gathered into problem order on both ranks; seeds recorded; tp=2 -> one share"


def check_maker_tp() -> str:
    from bapo.reward import MathVerifier
    from bapo.rollout.maker import RolloutMaker

    engine = FakeEngine(tp=2)
    with MathVerifier(num_workers=0) as verifier:
        maker = RolloutMaker(iter(prompts(4)), engine, verifier, prompts_per_step=4, seed=3, rank=dist.rank(), world=2)
        batch = maker.gather(maker.make(1, 0, {}))
    seeds = dist.all_gather_object(engine.calls[0][1])
    ids = [s.prompt.problem.id for s in batch.samples]
    assert sorted(ids) == sorted(["0", "1", "2", "3"] * 2), ids  # 2 samples per prompt, no rank's copy twice
    assert engine.calls[0][0] == 4, engine.calls  # both ranks of the group generate all 4 prompts
    assert seeds[0] == seeds[1], "the ranks of one tensor-parallel group sampled with different seeds"
    return f"{len(ids)} samples, each prompt once per sample index; both ranks used seed {seeds[0]}"


def check_stream_bf16(src: Path, device) -> str:
    from torch.distributed.tensor import DTensor

    ref = load_model(str(src / "fp32"))
    model = fsdp.wrap(load_model(str(src / "fp32"), device="meta"), device=device)
    original, dtypes = DTensor.full_tensor, set()

    def recording(self, *a, **k):
        dtypes.add(self.to_local().dtype)
        return original(self, *a, **k)

    DTensor.full_tensor = recording
    try:
        streamed = {k: v.clone() for k, v in StreamedWeights(model, device, torch.bfloat16).items()}
        strat = FSDPStrategy.__new__(FSDPStrategy)
        strat.device = device
        snap = strat.snapshot(model, torch.bfloat16)
    finally:
        DTensor.full_tensor = original
    assert dtypes == {torch.bfloat16}, f"the gathers moved {dtypes}"
    full = ref.state_dict()
    for name, t in streamed.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].to(torch.bfloat16)), name
        assert snap[name].dtype == torch.bfloat16 and torch.equal(snap[name], t), name
    return f"{len(streamed)} tensors gathered as bf16 (cast before the gather); snapshot bf16 on the CPU"


def check_export_bf16(src: Path, device, out: Path) -> str:
    import json as js

    from transformers import AutoModelForCausalLM

    model = fsdp.wrap(load_model(str(src / "fp32"), device="meta"), device=device)
    folder = dist.shared_path(out / "export")
    fsdp.save_hf(model, folder, dtype=torch.bfloat16, extra={"bapo_config.yaml": "seed: 7\n"}, device=device)
    dist.barrier()
    if dist.rank() != 0:
        return "rank 0 writes"
    assert js.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert (folder / "bapo_config.yaml").read_text() == "seed: 7\n"
    back = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    ref = load_model(str(src / "fp32")).state_dict()
    for name, t in back.state_dict().items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16)), name
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return f"bf16 safetensors ({size} bytes), config.json dtype bfloat16, bapo_config.yaml beside them"


def _fsdp_learner(src: Path, **kw):
    from bapo.algos import build_objective
    from bapo.learner import Learner
    from tests.helpers.config import run_config

    rc = run_config("learner=fsdp", "learner.micro_batch_size=2", "debug=smoke")
    model = load_model(str(src / "fp32"), device="meta")
    return Learner(model, rc.learner, objective=build_objective(rc.algo), pad_id=0, **kw), rc


def _samples(count: int):
    from bapo.samples import Problem, Prompt, Sample

    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(count):
        prompt = Prompt(
            Problem(str(i), f"q{i}", "1"), f"q{i}", tuple(torch.randint(3, 300, (4 + i % 3,), generator=g).tolist())
        )
        resp = torch.randint(3, 300, (3 + i % 4,), generator=g)
        out.append(Sample(prompt, i, resp, torch.zeros(len(resp)), "", 0, True))
    return out


def check_recompute_sharded(src: Path, device) -> str:
    from bapo.learner import Learner

    lrn, _ = _fsdp_learner(src)
    samples = _samples(7)  # odd: the ranks hold 4 and 3
    rows = []
    original = Learner._forward

    def counting(self, model, mb, entropy=True):
        rows.append(int((mb.mask.sum(1) > 0).sum()))
        return original(self, model, mb, entropy)

    Learner._forward = counting
    try:
        lp = lrn.response_logp(samples)  # [7, T]
    finally:
        Learner._forward = original
    everyone = dist.all_gather_object(lp.tolist())
    mine = sum(rows)
    expected = len(range(dist.rank(), 7, 2))
    assert mine == expected, f"rank {dist.rank()} ran the forward of {mine} samples, its share is {expected}"
    assert everyone[0] == everyone[1], "the ranks disagree on the gathered log-probs"
    ref = load_model(str(src / "fp32")).eval()
    from bapo.algos import token_logp
    from bapo.learner import collate

    for i, s in enumerate(samples):
        b = collate([s], pad_id=0)
        with torch.no_grad():
            full = token_logp(ref(input_ids=b.input_ids).logits[:, :-1].float(), b.input_ids[:, 1:])[0]
        want = full[b.mask[0].bool()]
        assert torch.allclose(lp[i, : len(want)], want, atol=1e-5), f"sample {i} differs"
    return f"this rank forwarded {mine} of 7 samples; all 7 rows gathered, equal to one unsharded forward"


def check_kl_reference(src: Path, device) -> str:
    from torch.distributed.tensor import DTensor

    ref = load_model(str(src / "fp32"), device="meta")
    lrn, _ = _fsdp_learner(src, ref_model=ref)
    params = list(lrn.ref_model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params), "the reference is not sharded"
    assert not any(p.requires_grad for p in params), "the reference has trainable parameters"
    local = sum(p.to_local().numel() for p in params)
    total = sum(p.numel() for p in params)
    from bapo.learner import collate
    from bapo.samples import ScoredSample

    batch = collate([ScoredSample(s, 0.0, 0.0, False) for s in _samples(4)], pad_id=0)
    got = lrn._ref_logp(batch)
    whole = load_model(str(src / "fp32")).eval()
    want = lrn._forward(whole, batch, entropy=False)[0]
    assert torch.allclose(got, want, atol=1e-6), "the sharded reference's log-probs differ"
    assert local <= total // 2 + 1024, f"this rank holds {local} of the reference's {total} parameters"
    return f"sharded: this rank holds {local} of {total} reference parameters; log-probs equal an unsharded copy"


def main(out: Path, src: Path) -> None:
    device = dist.init(timeout_s=120)  # a collective left waiting by a bug fails instead of hanging
    results: dict[str, list] = {}
    checks = {
        "meta_load": lambda: check_meta_load(src, device),
        "stream": lambda: check_stream(src, device),
        "snapshot": lambda: check_snapshot(src, device),
        "eval_shared": check_eval_shared,
        "maker_tp": check_maker_tp,
        "stream_bf16": lambda: check_stream_bf16(src, device),
        "export_bf16": lambda: check_export_bf16(src, device, out),
        "recompute_sharded": lambda: check_recompute_sharded(src, device),
        "kl_reference": lambda: check_kl_reference(src, device),
    }
    for name, fn in checks.items():
        try:
            detail = fn()
            if isinstance(detail, tuple):
                results[name + "_values"], results[name + "_one_at_a_time"] = [True, detail[0]], [True, detail[1]]
            else:
                results[name] = [True, detail]
        except Exception:
            results[name] = [False, traceback.format_exc()]
        dist.barrier()
    (out / f"rank{dist.rank()}.json").write_text(json.dumps(results))
    dist.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
