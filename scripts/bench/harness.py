"""What the benchmarks share: this tree's ``bapo`` first on the path, the flags of interleaved rounds, a timer,
medians, and the models and prompts of the two decode benchmarks (``bench_decode.py``, ``bench_rollout.py``).

A benchmark times each variant once a round, in turn, for ``--rounds`` rounds, and reports medians: on a shared
machine another process slows every variant of a round alike, and a median passes over the round it hit. One
torch thread by default, the steadiest figure on a busy machine. Imports nothing heavy: ``bench_reward.py`` times
process start-ups, and the decode benchmarks run in either venv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this tree's bapo, not an installed one


def parser(doc: str, *, rounds: int = 3, threads: int | None = 1) -> argparse.ArgumentParser:
    """A benchmark's parser, described by ``doc``'s first line, with ``--rounds`` and (unless ``threads`` is None:
    the engine sets them) ``--threads``, which mean the same in every benchmark."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds; medians reported")
    if threads is not None:
        ap.add_argument("--threads", type=int, default=threads, help="torch threads (1: robust on a shared machine)")
    return ap


def start(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed flags, with torch on ``--threads`` threads and seeded at 0."""
    import torch

    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return args


def add_model_flags(ap: argparse.ArgumentParser, *, n: int) -> None:
    """The decode benchmarks' models and prompts: ``--models``, ``--prompts`` and ``--n``."""
    ap.add_argument("--models", default="tiny,smollm2_135m", help="conf/model names, comma-separated")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=n, help="responses per prompt")


def timed(fn: Callable[..., Any], *args: Any, sync: Callable[[], None] | None = None, **kwargs: Any):
    """``(seconds, fn(*args, **kwargs))``; ``sync`` (a device's synchronize) runs before the clock starts and before
    it stops, so that queued device work is counted where it was launched."""
    if sync:
        sync()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if sync:
        sync()
    return time.perf_counter() - t0, out


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    """Each variant's median over its rounds."""
    return {name: statistics.median(times) for name, times in runs.items()}


def local_model(name: str) -> str | None:
    """The local folder of conf/model/<name>.yaml, or None if it is not there (nothing downloads)."""
    from omegaconf import OmegaConf

    from bapo.modeling import model_path

    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    gguf = cfg.get("gguf")
    try:
        path = model_path(cfg.name_or_path, gguf.package if gguf else None, gguf.file if gguf else None)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"[{name}] skipped: {e}")
        return None
    path = path if Path(path).is_absolute() else str(ROOT / path)
    if not (Path(path) / "config.json").exists():
        print(f"[{name}] skipped: no model at {path}")
        return None
    return path


def arith_prompts(name: str, tok, count: int) -> list:
    """``count`` held-out arithmetic prompts rendered for model ``name``: the tiny model's own task, and short
    sums for a pretrained model (which does not know the tiny model's format)."""
    from bapo.data.loading import render_prompt
    from bapo.data.tasks import ArithSpec, arith_heldout

    spec = ArithSpec() if name == "tiny" else ArithSpec(max_value=20, max_terms=2)
    return [render_prompt(p, tok) for p in arith_heldout(count, seed=1, heldout_frac=0.1, spec=spec)]


def tokens_per_s(engine, prompts, seed: int) -> tuple[float, list]:
    """An engine's generated tokens per second on ``prompts``, and its samples."""
    seconds, samples = timed(engine.generate, prompts, seed=seed)
    return sum(len(s.response_ids) for s in samples) / seconds, samples
