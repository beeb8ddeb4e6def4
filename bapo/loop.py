"""The off-policy RL loop, top to bottom. The only module that sees every stage.

    data -> rollout -> reward -> advantages -> replay buffer -> learner
                ^------------------ new weights -----------------'

One *step* is one rollout batch: ``train.prompts_per_step`` prompts x
``rollout.n`` responses. The learner then makes ``learner.ppo_epochs`` x
``learner.mini_batches_per_rollout`` optimizer updates on it; the policy version
increments at every update, so reuse makes samples stale (staleness = learner
version - sample version), which is the regime BAPO is for. The rollout engine
receives the learner's weights every ``train.sync_every`` updates.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import random
import shutil
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from bapo import algos, checkpoint, dist, offpolicy
from bapo.buffer import ReplayBuffer
from bapo.config import AlgoConfig, ConfigError, RunConfig, build
from bapo.data import ArithSpec, problem_sources, render_prompt
from bapo.evaluate import evaluate, evaluate_sets, load_evalset, named_set
from bapo.learner import Critic, Learner, collate, fsdp
from bapo.logging import MetricsLogger
from bapo.modeling import load_model, load_tokenizer, model_path, pick_device
from bapo.monitor import Monitor
from bapo.reward import MathVerifier, overlong_penalty
from bapo.rollout import HFRollout
from bapo.types import RolloutBatch, Sample, ScoredSample

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_objective(a: AlgoConfig) -> algos.Objective:
    """The learner's objective from the algo config. Every algorithm is the one clipped surrogate
    with its bound choice (BAPO's search or fixed bounds), except the card (NOT the paper's method)."""
    loss_kw = dict(
        dual_clip=a.dual_clip,
        agg=a.agg,
        entropy_coef=a.entropy_coef,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
    )
    if a.loss == "card":
        return algos.card_objective(algos.CardState(**vars(a.card)), **loss_kw)
    if a.bounds == "fixed":
        bound_kw = dict(ratio_low=a.ratio_low, ratio_high=a.ratio_high)
    else:
        bound_kw = dict(
            rho0=a.rho0,
            low_range=tuple(a.low_range),
            high_range=tuple(a.high_range),
            low_step=a.low_step,
            high_step=a.high_step,
            variant=a.variant,
        )
    return algos.surrogate_objective(a.bounds, contribution=a.contribution, weight=a.weight, **bound_kw, **loss_kw)


def check_combination(rc: RunConfig, world: int) -> None:
    """Combinations this build refuses at startup, each with the keys involved."""
    fsdp_on = rc.learner.kind == "fsdp"
    if fsdp_on and rc.algo.advantage == "gae":
        raise ConfigError("learner.kind=fsdp: algo.advantage=gae (the PPO critic) is single-process only for now")
    if fsdp_on and rc.learner.old_logp == "recompute" and rc.train.async_rollout:
        raise ConfigError(
            "learner.old_logp=recompute with learner=fsdp needs train.async_rollout=false "
            "(the learner recomputes at its current version; older versions would need a sharded snapshot)"
        )
    if world > 1 and rc.train.async_rollout and rc.buffer.enforce == "drop":
        raise ConfigError(
            "buffer.enforce=drop under torchrun: what is dropped depends on timing, so ranks would disagree; "
            "use buffer.enforce=admission"
        )
    if world > 1 and rc.train.prompts_per_step < world:
        raise ConfigError(f"train.prompts_per_step={rc.train.prompts_per_step} < {world} ranks: each rank needs one")
    if world > 1 and rc.sizes.mini_batch_size < world:
        raise ConfigError(
            f"a mini-batch of {rc.sizes.mini_batch_size} samples cannot be shared by {world} ranks "
            "(train.prompts_per_step x rollout.n / learner.mini_batches_per_rollout)"
        )


def build_rollout(rc: RunConfig, path: str, tok, model):
    """The generation engine: HF generate on its own copy of the weights, or vLLM's offline engine."""
    r = rc.rollout
    if r.engine == "vllm":
        from bapo.rollout.vllm import VLLMRollout  # lazy: vllm is an optional extra

        return VLLMRollout(
            path,
            tok,
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            gpu_memory_utilization=r.gpu_memory_utilization,
            tensor_parallel_size=r.tensor_parallel_size,
            dtype=rc.model.dtype,
            enable_sleep_mode=r.enable_sleep_mode,
            enforce_eager=r.enforce_eager,
            seed=rc.seed,
        )
    return HFRollout(
        model,
        tok,
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        batch_size=r.batch_size,
    )


def build_stages(rc: RunConfig):
    fsdp_on = rc.learner.kind == "fsdp"
    device = dist.init() if fsdp_on else pick_device(rc.learner.device)
    check_combination(rc, dist.world_size())
    path = model_path(rc.model.name_or_path, rc.model.gguf_package, rc.model.gguf_file)
    tok = load_tokenizer(path, trust_remote_code=rc.model.trust_remote_code)
    m = rc.model
    load = dict(trust_remote_code=m.trust_remote_code, init=m.init, arch=m.arch)
    # FSDP keeps fp32 master weights (mixed precision computes in bf16 on GPU); the engine gets its own copy
    policy = load_model(path, dtype="float32" if fsdp_on else m.dtype, device=device, **load)
    engine_model = None
    if rc.rollout.engine == "hf":
        engine_model = load_model(path, dtype=m.dtype, device=device, **load) if fsdp_on else copy.deepcopy(policy)
        if m.init == "random":
            engine_model.load_state_dict(policy.state_dict())  # the same random draw as the policy
    ref_model = copy.deepcopy(policy).eval() if rc.algo.kl_coef > 0 else None
    if fsdp_on:
        lc = rc.learner
        policy = fsdp.wrap(
            policy,
            device=device,
            mixed_precision=lc.mixed_precision,
            activation_checkpointing=lc.activation_checkpointing,
            cpu_offload=lc.cpu_offload,
        )
    rollout = build_rollout(rc, path, tok, engine_model)
    r = rc.rollout
    verifier = MathVerifier(
        num_workers=rc.reward.num_workers,
        timeout_s=rc.reward.timeout_s,
        fallback=rc.reward.fallback,
        format_reward=rc.reward.format_reward,
    )
    d = rc.data
    train_src, heldout, report = problem_sources(
        kind=d.kind,
        arith=ArithSpec(**vars(d.arith)),
        train_seed=d.train_seed,
        heldout_seed=d.heldout_seed,
        heldout_frac=d.heldout_frac,
        heldout_size=d.heldout_size,
        path=d.path,
        eval_path=d.eval_path,
        split=d.split,
        eval_split=d.eval_split,
        subset=d.subset,
        problem_key=d.problem_key,
        answer_key=d.answer_key,
        answer_format=d.answer_format,
    )
    heldout_prompts = [render_prompt(p, tok, instruction=d.instruction) for p in heldout]
    buffer = ReplayBuffer(
        max_staleness=rc.buffer.max_staleness,
        capacity=rc.buffer.capacity,
        sampling=rc.buffer.sampling,
        seed=rc.seed,
    )
    a, lc = rc.algo, rc.learner
    opt_kw = dict(betas=tuple(lc.betas), weight_decay=lc.weight_decay, eps=lc.eps, grad_clip=lc.grad_clip)
    # GAE's value model (its own copy of the policy's trunk); the KL term's frozen initial policy
    critic = None
    if a.advantage == "gae":
        critic = Critic(policy, lr=a.critic.lr, vf_clip=a.critic.vf_clip, agg=a.agg, **opt_kw)
    learner = Learner(
        policy,
        objective=make_objective(a),
        critic=critic,
        ref_model=ref_model,
        scope=a.scope,
        lr=lc.lr,
        warmup_steps=lc.warmup_steps,
        micro_batch_size=lc.micro_batch_size,
        **opt_kw,
        temperature=r.temperature,
        max_response_len=r.max_new_tokens,
        reduce_sum=dist.reduce_sum if fsdp_on else None,
        reduce_max=dist.reduce_max if fsdp_on else None,
        packing=lc.packing,
        max_tokens_per_micro_batch=lc.max_tokens_per_micro_batch,
    )
    return tok, rollout, verifier, train_src, heldout_prompts, report, buffer, learner


def export_hf(model, tok, out: Path) -> None:
    """Write an HF folder (safetensors) under a temporary name, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def score(samples: list[Sample], correct, extracted, rewards, adv, returns, values) -> list[ScoredSample]:
    """Attach the (shaped) reward, per-token advantages and (with a critic) old values and returns to each sample."""

    def row(t, i: int) -> tuple[float, ...] | None:  # sample i's response tokens of a [B, T] tensor
        return None if t is None else tuple(t[i, : len(samples[i].response_ids)].tolist())

    return [
        ScoredSample(
            s,
            float(rewards[i]),
            float(adv[i, 0]) if s.response_ids else 0.0,
            c,
            x,
            token_adv=row(adv, i),
            old_values=row(values, i),
            returns=row(returns, i),
        )
        for i, (s, c, x) in enumerate(zip(samples, correct, extracted, strict=True))
    ]


def run_eval(rc: RunConfig, rollout, verifier, prompts, tok, sets: dict, step: int) -> dict:
    """The held-out check (eval/accuracy, ...) and, with eval.sets, eval.py's metrics (eval/<set>/avg@k, ...).

    Seeded by (seed, step), so an evaluation does not depend on what ran before it."""
    t0, e = time.perf_counter(), rc.eval
    seed = derive_seed(rc.seed, "eval", step)
    out = evaluate(rollout, verifier, prompts, n=e.n, temperature=e.temperature, prefix="eval/", seed=seed)
    if e.greedy:
        g = evaluate(rollout, verifier, prompts, n=1, temperature=0.0, prefix="eval/greedy_")
        out["eval/accuracy_greedy"] = g["eval/greedy_accuracy"]
    if sets:
        kw = dict(k=e.sets_k, temperature=e.temperature, instruction=rc.data.instruction)
        out |= evaluate_sets(rollout, verifier, tok, sets, **kw, seed=derive_seed(rc.seed, "eval_sets", step))
    out["eval/version"] = float(rollout.version)
    out["time/eval_s"] = time.perf_counter() - t0
    return out


def mean_metrics(rows: list[dict]) -> dict:
    keys = {k for r in rows for k in r}
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}


def derive_seed(seed: int, purpose: str, index: int) -> int:
    """A 63-bit seed for one (purpose, index), independent of everything run before it."""
    tag = int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:4], "little")
    return int(np.random.SeedSequence([seed, tag, index]).generate_state(2, dtype=np.uint64)[0] >> 1)


class TrainingDiverged(RuntimeError):
    pass


class NullLogger:
    """What ranks other than 0 log to."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class StopRequested:
    """SIGTERM and Ctrl-C: finish the step, save a checkpoint, exit cleanly. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequested:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s: saving a checkpoint after this step, then stopping", signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def __bool__(self) -> bool:
        return self.signum is not None

    def agree(self, any_rank: bool) -> None:
        """Under torchrun: stop when any rank was signalled."""
        if any_rank and self.signum is None:
            self.signum = signal.SIGTERM


def find_resume(rc: RunConfig) -> Path | None:
    """The checkpoint ``resume`` points at: None (fresh start), the newest in this run (auto), or a path."""
    if rc.resume is None:
        return None
    ckpt_dir = rc.run_dir / "checkpoints"
    if rc.resume == "auto":
        checkpoint.clean_partial(ckpt_dir)
        return checkpoint.latest(ckpt_dir)
    p = Path(rc.resume)
    if (p / "state.pt").is_file():
        return p
    found = checkpoint.latest(p / "checkpoints")
    if found is None:
        raise ConfigError(f"resume: no complete checkpoint in {p} (looked for state.pt and {p}/checkpoints/step_*)")
    return found


def load_producer_state(ckpt: Path, rank: int) -> dict:
    """This rank's producer state. At another world size (DCP reshards the model), a checkpoint
    whose producers held no batches ahead resumes from rank 0's (all ranks draw the same prompts)."""
    pfile = ckpt / f"producer_rank{rank}.pt"
    if pfile.is_file():
        return checkpoint.load(pfile)
    state = checkpoint.load(ckpt / "producer_rank0.pt")
    if state["pending"]:
        raise checkpoint.CheckpointError(
            f"{pfile}: missing; this checkpoint was written by a different number of ranks while the "
            "rollout producer had batches queued (async): resume it with the world size that wrote it"
        )
    return state


def last_logged_step(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    lines = f.read_text().splitlines() if f.is_file() else []
    try:
        return int(json.loads(lines[-1])["step"]) if lines else -1
    except (json.JSONDecodeError, KeyError):
        return -1


def restore_metrics(run_dir: Path, source_run: Path, step: int) -> None:
    """metrics.jsonl up to ``step`` (lines a killed run wrote after its checkpoint are dropped), atomically."""
    src = source_run / "metrics.jsonl"
    keep = []
    if src.is_file():
        for line in src.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short by the kill: it and anything after it are past the checkpoint
            if row.get("step", 1 << 60) <= step:
                keep.append(line)
    tmp = run_dir / ".metrics.jsonl.tmp"
    tmp.write_text("".join(x + "\n" for x in keep))
    tmp.replace(run_dir / "metrics.jsonl")


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Train as configured; returns the last logged metrics."""
    rc = build(cfg, run_dir)
    if rc.learner.kind == "fsdp":
        dist.init()
        if dist.world_size() > 1:  # Hydra's ${now} run folder may differ by a second between ranks: use rank 0's
            rc = dataclasses.replace(rc, run_dir=Path(dist.broadcast_object(str(rc.run_dir))))
    rc.run_dir.mkdir(parents=True, exist_ok=True)
    final = rc.run_dir / "final_metrics.json"
    if rc.resume == "auto" and final.is_file() and last_logged_step(rc.run_dir) >= rc.train.steps:
        log.info("%s is complete (final_metrics.json, step %d): nothing to do", rc.run_dir, rc.train.steps)
        return json.loads(final.read_text())
    resume_from = find_resume(rc)
    seed_everything(rc.seed)
    tok, rollout, verifier, train_src, heldout, report, buffer, learner = build_stages(rc)
    world, rank, main = dist.world_size(), dist.rank(), dist.is_main()
    if not main:  # rank 0 reports; the others only warn
        logging.getLogger("bapo").setLevel(logging.WARNING)
    fsdp_on = rc.learner.kind == "fsdp"
    if main:
        final.unlink(missing_ok=True)  # written again when this run completes
        (rc.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    sizes, a, U = rc.sizes, rc.algo, rc.sizes.updates_per_step
    adv_kw = dict(group_size=rc.rollout.n, norm_std=a.norm_std, gamma=a.critic.gamma, lam=a.critic.lam)
    monitor = Monitor(**vars(rc.monitor))
    rng = random.Random(rc.seed)  # mini-batch shuffles
    mode = "sync" if not rc.train.async_rollout else rc.buffer.enforce
    recompute = rc.learner.old_logp == "recompute"
    scratch = copy.deepcopy(learner.model).eval().requires_grad_(False) if recompute and not fsdp_on else None
    # the learner's full weights: a plain state_dict, or (FSDP) gathered on every rank: a collective
    weights_fn = (lambda: fsdp.full_state_dict(learner.model, rank0_only=False)) if fsdp_on else learner.weights
    mailbox = offpolicy.WeightMailbox()
    start, version, state, pstate = 0, 0, None, None
    if resume_from is not None:
        state = checkpoint.load(resume_from)
        pstate = load_producer_state(resume_from, rank)
        start, version = int(state["step"]), int(state["version"])
        if fsdp_on:
            fsdp.load_checkpoint(learner, resume_from / "learner")
        else:
            learner.load_state_dict(state["learner"])
        buffer.load_state_dict(state["buffer"])
        monitor.load_state_dict(state["monitor"])
        train_src.load_state_dict(pstate["data"])
        rng.setstate(_rng_tuple(state["rng"]["loop"]))
        random.setstate(_rng_tuple(state["rng"]["python"]))
        name, key, *rest = state["rng"]["numpy"]
        np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
        torch.set_rng_state(state["rng"]["torch"])
        for v, snap in pstate["snapshots"].items():
            mailbox.publish(int(v), snap, clone=False)
        if main:
            restore_metrics(rc.run_dir, resume_from.parent.parent, start)
        dist.barrier()
        lines = (rc.run_dir / "metrics.jsonl").read_text().splitlines()
        metrics = {k: v for k, v in json.loads(lines[-1]).items() if k != "step"} if lines else {}
        log.info("resumed from %s at step %d (policy version %d)", resume_from, start, version)
    elif main and (rc.run_dir / "metrics.jsonl").exists():
        (rc.run_dir / "metrics.jsonl").unlink()  # a fresh start owns its run folder's metrics

    lg = rc.logger
    id_file = rc.run_dir / "wandb_id.txt"  # one wandb run across resumes
    if main and (state is None or not id_file.is_file()):
        id_file.write_text(uuid.uuid4().hex[:16])
    logger = (
        MetricsLogger(
            rc.run_dir,
            wandb=lg.wandb,
            project=lg.project,
            mode=lg.mode,
            group=lg.group,
            tags=list(lg.tags),
            name=rc.run_dir.name,
            config=OmegaConf.to_container(cfg, resolve=True),
            run_id=id_file.read_text().strip(),
        )
        if main
        else NullLogger()
    )

    def make_batch(t: int, v: int, weights: dict) -> RolloutBatch:
        """Generate and verify rollout batch t with the weights of version v (the producer's side).

        Under torchrun every rank draws the same prompts and generates its share of them
        (prompts rank, rank + world, ...) with its own seed; the learner thread gathers the
        shares (:func:`gather_batch`), so every rank then holds the same batch."""
        t_sync = rollout.update_weights(weights, v) if rollout.version != v else 0.0
        prompts = [
            render_prompt(next(train_src), tok, instruction=rc.data.instruction)
            for _ in range(rc.train.prompts_per_step)
        ]
        mine = prompts[rank::world]
        t0 = time.perf_counter()
        purpose = "rollout" if rank == 0 else f"rollout/rank{rank}"
        samples = rollout.generate(mine, seed=derive_seed(rc.seed, purpose, t))
        if world > 1:  # group ids: the prompt's index in the whole batch
            samples = [dataclasses.replace(s, group=rank + world * s.group) for s in samples]
        t_rollout = time.perf_counter() - t0
        grades, rstats = verifier.grade([s.text for s in samples], [s.prompt.problem.answer for s in samples])
        n_tok = sum(len(s.response_ids) for s in samples)
        stats = rstats.as_dict() | {
            "rollout/tokens_per_s": n_tok / max(t_rollout, 1e-9),
            "time/rollout_s": t_rollout,
            "time/reward_s": rstats.verify_s,
            "time/sync_s": t_sync,
        }
        return RolloutBatch(
            t,
            v,
            tuple(samples),
            tuple(g.reward for g in grades),
            tuple(g.correct for g in grades),
            tuple(g.extracted for g in grades),
            stats,
        )

    def take() -> tuple[RolloutBatch, float]:
        item, waited = producer.take()
        return (gather_batch(dist.all_gather_object(item)) if world > 1 else item), waited

    producer = offpolicy.Producer(
        make_batch,
        mailbox,
        mode=mode,
        updates_per_batch=U,
        max_staleness=rc.buffer.max_staleness,
        sync_every=rc.train.sync_every,
        ahead=max(1, rc.buffer.capacity // sizes.samples_per_step),
        first_batch=start + 1,
        last_batch=None if mode == "drop" else rc.train.steps,  # drop: replacements for dropped batches
    )
    for item in [] if pstate is None else pstate["pending"]:
        producer.queue.append(item)
        producer.next_batch += 1

    def publish(mid_step: bool) -> None:
        """Offer the learner's weights at ``version`` to the producer, if a batch will be generated with them."""
        if producer.wants(version):  # the same answer on every rank: weights_fn may be a collective
            weights = weights_fn()
            if not mailbox.has(version):
                # sync at a step boundary: the producer loads them before the next update, so no copy
                mailbox.publish(version, weights, clone=mode != "sync" or mid_step)

    def release() -> None:
        mailbox.release_below(producer.release_floor(version, keep_window=recompute))

    def old_logp(batch: RolloutBatch) -> tuple[RolloutBatch, dict]:
        """``learner.old_logp=recompute``: the learner's own log-probs at the version that generated it."""
        if not recompute:
            return batch, {}
        if batch.version == version:
            model = learner.model
        else:
            _, weights = mailbox.wait(batch.version)
            scratch.load_state_dict(weights)
            model = scratch
        lp = learner.response_logp(collate(list(batch.samples), pad_id=rollout.pad_id), model)  # [B, T]
        new, diffs = [], []
        for i, s in enumerate(batch.samples):
            row = tuple(lp[i, : len(s.response_ids)].tolist())
            diffs.extend(abs(x - y) for x, y in zip(row, s.logp, strict=True))
            new.append(dataclasses.replace(s, logp=row))
        stats = {
            "rollout/logp_mismatch_mean": float(np.mean(diffs)) if diffs else 0.0,
            "rollout/logp_mismatch_max": float(np.max(diffs)) if diffs else 0.0,
        }
        return dataclasses.replace(batch, samples=tuple(new)), stats

    def score_batch(batch: RolloutBatch) -> tuple[list[ScoredSample], dict]:
        """Shape the rewards, take the critic's values now (before any update on them) and compute advantages."""
        batch, lp_stats = old_logp(batch)
        samples = list(batch.samples)
        lengths = [len(s.response_ids) for s in samples]
        rewards = torch.tensor(batch.rewards, dtype=torch.float64)  # [B]
        # DAPO's soft overlong penalty shapes the reward only; `correct` (accuracy) stays the verifier's
        max_len, buf = rc.rollout.max_new_tokens, rc.reward.overlong_buffer
        rewards = rewards + torch.tensor([overlong_penalty(n, max_len=max_len, buffer=buf) for n in lengths])
        values = learner.values(collate(samples, pad_id=rollout.pad_id))  # [B, T]; None without a critic
        adv, returns, adv_stats = algos.compute_advantages(rc.algo.advantage, rewards, lengths, values=values, **adv_kw)
        scored = score(samples, batch.correct, batch.extracted, rewards, adv, returns, values)
        n_tok = sum(lengths)
        stats = dict(batch.stats) | lp_stats | {f"adv/{k}": float(v) for k, v in adv_stats.items()}
        stats |= {
            "reward/mean": float(rewards.mean()),
            "rollout/response_len": n_tok / len(samples),
            "rollout/truncated": sum(s.truncated for s in samples) / len(samples),
            "rollout/version": float(batch.version),
        }
        return scored, stats

    def save(step: int) -> None:
        """Checkpoint ``step``: shared state from rank 0 (state.pt), each rank's producer (queue, data cursor,
        snapshots), and under FSDP the sharded learner (DCP); renamed into place when all are written."""
        producer.pause()  # between two batches: the queue and the data cursor agree
        try:
            t0 = time.perf_counter()
            ckpt_dir = rc.run_dir / "checkpoints"
            tmp = ckpt_dir / f".tmp-step_{step:06d}"
            if main:
                checkpoint.prepare(tmp)
            dist.barrier()
            live = version if mailbox.has(version) else None  # the current weights: restored from the model
            own = {
                "data": train_src.state_dict(),
                "pending": list(producer.queue),
                "snapshots": {v: w for v, w in mailbox.state_dict().items() if v != live},
            }
            checkpoint.write(tmp / f"producer_rank{rank}.pt", own)
            if fsdp_on:
                fsdp.save_checkpoint(learner, tmp / "learner")
            dist.barrier()
            if main:
                shared = {
                    "step": step,
                    "version": version,
                    "buffer": buffer.state_dict(),
                    "monitor": monitor.state_dict(),
                    "rng": {
                        "loop": rng.getstate(),
                        "python": random.getstate(),
                        "numpy": checkpoint.rng_state_plain(np.random.get_state()),
                        "torch": torch.get_rng_state(),
                    },
                }
                if not fsdp_on:
                    shared["learner"] = learner.state_dict()
                meta = {"version": version, "world_size": world}
                path = checkpoint.save(ckpt_dir, step, shared, keep=rc.checkpoint.keep, meta=meta, tmp=tmp)
                log.info("checkpoint %s (%.2f s)", path, time.perf_counter() - t0)
            dist.barrier()
        finally:
            producer.resume()

    sets = {n: load_evalset(named_set(n, data_dir=rc.eval.data_dir), limit=rc.eval.sets_limit) for n in rc.eval.sets}

    def evaluate_now(step: int) -> dict:
        """Evaluate the learner's current weights, borrowing the rollout engine from the producer."""
        producer.pause()
        try:
            weights = weights_fn()  # on every rank (a collective under FSDP), whatever its engine holds
            if rollout.version != version:
                rollout.update_weights(weights, version)
            return run_eval(rc, rollout, verifier, heldout, tok, sets, step) if main else {}
        finally:
            producer.resume()

    metrics = metrics if state is not None else {}
    consecutive_skips = 0
    publish(mid_step=False)
    try:
        with StopRequested() as stop:
            if state is None:
                metrics = {"data/skipped_rows": float(report.skipped)} | evaluate_now(0)
                logger.log(metrics, step=0)
            producer.start()
            bar = tqdm(
                range(start + 1, rc.train.steps + 1),
                desc="train",
                disable=not lg.progress or not main,
                dynamic_ncols=True,
                initial=start,
                total=rc.train.steps,
            )
            for step in bar:
                t_step = time.perf_counter()
                # 1-2. rollout + reward (the producer: inline, or ahead on its thread) -> 3. advantages -> 4. buffer
                item, consumer_wait = take()
                scored, batch_stats = score_batch(item)
                buffer.put(scored)
                rows_stats = [batch_stats]
                if mode == "drop":
                    while (more := producer.try_take()) is not None:
                        sc, st = score_batch(more)
                        buffer.put(sc)
                        rows_stats.append(st)
                batch = buffer.get(sizes.samples_per_step, version, horizon=U - 1)
                while len(batch) < sizes.samples_per_step:  # drop mode: stale groups went; wait for fresh ones
                    more, w = take()
                    consumer_wait += w
                    sc, st = score_batch(more)
                    buffer.put(sc)
                    rows_stats.append(st)
                    batch += buffer.get(sizes.samples_per_step - len(batch), version, horizon=U - 1)
                # 5. learner: ppo_epochs passes, mini_batches_per_rollout updates each; version += 1 per update
                if mode == "sync" and hasattr(rollout, "sleep"):
                    rollout.sleep()  # vLLM on a GPU frees its memory for the update; it wakes to load or generate
                t0, updates = time.perf_counter(), []
                for _ in range(rc.learner.ppo_epochs):
                    order = list(range(len(batch)))
                    rng.shuffle(order)
                    for i in range(0, len(order), sizes.mini_batch_size):
                        mb = [batch[j] for j in order[i : i + sizes.mini_batch_size]]
                        stale = buffer.check(mb, version)
                        mine = dist.shard(mb) if world > 1 else mb  # each rank its share; FSDP sums the gradients
                        row = learner.update(collate(mine, pad_id=rollout.pad_id)) | stale
                        updates.append(row)
                        version += 1
                        publish(mid_step=len(updates) < U)  # the one backward edge: new weights for the producer
                        finite = math.isfinite(row["learner/grad_norm"]) and math.isfinite(row["learner/loss"])
                        consecutive_skips = 0 if finite else consecutive_skips + 1
                        if consecutive_skips >= rc.learner.max_consecutive_skips:
                            raise TrainingDiverged(
                                f"{consecutive_skips} optimizer updates in a row had a non-finite loss or gradient "
                                f"(learner.max_consecutive_skips={rc.learner.max_consecutive_skips}) at step {step}; "
                                f"the newest checkpoint is in {rc.run_dir / 'checkpoints'}"
                            )
                t_learn = time.perf_counter() - t0
                release()
                metrics = step_metrics(updates, rows_stats, U)
                metrics |= {
                    "learner/updates": float(len(updates)),
                    "policy/version": float(version),
                    "time/learner_s": t_learn,
                    "buffer/consumer_wait_s": consumer_wait,
                    "buffer/producer_wait_s": producer.take_wait_s(),
                } | buffer.metrics()
                for s_ in range(rc.buffer.max_staleness + 1):
                    metrics.setdefault(f"buffer/staleness_hist/{s_}", 0.0)
                metrics |= monitor.observe(metrics, updates)
                if step == rc.train.steps or (rc.eval.every and step % rc.eval.every == 0):
                    metrics |= evaluate_now(step)
                metrics["time/step_s"] = time.perf_counter() - t_step
                logger.log(metrics, step=step)
                bar.write(summary(step, metrics)) if lg.progress else log.info(summary(step, metrics))
                if world > 1:  # a signal may reach the ranks at different steps: stop together
                    stop.agree(bool(dist.reduce_max(torch.tensor(float(bool(stop)))).item()))
                due = rc.checkpoint.every and step % rc.checkpoint.every == 0
                if due or stop or step == rc.train.steps:
                    save(step)
                if stop:
                    log.warning("stopped at step %d; continue with resume=auto hydra.run.dir=%s", step, rc.run_dir)
                    metrics["stopped_by_signal"] = float(stop.signum)
                    return metrics
            if fsdp_on:
                fsdp.save_hf(learner.model, rc.run_dir / "export", tokenizer=tok)
            elif main:
                export_hf(learner.model, tok, rc.run_dir / "export")
    finally:
        producer.stop()
        mailbox.close()
        logger.close()
        verifier.close()
    if main:
        (rc.run_dir / "final_metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    dist.teardown()
    return metrics


def gather_batch(parts: list[RolloutBatch]) -> RolloutBatch:
    """The ranks' shares of one rollout batch, as one batch in rank order (the same on every rank)."""
    first = parts[0]
    if any(p.index != first.index or p.version != first.version for p in parts):
        raise RuntimeError(f"ranks produced different rollout batches: {[(p.index, p.version) for p in parts]}")
    stats: dict[str, float] = {}
    for key in {k for p in parts for k in p.stats}:
        vals = [float(p.stats[key]) for p in parts if key in p.stats]
        if key.startswith("time/"):
            stats[key] = max(vals)  # the ranks generate in parallel: the step waits for the slowest
        elif key.endswith("tokens_per_s") or (key.startswith("reward/") and key != "reward/accuracy"):
            stats[key] = sum(vals)  # counts and throughput add up
        else:
            stats[key] = float(np.mean(vals))
    correct = tuple(c for p in parts for c in p.correct)
    stats["reward/accuracy"] = sum(correct) / max(len(correct), 1)
    return RolloutBatch(
        first.index,
        first.version,
        tuple(s for p in parts for s in p.samples),
        tuple(r for p in parts for r in p.rewards),
        correct,
        tuple(x for p in parts for x in p.extracted),
        stats,
    )


def _rng_tuple(st) -> tuple:
    return (st[0], tuple(st[1]), st[2])


def step_metrics(updates: list[dict], batches: list[dict], updates_per_step: int) -> dict:
    """One step's row: means over its updates and its rollout batches; maxima and counts where those are meant."""
    m = mean_metrics(updates) | mean_metrics(batches)
    m["buffer/staleness_max"] = max((u["buffer/staleness_max"] for u in updates), default=0.0)
    if updates:
        m["learner/skipped_updates"] = updates[-1]["learner/skipped_updates"]  # a running count, not a mean
    for k in {k for u in updates for k in u if k.startswith("buffer/staleness_hist/")}:
        m[k] = float(sum(u.get(k, 0.0) for u in updates))
    return m


def summary(step: int, m: dict) -> str:
    lo, hi = (m.get(f"bapo/{k}", m.get(f"card/{k}", 0)) for k in ("ratio_low", "ratio_high"))
    s = (
        f"step {step:4d} | reward {m['reward/mean']:.3f} | clip [{lo:.2f}, {hi:.2f}] "
        f"rho {m.get('bapo/rho', 0):.2f} | ent {m.get('learner/entropy', 0):.3f} "
        f"| gnorm {m.get('learner/grad_norm', 0):.2f} | stale {m.get('buffer/staleness_mean', 0):.1f} "
        f"| {m['time/step_s']:.1f}s"
    )
    if "eval/accuracy" in m:
        s += f" | eval {m['eval/accuracy']:.3f}"
    return s
