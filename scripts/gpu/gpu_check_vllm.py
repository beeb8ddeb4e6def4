"""The day-one GPU check's vLLM sections (full mode; scripts/gpu/gpu_check.py runs each in a process of its own through
gpu_check_worker.py). Both serve the 7B-wide stand-in under its hub id (as ``metaload`` does; the toy stand-in in
a dry run), build the learner as the loop builds it (FSDP2 meta-load in a one-rank group), sample at paper_7b's
temperature (0.6) and compare the engine's log-probs of its own samples with the learner's
(``Learner.response_logp``): the mean and largest |difference| over the response tokens, and the share above 0.1.

``server``: ``rollout=vllm_server`` starts its server (``python -m bapo.engines.vllm_server_process``: vLLM's OpenAI
server under a parent watch); the learner makes one update (a large learning rate, so versions differ visibly) and its
weights are streamed to the server (``engine.load_weights(learner.weights(), 1)``: the FSDP learner's
``StreamedWeights``, a staged folder, the server's reload, the prefix-cache reset). Then: whether the server holds
exactly the learner's weights (the engine's fingerprint, :func:`server_holds_learner_weights`), the seconds of
the sync, the log-probs after the sync on the same prompts as before it (their prompt KV was cached under the old
weights: the first response token's log-prob shows a prefix cache that was not reset), and tokens/s.

``logprobs``: ``rollout=vllm`` in this process with sleep mode: the learner's updated weights loaded, then the
log-probs at T = 0.6 (a server or engine that returned untempered log-probs would differ by far more than the
tolerance), again after ``sleep`` at level 1 (weights offloaded to host memory and back: the same tokens for the
same seeds) and at level 2 (weights discarded, refilled by ``load_weights``), and seed reproducibility: the same
seed gives the same tokens, another seed other tokens. On CPU vLLM has no sleep mode: sleep is a no-op there and
the section says so (``sleep_mode: false``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from scripts.gpu.gpu_check_scale import (
    REPO_ID,
    arch_overrides,
    build_learner,
    one_rank_group,
    run_config,
    serve_hub_cache,
    standin_arch,
    synthetic_batch,
    write_wide_standin,
)

LR = 5e-3  # one update moves the weights visibly, so the engine's log-probs before and after a sync differ
TOLERANCE = 0.1  # mean |engine - learner| log-prob: both bf16 on a GPU, different kernels (vLLM's and torch's)
SIZES = {True: dict(prompts=2, n=2, new_tokens=8), False: dict(prompts=16, n=4, new_tokens=256)}  # by ctx.dry


def standin_world(ctx, rollout: list[str]):
    """(run config, checkpoint path, learner, tokenizer, device): the stand-in served under its hub id."""
    from bapo.modeling import model_path

    device = one_rank_group()
    arch = standin_arch(ctx.standin_layers, ctx.dry)
    cache = ctx.scratch / "hub"
    write_wide_standin(cache, arch, device)
    serve_hub_cache(cache)
    path = model_path(REPO_ID)
    s = SIZES[ctx.dry]
    over = ["experiment=paper_7b", *arch_overrides(arch), *rollout, f"learner.lr={LR}", f"rollout.n={s['n']}"]
    over += [f"model.max_new_tokens={s['new_tokens']}", "learner.max_tokens_per_micro_batch=4096"]
    over += ["rollout.gpu_memory_utilization=0.3"] + (["learner.mixed_precision=fp32"] if ctx.dry else [])
    rc = run_config(*over)
    learner, tok = build_learner(rc, path)
    return rc, path, learner, tok, device


def engine_for(rc, path: str, tok, learner):
    """The rollout engine of ``rc`` as the loop builds it (``bapo.engines.build_rollout``)."""
    from bapo.config import prompt_limit
    from bapo.engines import build_rollout

    context = getattr(learner.model.config, "max_position_embeddings", None)
    limit = prompt_limit(rc.data.max_prompt_tokens, rc.rollout.max_new_tokens, context)
    return build_rollout(rc.rollout, path=path, tokenizer=tok, dtype=rc.model.dtype, seed=rc.seed,
                         max_model_len=limit + rc.rollout.max_new_tokens)  # fmt: skip


def prompts(tok, k: int):
    from bapo.data.loading import render_prompts
    from bapo.samples import Problem

    problems = [Problem(f"p{i}", f"What is {i} + {i + 1}? Show your steps.", str(2 * i + 1)) for i in range(k)]
    return render_prompts(problems, tok, max_prompt_tokens=256)


def mismatch(learner, samples) -> dict:
    """|engine log-prob - learner log-prob| over the samples' response tokens: mean, max, share > 0.1, and the
    mean at the first response token (whose logits come from the prompt's KV alone)."""
    lp = learner.response_logp(samples)  # [B, T]
    diffs = [(lp[i, : len(s.logp)].float().cpu() - torch.as_tensor(s.logp)).abs() for i, s in enumerate(samples)]
    d = torch.cat(diffs)  # [tokens]
    first = torch.stack([x[0] for x in diffs if len(x)])  # [B]
    return {
        "mean": round(float(d.mean()), 5),
        "max": round(float(d.max()), 5),
        "share_over_0.1": round(float((d > 0.1).float().mean()), 4),
        "first_token_mean": round(float(first.mean()), 5),
        "tokens": int(d.numel()),
    }


def tokens_of(samples) -> list[list[int]]:
    return [list(map(int, s.response_ids)) for s in samples]


def update(learner, seed: int = 0) -> float:
    """One update of the learner (its weights move); returns the grad norm."""
    vocab = learner.model.config.vocab_size
    return float(learner.update(synthetic_batch(vocab, 4, 8, 24, seed=seed))["learner/grad_norm"])


def server_holds_learner_weights(engine, learner) -> dict:
    """Whether the server's workers read exactly the learner's weights at the last sync: the learner's tensors
    gathered again one name at a time (``weights[name]``, not the sync's stream), fingerprinted in the engine's
    dtype (tied names once), against the digest the workers answered (``engine.fingerprint()``)."""
    from bapo.engines.staging import digest, fingerprint

    out: dict[str, Any] = {
        "sync_parts_s": {k: round(v, 3) for k, v in (getattr(engine, "sync_parts", None) or {}).items()}
    }
    reply = engine.fingerprint()
    t0 = time.perf_counter()
    weights = learner.weights()
    values = getattr(weights, "_sd", weights)  # tied names share one tensor object
    seen, want = set(), {}
    for name in list(weights):
        if id(values[name]) in seen:
            continue
        seen.add(id(values[name]))
        t = weights[name]
        want[name] = fingerprint(t.to(engine.dtype) if t.is_floating_point() else t)
    expected = {"tensors": len(want), "digest": digest(want)}
    out |= {"fingerprint_s": round(time.perf_counter() - t0, 3), "fingerprint_reply": reply}
    return out | {"fingerprint": bool(reply) and all(r == expected for r in reply), "fingerprint_expected": expected}


def server(ctx) -> dict:
    rc, path, learner, tok, device = standin_world(ctx, ["rollout=vllm_server"])
    s = SIZES[ctx.dry]
    t0 = time.perf_counter()
    engine = engine_for(rc, path, tok, learner)
    out: dict[str, Any] = {"engine": type(engine).__name__, "start_s": round(time.perf_counter() - t0, 1)}
    out["temperature"] = rc.rollout.temperature
    try:
        ps = prompts(tok, s["prompts"])
        stale = engine.generate(ps, seed=1)  # version 0; its prompts' KV enters the prefix cache
        out["grad_norm"] = update(learner)
        out["sync_s"] = round(engine.load_weights(learner.weights(), learner.version), 3)
        out |= server_holds_learner_weights(engine, learner)
        t1 = time.perf_counter()
        fresh = engine.generate(ps, seed=1)  # the same prompts: a stale prefix cache would serve the old KV
        sec = time.perf_counter() - t1
        new_tokens = sum(len(x.response_ids) for x in fresh)
        out |= {"engine_version": engine.version, "samples_version": sorted({x.version for x in fresh})}
        out |= {"sequences": len(fresh), "new_tokens": new_tokens, "tokens_per_s": round(new_tokens / sec, 1)}
    finally:
        engine.close()
    out["logp_before_sync"] = before = mismatch(learner, stale)
    out["logp_after_sync"] = after = mismatch(learner, fresh)
    checks = {
        "samples_of_the_new_version": out["samples_version"] == [learner.version],
        "logp_match_after_sync": after["mean"] <= min(TOLERANCE, 0.5 * before["mean"]),
        "prefix_cache_reset": after["first_token_mean"] <= min(TOLERANCE, 0.5 * before["first_token_mean"]),
    }
    if out["fingerprint"] is not None:
        checks["server_holds_learner_weights"] = out["fingerprint"]
    return out | {"checks": checks}


def logprobs(ctx) -> dict:
    rc, path, learner, tok, device = standin_world(ctx, ["rollout=vllm", "rollout.enable_sleep_mode=true"])
    ps = prompts(tok, SIZES[ctx.dry]["prompts"])
    engine = engine_for(rc, path, tok, learner)
    out: dict[str, Any] = {"engine": type(engine).__name__, "temperature": rc.rollout.temperature,
                           "sleep_mode": engine.sleep_mode}  # fmt: skip
    try:
        out["grad_norm"] = update(learner)
        engine.load_weights(learner.weights(), learner.version)
        a = engine.generate(ps, seed=7)
        again, other = engine.generate(ps, seed=7), engine.generate(ps, seed=8)
        engine.sleep()  # level 1: weights to host memory, KV cache freed
        out["free_gib_asleep_1"] = free_gib(device)
        engine.wake()
        out["free_gib_awake"] = free_gib(device)
        level1 = engine.generate(ps, seed=7)
        engine.sleep_level = 2  # the same engine at level 2: weights discarded, refilled by the next load
        engine.sleep()
        out["version_asleep_2"] = engine.version
        t0 = time.perf_counter()
        engine.load_weights(learner.weights(), learner.version)
        out["refill_s"] = round(time.perf_counter() - t0, 3)
        level2 = engine.generate(ps, seed=7)
    finally:
        engine.close()
    out |= {"logp": mismatch(learner, a), "logp_after_sleep_1": mismatch(learner, level1),
            "logp_after_sleep_2": mismatch(learner, level2)}  # fmt: skip
    out |= {"same_seed_same_tokens": tokens_of(a) == tokens_of(again), "other_seed_other_tokens":
            tokens_of(a) != tokens_of(other), "sleep_1_same_tokens": tokens_of(level1) == tokens_of(a),
            "sleep_2_same_tokens": tokens_of(level2) == tokens_of(a)}  # fmt: skip
    checks = {k: out[k] for k in ("same_seed_same_tokens", "other_seed_other_tokens", "sleep_1_same_tokens")}
    for key in ("logp", "logp_after_sleep_1", "logp_after_sleep_2"):
        checks[f"{key}_match"] = out[key]["mean"] <= TOLERANCE
    return out | {"checks": checks}


def free_gib(device: torch.device) -> float | None:
    return round(torch.cuda.mem_get_info(device)[0] / 2**30, 2) if device.type == "cuda" else None
