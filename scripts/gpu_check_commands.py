"""scripts/gpu_check.py's sections that run the users' own commands at toy size, against stand-ins served under the
commands' hub ids from a temporary HF cache (``scripts/standin.py``: the family's tokenizer and chat template,
taught to box an answer so that rewards vary), with tiny data sets written beside them.

``qwen7b``: ``python train.py algo=bapo model=qwen7b`` (no torchrun: ``learner=fsdp`` joins a one-rank group, NCCL
and bf16 on a GPU, the chunked log-prob chain) on this machine's device.

``world2``: two processes. ``torchrun --nproc_per_node=2 scripts/gpu_check_worker.py`` (the meta-load, an update
and a streamed weight sync on every rank), then ``torchrun --nproc_per_node=2 train.py experiment=paper_7b`` through
a checkpoint, a resume (the run killed after step 3, resumed from step 2: its metrics must be the uninterrupted
run's) and the HF export. With two or more GPUs they run on GPUs 0 and 1 (NCCL); with one GPU, or none, on the CPU
(``CUDA_VISIBLE_DEVICES=``, gloo), so the multi-process path is checked there too.

The overrides are the commands' own plus sizes only (steps, prompts, responses, response length, set sizes,
checkpoint interval, and the stand-in's layers and widths as ``model.arch.*``), and, where the machine lacks a
package: ``rollout=hf`` without vLLM, ``logger.mode=disabled`` without wandb; the summary lists them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.gpu_check_scale import judge

ROOT = Path(__file__).resolve().parents[1]
QWEN7B = ["algo=bapo", "model=qwen7b"]  # python train.py algo=bapo model=qwen7b
QWEN7B_SIZES = ["train.steps=2", "train.prompts_per_step=2", "rollout.n=2", "model.max_new_tokens=16",
                "data.heldout_size=2", "eval.n=1"]  # fmt: skip
PAPER_7B = ["experiment=paper_7b"]  # torchrun --standalone --nproc_per_node=8 train.py experiment=paper_7b
PAPER_7B_SIZES = ["train.steps=4", "train.prompts_per_step=4", "rollout.n=2", "model.max_new_tokens=16",
                  "data.heldout_size=2", "eval.n=2", "eval.sets_k=2", "eval.sets_limit=2",
                  "checkpoint.every=2"]  # fmt: skip
HUB_IDS = {"qwen7b": "Qwen/Qwen2.5-7B-Instruct", "paper_7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"}
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME")
TORCHRUN_ENV += ("ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# Wall-clock and throughput differ between any two runs; everything else must not.
TIMING = ("time/", "reward/verify_s", "rollout/tokens_per_s", "buffer/consumer_wait_s", "buffer/producer_wait_s")
# (problem, answer): answers 1-3, what the stand-ins learned to box at random, so rewards differ within a group
PROBLEMS = [
    ("What is $5 - 3$?", "2"),
    ("Compute $6 \\div 2$.", "3"),
    ("Find $x$ if $2x + 3 = 5$.", "1"),
    ("What is the remainder when $17$ is divided by $5$?", "2"),
    ("How many positive divisors does $4$ have?", "3"),
    ("Evaluate $\\frac{9}{3} - 2$.", "1"),
    ("What is $\\sqrt{9}$?", "3"),
    ("Compute $\\binom{2}{1}$.", "2"),
]


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def machine_overrides() -> dict[str, str]:
    """Overrides beyond sizes that this machine needs, each with its reason."""
    out = {}
    if not has("vllm"):
        out["rollout=hf"] = "vLLM is not installed: the HF engine generates"
    if not has("wandb"):
        out["logger.mode=disabled"] = "wandb is not installed: metrics.jsonl only"
    return out


def write_data(folder: Path) -> Path:
    """train_math.jsonl, math500.jsonl, aime24.jsonl and aime25.jsonl with the fields of the project's data."""
    folder.mkdir(parents=True, exist_ok=True)
    sets = {
        "train_math": ("math-train", "MATH train", PROBLEMS * 2),
        "math500": ("test/prealgebra", "MATH-500", PROBLEMS[:4]),
        "aime24": ("aime24-I", "AIME 2024 I", PROBLEMS[4:7]),
        "aime25": ("aime25-I", "AIME 2025 I", PROBLEMS[5:8]),
    }
    for name, (prefix, source, problems) in sets.items():
        lines = [
            json.dumps({"id": f"{prefix}-{i:04d}", "problem": p, "answer": a, "source": source}) + "\n"
            for i, (p, a) in enumerate(problems)
        ]
        (folder / f"{name}.jsonl").write_text("".join(lines))
    return folder


def tiny_world(base: Path, *repo_ids: str) -> dict[str, str]:
    """Stand-ins of ``repo_ids`` in ``base/hub``, the data in ``base/data``; the children's environment."""
    from scripts.standin import write_standin

    for repo_id in repo_ids:
        write_standin(base / "hub", repo_id, boxed_answers="123")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env |= {"HF_HUB_CACHE": str(base / "hub"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"BAPO_DATA_DIR": str(write_data(base / "data")), "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env |= {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return env


def on_cpu(env: dict[str, str]) -> dict[str, str]:
    """``env`` for children on the CPU (no GPU visible: gloo), one thread per rank, vLLM's CPU settings."""
    env = env | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return env | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def arch_of(snapshot: Path) -> list[str]:
    """``model.arch.*`` overrides for the stand-in at ``snapshot`` (its config.json shape)."""
    from scripts.gpu_check_scale import SHAPE_KEYS, arch_overrides

    config = json.loads((snapshot / "config.json").read_text())
    return arch_overrides({k: config[k] for k in SHAPE_KEYS})


def snapshot_of(env: dict[str, str], repo_id: str) -> Path:
    repo = Path(env["HF_HUB_CACHE"]) / ("models--" + repo_id.replace("/", "--"))
    return repo / "snapshots" / (repo / "refs" / "main").read_text().strip()


def launch(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``cmd`` from the repository root; its exit status, seconds and, on failure, its output's tail."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", f"killed after {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
    res: dict[str, Any] = {"cmd": " ".join("python" if c == sys.executable else c for c in cmd), "rc": rc}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["ok"] = rc == 0 and "Traceback" not in out
    if not res["ok"]:
        last = [line for line in out.splitlines() if line.strip() and not line.startswith(" ")]
        res["error"] = f"exit {rc}: {last[-1] if last else 'no output'}"
        res["output_tail"] = out[-3000:]
    res["_out"] = out
    return res


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def untimed(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rs]


def export_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def public(res: dict) -> dict:
    return {k: v for k, v in res.items() if not k.startswith("_")}


# ----------------------------------------------------------------------------- qwen7b: one process, this device


def check_qwen7b(base: Path, *, cuda: bool, deadline: float) -> dict:
    """``python train.py algo=bapo model=qwen7b`` at toy size on this machine's device (CPU in a dry run)."""
    env = tiny_world(base, HUB_IDS["qwen7b"])
    env = env if cuda else on_cpu(env)
    extra = machine_overrides()
    run = base / "run"
    over = [*QWEN7B, *QWEN7B_SIZES, *arch_of(snapshot_of(env, HUB_IDS["qwen7b"])), *extra]
    res = launch([sys.executable, "train.py", *over, f"hydra.run.dir={run}"], env, deadline - time.perf_counter())
    out = public(res) | {"device": "cuda" if cuda else "cpu", "extra_overrides": extra}
    if not res["ok"]:
        return out
    r = rows(run)
    config = json.loads((run / "export" / "config.json").read_text())
    out |= {
        "steps": [x["step"] for x in r],
        "policy_version": r[-1].get("policy/version"),
        "grad_norms": [x.get("learner/grad_norm") for x in r[1:]],
        "eval_accuracy": r[-1].get("eval/accuracy"),
        "sharded_checkpoint": (run / "checkpoints" / "step_000002" / "learner").is_dir(),  # DCP: the FSDP learner
        "export_dtype": config.get("dtype") or config.get("torch_dtype"),
    }
    return judge(
        out,
        steps_0_to_2=out["steps"] == [0, 1, 2],
        policy_version_4=out["policy_version"] == 4,
        sharded_checkpoint=out["sharded_checkpoint"],
    )


# ----------------------------------------------------------------------------- world2: two processes


class World2:
    """The two-process section; :meth:`run` does it all (the caller may run it on a thread beside the GPU work)."""

    def __init__(self, base: Path, *, gpus: int, deadline: float):
        self.base, self.deadline = base, deadline
        self.nccl = gpus >= 2
        self.variant = "nccl: 2 GPUs" if self.nccl else "cpu: 2 gloo ranks"
        self.why = "2+ GPUs here" if self.nccl else f"{gpus} GPU(s) here: the two processes run on the CPU"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def prepare(self) -> None:
        """The stand-in and the data (on the caller's thread: torch's CPU work stays off the background one)."""
        env = tiny_world(self.base, HUB_IDS["paper_7b"])
        self.env = env | {"CUDA_VISIBLE_DEVICES": "0,1"} if self.nccl else on_cpu(env)

    def run(self) -> dict:
        env = self.env
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        arch = arch_of(snapshot_of(env, HUB_IDS["paper_7b"]))
        out: dict[str, Any] = {"variant": self.variant, "why": self.why}
        report = self.base / "worker.json"
        worker = launch([*torchrun, "scripts/gpu_check_worker.py", "--out", str(report), "--override", *arch], env,
                        self.left())  # fmt: skip
        ranks = json.loads(report.read_text()) if report.exists() else {"ok": False}
        out["worker"] = public(worker) | ranks | {"ok": worker["ok"] and ranks["ok"]}
        out["train"] = self.train(torchrun, env, arch)
        ranks = {f"worker_rank_{i}": r for i, r in enumerate(out["worker"].get("ranks", []))}
        return judge(out, worker=out["worker"], **ranks, train=out["train"])

    def train(self, torchrun: list[str], env: dict, arch: list[str]) -> dict:
        """experiment=paper_7b under torchrun: the whole run, then its copy killed after step 3 and resumed."""
        extra = machine_overrides()
        train = [*torchrun, "train.py", *PAPER_7B, *PAPER_7B_SIZES, *arch, *extra]
        full, resumed = self.base / "full", self.base / "resumed"
        first = launch([*train, f"hydra.run.dir={full}"], env, self.left())
        out: dict[str, Any] = {"extra_overrides": extra, "run": public(first)}
        if not first["ok"]:
            return judge(out, run=first)
        shutil.copytree(full, resumed, symlinks=True)
        shutil.rmtree(resumed / "checkpoints" / "step_000004")
        shutil.rmtree(resumed / "export")
        (resumed / "final_metrics.json").unlink()
        second = launch([*train, f"hydra.run.dir={resumed}", "resume=auto"], env, self.left())
        out["resume"] = public(second)
        if not second["ok"]:
            return judge(out, resume=second)
        a, b = rows(full), rows(resumed)
        wa, wb = export_weights(full / "export"), export_weights(resumed / "export")
        same = wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
        out |= {
            "steps": [r["step"] for r in a],
            "policy_version": a[-1].get("policy/version"),
            "checkpoint_world_size": json.loads((full / "checkpoints/step_000002/meta.json").read_text())["world_size"],
            "resumed_from_step_2": "resumed from" in second["_out"] and "step_000002" in second["_out"],
            "resumed_metrics_equal": untimed(a) == untimed(b),
            "resumed_export_equal": same,
            "export_files": sorted(p.name for p in (full / "export").iterdir()),
        }
        # on GPUs the kernels are not bitwise deterministic: the resumed run is checked for its steps there
        exact = not self.nccl
        equal = out["resumed_metrics_equal"] and out["resumed_export_equal"]
        return judge(
            out,
            steps_0_to_4=out["steps"] == [0, 1, 2, 3, 4],
            policy_version_16=out["policy_version"] == 16,
            checkpoint_of_2_ranks=out["checkpoint_world_size"] == 2,
            resumed_from_step_2=out["resumed_from_step_2"],
            resumed_steps=[r["step"] for r in b] == out["steps"],
            resumed_equal_uninterrupted=equal or not exact,
        )
