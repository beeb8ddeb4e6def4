"""One section of the day-one GPU check, in a process of its own:
``python scripts/gpu/gpu_check_worker.py <section> --result FILE``. scripts/gpu/gpu_check.py runs it (and kills it
at the section's timeout); it writes the section's figures and verdict to FILE as JSON, or, where the section raised,
``fail`` with the error's first line.

A section is a function of a :class:`Ctx` returning its figures with ``checks`` (name -> passed), or ``skip`` or
``fail`` (why): the verdict is ``skip`` or ``fail`` with that reason, ``ok`` when every check passed, else ``fail``
naming the checks that did not. The sections live in gpu_check_commands.py (env, host, qwen7b), gpu_check_scale.py
(metaload, budget, mask), gpu_check_staging.py (staging) and gpu_check_vllm.py (server, logprobs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@dataclass
class Ctx:
    """What every section is given: toy width or not, its scratch folder, the sizes the command line chose."""

    dry: bool
    scratch: Path
    standin_layers: int
    budgets: list[int]

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self.dry or not torch.cuda.is_available() else torch.device("cuda", 0)


def sections() -> dict:
    from scripts.gpu import gpu_check_commands as commands
    from scripts.gpu import gpu_check_scale as scale
    from scripts.gpu import gpu_check_staging as staging
    from scripts.gpu import gpu_check_vllm as vllm

    return {"env": commands.env, "host": commands.host, "qwen7b": commands.qwen7b, "metaload": scale.metaload,
            "staging": staging.staging, "budget": scale.budget, "mask": scale.mask, "server": vllm.server,
            "logprobs": vllm.logprobs}  # fmt: skip


def verdict(out: dict) -> dict:
    """``out`` with ``verdict`` and ``reason`` in front (see the module docstring)."""
    if out.get("skip"):
        return {"verdict": "skip", "reason": out.pop("skip")} | out
    if out.get("fail"):
        return {"verdict": "fail", "reason": out.pop("fail")} | out
    checks = out.get("checks", {})
    failed = [name for name, passed in checks.items() if not passed]
    head = {"verdict": "fail" if failed or not checks else "ok"}
    head["reason"] = ("failed: " + ", ".join(failed)) if failed else None if checks else "the section checked nothing"
    return head | out


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("section")
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--scratch", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--standin-layers", type=int, default=2)
    p.add_argument("--budgets", type=int, nargs="+", default=[16384, 32768])
    a = p.parse_args(argv)
    a.scratch.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(dry=a.dry_run, scratch=a.scratch, standin_layers=a.standin_layers, budgets=a.budgets)
    try:
        out = verdict(sections()[a.section](ctx))
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        out = {"verdict": "fail", "reason": f"{type(e).__name__}: {first}", "log_tail": traceback.format_exc()[-2000:]}
    a.result.write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the line is written: no exit handler (NCCL's, vLLM's) may hang the section past its timeout


if __name__ == "__main__":
    sys.exit(main())
