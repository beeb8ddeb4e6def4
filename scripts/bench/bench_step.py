"""One training step, stage by stage: this tree against a baseline, in interleaved rounds.

A step of the default loop in sync mode is timed piece by piece: **sync** (the learner's
weights into the rollout engine), **generation** (the engine's ``generate``, which takes the
behaviour log-probs inside its loop; **sampling** is the part of it spent choosing tokens and
taking their log-probs, the rest is the model's forward), **grading** (math-verify in the
reward workers), **scoring** (advantages), **collate**, and one learner update split into
**forward** (the model and the log-prob/entropy), **backward**, **optimizer** (clip + AdamW
+ zero_grad) and **loss** (the objective: the rest of the update).

Each *variant* is a worker process: a source tree to import ``bapo`` from and Hydra overrides.
The default pair is this tree against ``--base`` (a worktree of the baseline commit:
``git worktree add /tmp/wt-perf-base 1eb02e8``) with the same overrides; ``--variant
NAME=ROOT:OVERRIDES`` adds more (overrides comma-separated). Workers stay up and run one step
each in turn, so a busy machine slows every variant alike; medians over ``--rounds`` are
printed with each stage's ratio against the first variant given as the baseline.

    python scripts/bench/bench_step.py --base /tmp/wt-perf-base [--rounds 7] [--threads 2]
        [--overrides algo=grpo,learner.mini_batches_per_rollout=1] [--base-overrides rollout.decode=generate]

Workers run one at a time; their torch thread count is ``--threads`` (0: torch's default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = (
    "sync",
    "generation",
    "  sampling",
    "grading",
    "scoring",
    "collate",
    "forward",
    "backward",
    "loss",
    "optimizer",
    "learner",
    "step",
)
# The equal settings: 32 prompts x 8 responses, one update.
EQUAL = "algo=grpo,train.prompts_per_step=32,learner.mini_batches_per_rollout=1"


class Clock:
    """Adds up the time spent in wrapped callables, by stage name."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0

        return timed

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        yield
        self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0


def worker(root: Path, overrides: list[str], threads: int) -> None:
    """Build the stages from ``root``'s bapo and conf/, then time one step per line read from stdin."""
    os.chdir(root)
    sys.path.insert(0, str(root))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch
    from hydra import compose, initialize_config_dir

    if threads:
        torch.set_num_threads(threads)
    from bapo.build import build_stages
    from bapo.config import build
    from bapo.engines import decode
    from bapo.experience import scoring
    from bapo.infra.seeding import seed_everything
    from bapo.learner import collate
    from bapo.samples import RolloutBatch

    with initialize_config_dir(version_base="1.3", config_dir=str(root / "conf")):
        cfg = compose(config_name="config", overrides=overrides)
    rc = build(cfg, tempfile.mkdtemp(prefix="bench-step-"))
    seed_everything(rc.seed)
    s = build_stages(rc)
    maker, learner, engine = s.source.maker, s.learner, s.source.engine
    clock = Clock()
    decode._pick = clock.wrap("  sampling", decode._pick)
    learner._forward = clock.wrap("forward", learner._forward)
    learner.optimizer.step = clock.wrap("optimizer", learner.optimizer.step)
    learner.optimizer.zero_grad = clock.wrap("optimizer", learner.optimizer.zero_grad)
    torch.nn.utils.clip_grad_norm_ = clock.wrap("optimizer", torch.nn.utils.clip_grad_norm_)
    torch.Tensor.backward = clock.wrap("backward", torch.Tensor.backward)
    rng = random.Random(rc.seed)
    print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__}), flush=True)
    for t, _ in enumerate(sys.stdin, start=1):
        clock.t = {}
        t_step = time.perf_counter()
        with clock.stage("sync"):
            engine.load_weights(learner.weights(), learner.version)
        prompts = [next(maker.prompts) for _ in range(maker.prompts_per_step)]
        with clock.stage("generation"):
            samples = engine.generate(prompts, seed=1000 + t)
        with clock.stage("grading"):
            grades, _ = maker.verifier.grade([x.text for x in samples], [x.prompt.problem.answer for x in samples])
        rb = RolloutBatch(
            t,
            learner.version,
            tuple(samples),
            tuple(g.reward for g in grades),
            tuple(g.correct for g in grades),
            tuple(g.extracted for g in grades),
            {},
            tuple(prompts),
        )
        with clock.stage("scoring"):
            scored, _ = scoring.score(
                rb,
                learner,
                algo=rc.algo,
                max_new_tokens=rc.rollout.max_new_tokens,
                overlong_buffer=rc.reward.overlong_buffer,
                group_size=rc.rollout.n,
            )
        rng.shuffle(scored)
        size = rc.sizes.mini_batch_size
        for i in range(0, len(scored), size):
            with clock.stage("collate"):
                tb = collate(scored[i : i + size], pad_id=learner.pad_id)
            with clock.stage("learner"):
                learner.update(tb)
        clock.t["step"] = time.perf_counter() - t_step
        clock.t["learner"] += clock.t["collate"]
        inner = sum(clock.t.get(k, 0.0) for k in ("forward", "backward", "optimizer"))
        clock.t["loss"] = clock.t["learner"] - clock.t["collate"] - inner
        clock.t["tokens"] = sum(len(x.response_ids) for x in samples)
        print(json.dumps(clock.t), flush=True)
    s.verifier.close()


def split_overrides(text: str) -> list[str]:
    """``a=1,b=2`` -> ``["a=1", "b=2"]`` (empty items dropped)."""
    return [o for o in text.split(",") if o]


def parse_variant(text: str) -> tuple[str, Path, list[str]]:
    name, _, rest = text.partition("=")
    root, _, ov = rest.partition(":")
    return name, Path(root).resolve(), split_overrides(ov)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="source tree of the baseline (a git worktree of the base commit)")
    ap.add_argument(
        "--base-overrides",
        default="",
        help="extra Hydra overrides for the baseline only, comma-separated "
        "(rollout.decode=generate on 1eb02e8: HF generate and the padded learner)",
    )
    ap.add_argument("--tree", default=str(ROOT), help="source tree of the new code (default: this one)")
    ap.add_argument("--overrides", default=EQUAL, help="Hydra overrides for every variant, comma-separated")
    ap.add_argument("--variant", action="append", default=[], help="NAME=ROOT:OVERRIDES (extra variants)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the workers (0: torch's default)")
    ap.add_argument("--json", help="also write the medians here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    common = split_overrides(args.overrides)
    if args.worker:
        root, _, ov = args.worker.partition(":")
        return worker(Path(root), split_overrides(ov), args.threads)

    variants = []
    if args.base:
        variants.append(("base", Path(args.base).resolve(), common + split_overrides(args.base_overrides)))
    variants.append(("this tree", Path(args.tree).resolve(), common))
    variants += [(n, r, common + o) for n, r, o in map(parse_variant, args.variant)]
    procs = {}
    for name, root, ov in variants:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", f"{root}:{','.join(ov)}"]
        procs[name] = subprocess.Popen(cmd + ["--threads", str(args.threads)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)  # fmt: skip
    info = {name: json.loads(p.stdout.readline()) for name, p in procs.items()}
    runs: dict[str, list[dict]] = {name: [] for name in procs}
    for r in range(args.warmup + args.rounds):
        for name, p in procs.items():  # one at a time: a worker waits on its stdin while another runs
            p.stdin.write("go\n")
            p.stdin.flush()
            row = json.loads(p.stdout.readline())
            if r >= args.warmup:
                runs[name].append(row)
    for p in procs.values():
        p.stdin.close()
        p.wait()

    load = os.getloadavg()
    print(f"{args.rounds} interleaved rounds (+{args.warmup} warm-up), medians in ms; overrides: {args.overrides}")
    print(f"torch threads {info}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")
    for name, root, ov in variants:
        print(f"  {name}: {root} {' '.join(ov)}")
    med = {n: {k: statistics.median(row.get(k, 0.0) for row in rows) for k in STAGES + ("tokens",)}
           for n, rows in runs.items()}  # fmt: skip
    first = variants[0][0]
    head = f"{'stage':12s}" + "".join(f"{n[:18]:>20s}" for n in med)
    head += "".join(f"{'x vs ' + first[:10]:>16s}" for n in list(med)[1:])
    print(head)
    for k in STAGES:
        line = f"{k:12s}" + "".join(f"{m[k] * 1e3:20.0f}" for m in med.values())
        for n in list(med)[1:]:
            line += f"{med[first][k] / med[n][k]:16.2f}" if med[n][k] > 0 else f"{'-':>16s}"
        print(line)
    print(f"{'tokens':12s}" + "".join(f"{m['tokens']:20.0f}" for m in med.values()))
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": med, "load": load, "variants": [v[0] for v in variants]}))


if __name__ == "__main__":
    main()
