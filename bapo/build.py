"""The composition of a run: every stage built from its typed config group, once, in the learner's process
(:func:`build_stages`), and the rollout side of a rollout worker process (:func:`worker_side`). :mod:`bapo.loop`
runs the steps over what this builds; a worker process (``python -m bapo.entry.worker``) builds its side here too,
never from the loop.

Where rollout runs is the placement's (``placement.mode``, :mod:`bapo.rollout.placement`): in this process (the
producer of :mod:`bapo.rollout.producer` runs the batch maker inline or on its thread), or in rollout worker
processes (:mod:`bapo.rollout.disaggregated`, whose remote maker the same producer drives). This module builds the
parts and lends them to the placement; it never reads the mode's name.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import threading

import torch
from omegaconf import DictConfig, OmegaConf

from bapo.algos import build_objective
from bapo.config import RunConfig, build, prompt_limit
from bapo.data.loading import LoadReport, PromptStream, problem_sources, render_prompts
from bapo.engines import build_rollout, engine_traits
from bapo.eval.evaluate import prepare_set
from bapo.eval.job import load_evalset, named_set
from bapo.experience.buffer import ReplayBuffer
from bapo.infra import dist
from bapo.learner import Learner, frozen_dtype, master_dtype
from bapo.modeling import DTYPES, attention_kernel, load_model, load_tokenizer, model_path
from bapo.monitor import Monitor
from bapo.reward import Verifier, build_verifier
from bapo.rollout.groupfilter import GroupFilter
from bapo.rollout.maker import RolloutMaker
from bapo.rollout.placement import RolloutParts, RolloutSide, placement_class
from bapo.rollout.source import RolloutSource


@dataclasses.dataclass
class Stages:
    """Everything :func:`run` wires together, built once by :func:`build_stages`."""

    tokenizer: object
    verifier: Verifier
    heldout: list
    sets: dict
    buffer: ReplayBuffer
    learner: Learner
    source: RolloutSource  # the rollout batches, and the engine evaluation borrows
    monitor: Monitor
    rng: random.Random  # mini-batch shuffles
    interrupt: threading.Event  # set by a stop request: wakes every blocking wait
    report: LoadReport  # rows the data loaders skipped (malformed, over-long)


def model_files(rc: RunConfig) -> tuple[str, object, dict]:
    """The model's local folder (converted from GGUF first if asked), its tokenizer, and how to load it."""
    m = rc.model
    path = model_path(m.name_or_path, m.gguf.package if m.gguf else None, m.gguf.file if m.gguf else None)
    tok = load_tokenizer(path, trust_remote_code=m.trust_remote_code)
    on_cuda = torch.cuda.is_available() and getattr(rc.learner, "device", "auto") != "cpu"
    kernel = attention_kernel(m.attn_implementation, on_cuda)
    load = dict(trust_remote_code=m.trust_remote_code, init=m.init, arch=m.arch, attn_implementation=kernel)
    return path, tok, load


def build_maker(rc: RunConfig, *, path: str, tokenizer, engine_model, limit: int, rank: int, world: int) -> RolloutSide:
    """The rollout side of a run: its engine and the batch maker that drives it (drawing prompts from the
    training stream, generating this rank's share, grading), the data loaders' report and the held-out
    prompts (rendered here too, so that the report counts their skipped rows wherever it is built). Built
    in the learner's process, or in each rollout worker (``bapo.rollout.disaggregated.worker``) of a disaggregated
    run."""
    engine = build_rollout(
        rc.rollout,
        path=path,
        tokenizer=tokenizer,
        model=engine_model,
        dtype=rc.model.dtype,
        seed=rc.seed,
        max_model_len=limit + rc.rollout.max_new_tokens,  # vLLM sizes its engine for this, not the full context
        syncs_together=not rc.train.async_rollout,  # sync mode: every rank loads each version at once
    )
    verifier = build_verifier(rc.reward)
    d = rc.data
    train_src, heldout, report = problem_sources(d)
    heldout = render_prompts(heldout, tokenizer, instruction=d.instruction, max_prompt_tokens=limit, report=report)
    stream = PromptStream(train_src, tokenizer, instruction=d.instruction, max_prompt_tokens=limit, report=report)
    maker = RolloutMaker(
        stream,
        engine,
        verifier,
        prompts_per_step=rc.train.prompts_per_step,
        seed=rc.seed,
        rank=rank,
        world=world,
        skipped=report,
        partial_budget=rc.behaviour.partial_budget,
    )
    if rc.algo.filter_groups:  # DAPO's dynamic sampling: informative groups only, refilled (rollout/groupfilter.py)
        maker = GroupFilter(maker, prompts_per_step=rc.train.prompts_per_step)
    return RolloutSide(maker, engine, verifier, report, heldout)


def build_stages(rc: RunConfig, cfg: DictConfig | None = None) -> Stages:
    """Load the model once, and build every stage from its typed config group (``cfg``: the composed config,
    which rollout workers are started with under ``placement.mode=disaggregated``)."""
    m = rc.model
    path, tok, load = model_files(rc)
    where = placement_class(rc.placement.mode)
    if rc.placement.learner_threads:
        torch.set_num_threads(rc.placement.learner_threads)
    # The learner's master weights; an engine that samples with a model of this process gets its own copy in
    # model.dtype. A sharded learner with nothing to copy them into starts from the meta device and reads each
    # rank's shard of the checkpoint, and so does a KL reference (sharded too, in the dtype the policy computes in).
    needs_copy = engine_traits(rc.rollout.engine).needs_model_copy and not where.traits.in_workers
    lazy = rc.learner.kind != "single" and not needs_copy and m.init != "random"
    device = "meta" if lazy else "cpu"
    policy = load_model(path, dtype=master_dtype(rc.learner, m.dtype), **load, device=device)
    engine_model = None
    if needs_copy:
        engine_model = copy.deepcopy(policy).to(DTYPES[m.dtype])
    ref_model = None
    if rc.algo.kl_coef > 0:
        ref_dtype = frozen_dtype(rc.learner, m.dtype)
        if lazy:
            ref_model = load_model(path, dtype=ref_dtype, **load, device=device)
        else:
            ref_model = copy.deepcopy(policy).to(DTYPES[ref_dtype])
    engine_dtype = DTYPES[m.dtype]
    d, context = rc.data, getattr(policy.config, "max_position_embeddings", None)
    limit = prompt_limit(d.max_prompt_tokens, rc.rollout.max_new_tokens, context, model_dir=path)
    interrupt = threading.Event()
    placement = where(rc, cfg, path=path, limit=limit, interrupt=interrupt)  # workers load while the learner does
    try:
        learner = Learner(
            policy,
            rc.learner,
            objective=build_objective(rc.algo),
            pad_id=tok.pad_token_id,
            temperature=rc.rollout.temperature,
            max_response_len=rc.rollout.max_new_tokens,
            critic_cfg=rc.algo.critic,
            agg=rc.algo.agg,
            ref_model=ref_model,
            weights_dtype=engine_dtype,  # engines and the export get the model's dtype, not fp32 masters
            snapshot_dtype=rc.behaviour.snapshot_dtype(engine_dtype),  # recompute: the learner's
        )
        if engine_model is not None:
            engine_model.to(learner.device)

        def heldout_prompts() -> tuple:
            _, heldout, report = problem_sources(d)
            return render_prompts(
                heldout, tok, instruction=d.instruction, max_prompt_tokens=limit, report=report
            ), report

        parts = RolloutParts(
            local=lambda: build_maker(
                rc,
                path=path,
                tokenizer=tok,
                engine_model=engine_model,
                limit=limit,
                rank=dist.rank(),
                world=dist.world_size(),
            ),
            verifier=lambda: build_verifier(rc.reward),
            heldout=heldout_prompts,
            tokenizer=tok,
        )
        maker, engine, verifier, report, heldout = placement.rollout(parts)
        source = placement.source(maker, engine, interrupt)
        e, sets = rc.eval, {}
        why = "data.max_prompt_tokens, and the model's context - rollout.max_new_tokens"
        for n in e.sets:  # over-long prompts skipped and counted as in the held-out set (eval/<set>/skipped)
            problems = load_evalset(named_set(n), limit=e.sets_limit)
            sets[n] = prepare_set(n, problems, tok, instruction=d.instruction, max_prompt_tokens=limit, limit_keys=why)
    except BaseException:
        placement.stop()
        raise
    buffer = ReplayBuffer(
        max_staleness=rc.buffer.max_staleness, capacity=rc.buffer.capacity, sampling=rc.buffer.sampling, seed=rc.seed
    )
    monitor = Monitor(**vars(rc.monitor))
    if not dist.is_main():  # rank 0 reports; the others only warn
        logging.getLogger("bapo").setLevel(logging.WARNING)
    rng = random.Random(rc.seed)
    return Stages(tok, verifier, heldout, sets, buffer, learner, source, monitor, rng, interrupt, report)


def worker_side(init: dict):
    """A rollout worker's side (bapo.rollout.disaggregated.worker): the rollout maker and engine of share
    ``init['share']`` of the run in ``init``, its verifier, and the engine's model if it has one."""

    torch.set_num_threads(int(init["threads"]))
    rc = build(OmegaConf.create(init["config"]), init["run_dir"])
    path = init["path"]
    _, tok, load = model_files(rc)
    engine_model = None
    if engine_traits(rc.rollout.engine).needs_model_copy:
        engine_model = load_model(path, dtype=rc.model.dtype, **load, device="cpu")
    maker, engine, verifier, _, _ = build_maker(
        rc,
        path=path,
        tokenizer=tok,
        engine_model=engine_model,
        limit=int(init["limit"]),
        rank=int(init["share"]),
        world=int(init["shares"]),
    )
    return maker, engine, verifier, engine_model
