"""Evaluate a model or a training run on math sets:

    python eval.py checkpoint=outputs/<date>/<run> eval=[aime24,aime25,math500] k=16 temperature=0.6
    torchrun --nproc_per_node=8 eval.py rollout=vllm checkpoint=... eval=aime24 k=16   (data-parallel, a GPU node)
    python eval.py model=smollm2_135m eval=gsm8k k=4 eval.limit=50
    .venv-vllm/bin/python eval.py rollout=vllm eval=arith k=2 eval.limit=8

A training run is evaluated the way it was trained. When ``checkpoint=`` is a run folder (its
``config.yaml``, its weights in ``export/``), or an export folder that carries the run's config
(``bapo_config.yaml``), the run's settings replace eval.py's own: the model group (dtype, arch,
answer_fallback; the weights are the export's), ``max_new_tokens`` (the run's
``rollout.max_new_tokens``), the prompt's ``instruction`` and ``max_prompt_tokens`` (its ``data.*``),
and the rollout engine with its knobs (vLLM's memory share, tensor parallelism, eager mode; vLLM's servers,
which ran on GPUs of their own, give way to vLLM in each eval rank). A key
given on the command line wins (``checkpoint=<run> max_new_tokens=1024``); every value taken, and
every override, is logged in one block and recorded in results.json's config. A bare HF folder,
or no checkpoint, is evaluated with the settings composed here (conf/eval_config.yaml, ``model=``).
``model.trust_remote_code`` is never taken from a run or an export (a shared folder must not decide to
run its own code): only ``model.trust_remote_code=true`` on the command line turns it on. A run folder or
export is read as data (``bapo/infra/artifacts.py``: bounded, never interpolated), its model folder checked
before anything loads it and its chat template rendered within bounds (``bapo/infra/chat_template.py``).

Prompts longer than the model leaves room for (its context minus ``max_new_tokens``, and at most
``max_prompt_tokens``) are skipped and counted as in training; the reports say how many per set.
vLLM is sized for exactly that (``max_model_len`` = the prompt limit + ``max_new_tokens``).

A plain ``python eval.py`` on a GPU node starts one rank per GPU itself (``bapo.entry.launch``: the elastic launcher
torchrun runs), as ``torchrun --nproc_per_node=<GPUs> eval.py`` does. Every rank builds its own engine (vLLM: one
per rank in the process group), samples and grades its share of the problems; the graded shares are gathered
and rank 0 writes the reports. Every sample row records its generate call's seed and request index
(bapo/eval/evaluate.py).

Writes results.json, results.md and samples_<set>.jsonl to the run folder
(outputs/eval/<date>/<time>), which it holds as train.py holds its own (a second eval.py on the same
folder is refused at once; so is a training run's folder, whose ``.hydra/`` is the run's record: evaluate
beside it with ``hydra.run.dir=<run>/eval``). Bad input is one line, ``error: ConfigError: <key>: ...``, exit
status 2, and leaves no run folder behind (bapo/entry/cli.py). This is evaluation's composition root,
as bapo/loop.py is training's: it alone builds the engines (the rollout engine and the training
verifier) and hands them to bapo/eval/evaluate.py (its job's config: bapo/eval/job.py; a run's
settings: bapo/eval/adopt.py; the reports: bapo/eval/report.py).
"""

from collections.abc import Sequence
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf


def run(cfg: DictConfig, run_dir, overrides: Sequence[str] = ()) -> dict:
    """Evaluate as configured; returns {set: metrics}. ``overrides``: the command line's (Hydra's task
    overrides), which win over a training run's settings."""
    import logging

    from bapo.eval.adopt import adopt_run
    from bapo.eval.job import build_job, load_evalset
    from bapo.infra import dist

    log = logging.getLogger("eval")
    source = adopt_run(cfg, overrides)  # a training run's settings, before anything is validated or loaded
    job = build_job(cfg)
    from bapo.engines import check_engine

    check_engine(job.rollout)  # vLLM not installed: one line, before the model loads
    problems = {name: load_evalset(s, limit=job.run.limit) for name, s in job.sets.items()}  # before loading
    finished = False
    try:
        results = _evaluate(cfg, run_dir, job, source, problems, log)
        finished = True
        return results
    finally:
        dist.teardown(barrier=finished)  # engines and the process group, on every exit path


def _evaluate(cfg: DictConfig, run_dir, job, source, problems: dict, log) -> dict:
    """:func:`run`'s body, once the config is valid: join the ranks, load, sample, grade, report."""
    from bapo.config import ConfigError
    from bapo.engines import build_rollout, engine_traits
    from bapo.eval.adopt import checkpoint_weights
    from bapo.eval.evaluate import evaluate_set, prepare_set
    from bapo.eval.job import eval_prompt_limit, model_context
    from bapo.eval.report import write_results, write_samples
    from bapo.infra import dist
    from bapo.infra.artifacts import check_model_folder
    from bapo.modeling import attention_kernel, load_model, load_tokenizer, model_path, pick_device
    from bapo.reward import build_verifier

    m, r = job.model, job.run
    run_dir = dist.shared_path(run_dir)  # torchrun: joins the process group (a hub id resolves rank by rank)
    key = "checkpoint" if source else "model.name_or_path"
    path = (
        str(source.weights)
        if source
        else model_path(m.name_or_path, m.gguf.package if m.gguf else None, m.gguf.file if m.gguf else None)
    )
    check_model_folder(path, key, trust_remote_code=m.trust_remote_code)  # a damaged or hostile one: one line
    try:
        tok = load_tokenizer(path, trust_remote_code=m.trust_remote_code)
        context = model_context(path, trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path}: {str(e).splitlines()[0]}") from None
    limit = eval_prompt_limit(r.max_prompt_tokens, r.max_new_tokens, context)
    why = f"the model's context of {context} tokens - max_new_tokens={r.max_new_tokens}, and max_prompt_tokens"
    why += f"={r.max_prompt_tokens}"
    sets = {
        name: prepare_set(name, p, tok, instruction=r.instruction, max_prompt_tokens=limit, limit_keys=why)
        for name, p in problems.items()
    }
    log.info("model %s; sets %s", path, {name: len(s.prompts) for name, s in sets.items()})
    main = dist.is_main()
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    model = None  # an engine that needs no model of this process loads the checkpoint itself
    if engine_traits(job.engine).needs_model_copy:
        device = dist.init() if dist.launched() else pick_device(r.device)  # torchrun: this rank's device
        kernel = attention_kernel(m.attn_implementation, device.type == "cuda")
        model = load_model(
            path, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code, attn_implementation=kernel
        )
    # evaluation records no log-probs, so nucleus sampling (top_p < 1) is allowed here
    rollout = build_rollout(
        job.rollout, path=path, tokenizer=tok, model=model, dtype=m.dtype, seed=r.seed, top_p=r.top_p, logprobs=False,
        max_model_len=None if limit is None else limit + r.max_new_tokens,
    )  # fmt: skip
    if rollout.version != 0:  # a server given by URL holds whatever it last loaded: the checkpoint's weights first
        rollout.load_weights(checkpoint_weights(path), 0)
    config = OmegaConf.to_container(cfg, resolve=True) | (source.record() if source else {"model_path": path})
    results = {}
    with build_verifier(job.reward) as verifier:
        for name, s in sets.items():
            res = evaluate_set(
                rollout, verifier, s, k=r.k, temperature=r.temperature, max_distinct=r.maj_max_distinct, seed=r.seed
            )
            results[name] = res
            if main:  # every rank has the same results (gathered); one writes them
                write_samples(run_dir / f"samples_{name}.jsonl", res.samples)
                write_results(run_dir, results, k=r.k, config=config)  # after each set: a crash keeps what is done
                log.info(
                    "%s: %s skipped=%d", name, " ".join(f"{k}={v:.3f}" for k, v in res.metrics.items()), res.skipped
                )
    if main:
        log.info("results in %s\n%s", run_dir, (run_dir / "results.md").read_text())
    return {name: res.metrics for name, res in results.items()}


@hydra.main(version_base="1.3", config_path="conf", config_name="eval_config")
def main(cfg: DictConfig) -> None:
    import os

    from bapo.entry.cli import guarded, hydra_files, refuse_training_run
    from bapo.entry.launch import announce, watch_launcher
    from bapo.entry.launch_step import launch_here
    from bapo.infra.dist import from_slurm

    watch_launcher()  # a rank this command's launch started ends with its launcher (bapo.entry.launch)
    from_slurm()  # SLURM with one task per rank: torchrun's variables
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    refuse_training_run(run_dir, "eval.py")  # a training run's folder holds its record: never written over
    if launch_here(cfg, hc, __file__, run_dir, None, "eval"):  # the node's ranks evaluated (bapo.entry.launch)
        return
    files = hydra_files(cfg)  # .hydra/, written once the folder is held (conf/eval_config.yaml: output_subdir null)
    rank0 = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 holds the shared folder
    # the folder's lock first (two evals started in one second share outputs/eval/<date>/<time>); bad input: one
    # line, exit 2, the folder left as it was
    job = lambda: announce(cfg) or run(cfg, run_dir, hc.overrides.task)  # noqa: E731
    guarded(job, run_dir, hold=rank0, files=files if rank0 else None)


if __name__ == "__main__":  # vLLM's engine may spawn processes that re-import this file
    from bapo.entry.cli import hydra_entry

    hydra_entry(main)  # Hydra's own start-up errors (a bad override, an unknown set): one line too
