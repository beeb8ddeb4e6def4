"""Run under torchrun (2 gloo ranks, .venv-vllm) by tests/e2e/engines/test_vllm_colocated.py; writes
``$OUT/rank{r}.json``.

Every rank builds its own vLLM engine through ``external_launcher`` (``tensor_parallel_size`` 1: two engines;
2: one engine over both ranks), beside an FSDP2-sharded copy of the same model. Checks, each ``[ok, detail]``:

- ``colocated``: the engine runs in this process under torchrun's group (external_launcher), and the ranks
  sample differently with their own seeds (tp=1) or identically as one engine (tp=2);
- ``stream_sync``: after the sharded weights are perturbed and streamed into the engine
  (``StreamedWeights``, one parameter gathered at a time), vLLM's log-probs match the HF forward pass of the
  new full weights, and not the old ones;
- ``eval_shared``: data-parallel evaluation gives the same samples on both ranks, and again on a rerun.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

from bapo.infra import dist
from bapo.learner import fsdp
from bapo.learner.weights import StreamedWeights
from bapo.modeling import load_model, load_tokenizer
from tests.helpers.engines import ENGINE_KW, arith_prompts, learner_logp_diff


def main(out: Path, model_dir: Path, tp: int) -> None:
    device = dist.init()
    from bapo.engines.vllm import VLLMRollout

    tok = load_tokenizer(str(model_dir))
    engine = VLLMRollout(str(model_dir), tok, n=2, temperature=0.7, tensor_parallel_size=tp, **ENGINE_KW)
    results: dict[str, list] = {}
    prompts = arith_prompts(tok, 6)

    def check(name, fn):
        try:
            results[name] = [True, fn()]
        except Exception:
            results[name] = [False, traceback.format_exc()]

    def colocated():
        backend = engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
        assert engine.colocated and backend == "external_launcher", (engine.colocated, backend)
        share = dist.rank() // tp
        rows = [s.response_ids.tolist() for s in engine.generate(prompts, seed=100 + share)]
        both = dist.all_gather_object(rows)
        assert (both[0] == both[1]) == (tp == 2), f"tp={tp}: ranks sampled {'alike' if both[0] == both[1] else 'apart'}"
        return f"external_launcher, tp={tp}, ranks {'alike' if tp == 2 else 'apart'}"

    def stream_sync():
        ref = load_model(str(model_dir)).eval()
        model = fsdp.wrap(load_model(str(model_dir), device="meta"), device=device)
        g = torch.Generator().manual_seed(7 + dist.rank())
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local()
                local.add_(torch.randn(local.shape, generator=g) * 0.05)
        new = load_model(str(model_dir)).eval()
        new.load_state_dict(dict(StreamedWeights(model, device).items()))
        engine.generate(prompts, n=1)  # fills the prefix cache with the old weights' KV
        seconds = engine.load_weights(StreamedWeights(model, device), version=3)
        samples = engine.generate(prompts, n=2, seed=5)
        assert {s.version for s in samples} == {3}
        d_new = learner_logp_diff(new, samples, 0.7, engine.pad_id)
        d_old = learner_logp_diff(ref, samples, 0.7, engine.pad_id)
        assert d_new < 1e-4 and d_old > 1e-2, (d_new, d_old)
        return f"|logp - new| {d_new:.1e}, |logp - old| {d_old:.1e}, sync {seconds:.3f} s"

    def eval_shared():
        from bapo.eval.evaluate import generate_shared

        a, oa = generate_shared(engine, prompts, n=2, temperature=0.7, seed=9)
        b, ob = generate_shared(engine, prompts, n=2, temperature=0.7, seed=9)
        rows_a, rows_b = [s.response_ids.tolist() for s in a], [s.response_ids.tolist() for s in b]
        assert rows_a == rows_b and oa == ob, "a rerun with the same seed sampled differently"
        both = dist.all_gather_object(rows_a)
        assert both[0] == both[1], "the ranks disagree on the gathered samples"
        assert [s.prompt for s in a] == [p for p in prompts for _ in range(2)]
        return f"{len(a)} samples, shares {sorted({o['share'] for o in oa})}, rerun identical"

    check("colocated", colocated)
    check("stream_sync", stream_sync)
    check("eval_shared", eval_shared)
    (out / f"rank{dist.rank()}.json").write_text(json.dumps(results))
    dist.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
