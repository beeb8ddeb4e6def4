"""Run under torchrun (2 gloo ranks) by tests/learner/test_strategy.py; writes ``$OUT/rank{r}.json``.

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
"""

from __future__ import annotations

import json
import sys
import traceback
import weakref
from pathlib import Path

import torch

from bapo import dist
from bapo.learner import fsdp
from bapo.learner.strategy import FSDPStrategy, StreamedWeights
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
        from bapo.types import Sample

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
    from bapo.types import Problem, Prompt

    return [Prompt(Problem(str(i), f"q{i}", str(i)), f"q{i}", (5, 6, i + 7)) for i in range(count)]


def check_eval_shared() -> str:
    from bapo.evaluate import generate_shared

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
    from bapo.batches import RolloutMaker
    from bapo.reward import MathVerifier

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


def main(out: Path, src: Path) -> None:
    device = dist.init(timeout_s=120)  # a collective left waiting by a bug fails instead of hanging
    results: dict[str, list] = {}
    checks = {
        "meta_load": lambda: check_meta_load(src, device),
        "stream": lambda: check_stream(src, device),
        "snapshot": lambda: check_snapshot(src, device),
        "eval_shared": check_eval_shared,
        "maker_tp": check_maker_tp,
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
