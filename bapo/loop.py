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
import json
import logging
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from bapo import algos
from bapo.buffer import ReplayBuffer
from bapo.config import AlgoConfig, ConfigError, RunConfig, build
from bapo.data import ArithSpec, problem_sources, render_prompt
from bapo.evaluate import evaluate, evaluate_sets, load_evalset, named_set
from bapo.learner import Critic, Learner, collate
from bapo.logging import MetricsLogger
from bapo.modeling import load_model, load_tokenizer, model_path, pick_device
from bapo.monitor import Monitor
from bapo.reward import MathVerifier, overlong_penalty
from bapo.rollout import HFRollout
from bapo.types import Sample, ScoredSample

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


def build_stages(rc: RunConfig):
    if rc.rollout.engine != "hf" or rc.learner.kind != "single":
        raise ConfigError(
            f"rollout.engine={rc.rollout.engine} / learner.kind={rc.learner.kind}: the vLLM engine and the "
            "FSDP2 learner are not in this build yet; use rollout=hf learner=single"
        )
    device = pick_device(rc.learner.device)
    path = model_path(rc.model.name_or_path, rc.model.gguf_package, rc.model.gguf_file)
    tok = load_tokenizer(path, trust_remote_code=rc.model.trust_remote_code)
    policy = load_model(path, dtype=rc.model.dtype, device=device, trust_remote_code=rc.model.trust_remote_code)
    r = rc.rollout
    rollout = HFRollout(
        copy.deepcopy(policy),
        tok,
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        batch_size=r.batch_size,
    )
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
        ref_model=copy.deepcopy(policy).eval() if a.kl_coef > 0 else None,
        scope=a.scope,
        lr=lc.lr,
        warmup_steps=lc.warmup_steps,
        micro_batch_size=lc.micro_batch_size,
        **opt_kw,
        temperature=r.temperature,
        max_response_len=r.max_new_tokens,
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


def score(samples: list[Sample], grades, rewards, adv, returns, values) -> list[ScoredSample]:
    """Attach the (shaped) reward, per-token advantages and (with a critic) old values and returns to each sample."""

    def row(t, i: int) -> tuple[float, ...] | None:  # sample i's response tokens of a [B, T] tensor
        return None if t is None else tuple(t[i, : len(samples[i].response_ids)].tolist())

    return [
        ScoredSample(
            s,
            float(rewards[i]),
            float(adv[i, 0]) if s.response_ids else 0.0,
            g.correct,
            g.extracted,
            token_adv=row(adv, i),
            old_values=row(values, i),
            returns=row(returns, i),
        )
        for i, (s, g) in enumerate(zip(samples, grades, strict=True))
    ]


def run_eval(rc: RunConfig, rollout, verifier, prompts, tok, sets: dict) -> dict:
    """The held-out check (eval/accuracy, ...) and, with eval.sets, eval.py's metrics (eval/<set>/avg@k, ...)."""
    t0, e = time.perf_counter(), rc.eval
    out = evaluate(rollout, verifier, prompts, n=e.n, temperature=e.temperature, prefix="eval/")
    if e.greedy:
        g = evaluate(rollout, verifier, prompts, n=1, temperature=0.0, prefix="eval/greedy_")
        out["eval/accuracy_greedy"] = g["eval/greedy_accuracy"]
    if sets:
        kw = dict(k=e.sets_k, temperature=e.temperature, instruction=rc.data.instruction)
        out |= evaluate_sets(rollout, verifier, tok, sets, **kw)
    out["time/eval_s"] = time.perf_counter() - t0
    return out


def mean_metrics(rows: list[dict]) -> dict:
    keys = {k for r in rows for k in r}
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Train as configured; returns the last logged metrics."""
    rc = build(cfg, run_dir)
    rc.run_dir.mkdir(parents=True, exist_ok=True)
    (rc.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    seed_everything(rc.seed)
    tok, rollout, verifier, train_src, heldout, report, buffer, learner = build_stages(rc)
    lg = rc.logger
    logger = MetricsLogger(
        rc.run_dir,
        wandb=lg.wandb,
        project=lg.project,
        mode=lg.mode,
        group=lg.group,
        tags=list(lg.tags),
        name=rc.run_dir.name,
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    sizes, version, rng = rc.sizes, 0, random.Random(rc.seed)
    a = rc.algo
    adv_kw = dict(group_size=rc.rollout.n, norm_std=a.norm_std, gamma=a.critic.gamma, lam=a.critic.lam)
    monitor = Monitor(**vars(rc.monitor))
    sets = {n: load_evalset(named_set(n, data_dir=rc.eval.data_dir), limit=rc.eval.sets_limit) for n in rc.eval.sets}
    metrics = {"data/skipped_rows": float(report.skipped)} | run_eval(rc, rollout, verifier, heldout, tok, sets)
    logger.log(metrics, step=0)
    bar = tqdm(range(1, rc.train.steps + 1), desc="train", disable=not lg.progress, dynamic_ncols=True)
    try:
        for step in bar:
            t_step = time.perf_counter()
            # 1. rollout: sample n responses per prompt with the engine's (possibly older) weights
            prompts = [
                render_prompt(next(train_src), tok, instruction=rc.data.instruction)
                for _ in range(rc.train.prompts_per_step)
            ]
            t0 = time.perf_counter()
            samples = rollout.generate(prompts)
            t_rollout = time.perf_counter() - t0
            # 2. reward: verify the answers in worker processes
            grades, rstats = verifier.grade([s.text for s in samples], [s.prompt.problem.answer for s in samples])
            lengths = [len(s.response_ids) for s in samples]
            rewards = torch.tensor([g.reward for g in grades], dtype=torch.float64)  # [B]
            # DAPO's soft overlong penalty shapes the reward only; `correct` (accuracy) stays the verifier's
            max_len, buf = rc.rollout.max_new_tokens, rc.reward.overlong_buffer
            rewards = rewards + torch.tensor([overlong_penalty(n, max_len=max_len, buffer=buf) for n in lengths])
            # 3. advantages: GRPO's groups, or GAE on the critic's values taken now, before any update
            values = learner.values(collate(samples, pad_id=rollout.pad_id))  # [B, T]; None without a critic
            adv, returns, adv_stats = algos.compute_advantages(
                rc.algo.advantage, rewards, lengths, values=values, **adv_kw
            )
            scored = score(samples, grades, rewards, adv, returns, values)
            # 4. buffer: tag, admit, drop what is too stale for this learner version
            buffer.put(scored)
            batch = buffer.get(sizes.samples_per_step, version)
            # 5. learner: ppo_epochs passes, mini_batches_per_rollout updates each; version += 1 per update
            t0, updates, t_sync = time.perf_counter(), [], 0.0
            for _ in range(rc.learner.ppo_epochs):
                order = list(range(len(batch)))
                rng.shuffle(order)
                for i in range(0, len(order), sizes.mini_batch_size):
                    mb = [batch[j] for j in order[i : i + sizes.mini_batch_size]]
                    stale = buffer.check(mb, version)
                    updates.append(learner.update(collate(mb, pad_id=rollout.pad_id)) | stale)
                    version += 1
                    # the one backward edge: new weights go back to the rollout engine
                    if version % rc.train.sync_every == 0:
                        t_sync += rollout.update_weights(learner.weights(), version)
            t_learn = time.perf_counter() - t0 - t_sync
            metrics = mean_metrics(updates) | rstats.as_dict()
            metrics["buffer/staleness_max"] = max((u["buffer/staleness_max"] for u in updates), default=0.0)
            metrics |= {f"adv/{k}": float(v) for k, v in adv_stats.items()}
            n_tok = sum(len(s.response_ids) for s in samples)
            metrics |= {
                "reward/mean": float(rewards.mean()),
                "rollout/response_len": n_tok / len(samples),
                "rollout/truncated": sum(s.truncated for s in samples) / len(samples),
                "rollout/tokens_per_s": n_tok / max(t_rollout, 1e-9),
                "learner/updates": float(len(updates)),
                "policy/version": float(version),
                "time/rollout_s": t_rollout,
                "time/learner_s": t_learn,
                "time/sync_s": t_sync,
                "time/reward_s": rstats.verify_s,
            } | buffer.metrics()
            metrics |= monitor.observe(metrics, updates)
            if step == rc.train.steps or (rc.eval.every and step % rc.eval.every == 0):
                metrics |= run_eval(rc, rollout, verifier, heldout, tok, sets)
            metrics["time/step_s"] = time.perf_counter() - t_step
            logger.log(metrics, step=step)
            bar.write(summary(step, metrics)) if lg.progress else log.info(summary(step, metrics))
        export_hf(learner.model, tok, rc.run_dir / "export")
    finally:
        logger.close()
        verifier.close()
    (rc.run_dir / "final_metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    return metrics


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
