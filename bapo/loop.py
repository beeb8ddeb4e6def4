"""The off-policy RL loop, top to bottom, over the stages :mod:`bapo.build` composes.

    data -> rollout -> reward -> advantages -> replay buffer -> learner
                ^------------------ new weights -----------------'

One *step* is one rollout batch: ``train.prompts_per_step`` prompts x
``rollout.n`` responses. The learner then makes ``learner.ppo_epochs`` x
``learner.mini_batches_per_rollout`` optimizer updates on it; the policy version
increments at every update, so reuse makes samples stale (staleness = learner
version - sample version), which is the regime BAPO is for. The rollout engine
receives the learner's weights every ``train.sync_every`` updates.

Who owns what: the learner its version, weights, checkpoint and export (sharding is a
strategy inside it); the rollout source (``bapo.rollout.source``; in this process the
producer of ``bapo.rollout.producer``) its engine, weight snapshots, queue and, through its batch
maker (``bapo.rollout.maker``), the data cursor and the cross-rank gather; ``bapo.experience.scoring``
recompute, critic values and advantages; ``bapo.checkpoint`` the checkpoint layout and RNG
state; ``bapo.rundir`` the run folder (lock, fresh/resume decision, config changes). ``bapo.build`` builds them;
:func:`run` only runs the steps over them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from bapo import checkpoint, rundir
from bapo.build import Stages, build_stages
from bapo.config import RunConfig, build
from bapo.data.loading import check_files
from bapo.engines import check_engine
from bapo.eval.evaluate import evaluate, evaluate_sets
from bapo.experience import scoring
from bapo.infra import dist, stop
from bapo.infra.paths import EXPORT_CONFIG
from bapo.infra.seeding import derive_seed, seed_everything
from bapo.infra.tracking import MetricsLogger, NullLogger, check_wandb, truncate_metrics
from bapo.learner import TrainingDiverged
from bapo.plan.verdict import check_one_gpu

log = logging.getLogger(__name__)


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Train as configured; returns the last logged metrics. Every exit (done, already complete, stopped by a
    signal, an error) shuts the engines and the process group down (``dist.teardown``)."""
    rc = build(cfg, run_dir)  # every config error is raised here, before any file is touched
    check_one_gpu(rc)  # one learner process on a GPU machine: whether one GPU holds it, by the memory plan
    check_files(rc.data, rc.data_dir)  # a missing, empty or folder data file, before the model load
    check_wandb(rc.logger.mode)  # logger.mode=online without credentials
    check_engine(rc.rollout)  # vLLM not installed, before minutes of model loading
    finished = False
    try:
        rc = dataclasses.replace(rc, run_dir=dist.shared_path(rc.run_dir))  # torchrun: rank 0's folder
        metrics = train(rc, cfg)
        finished = True
        return metrics
    finally:
        dist.teardown(barrier=finished)  # after an error the other ranks may never reach a barrier


def train(rc: RunConfig, cfg: DictConfig) -> dict:
    """:func:`run`'s body: the run folder, the stages, the steps."""
    with rundir.RunFolder.open(rc.run_dir) if dist.is_main() else contextlib.nullcontext() as folder:
        decision, changes = decide_start(rc, cfg)  # refuses a wrong start, or incompatible changes, before any write
        if decision.kind == "complete":
            return json.loads((rc.run_dir / "final_metrics.json").read_text())
        seed_everything(rc.seed)
        s = build_stages(rc, cfg)
        start, metrics, pending = 0, {}, None
        if decision.kind == "resume":
            start, pending = checkpoint.restore_run(decision.checkpoint, learner=s.learner, source=s.source,
                                                    **shared_state(s))  # fmt: skip
            pending = None if pending is None else StepProgress.from_state(pending)
            inside = f", inside step {start + 1} ({len(pending.updates)} updates made)" if pending else ""
            log.info("resumed from %s at step %d%s (policy version %d)", decision.checkpoint, start, inside,
                     s.learner.version)  # fmt: skip
        if dist.is_main():
            if decision.clear:
                folder.clear()
            checkpoint.clean_partial(rc.run_dir / "checkpoints")  # leftovers of a write a kill interrupted
            if decision.kind == "resume":
                metrics = truncate_metrics(rc.run_dir, decision.source_run, start)
                rundir.record_changes(rc.run_dir, changes, start)
            (rc.run_dir / "final_metrics.json").unlink(missing_ok=True)  # written again when this run completes
            (rc.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        dist.barrier()
        lineage = lineage_id(rc.run_dir)
        logger = make_logger(rc, cfg, lineage)
        clock = SaveClock(rc.checkpoint.every, rc.checkpoint.every_minutes)
        try:
            with stop.handling(s.interrupt.set), stop.shared():
                s.source.offer_weights(s.learner)
                if start == 0 and decision.kind != "resume":
                    metrics = {"data/skipped_rows": float(s.report.skipped)} | evaluate_now(rc, s, 0)
                    logger.log(metrics, step=0)
                s.source.start()
                for step in progress(rc, start):
                    mark = StepMark.take(s)
                    carried, pending = (pending, None) if pending is not None and pending.step == step else (None, None)
                    try:
                        metrics = one_step(rc, s, step, carried)
                    except Stopped as e:  # inside the updates or the evaluation: the step's rest is saved with it
                        mark.restore_monitor(s)
                        save(rc, s, step - 1, lineage, logger, pending=e.progress.state_dict())
                        return stopped(rc, metrics)
                    except stop.Interrupted:  # before the first update: the step's start is saved
                        mark.rewind(s)
                        save(rc, s, step - 1, lineage, logger)
                        return stopped(rc, metrics)
                    logger.log(metrics, step=step)
                    log_line(rc, step, metrics)
                    asked, due = clock.votes(step, final=step == rc.train.steps)
                    if due or asked:
                        save(rc, s, step, lineage, logger)
                        clock.saved()
                    if asked:
                        return stopped(rc, metrics)
                config = {EXPORT_CONFIG: OmegaConf.to_yaml(cfg, resolve=True)}  # eval.py reads the run's settings
                s.learner.export_hf(rc.run_dir / "export", s.tokenizer, extra=config)
        except stop.Interrupted:  # step 0's evaluation: nothing trained yet, nothing to save
            return stopped(rc, metrics)
        except TrainingDiverged as e:
            raise TrainingDiverged(f"{e}; {resume_point(rc)}") from None
        finally:
            s.source.stop()
            logger.close()
            s.verifier.close()
    if dist.is_main():
        (rc.run_dir / "final_metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    return metrics


# ----------------------------------------------------------------------------- building


def decide_start(rc: RunConfig, cfg: DictConfig) -> tuple[rundir.StartDecision, list]:
    """How this run starts in its folder (rank 0 decides, the other ranks follow), and the config changes a
    resume records. Refusals (another run's files, incompatible changes) come before anything is written."""
    decision, changes = None, []
    if dist.is_main():
        decision = rundir.start_decision(
            rc.run_dir,
            resume=rc.resume,
            overwrite=rc.overwrite,
            steps=rc.train.steps,
            find_latest=checkpoint.latest_intact,
        )
        saved = rundir.saved_config(decision.source_run) if decision.kind == "resume" else None
        if saved is not None:
            changes = rundir.resume_changes(saved, OmegaConf.to_container(cfg, resolve=True))
        elif decision.kind == "resume":
            log.warning("%s has no config.yaml: the resumed run's config cannot be compared", decision.source_run)
    return dist.broadcast_object((decision, changes))


def shared_state(s: Stages) -> dict:
    """The run's state beside the learner and the source, by checkpoint entry (rank 0 writes it)."""
    return {"buffer": s.buffer, "monitor": s.monitor, "loop_rng": s.rng}


def lineage_id(run_dir: Path) -> str:
    """This run's id, kept across resumes: checkpoints are pruned within it, and wandb continues it."""
    f = run_dir / "wandb_id.txt"
    if dist.is_main() and not f.is_file():
        f.write_text(uuid.uuid4().hex[:16])
    dist.barrier()
    return f.read_text().strip()


def make_logger(rc: RunConfig, cfg: DictConfig, run_id: str):
    """metrics.jsonl and wandb on rank 0 (one wandb run across resumes: ``run_id``); nothing elsewhere."""
    if not dist.is_main():
        return NullLogger()
    lg = rc.logger
    return MetricsLogger(
        rc.run_dir,
        wandb=lg.mode != "disabled",
        project=lg.project,
        mode=lg.mode,
        group=lg.group,
        tags=list(lg.tags),
        name=rc.run_dir.name,
        config=OmegaConf.to_container(cfg, resolve=True),
        run_id=run_id,
    )


# ----------------------------------------------------------------------------- one step


def fill(rc: RunConfig, s: Stages, batch) -> tuple[list, list[dict], float]:
    """Score ``batch`` into the buffer and take the step's samples from it. In drop mode stale groups go, and
    the learner waits for fresh batches until the step is full. Returns (samples, batch stats, seconds waited)."""
    U, n = rc.sizes.updates_per_step, rc.sizes.samples_per_step
    rows, waited = [put(rc, s, batch)], 0.0
    if rc.mode == "drop":
        while (more := s.source.try_take()) is not None:
            rows.append(put(rc, s, more))
    samples = s.buffer.get(n, s.learner.version, horizon=U - 1)
    while len(samples) < n:  # drop mode: stale groups went; wait for fresh ones
        more, w = s.source.take()
        waited += w
        rows.append(put(rc, s, more))
        samples += s.buffer.get(n - len(samples), s.learner.version, horizon=U - 1)
    if rc.algo.correction is not None and rc.algo.correction.kind == "decoupled":  # the step's proximal policy
        samples, prox_stats = scoring.proximal(samples, s.learner, rc.algo.correction)
        rows.append(prox_stats)
    return samples, rows, waited


def put(rc: RunConfig, s: Stages, batch) -> dict:
    """Score one rollout batch (advantages; behaviour log-probs with recompute) and add it to the buffer."""
    v, horizon = s.learner.version, rc.sizes.updates_per_step - 1
    behaviour = None
    oldest = min((x.version for x in batch.samples), default=batch.version)  # partial rollouts: older tokens
    # A batch the buffer will drop as stale is not recomputed (nor checked): its snapshot may already be released.
    admissible, check = s.buffer.admissible(oldest, v, horizon=horizon), {}
    s.source.before_updates()  # a colocated engine frees the GPU first: recompute and the check run a learner forward
    if rc.behaviour.recompute and admissible:  # pi_old: the learner's forward at the generating weights
        behaviour = {"weights": rc.behaviour.weights(batch, v, s.source.snapshot)}
    elif rc.behaviour.checks and admissible:  # the engine's log-probs stay: measure their mismatch
        seed = derive_seed(rc.seed, "logp_check", batch.index)
        check = scoring.check_logp(batch, s.learner, share=rc.behaviour.check_share, seed=seed)
    scored, stats = scoring.score(
        batch,
        s.learner,
        algo=rc.algo,
        max_new_tokens=rc.rollout.max_new_tokens,
        overlong_buffer=rc.reward.overlong_buffer,
        group_size=rc.rollout.n,
        behaviour=behaviour,
    )
    s.buffer.put(scored)
    return stats | check


def one_step(rc: RunConfig, s: Stages, step: int, p: StepProgress | None) -> dict:
    """Step ``step`` (or the rest of it: ``p`` from a checkpoint written inside it): its metrics row.

    A stop request raises :class:`bapo.infra.stop.Interrupted` before the first update (nothing of the step is
    kept: the caller rewinds it) and :class:`Stopped` once an update was made (what the step's rest needs)."""
    t_step = time.perf_counter()
    if p is None:
        # 1-2. rollout + reward: the source's batch (made inline, or ahead of the learner)
        batch, waited = s.source.take()
        # 3. advantages (and recompute) -> 4. the buffer; drop mode refills what went stale
        samples, rows, more_wait = fill(rc, s, batch)
        p = StepProgress(step, samples, rows, waited + more_wait)
    try:
        # 5. learner: U updates, version +1 each, new weights offered back to the source
        t0 = time.perf_counter()
        updates = learn(rc, s, p)
        p.t_learn += time.perf_counter() - t0
        s.source.release(s.learner.version, keep_window=rc.behaviour.keeps_window)
        metrics = step_metrics(updates, p.rows, rc.buffer.max_staleness)
        metrics |= {
            "learner/updates": float(len(updates)),
            "policy/version": float(s.learner.version),
            "time/learner_s": p.t_learn,
            "buffer/consumer_wait_s": p.waited,
            "buffer/producer_wait_s": s.source.take_wait_s(),
        } | s.buffer.metrics()
        metrics |= s.monitor.observe(metrics, updates)
        if step == rc.train.steps or (rc.eval.every and step % rc.eval.every == 0):
            metrics |= evaluate_now(rc, s, step)
    except stop.Interrupted:
        if not p.updates:
            raise
        raise Stopped(p) from None
    metrics["time/step_s"] = time.perf_counter() - t_step
    return metrics


def learn(rc: RunConfig, s: Stages, p: StepProgress) -> list[dict]:
    """``ppo_epochs`` passes over the step's samples in ``mini_batches_per_rollout`` shuffled mini-batches, from
    where ``p`` stands (a resumed step continues at its next update); returns every update's row."""
    s.source.before_updates()  # an engine on this device may free its memory for the updates (vLLM on a GPU)
    size = rc.sizes.mini_batch_size
    while p.epoch < rc.learner.ppo_epochs:
        if not p.order:
            p.order = list(range(len(p.samples)))
            s.rng.shuffle(p.order)
        while p.at < len(p.order):
            mb = [p.samples[j] for j in p.order[p.at : p.at + size]]
            stale = s.buffer.check(mb, s.learner.version)
            if rc.behaviour.per_token:
                stale |= token_staleness(mb, s.learner.version)
            p.updates.append(s.learner.learn(mb) | stale)  # a stop raises before its update, which is not made
            p.at += size
            s.source.offer_weights(s.learner)  # the one backward edge
        p.epoch, p.order, p.at = p.epoch + 1, [], 0
    p.samples = []  # every update made: the rest of the step needs only the rows
    return p.updates


def evaluate_now(rc: RunConfig, s: Stages, step: int) -> dict:
    """Evaluate the learner's current weights, borrowing the rollout engine from the source. Every rank
    samples its share of the problems (data-parallel) and gets the same metrics."""
    with s.source.borrow(s.learner) as engine:
        t0, e = time.perf_counter(), rc.eval
        seed = derive_seed(rc.seed, "eval", step)
        out = evaluate(engine, s.verifier, s.heldout, n=e.n, temperature=e.temperature, prefix="eval/", seed=seed)
        if e.greedy:
            g = evaluate(engine, s.verifier, s.heldout, n=1, temperature=0.0, prefix="eval/greedy_")
            out["eval/accuracy_greedy"] = g["eval/greedy_accuracy"]
        if s.sets:
            seed = derive_seed(rc.seed, "eval_sets", step)
            out |= evaluate_sets(engine, s.verifier, s.sets, k=e.sets_k, temperature=e.temperature, seed=seed)
        out["eval/version"] = float(engine.version)
        out["time/eval_s"] = time.perf_counter() - t0
        return out


def save(rc: RunConfig, s: Stages, step: int, lineage: str, logger, pending: dict | None = None) -> None:
    """Checkpoint ``step`` (the source quiesced between two batches, so its queue and data cursor agree), with
    ``pending``, the rest of step ``step + 1`` when a stop came inside it. The metrics rows it covers go to disk
    first: a checkpoint never outlives the rows before it."""
    logger.sync()
    t0 = time.perf_counter()
    with s.source.paused():
        path = checkpoint.save_run(
            rc.run_dir / "checkpoints",
            step,
            learner=s.learner,
            source=s.source,
            keep=rc.checkpoint.keep,
            lineage=lineage,
            pending=pending,
            **shared_state(s),
        )
    inside = f" (with {len(pending['updates'])} updates of step {step + 1})" if pending else ""
    log.info("checkpoint %s%s in %.1f s", path, inside, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- metrics and signals


def step_metrics(updates: list[dict], batches: list[dict], max_staleness: int) -> dict:
    """One step's row: means over its updates and its rollout batches; maxima and counts where those are meant."""
    m = mean_metrics(updates) | mean_metrics(batches)
    for k in {k for u in updates for k in u if k.endswith("_max")}:
        m[k] = max(u[k] for u in updates if k in u)
    if updates:
        m["learner/skipped_updates"] = updates[-1]["learner/skipped_updates"]  # a running count, not a mean
    for v in range(max_staleness + 1):
        m[f"buffer/staleness_hist/{v}"] = float(sum(u.get(f"buffer/staleness_hist/{v}", 0.0) for u in updates))
        if any("buffer/token_staleness_max" in u for u in updates):  # partial rollouts: counted per token too
            key = f"buffer/token_staleness_hist/{v}"
            m[key] = float(sum(u.get(key, 0.0) for u in updates))
    return m


def token_staleness(samples: list, version: int) -> dict:
    """Staleness per response token at learner ``version`` (a partial rollout's tokens have several versions):
    mean, max, and counts per value (``buffer/token_staleness_hist/<s>``)."""
    stale = version - torch.cat([x.sample.token_versions() for x in samples] or [torch.zeros(0, dtype=torch.long)])
    out = {
        "buffer/token_staleness_mean": float(stale.double().mean()) if stale.numel() else 0.0,
        "buffer/token_staleness_max": float(stale.max()) if stale.numel() else 0.0,
    }
    values, counts = torch.unique(stale, return_counts=True)
    return out | {
        f"buffer/token_staleness_hist/{v}": float(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)
    }


def mean_metrics(rows: list[dict]) -> dict:
    keys = {k for r in rows for k in r}
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}


def progress(rc: RunConfig, start: int):
    show = rc.logger.progress and dist.is_main()
    steps = range(start + 1, rc.train.steps + 1)
    return tqdm(steps, desc="train", dynamic_ncols=True, initial=start, total=rc.train.steps) if show else steps


def log_line(rc: RunConfig, step: int, m: dict) -> None:
    s = (
        f"step {step:4d} | reward {m['reward/mean']:.3f} | clip [{m.get('clip/low', 0):.2f}, "
        f"{m.get('clip/high', 0):.2f}] rho {m.get('clip/rho', 0):.2f} | ent {m.get('learner/entropy', 0):.3f} "
        f"| gnorm {m.get('learner/grad_norm', 0):.2f} | stale {m.get('buffer/staleness_mean', 0):.1f} "
        f"| {m['time/step_s']:.1f}s"
    )
    if "eval/accuracy" in m:
        s += f" | eval {m['eval/accuracy']:.3f}"
    tqdm.write(s) if rc.logger.progress and dist.is_main() else log.info(s)


def resume_point(rc: RunConfig) -> str:
    """Where a run that stopped can be resumed from, for its error message: the newest checkpoint, or none."""
    newest = checkpoint.latest(rc.run_dir / "checkpoints")
    if newest is not None:
        return f"the newest checkpoint is {newest}"
    return (
        f"no checkpoint was written before it diverged (checkpoint.every={rc.checkpoint.every}): there is "
        "nothing to resume; start again with the change"
    )


def stopped(rc: RunConfig, metrics: dict) -> dict:
    log.warning("stopped; continue with resume=auto hydra.run.dir=%s", rc.run_dir)
    return metrics | {"stopped_by_signal": float(stop.signum() or signal.SIGTERM)}


# ----------------------------------------------------------------------------- a step stopped inside


@dataclasses.dataclass
class StepProgress:
    """How far step ``step`` got: its scored samples, its rollout batches' stats, the updates made (their rows) and
    where the next one starts (``epoch``, its shuffled ``order``, ``at``). A checkpoint written inside the step
    holds it (``pending``: tensors and plain values), and a resumed run makes the rest of the step from it."""

    step: int
    samples: list
    rows: list[dict]
    waited: float
    updates: list[dict] = dataclasses.field(default_factory=list)
    epoch: int = 0
    order: list[int] = dataclasses.field(default_factory=list)
    at: int = 0
    t_learn: float = 0.0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self) | {"samples": list(self.samples)}

    @classmethod
    def from_state(cls, state: dict) -> StepProgress:
        return cls(**state)


class Stopped(Exception):
    """A stop request inside a step once an update was made: ``progress`` is what the rest of the step needs."""

    def __init__(self, progress: StepProgress):
        super().__init__(f"stopped inside step {progress.step}")
        self.progress = progress


@dataclasses.dataclass
class StepMark:
    """What a step changes before its first update, as it was at the step's start: the RNGs, the buffer and the
    monitor. A stop before the first update puts them back and gives the step's batches back to the source
    (:meth:`rewind`): the checkpoint then is the step's start, with those batches still to train on."""

    rng: dict
    buffer: dict
    monitor: dict

    @classmethod
    def take(cls, s: Stages) -> StepMark:
        return cls(checkpoint.capture_rng(s.rng), s.buffer.state_dict(), s.monitor.state_dict())

    def rewind(self, s: Stages) -> None:
        s.source.requeue()
        checkpoint.restore_rng(self.rng, s.rng)
        s.buffer.load_state_dict(self.buffer)
        self.restore_monitor(s)

    def restore_monitor(self, s: Stages) -> None:
        """The monitor as before this step (it sees a step once, when the step's updates are done)."""
        s.monitor.load_state_dict(self.monitor)


class SaveClock:
    """When a step ends in a checkpoint: every ``every`` steps, once ``every_minutes`` have passed since the last
    one (a checkpoint or the start of this process), at the last step, and when any rank was asked to stop."""

    def __init__(self, every: int, every_minutes: float):
        self.every, self.every_s = every, 60.0 * every_minutes
        self.last = time.monotonic()

    def votes(self, step: int, *, final: bool) -> tuple[bool, bool]:
        """(stop asked on some rank, a checkpoint due): one collective under torchrun, the same on every rank."""
        due_time = bool(self.every_s) and time.monotonic() - self.last >= self.every_s
        flags = torch.tensor([float(stop.requested()), float(due_time)])
        if dist.world_size() > 1:
            flags = dist.reduce_max(flags)
        asked, due_time = bool(flags[0]), bool(flags[1])
        if asked and not stop.requested():
            stop.request(signal.SIGTERM)
        return asked, final or due_time or bool(self.every and step % self.every == 0)

    def saved(self) -> None:
        self.last = time.monotonic()
