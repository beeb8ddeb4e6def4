"""scripts/gpu_check.py's two-rank worker: ``torchrun --nproc_per_node=2 scripts/gpu_check_worker.py --out F``.

Every rank joins torchrun's group (NCCL on GPUs, gloo on CPU: ``CUDA_VISIBLE_DEVICES=``), resolves the hub id of
``experiment=paper_7b`` from ``$HF_HUB_CACHE`` (``bapo.modeling.model_path``: the first rank, then the others from
the cache), builds the learner as the loop does (the policy on the meta device, each rank reading its rows of the
safetensors), compares its shards and a forward pass with an eager load, makes one update (each rank its own
rows), and streams the new weights into a rollout engine on every rank: vLLM's external_launcher engine where vLLM
imports, else the HF engine. The engine's log-probs of its own samples, generated before and after that sync, are
compared with the learner's (``Learner.response_logp``, every rank's samples gathered): after the sync they agree.
Rank 0 writes every rank's findings as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts import gpu_check_scale as scale  # noqa: E402

LR = 5e-3  # a visible change of the weights in one update, so the sync's before and after differ


def run_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from bapo.config import build

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="config", overrides=overrides)
    return build(cfg, "gpu_check_worker")


def engine_for(rc, path: str, tok, learner):
    """The rollout engine of ``rc`` on this rank (vLLM: one external_launcher engine per rank)."""
    from bapo.config import prompt_limit
    from bapo.modeling import load_model
    from bapo.rollout import build_rollout

    model = None
    if rc.rollout.engine == "hf":
        model = load_model(path, dtype=rc.model.dtype, device=learner.device)
    context = getattr(learner.model.config, "max_position_embeddings", None)
    limit = prompt_limit(rc.data.max_prompt_tokens, rc.rollout.max_new_tokens, context)
    return build_rollout(
        rc.rollout, path=path, tokenizer=tok, model=model, dtype=rc.model.dtype, seed=rc.seed,
        max_model_len=limit + rc.rollout.max_new_tokens,
    )  # fmt: skip


def prompts(tok, k: int):
    from bapo.data import render_prompts
    from bapo.samples import Problem

    problems = [Problem(f"p{i}", f"What is {i} + {i + 1}?", str(2 * i + 1)) for i in range(k)]
    return render_prompts(problems, tok, max_prompt_tokens=256)


def mismatch(learner, samples) -> float:
    """Mean |engine log-prob - learner log-prob| over the samples' response tokens (a collective)."""
    from bapo import dist

    every = [s for part in dist.all_gather_object(samples) for s in part]
    lp = learner.response_logp(every)  # [B, T] every rank's samples, each rank its share, gathered
    diffs = [(lp[i, : len(s.logp)] - s.logp).abs() for i, s in enumerate(every)]
    return float(torch.cat(diffs).mean())


def work(args) -> dict:
    from bapo import dist
    from bapo.modeling import model_path

    device = dist.init()
    rank, world = dist.rank(), dist.world_size()
    vllm = importlib.util.find_spec("vllm") is not None
    over = ["experiment=paper_7b", *args.override, f"learner.lr={LR}", "learner.max_tokens_per_micro_batch=512"]
    over += ["model.max_new_tokens=8", "rollout.n=2"]
    over += ["rollout.gpu_memory_utilization=0.3"] if vllm else ["rollout=hf"]
    rc = run_config(over)
    out = {"rank": rank, "world": world, "backend": torch.distributed.get_backend(), "device": str(device)}
    t0 = time.perf_counter()
    path = model_path(rc.model.name_or_path)  # a collective: the first rank resolves, then the others
    out |= {"repo_id": rc.model.name_or_path, "resolved": path, "resolve_s": round(time.perf_counter() - t0, 2)}
    learner, tok = scale.build_learner(rc, path)
    out["against_eager"] = scale.against_eager(learner, path)
    before = [scale.local_tensor(p).detach().clone() for p in learner.model.parameters()]
    batch = scale.synthetic_batch(learner.model.config.vocab_size, 4, 8, 24, seed=rank)
    metrics = learner.update(batch)
    params = zip(learner.model.parameters(), before, strict=True)
    moved = max(float((scale.local_tensor(p) - b).abs().max()) for p, b in params)
    out["update"] = {"grad_norm": metrics["learner/grad_norm"], "max_change": moved, "version": learner.version}

    engine = engine_for(rc, path, tok, learner)
    try:
        ps = prompts(tok, 2)
        stale = engine.generate(ps, n=1, seed=rank)  # the checkpoint's weights: version 0
        sync_s = engine.load_weights(learner.weights(), learner.version)  # streamed: one tensor gathered at a time
        fresh = engine.generate(ps, n=1, seed=rank)
        out["sync"] = {
            "engine": type(engine).__name__,
            "seconds": round(sync_s, 3),
            "engine_version": engine.version,
            "samples_version": sorted({s.version for s in fresh}),
            "logp_mismatch_before": mismatch(learner, stale),
            "logp_mismatch_after": mismatch(learner, fresh),
        }
    finally:
        if hasattr(engine, "close"):
            engine.close()
    s, a = out["sync"], out["against_eager"]
    return scale.judge(
        out,
        against_eager=a["ok"],
        finite_grad_norm=math.isfinite(out["update"]["grad_norm"]),
        weights_moved=moved > 0,
        samples_of_the_new_version=s["samples_version"] == [learner.version],
        engine_matches_learner_after_sync=s["logp_mismatch_after"] < min(0.1, 0.5 * s["logp_mismatch_before"]),
    )


def main(argv=None) -> int:
    from bapo import dist

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--override", nargs="*", default=[], help="more overrides: the stand-in's shape (model.arch.*)")
    args = p.parse_args(argv)
    try:
        mine = work(args)
    except Exception as e:  # every rank reports; a rank that failed says why
        mine = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    ranks = dist.all_gather_object(mine) if dist.active() else [mine]
    if dist.rank() == 0:
        args.out.write_text(json.dumps({"ok": all(r["ok"] for r in ranks), "ranks": ranks}, indent=2) + "\n")
    dist.teardown(barrier=all(r["ok"] for r in ranks))
    return 0 if all(r["ok"] for r in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
