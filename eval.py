"""Evaluate a model or a training run on math sets:

    python eval.py checkpoint=outputs/<date>/<run> eval=[aime24,aime25,math500] k=16 temperature=0.6 top_p=0.95
    python eval.py model=smollm2_135m eval=gsm8k k=4 eval.limit=50
    .venv-vllm/bin/python eval.py rollout=vllm eval=arith k=2 eval.limit=8
    torchrun --nproc_per_node=8 eval.py rollout=vllm checkpoint=... eval=aime24 k=16   (data-parallel)

Under torchrun every rank builds its own engine (vLLM: one per rank in torchrun's process group)
and samples its share of the problems; the shares are gathered and rank 0 writes the reports.
Every sample row records its generate call's seed and request index (bapo/evaluate.py).

Writes results.json, results.md and samples_<set>.jsonl to the run folder
(outputs/eval/<date>/<time>). This is evaluation's composition root, as
bapo/loop.py is training's: it alone builds the engines (the rollout engine
and the training verifier) and hands them to bapo/evaluate.py.
"""

from pathlib import Path
from types import SimpleNamespace

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

# The set group `eval` lives in conf/evaluation/eval (conf/eval is training's held-out config).
# Hydra reads a relative searchpath from the working directory, so conf/eval_config.yaml names
# the folder through this resolver and eval.py runs from any directory.
OmegaConf.register_new_resolver("bapo.conf_dir", lambda: str(Path(__file__).resolve().parent / "conf"), replace=True)


def run(cfg: DictConfig, run_dir) -> dict:
    """Evaluate as configured; returns {set: metrics}."""
    import logging

    from bapo import dist
    from bapo import evaluate as ev
    from bapo.modeling import load_model, load_tokenizer, model_path, pick_device
    from bapo.reward import MathVerifier
    from bapo.rollout import build_rollout

    log = logging.getLogger("eval")
    job = ev.build_job(cfg)
    run_dir = dist.shared_path(run_dir)  # torchrun: joins the process group; rank 0's folder
    main = dist.is_main()
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    sets = {name: ev.load_evalset(s, limit=job.run.limit) for name, s in job.sets.items()}  # fail before loading
    m, r = job.model, job.run
    path = (
        ev.resolve_checkpoint(r.checkpoint)
        if r.checkpoint
        else model_path(m.name_or_path, m.gguf.package if m.gguf else None, m.gguf.file if m.gguf else None)
    )
    log.info("model %s; sets %s", path, {name: len(p) for name, p in sets.items()})
    tok = load_tokenizer(path, trust_remote_code=m.trust_remote_code)
    model = None  # vLLM loads the checkpoint itself
    if job.engine == "hf":
        device = dist.init() if dist.launched() else pick_device(r.device)  # torchrun: this rank's device
        model = load_model(path, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code)
    # evaluation records no log-probs, so nucleus sampling (top_p < 1) is allowed here
    engine_cfg = SimpleNamespace(**OmegaConf.to_container(cfg.rollout, resolve=True))
    rollout = build_rollout(
        engine_cfg, path=path, tokenizer=tok, model=model, dtype=m.dtype, seed=r.seed, top_p=r.top_p, logprobs=False
    )
    config = OmegaConf.to_container(cfg, resolve=True) | {"model_path": path}
    results = {}
    with MathVerifier(
        num_workers=job.reward.num_workers, timeout_s=job.reward.timeout_s, fallback=job.reward.fallback
    ) as verifier:
        for name, problems in sets.items():
            res = ev.evaluate_problems(
                rollout, verifier, tok, problems, k=r.k, temperature=r.temperature,
                instruction=r.instruction, max_distinct=r.maj_max_distinct, seed=r.seed,
            )  # fmt: skip
            results[name] = res
            if main:  # every rank has the same results (gathered); one writes them
                ev.write_samples(run_dir / f"samples_{name}.jsonl", res.samples)
                ev.write_results(run_dir, results, k=r.k, config=config)  # after each set: a crash keeps what is done
                log.info("%s: %s", name, " ".join(f"{k}={v:.3f}" for k, v in res.metrics.items()))
    if main:
        log.info("results in %s\n%s", run_dir, (run_dir / "results.md").read_text())
    dist.teardown()
    return {name: res.metrics for name, res in results.items()}


@hydra.main(version_base="1.3", config_path="conf", config_name="eval_config")
def main(cfg: DictConfig) -> None:
    run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":  # vLLM's engine may spawn processes that re-import this file
    main()
