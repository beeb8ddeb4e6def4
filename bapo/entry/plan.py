"""The memory plan's command line: ``python train.py <overrides> --plan [--nproc N] [--gpu-memory GiB]
[--host-memory GiB]`` and ``scripts/gpu/plan.py``.

It composes the config as ``train.py`` would (Hydra, the same overrides), builds it under the learner's ranks,
prints :class:`bapo.plan.verdict.Plan`'s render and exits 0 when it fits, 1 when it does not, 2 for bad input (one
``error:`` line); it starts nothing and writes no run folder.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import bapo.plan
from bapo.engines.registry import engine_traits
from bapo.plan.verdict import Plan, make_plan


def compose(overrides: list[str]):
    """The composed config, as train.py would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from bapo.infra.checks import known_options
    from bapo.infra.paths import ROOT

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="train"), known_options():
        return hydra_compose(config_name="config", overrides=overrides)


@contextlib.contextmanager
def _world_size(world: int):
    """``$WORLD_SIZE`` as torchrun would set it, for the config's checks of what runs under ``world`` ranks."""
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        yield
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def learner_ranks(cfg) -> int:
    """The learner's ranks when neither ``--nproc`` nor ``$WORLD_SIZE`` says: the placement's GPUs, less those its
    launched vLLM servers take (``rollout.gpus``)."""
    r = cfg.rollout
    server_gpus = len([g for g in str(r.get("gpus") or "").split(",") if g.strip()]) if r.get("url") is None else 0
    own = engine_traits(r.engine).gpu_memory == "vllm_own_gpus"
    return max(1, int(cfg.placement.gpus) - (server_gpus if own else 0))


def plan_for(overrides: list[str], *, nproc=None, gpu_memory=None, host_memory=None) -> Plan:
    """The plan of ``python train.py <overrides>`` on ``nproc`` learner ranks (else $WORLD_SIZE, else the
    placement's)."""
    from bapo.config import build

    cfg = compose(overrides)
    world = nproc or int(os.environ.get("WORLD_SIZE") or learner_ranks(cfg))
    with _world_size(world):
        rc = build(cfg, "plan")  # nothing is written: the run folder is only a name here
    if engine_traits(rc.rollout.engine).spans_ranks:  # the launch's rule: a tensor-parallel engine spans whole groups
        from bapo.engines.vllm import check_tensor_parallel

        check_tensor_parallel(rc.rollout.tensor_parallel_size, world)
    gpu = gpu_memory or rc.placement.gpu_memory_gib
    return make_plan(rc, world=world, gpu_memory_gib=gpu, host_memory_gib=host_memory)


class _OneLine(argparse.ArgumentParser):
    """Bad arguments are one ``error:`` line and exit status 2, as every entry point's bad input is."""

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _amount(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number of GiB, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number of GiB, got {text!r}")
        return value

    return parse


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nproc must be a whole number of ranks, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--nproc must be >= 1, got {text!r}")
    return value


def cli(argv: list[str], prog: str = "train.py") -> int:
    """``<prog> <overrides> --plan [--nproc N] [--gpu-memory GiB] [--host-memory GiB]``: print the plan.

    Exit status 0 when it fits, 1 when it does not, 2 for bad input (``error: <Class>: <message>``)."""
    from hydra.errors import HydraException

    from bapo.infra.checks import UserError

    parser = _OneLine(prog=f"{prog} [overrides] --plan", description=bapo.plan.__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the memory plan and exit")
    parser.add_argument("--nproc", type=_count, help="learner ranks (default: $WORLD_SIZE, else the placement's)")
    parser.add_argument("--gpu-memory", type=_amount("--gpu-memory"), metavar="GiB",
                        help="memory of one GPU (default: the placement's)")  # fmt: skip
    parser.add_argument("--host-memory", type=_amount("--host-memory"), metavar="GiB",
                        help="host memory of one node, to check")  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}: Hydra's own flags do not combine with --plan")
    try:
        plan = plan_for(overrides, nproc=args.nproc, gpu_memory=args.gpu_memory, host_memory=args.host_memory)
    except (UserError, HydraException) as e:
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(plan.render(" ".join(overrides)))
    return 0 if plan.fits else 1
