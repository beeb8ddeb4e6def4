"""scripts/gpu_check.py: its dry run (every section on CPU with tiny shapes) and the parts that judge a GPU's run.

The dry run is the same code the GPU runs: the stand-in served under a hub id and meta-loaded, the update at a
token budget against the memory plan, the users' commands (one process, and two under torchrun through a
checkpoint, a resume and the export). vLLM's part is skipped and says so without vLLM, and runs for real on
CPU where vLLM is installed.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
from scripts import gpu_check_commands as commands  # noqa: E402
from scripts import gpu_check_scale as scale  # noqa: E402

GiB = 2**30


def dry_run(tmp_path: Path, *only: str, timeout: int = 900) -> tuple[int, dict, str]:
    out = tmp_path / "summary.json"
    env = os.environ | {"OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out)]
    cmd += ["--only", *only] if only else []
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    summary = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc.returncode, summary, proc.stdout[-3000:] + proc.stderr[-5000:]


# ----------------------------------------------------------------------------- the dry run


def test_metaload_serves_the_standin_under_its_hub_id_and_loads_it_sharded(tmp_path):
    rc, s, log = dry_run(tmp_path, "metaload")
    assert rc == 0, log
    m = s["metaload"]
    assert m["ok"] and s["headline"]["sections"] == {"metaload": "ok"}
    assert m["repo_id"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    hub = "models--deepseek-ai--DeepSeek-R1-Distill-Qwen-7B/snapshots/"
    assert m["resolved_is_snapshot"] and hub in m["resolved"] and m["resolved"].startswith(m["hub_cache"])
    assert m["safetensors_files"] > 1  # shards and an index, as the hub's 7B repositories
    assert m["shards_equal_eager"] and m["sharded_param_tensors"] == m["param_tensors"] > 0
    assert m["forward_max_abs_logp_diff"] <= m["forward_tolerance"]
    assert not Path(s["scratch"]).exists()  # the stand-ins are removed afterwards


@pytest.mark.slow  # every section on CPU: about 4 minutes on 2 cores
def test_the_whole_dry_run_reports_every_section_ok(tmp_path):
    rc, s, log = dry_run(tmp_path)
    assert rc == 0, log
    h = s["headline"]
    assert set(h["sections"]) == set(gpu_check.SECTIONS)
    assert all(v == "ok" for k, v in h["sections"].items() if k != "vllm"), h["sections"]
    assert h["sections"]["vllm"] == "ok" or h["sections"]["vllm"].startswith("skipped: vLLM not importable")
    assert all(isinstance(h["seconds"][k], float) for k in gpu_check.SECTIONS)
    assert s["ok"] and s["failed"] == [] and s["seconds"] > 0

    # the update at each token budget, beside the plan's prediction for exactly that run config
    assert set(h["plan_vs_measured"]) == {"512", "1024"}
    for tokens, row in s["budget"]["budgets"].items():
        assert row["micro_batch_tokens"] == [int(tokens)] * 2
        assert row["within_plan"] and 0.5 < row["measured_over_plan"] <= 1.0, row
        assert row["plan_moment"] == "update, at the logits chain's backward"
    # the user's one-GPU command, here on the CPU, through the FSDP learner on one rank of its own
    q = s["qwen7b"]
    assert q["cmd"].startswith("python train.py algo=bapo model=qwen7b ") and q["steps"] == [0, 1, 2]
    assert q["sharded_checkpoint"] and q["export_dtype"] == "bfloat16"
    assert q["real_size_plan"]["gpu_memory_gib"] == 80.0 and not q["real_size_plan"]["fits"]  # 7.6 B on one GPU
    # two processes: the worker on every rank, paper_7b through a checkpoint, a resume and the export
    w = s["world2"]
    assert w["variant"] == "cpu: 2 gloo ranks" and h["world2"].startswith("cpu: 2 gloo ranks (0 GPU(s) here")
    ranks = w["worker"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["backend"] == "gloo" and r["ok"] for r in ranks)
    assert all(r["sync"]["samples_version"] == [1] for r in ranks)
    t = w["train"]
    assert t["steps"] == [0, 1, 2, 3, 4] and t["checkpoint_world_size"] == 2 and t["resumed_from_step_2"]
    assert t["resumed_metrics_equal"] and t["resumed_export_equal"] and "model.safetensors" in t["export_files"]


def test_a_failing_section_is_reported_and_the_others_still_run(tmp_path):
    # a stand-in without layers cannot be built: metaload fails, budget says it has no learner, the run exits 1
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--only", "metaload", "budget"]
    cmd += ["--standin-layers", "0", "--out", str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    s = json.loads(proc.stdout)
    assert s["failed"] == ["metaload", "budget"] and not s["ok"]
    assert s["headline"]["sections"]["metaload"].startswith("FAILED: ")
    assert s["headline"]["sections"]["budget"] == "FAILED: needs the metaload section's learner, which did not load"
    assert json.loads(out.read_text())["failed"] == ["metaload", "budget"]


# ----------------------------------------------------------------------------- the parts that judge a GPU's run


def test_a_section_that_no_longer_fits_before_the_cap_is_skipped_and_says_so(tmp_path):
    args = gpu_check.parse_args(["--dry-run", "--time-limit", "20", "--out", str(tmp_path / "s.json")])
    summary: dict = {}
    sections = gpu_check.Sections(summary, args, time.perf_counter())
    sections.run("world2", lambda: {"ok": True}, torch.device("cpu"))  # needs 24 s of the 10 s left
    assert summary["world2"]["skipped"].endswith("it needs ~24.0 s") and summary["world2"]["ok"]
    sections.run("vllm", lambda: 1 / 0, torch.device("cpu"))
    assert gpu_check.status(summary, "vllm") == "FAILED: ZeroDivisionError: division by zero"
    assert json.loads((tmp_path / "s.json").read_text()).keys() == {"world2", "vllm"}  # written as it goes


def test_a_background_section_reports_its_outcome_or_its_error():
    done = gpu_check.Background(lambda: {"ok": True}).result(timeout=30)
    assert done["ok"] and done["background_s"] >= 0 and "waited_s" in done
    failed = gpu_check.Background(lambda: {"ok": True}, before=lambda: 1 / 0).result(timeout=30)
    assert failed["error"] == "ZeroDivisionError: division by zero" and not failed["ok"]
    raised = gpu_check.Background(lambda: {}["x"]).result(timeout=30)
    assert raised["error"] == "KeyError: 'x'"
    slow = gpu_check.Background(lambda: time.sleep(2) or {"ok": True}).result(timeout=0.1)
    assert slow == {"ok": False, "error": "still running at the cap (0 s waited)"}


def test_a_failed_check_is_named_with_its_reason():
    part = scale.judge({"x": 1}, shards_equal_eager=True, no_full_host_copy=False)
    assert part == {"x": 1, "ok": False, "failed_checks": ["no_full_host_copy"]}
    out = scale.judge({}, worker={"ok": False, "error": "RuntimeError: x\ny"}, train=part, fine=True, rank={"ok": True})
    assert out["failed_checks"] == ["worker (RuntimeError: x)", "train (no_full_host_copy)"]
    assert gpu_check.status({"world2": out}, "world2") == "FAILED: worker (RuntimeError: x), train (no_full_host_copy)"
    assert scale.judge({}, a=True, b={"ok": True}) == {"ok": True, "failed_checks": []}


def test_the_plan_is_judged_against_the_measured_peak():
    from bapo import plan as P

    plan = P.plan_for(["experiment=paper_7b"], nproc=1, gpu_memory=139)
    torch_part = plan.update_peak.total - int(P.CUDA_CONTEXT_NCCL_GIB * GiB) - int(P.VLLM_CUDA_GRAPHS_GIB * GiB)
    ok = scale.against_plan(plan, torch_part)
    assert ok["within_plan"] and ok["measured_over_plan"] == 1.0 and ok["plan_outside_torch_gib"] == 2.5
    over = scale.against_plan(plan, torch_part + 1)
    assert not over["within_plan"]
    assert ok["plan_moment"] == plan.update_peak.name and sum(ok["plan_items_gib"].values()) == pytest.approx(
        plan.update_peak.total / GiB, abs=0.01
    )


def test_cpu_peak_follows_allocations_and_frees():
    mib = 2**20

    def twice():
        a = torch.ones(2 * mib)  # 8 MiB of fp32
        del a  # freed before the next one: the peak is one of them, not two
        b = torch.ones(2 * mib)
        return float(b[0])

    out, peak = scale.cpu_peak(twice)
    assert out == 1.0 and 8 * mib <= peak < 9 * mib
    _, peak = scale.cpu_peak(lambda: [torch.ones(mib) for _ in range(3)])  # three of 4 MiB alive together
    assert 12 * mib <= peak < 13 * mib


def test_the_budget_batch_fills_each_micro_batch_to_the_budget():
    batch = scale.budget_batch(vocab=1000, tokens=16384, seed=0)
    assert batch.input_ids.shape == (8, 4096) and int(batch.attention_mask.sum()) == 2 * 16384
    assert int(batch.mask[0].sum()) == 4096 - 512  # a 512-token prompt, the rest response


def test_the_users_commands_differ_from_the_documented_ones_in_sizes_only():
    from tests import test_rehearsal as R

    assert commands.QWEN7B == R.overrides(R.QWEN7B) and commands.PAPER_7B == R.overrides(R.PAPER_7B)
    arch = scale.arch_overrides(scale.standin_arch(2, dry=True))
    for user, sizes in [(commands.QWEN7B, commands.QWEN7B_SIZES), (commands.PAPER_7B, commands.PAPER_7B_SIZES)]:
        given, size_keys = dict(o.split("=", 1) for o in [*sizes, *arch]), {o.split("=")[0] for o in sizes}
        assert size_keys <= R.SIZE_KEYS
        changed = R.changed_keys("config", user, given)  # an arch field already of the stand-in's value: unchanged
        assert size_keys <= changed <= set(given) and all(k.startswith("model.arch.") for k in changed - size_keys)


@pytest.mark.parametrize("gpus, nccl", [(0, False), (1, False), (2, True), (8, True)])
def test_two_processes_run_on_two_gpus_where_there_are_two_else_on_the_cpu(tmp_path, gpus, nccl):
    w = commands.World2(tmp_path, gpus=gpus, deadline=0.0)
    assert w.nccl == nccl and w.variant == ("nccl: 2 GPUs" if nccl else "cpu: 2 gloo ranks")


def test_headline_pulls_the_figures():
    summary = {
        "peak_tflops": 989.0,
        "learner": {"ok": True, "mfu": 0.41, "tokens_per_s": 9.0, "seconds": 3.0},
        "vllm": {"ok": True, "skipped": "vLLM not importable (ImportError: x); the other checks ran", "seconds": 0.1},
        "budget": {"ok": True, "seconds": 4.0, "budgets": {
            "16384": {"tokens_per_s": 5.0, "tflops_per_s": 494.5, "measured_peak_gib": 30.0, "plan_torch_gib": 32.0,
                      "measured_over_plan": 0.938, "within_plan": True},
            "32768": {"skipped": "the plan's update peak 150 GiB exceeds this GPU's memory"},
        }},
        "world2": {"ok": False, "error": "RuntimeError: boom\nmore", "variant": "cpu: 2 gloo ranks", "why": "1 GPU(s)",
                   "background_s": 90.0, "seconds": 2.0},
    }  # fmt: skip
    h = gpu_check.headline(summary)
    assert h["mfu"] == 0.41 and h["learner_tokens_per_s"] == 9.0 and h["budget_tokens_per_s"] == 5.0
    assert h["budget_mfu"] == 0.5
    assert h["plan_vs_measured"] == {
        "16384": {"measured_peak_gib": 30.0, "plan_torch_gib": 32.0, "measured_over_plan": 0.938, "within_plan": True}
    }
    assert h["sections"] == {"learner": "ok", "vllm": "skipped: vLLM not importable (ImportError: x); the other "
                             "checks ran", "budget": "ok", "world2": "FAILED: RuntimeError: boom"}  # fmt: skip
    assert h["seconds"] == {"learner": 3.0, "vllm": 0.1, "budget": 4.0, "world2": 90.0}
    assert h["world2"] == "cpu: 2 gloo ranks (1 GPU(s))"


# ----------------------------------------------------------------------------- vLLM


def test_vllm_check_is_skipped_and_says_so_without_vllm(without_vllm):
    args = gpu_check.parse_args(["--dry-run"])
    out = gpu_check.check_vllm(gpu_check.TINY_ARCH, torch.device("cpu"), args)
    assert out["ok"] and "vLLM not importable" in out["skipped"]
    assert gpu_check.headline({"vllm": out})["sections"]["vllm"].startswith("skipped: vLLM not importable")


@pytest.mark.slow
def test_vllm_check_runs_on_cpu(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "summary.json"
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--only", "vllm", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    v = s["vllm"]
    assert v["ok"] and v["new_tokens"] > 0 and v["sync_s"] > 0 and s["headline"]["vllm_sync_s"] == v["sync_s"]
