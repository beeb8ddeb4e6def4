"""The day-one GPU check's model-scale sections (scripts/gpu/gpu_check.py runs each in a process of its own through
gpu_check_worker.py, in a one-rank process group of its own: NCCL on a GPU, gloo on the CPU).

``metaload``: :func:`scripts.build.standin.write_standin` writes a Qwen2 checkpoint at the 7B's width (hidden 3584,
vocabulary 152,064, a few layers: a few GB in bf16) into a temporary HF cache under
``deepseek-ai/DeepSeek-R1-Distill-Qwen-7B``; ``bapo.modeling.model_path`` resolves the id offline to its snapshot;
the learner is built as ``bapo.build.build_stages`` builds it (the policy on the meta device, FSDP2 reading each
rank's rows of the safetensors); every shard is compared with the same rows of an eager ``from_pretrained`` load,
and a forward pass of the sharded policy with the eager model's.

``budget``: the learner (random weights of the stand-in's shape, made on the device) updates with micro-batches
of exactly the placement's token budget (``learner.max_tokens_per_micro_batch``, gpu_node's 16,384 and
gpu_node_h200's 32,768) at the real vocabulary, bf16 mixed precision and the placement's activation
checkpointing; the peak of ``torch.cuda.max_memory_allocated`` beside ``bapo.plan``'s update peak for exactly that
run config (the stand-in's shape in ``model.arch``, one rank, the device's memory), less what the plan counts
outside torch's allocator in this process (the CUDA context and NCCL buffers, vLLM's CUDA graphs). On CPU
(``--dry-run``) the peak is the learner's state plus the peak of the allocations made during the update
(:func:`cpu_peak`).

``mask``: the dense [R, W, W] mask of shared-prompt packing (the sdpa kernel, which the learner uses where
flash-attn is not installed) for a micro-batch of paper_7b's shape (one prompt's group of responses filling the
token budget), timed as the learner builds it, against :data:`MASK_LIMIT_S`.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
REPO_ID = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"  # experiment=paper_7b's model
# The 7B's width (conf/model/r1_distill_qwen_7b.yaml) with a few layers; --dry-run's small but logits-dominated shape.
WIDE = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=16384)
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
SHAPE_KEYS += ("vocab_size", "max_position_embeddings", "rope_theta")
ROWS_PER_MICRO_BATCH = 4  # the budget's tokens in this many sequences, prompt + response
MICRO_BATCHES = 2  # per update: the gradient accumulates over two micro-batches of the budget each


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GiB, 3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve_hub_cache(cache: Path) -> None:
    """Serve hub ids from ``cache`` offline, in this process and its children (``HF_HUB_CACHE``,
    ``HF_HUB_OFFLINE``; huggingface_hub's module constants too where it was imported before)."""
    os.environ["HF_HUB_CACHE"], os.environ["HF_HUB_OFFLINE"] = str(cache), "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = str(cache), True


# ----------------------------------------------------------------------------- FLOPs and batches


def matmul_params(model: torch.nn.Module) -> int:
    """Weights of every nn.Linear (their global sizes under FSDP)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def forward_flops(n_matmul: int, arch: dict, lengths: list[int]) -> float:
    """One forward pass over sequences of ``lengths`` (scripts/gpu/gpu_check.py's docstring)."""
    d_attn = arch["hidden_size"]  # num_attention_heads x head_dim for Qwen2
    return 2.0 * n_matmul * sum(lengths) + 2.0 * arch["num_hidden_layers"] * d_attn * sum(n * n for n in lengths)


def synthetic_batch(vocab: int, rows: int, prompt_len: int, response_len: int, seed: int):
    """Full-length rows (no padding): random prompt+response ids, one advantage per sequence."""
    from bapo.samples import TrainBatch

    g = torch.Generator().manual_seed(seed)
    L = prompt_len + response_len
    ids = torch.randint(0, vocab, (rows, L), generator=g)
    mask = torch.zeros(rows, L - 1)
    mask[:, prompt_len - 1 :] = 1.0  # logits at t predict token t+1
    old_logp = -math.log(vocab) + 0.1 * torch.randn(rows, L - 1, generator=g)
    adv = torch.where(torch.rand(rows, 1, generator=g) < 0.5, -1.0, 1.0).expand(rows, L - 1).clone()
    return TrainBatch(ids, torch.ones_like(ids), mask, old_logp, adv, torch.zeros(rows, dtype=torch.long))


def budget_batch(vocab: int, tokens: int, seed: int):
    """An update's batch: MICRO_BATCHES micro-batches of exactly ``tokens`` tokens (ROWS_PER_MICRO_BATCH rows each)."""
    row = tokens // ROWS_PER_MICRO_BATCH
    prompt = min(512, row // 8)
    return synthetic_batch(vocab, ROWS_PER_MICRO_BATCH * MICRO_BATCHES, prompt, row - prompt, seed)


# ----------------------------------------------------------------------------- memory


def cpu_peak(fn) -> tuple[Any, int]:
    """``fn()`` and the peak bytes of the CPU allocations made while it ran, over what was alive before: torch's
    profiler records every allocation and free of its CPU allocator (the CPU has no ``max_memory_allocated``). A
    profiler, not a dispatch mode: under a mode autograd takes its out-of-place formulas, which allocate more."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak


def state_bytes(learner) -> int:
    """Bytes of the learner's tensors alive between updates: its (local) parameters, buffers and AdamW moments."""
    tensors = list(learner.model.parameters()) + list(learner.model.buffers())
    tensors += [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = [local_tensor(t) for t in tensors]  # FSDP2's parameters and AdamW's moments are DTensors
    storages = {(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def host_peak_reset() -> bool:
    """Start measuring this process's peak RSS from now (Linux ``clear_refs``); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def host_rss(key: str = "VmHWM") -> int | None:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident memory, in bytes (None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------- the stand-in and the learner


def standin_arch(layers: int, dry: bool) -> dict:
    """The stand-in's config.json shape: conf/model/r1_distill_qwen_7b.yaml's width (``dry``: SMALL), ``layers``."""
    return {**(SMALL if dry else WIDE), "num_hidden_layers": layers, "max_position_embeddings": 131072,
            "rope_theta": 10000.0}  # fmt: skip


def write_wide_standin(cache: Path, arch: dict, device: torch.device) -> Path:
    """The stand-in under :data:`REPO_ID` in ``cache`` (random bf16 weights made on ``device``), in shards."""
    from scripts.build.standin import write_standin

    kw = {k: arch[k] for k in SHAPE_KEYS}
    shard = "100KB" if arch["hidden_size"] < 1024 else "2GB"  # several shards and an index, as on the hub
    return write_standin(cache, REPO_ID, **kw, max_shard_size=shard, device=str(device))


def arch_overrides(arch: dict) -> list[str]:
    """``model.arch.<key>=<value>`` for the stand-in's shape: the plan (and the one-GPU fit check) then plan it."""
    return [f"model.arch.{k}={arch[k]}" for k in SHAPE_KEYS]


def build_learner(rc, path: str):
    """The policy learner as ``bapo.build.build_stages`` builds it for ``learner=fsdp rollout=vllm``: the policy on
    the meta device, FSDP2 reading each rank's shard of the checkpoint at ``path``. Returns (learner, tokenizer)."""
    from bapo.algos import build_objective
    from bapo.learner import Learner, master_dtype
    from bapo.modeling import DTYPES, attention_kernel, load_model, load_tokenizer

    m = rc.model
    tok = load_tokenizer(path, trust_remote_code=m.trust_remote_code)
    kernel = attention_kernel(m.attn_implementation, torch.cuda.is_available())
    policy = load_model(path, dtype=master_dtype(rc.learner, m.dtype), device="meta", attn_implementation=kernel)
    if not all(p.is_meta for p in policy.parameters()):
        raise AssertionError("the policy was not built on the meta device")
    learner = Learner(
        policy,
        rc.learner,
        objective=build_objective(rc.algo),
        pad_id=tok.pad_token_id,
        temperature=rc.rollout.temperature,
        max_response_len=rc.rollout.max_new_tokens,
        weights_dtype=DTYPES[m.dtype],
    )
    return learner, tok


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the tensor itself where it is not sharded)."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def against_eager(learner, path: str, *, seq: int = 128) -> dict:
    """Every shard of the sharded policy against the same rows of an eager ``from_pretrained`` load, and the log-probs
    of one forward pass of each (the eager model in the learner's compute dtype; every rank runs the forward)."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from bapo.learner.fsdp import shard_rows, uses_bf16

    device = learner.device
    bf16 = uses_bf16(learner.cfg.mixed_precision, device)
    kernel = learner.model.config._attn_implementation
    eager = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if bf16 else torch.float32, attn_implementation=kernel
    )
    eager = eager.to(device).eval()
    ref = eager.state_dict()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mismatched, sharded, local_bytes = [], 0, 0
    for name, p in learner.model.named_parameters():
        local = local_tensor(p)
        sharded += isinstance(p, DTensor)
        local_bytes += local.numel() * local.element_size()
        start, stop = shard_rows(p.shape[0], rank, world) if isinstance(p, DTensor) else (0, p.shape[0])
        if not torch.equal(local.detach(), ref[name][start:stop].to(local.dtype)):
            mismatched.append(name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, eager.config.vocab_size, (2, seq), generator=g).to(device)
    with torch.no_grad():
        a = torch.log_softmax(learner.model(input_ids=ids, use_cache=False).logits.float(), -1)  # [2, seq, V]
        b = torch.log_softmax(eager(input_ids=ids, use_cache=False).logits.float(), -1)  # [2, seq, V]
    learner.model.reshard()  # the root keeps its gathered parameters after a forward until a backward reshards them
    diff = float((a - b).abs().max())
    tol = 0.05 if bf16 else 1e-4
    del eager, ref, a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    params = sum(1 for _ in learner.model.parameters())
    return {
        "param_tensors": params,
        "sharded_param_tensors": sharded,
        "local_shard_gib": gib(local_bytes),
        "shards_equal_eager": not mismatched,
        "mismatched": mismatched[:5],
        "compute_dtype": "bfloat16" if bf16 else "float32",
        "forward_max_abs_logp_diff": diff,
        "forward_tolerance": tol,
        "ok": not mismatched and sharded == params and diff <= tol,
    }


# ----------------------------------------------------------------------------- the sections


def one_rank_group():
    """This process as a world of one (NCCL on a GPU, gloo on the CPU), as ``python train.py`` makes it."""
    from bapo.infra import dist as bdist

    return bdist.init_one_rank()


def run_config(*overrides: str):
    """The typed config train.py would build with ``overrides`` (bapo.config.build), for a world of one."""
    from bapo.config import build
    from bapo.entry.plan import compose

    return build(compose(list(overrides)), "gpu_check")


def overrides(ctx, arch: dict, tokens: int) -> list[str]:
    """experiment=paper_7b with the stand-in's shape and a token budget (fp32 compute on the CPU, as FSDP does)."""
    over = ["experiment=paper_7b", *arch_overrides(arch), f"learner.max_tokens_per_micro_batch={tokens}"]
    # at toy width the sequences shrink too: the plan holds at least one whole sequence per micro-batch
    toy = ["learner.mixed_precision=fp32", "model.max_new_tokens=64", "data.max_prompt_tokens=64"]
    return over + (toy if ctx.dry else [])


def release(device: torch.device) -> None:
    gc.collect()  # a transformers model holds reference cycles: freed by the collector, not by del
    if device.type == "cuda":
        torch.cuda.empty_cache()


def metaload(ctx) -> dict:
    """The stand-in under its hub id, resolved offline, meta-loaded by the FSDP learner, checked against eager."""
    from bapo.modeling import model_path

    device = one_rank_group()
    arch = standin_arch(ctx.standin_layers, ctx.dry)
    t0 = time.perf_counter()
    cache = ctx.scratch / "hub"
    snapshot = write_wide_standin(cache, arch, device)
    written = time.perf_counter() - t0
    release(device)  # the writer's model, before the load is measured
    serve_hub_cache(cache)
    resolved = model_path(REPO_ID)
    rc = run_config(*overrides(ctx, arch, ctx.budgets[0]))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss0, hwm = host_rss("VmRSS"), host_peak_reset()
    t1 = time.perf_counter()
    learner, _ = build_learner(rc, resolved)
    sync(device)
    load_s = time.perf_counter() - t1
    host = host_rss() - rss0 if hwm and rss0 is not None else None
    n = sum(p.numel() for p in learner.model.parameters())
    out: dict[str, Any] = {
        "repo_id": REPO_ID,
        "resolved_is_snapshot": Path(resolved) == snapshot,
        "safetensors_files": len(list(Path(resolved).glob("*.safetensors"))),
        "arch": arch,
        "params": n,
        "fp32_model_gib": gib(4 * n),
        "write_s": round(written, 1),
        "load_s": round(load_s, 1),
        "load_host_peak_gib": gib(host),  # no full host copy: well under fp32_model_gib
    }
    if device.type == "cuda":
        out["load_gpu_peak_gib"] = gib(torch.cuda.max_memory_allocated(device))  # ~ its fp32 shard
    check = against_eager(learner, resolved)
    out |= check
    no_host_copy = host is None or host < 0.5 * 4 * n or device.type == "cpu"  # on CPU the shard is host memory
    checks = {
        "resolved_to_the_snapshot": out["resolved_is_snapshot"],
        "several_shards": out["safetensors_files"] > 1,
        "every_parameter_sharded": check["sharded_param_tensors"] == check["param_tensors"],
        "shards_equal_eager": check["shards_equal_eager"],
        "forward_equal_eager": check["forward_max_abs_logp_diff"] <= check["forward_tolerance"],
        "no_full_host_copy": no_host_copy,
    }
    return out | {"checks": checks}


def standin_learner(ctx, device: torch.device):
    """The learner of the stand-in's shape (random weights made on ``device``), FSDP2 as the loop builds it, with
    the stand-in's arch, the run config of the first budget and the attention kernel chosen."""
    from bapo.algos import build_objective
    from bapo.learner import Learner, master_dtype
    from bapo.modeling import DTYPES, attention_kernel, load_model

    arch = standin_arch(ctx.standin_layers, ctx.dry)
    rc = run_config(*overrides(ctx, arch, ctx.budgets[0]))
    kernel = attention_kernel(rc.model.attn_implementation, device.type == "cuda")
    torch.manual_seed(0)
    model = load_model("", init="random", arch=dict(rc.model.arch), dtype=master_dtype(rc.learner, rc.model.dtype),
                       device=device, attn_implementation=kernel)  # fmt: skip
    learner = Learner(model, rc.learner, objective=build_objective(rc.algo), pad_id=0,
                      temperature=rc.rollout.temperature, max_response_len=rc.rollout.max_new_tokens,
                      weights_dtype=DTYPES[rc.model.dtype])  # fmt: skip
    return learner, arch, rc, kernel


def budget(ctx) -> dict:
    """The update at each token budget (random weights of the stand-in's shape) against the plan's update peak."""
    from bapo.plan.verdict import make_plan

    device = one_rank_group()
    learner, arch, rc, kernel = standin_learner(ctx, device)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    gpu_gib = total / GiB if total else rc.placement.gpu_memory_gib
    out: dict[str, Any] = {"arch": arch, "attention": kernel, "gpu_memory_gib": round(gpu_gib, 1), "budgets": {}}
    warm = False
    for tokens in ctx.budgets:
        rc = run_config(*overrides(ctx, arch, tokens))
        plan = make_plan(rc, world=1, gpu_memory_gib=gpu_gib)
        row: dict[str, Any] = {}
        if total and plan.update_peak.total > total:
            row["skipped"] = f"the plan's update peak {gib(plan.update_peak.total)} GiB exceeds this GPU's memory"
            out["budgets"][str(tokens)] = row
            continue
        learner.cfg = rc.learner  # the budget is read at each update (micro_batches)
        if not warm:  # AdamW's moments allocated, kernels chosen: the measured update is a steady one
            learner.update(budget_batch(arch["vocab_size"], tokens, seed=0))
            warm = True
        row |= measured_update(learner, device, arch, tokens, plan)
        out["budgets"][str(tokens)] = row
    ran = {t: r for t, r in out["budgets"].items() if "skipped" not in r}
    checks = {"some_budget_ran": bool(ran)}
    for t, r in ran.items():
        checks[f"budget_{t}_within_plan"] = r["within_plan"]
        checks[f"budget_{t}_finite_grad_norm"] = math.isfinite(r["grad_norm"] or math.nan)
    return out | {"checks": checks}


def measured_update(learner, device: torch.device, arch: dict, tokens: int, plan) -> dict:
    batch = budget_batch(arch["vocab_size"], tokens, seed=tokens)
    micro = learner.micro_batches(batch, sync=False)
    sync(device)
    state = state_bytes(learner)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        metrics = learner.update(batch)
        sync(device)
        sec = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) - before
        how = "the learner's state + torch.cuda.max_memory_allocated over what was allocated before the update"
        others = before - state  # what else this process holds on the GPU (none of the learner's)
    else:
        t0 = time.perf_counter()
        metrics, peak = cpu_peak(lambda: learner.update(batch))
        sec = time.perf_counter() - t0  # with the profiler's overhead
        how = "CPU: the learner's state + the peak of the allocations during the update (torch's profiler)"
        others = None
    lengths = batch.attention_mask.sum(1).tolist()
    flops = forward_flops(matmul_params(learner.model), arch, lengths) * (3 + int(learner.objective.prepass))
    row = {
        "micro_batches": len(micro),
        "micro_batch_tokens": [int(mb.attention_mask.sum()) for mb in micro],
        "seconds": round(sec, 3),
        "tokens_per_s": round(sum(lengths) / sec, 1),
        "tflops_per_s": round(flops / sec / 1e12, 2),
        "grad_norm": metrics.get("learner/grad_norm"),
        "measured": how,
        "learner_state_gib": gib(state),
        "other_allocations_gib": gib(others),
    }
    return row | against_plan(plan, state + peak)


# The dense mask of shared-prompt packing is built twice per micro-batch (the pre-pass and the training pass);
# past this many seconds a mask costs a visible share of a 7B update at 16k tokens (about 1.5 s on an H200).
MASK_LIMIT_S = 0.1


def mask_batch(tokens: int, prompt: int, longest: int, n: int, seed: int = 0):
    """A paper_7b-shaped micro-batch: one prompt's group of up to ``n`` responses (256 to ``longest`` tokens,
    drawn) until the next would pass ``tokens``; right-padded, as the learner gets it."""
    from bapo.samples import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while len(lengths) < n:
        r = int(torch.randint(256, max(257, longest + 1), (1,), generator=g))
        if sum(prompt + x for x in lengths) + prompt + r > tokens:
            break
        lengths.append(r)
    lengths = lengths or [min(longest, tokens - prompt)]
    L = prompt + max(lengths)
    ids = torch.randint(0, 1000, (len(lengths), L), generator=g)  # [B, L]
    ids[:, :prompt] = ids[0, :prompt]  # the group shares its prompt
    am = (torch.arange(L) < torch.tensor([prompt + x for x in lengths])[:, None]).long()  # [B, L]
    mask = am[:, 1:].clone().float()  # [B, L-1] response positions: logits at t predict t+1
    mask[:, : prompt - 1] = 0
    zeros = torch.zeros(len(lengths), L - 1)
    return TrainBatch(ids * am, am, mask, zeros, zeros.clone(), torch.zeros(len(lengths), dtype=torch.long))


def mask(ctx) -> dict:
    """The dense attention mask at paper_7b's micro-batch shape, made as the learner makes it
    (``bapo.learner.forward.ForwardInputs``: the layout once per micro-batch and update, the mask once per pass):
    seconds for the layout and per mask, where the mask lives, its size."""
    from bapo.learner.forward import ForwardInputs

    device = ctx.device
    rc = run_config("experiment=paper_7b")
    tokens = rc.learner.max_tokens_per_micro_batch
    prompt, longest, n = 512, rc.rollout.max_new_tokens, rc.rollout.n
    if ctx.dry:
        tokens, prompt, longest = 2048, 64, 512
    mb = mask_batch(tokens, prompt, longest, n)
    ForwardInputs(mb, packing=True, device=device).mask()  # warm-up: allocator, kernels
    sync(device)
    layouts, masks = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        inputs = ForwardInputs(mb, packing=True, device=device)
        inputs.shared()
        sync(device)
        t1 = time.perf_counter()
        allowed = inputs.mask()  # [R, 1, W, W]
        sync(device)
        layouts.append(t1 - t0)
        masks.append(time.perf_counter() - t1)
        inputs.release()
    seconds = sorted(masks)[1]
    out = {
        "micro_batch_tokens": int(mb.attention_mask.sum()),
        "responses": len(mb),
        "mask_shape": list(allowed.shape),
        "mask_gib": gib(allowed.numel() * allowed.element_size()),
        "mask_device": str(allowed.device),
        "layout_s": round(sorted(layouts)[1], 4),
        "seconds_per_mask": round(seconds, 4),
        "limit_s": None if ctx.dry else MASK_LIMIT_S,
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,  # then the learner needs none
    }
    checks = {
        "built_on_the_device": allowed.device.type == device.type,
        "square_masks": allowed.shape[-1] == allowed.shape[-2],
        "within_limit": ctx.dry or seconds <= MASK_LIMIT_S,
    }
    return out | {"checks": checks}


OUTSIDE_TORCH = ("CUDA context", "CUDA graphs")  # the plan's items that are no torch allocation of this process


def against_plan(plan, measured: int) -> dict:
    """The plan's update peak beside a measured peak of torch's allocations: the plan less what it counts outside
    them in this process (the CUDA context and NCCL's buffers, vLLM's CUDA graphs: the items that name them), and
    the ratio."""
    peak = plan.update_peak
    outside = sum(i.bytes for i in peak.items if any(w in i.what for w in OUTSIDE_TORCH))
    planned = peak.total - outside
    return {
        "measured_peak_gib": gib(measured),
        "plan_moment": peak.name,
        "plan_peak_gib": gib(peak.total),
        "plan_outside_torch_gib": gib(outside),
        "plan_torch_gib": gib(planned),
        "measured_over_plan": round(measured / planned, 3),
        "within_plan": measured <= planned,
        "plan_items_gib": {i.what: gib(i.bytes) for i in peak.items if i.bytes},
        "plan_other_moments_gib": {m.name: gib(m.total) for m in plan.update if m is not peak},
    }
