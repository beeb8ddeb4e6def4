"""The users' own commands, rehearsed on CPU through the code path they take on a GPU node.

Each command is the one README.md, docs/gpu.md and eval.py document, run with **only size overrides**
(steps, prompts per step, responses per prompt, response length, held-out and set sizes, checkpoint
interval): the layers and widths come from a tiny stand-in checkpoint served under the same hub id from an
HF cache (``scripts/build/standin.py``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``), with the family's tokenizer class
and chat template. A test composes every command with and without those overrides and checks that they
differ in exactly those keys, so a config change cannot make the rehearsal drift from what users run.

Two variants of each command: vLLM, the users' engine (``.venv-vllm``: one external_launcher engine per
rank), and HF (``.venv``, ``rollout=hf``: the one other override, and only in that variant); paper_7b's, the longest,
runs in one of them (``PAPER_7B_ENGINES``). torchrun runs
2 gloo ranks (``OMP_NUM_THREADS=1``); ``--standalone`` is added so that concurrent test runs do not share a
rendezvous port. paper_7b goes through a checkpoint, a resume (the second half of a run killed after step 3:
its metrics must equal the uninterrupted run's, timings aside), the HF export, and eval.py on the export.
paper_7b trains on a hub set (Skywork-OR1-RL-Data): the rehearsal gives it a small local copy in the set's own
layout (tests/helpers/hubsets.py) as users give it on a node without network, ``data.path=<the copy>``; the
evaluation sets are the shipped ones (assets/evalsets/), so a fresh clone runs this without ``../shared/data``.

Where vLLM is not installed the vLLM variants skip and say why, except under CI (``CI`` set): there they
fail, since CI builds ``.venv-vllm``.
"""

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from scripts.build.standin import write_standin
from tests.helpers.config import differing_keys
from tests.helpers.metrics import rows, untimed
from tests.helpers.processes import python_for, vllm_python
from tests.helpers.runs import killed_after_step_3

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
DOCS = [ROOT / "README.md", ROOT / "docs" / "gpu.md", ROOT / "docs" / "sweeps.md", ROOT / "eval.py"]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

# The users' commands (as documented; the test below checks that they still are), each with its sizes.
PAPER_7B = "torchrun --standalone --nproc_per_node=8 train.py experiment=paper_7b"
PAPER_7B_SIZES = {
    "train.steps": "4",  # 150
    "train.prompts_per_step": "4",  # 256; 4 mini-batches of whole groups, one sample per rank each
    "rollout.n": "2",  # 16
    "model.max_new_tokens": "16",  # 8192
    "data.heldout_size": "2",  # 200 held-out Skywork problems
    "eval.n": "2",  # 4
    "eval.sets_k": "2",  # AIME avg@16
    "eval.sets_limit": "2",  # all 30 problems
    "checkpoint.every": "2",  # 10 of 150 steps
}
# 4 GPUs train, 4 generate behind vLLM servers (docs/gpu.md, "Generation on GPUs of its own"); vLLM only
PAPER_7B_SPLIT = (
    "torchrun --standalone --nproc_per_node=4 train.py experiment=paper_7b placement=gpu_node_split "
    "train.async_rollout=true"
)
PAPER_7B_SPLIT_SYNC = "torchrun --standalone --nproc_per_node=4 train.py experiment=paper_7b placement=gpu_node_split"
QWEN7B = "python train.py algo=bapo model=qwen7b"
QWEN7B_SIZES = {
    "train.steps": "2",
    "train.prompts_per_step": "2",  # 64
    "rollout.n": "2",  # 8
    "model.max_new_tokens": "16",  # 8192
    "data.heldout_size": "2",  # 200
    "eval.n": "1",  # 4
}
# One cell of the staleness sweep: its coordinates are what the basic launcher hands the cell's job.
SWEEP = "python train.py -m experiment=ablation_staleness"
SWEEP_CELL = ["algo=bapo", "learner.mini_batches_per_rollout=3", "seed=2"]
SWEEP_SIZES = {
    "train.steps": "2",  # 60
    "train.prompts_per_step": "3",  # 30; divisible by the cell's 3 mini-batches
    "rollout.n": "2",  # 8
    "data.heldout_size": "4",  # 200
    "eval.n": "1",  # 4
}
EVAL = "torchrun --nproc_per_node=8 eval.py rollout=vllm checkpoint=... eval=aime24 k=16"
EVAL_SIZES = {"k": "2", "eval.limit": "2"}  # 16 samples of all 30 problems

# What counts as a size: how much work a run does, never how it does it. Each rehearsal's overrides come from here.
SIZE_KEYS = {
    "train.steps", "train.prompts_per_step", "rollout.n", "model.max_new_tokens", "data.heldout_size",
    "eval.n", "eval.sets_k", "eval.sets_limit", "checkpoint.every", "k", "eval.limit",
    "learner.max_tokens_per_micro_batch", "learner.micro_batch_size", "data.max_prompt_tokens",
}  # fmt: skip
HUB_IDS = {"paper_7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "qwen7b": "Qwen/Qwen2.5-7B-Instruct"}
ENGINES = ["vllm", "hf"]
# paper_7b's whole path (checkpoint, resume, export, eval.py) runs once: with vLLM, the users' engine, where
# .venv-vllm is (always on CI: python_for fails there without it), else with HF, so that a machine without vLLM
# still rehearses it. The HF engine under torchrun and FSDP is the loop's own (tests/e2e/test_loop_fsdp.py).
PAPER_7B_ENGINES = ["vllm"] if vllm_python() or os.environ.get("CI") else ["hf"]


def overrides(command: str) -> list[str]:
    """The Hydra overrides of a documented command line (what follows train.py / eval.py, no flags)."""
    words = command.split()
    entry = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return [w for w in words[entry + 1 :] if not w.startswith("-")]


def local_data(command: str, copy: str | Path) -> list[str]:
    """What a user without network adds to a command that trains on the paper's hub set: its local copy."""
    return [f"data.path={copy}"] if "experiment=paper_7b" in command.split() else []


def users(command: str, copy: str | Path = "/data/Skywork-OR1-RL-Data") -> list[str]:
    """The overrides the user types on a node without network: the command's, and where the data is."""
    return [*overrides(command), *local_data(command, copy)]


def sized(sizes: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in sizes.items()]


# ----------------------------------------------------------------------------- the commands and their configs


@pytest.mark.parametrize("command", [PAPER_7B, PAPER_7B_SPLIT, PAPER_7B_SPLIT_SYNC, QWEN7B, SWEEP, EVAL])
def test_the_rehearsed_commands_are_the_documented_ones(command):
    assert any(command in doc.read_text() for doc in DOCS), f"{command!r} is no longer in {[d.name for d in DOCS]}"


def _compose(config_name: str, over: list[str]):
    importlib.import_module("eval")  # registers the resolver eval_config.yaml's search path uses
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose(config_name=config_name, overrides=over)


def changed_keys(config_name: str, user: list[str], sizes: dict[str, str]) -> set[str]:
    """The keys whose (unresolved) values differ between the user's command and the rehearsal's."""
    return differing_keys(_compose(config_name, user), _compose(config_name, [*user, *sized(sizes)]))


def variant(user: list[str], engine: str) -> list[str]:
    """The user's overrides in an engine's variant: as documented for vLLM; for HF, ``rollout=hf`` in place
    of a documented ``rollout=vllm`` or after the overrides (the GPU placement picks vLLM)."""
    if engine == "vllm":
        return list(user)
    swapped = ["rollout=hf" if o == "rollout=vllm" else o for o in user]
    return swapped if swapped != list(user) else [*user, "rollout=hf"]


def with_checkpoint(user: list[str], run: str | Path) -> list[str]:
    return [f"checkpoint={run}" if o == "checkpoint=..." else o for o in user]


CASES = {
    "paper_7b-vllm": ("config", users(PAPER_7B), PAPER_7B_SIZES),
    "paper_7b_split-vllm": ("config", users(PAPER_7B_SPLIT), PAPER_7B_SIZES),
    "qwen7b-vllm": ("config", overrides(QWEN7B), QWEN7B_SIZES),
    "eval-vllm": ("eval_config", with_checkpoint(overrides(EVAL), "outputs/run"), EVAL_SIZES),
    "sweep_cell": ("config", [*overrides(SWEEP), *SWEEP_CELL], SWEEP_SIZES),
}
CASES |= {
    k.replace("-vllm", "-hf"): (name, variant(user, "hf"), sizes)
    for k, (name, user, sizes) in CASES.items()
    if k.endswith("-vllm")
}


@pytest.mark.parametrize("case", CASES)
def test_the_rehearsal_differs_from_the_users_command_in_sizes_only(case):
    config_name, user, sizes = CASES[case]
    assert set(sizes) <= SIZE_KEYS, f"not sizes: {sorted(set(sizes) - SIZE_KEYS)}"
    assert changed_keys(config_name, user, sizes) == set(sizes)  # each changes what it names, and only that


def test_the_size_check_sees_a_drift():
    # a key outside the sizes (here the learning rate) is reported: the check is not vacuous
    assert changed_keys("config", users(PAPER_7B), {"learner.lr": "1e-3"}) == {"learner.lr"}
    assert changed_keys("config", users(PAPER_7B), {"model": "tiny"}) > {"model.name_or_path"}


# ----------------------------------------------------------------------------- fixtures: hub cache, data, env

# (problem, answer): the answers are 1-3, what the stand-in learned to box at random (scripts/build/standin.py), so
# rewards differ within a group and the updates have a signal
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


def write_data(folder: Path) -> Path:
    """A local copy of Skywork-OR1-RL-Data (its layout, the math split): PROBLEMS, and differences of the same shape
    whose answers are 1-3 too, enough that the 1% data=skywork_or1 holds out by hash covers data.heldout_size."""
    from bapo.data.tasks import is_heldout
    from tests.helpers.hubsets import write_skywork_or1

    more = [(f"What is ${a} - {a - d}$?", str(d)) for a in range(6, 200) for d in (1, 2, 3)]
    problems = PROBLEMS + [p for p in more if p[0] not in {q for q, _ in PROBLEMS}]
    assert sum(is_heldout(p, 0.01) for p, _ in problems) >= int(PAPER_7B_SIZES["data.heldout_size"])
    return write_skywork_or1(folder, problems)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The machine the commands run on: an HF cache holding the stand-ins, the data, and the environment."""
    import torch

    base, threads = tmp_path_factory.mktemp("rehearsal"), torch.get_num_threads()
    torch.set_num_threads(1)  # the stand-ins' few supervised steps: a second thread only contends on 2 cores
    try:
        for repo_id in HUB_IDS.values():
            write_standin(base / "hub", repo_id, boxed_answers="123")
    finally:
        torch.set_num_threads(threads)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    env |= {"HF_HUB_CACHE": str(base / "hub"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    (base / "data").mkdir()  # paths.data_dir, pinned; no rehearsed command reads it
    env |= {"BAPO_DATA_DIR": str(base / "data"), "WANDB_MODE": "offline", "WANDB_DIR": str(base)}
    env |= {"HF_DATASETS_CACHE": str(base / "datasets")}
    # vLLM on CPU: the KV cache it may take, and its in-process engine core (as the existing vLLM tests)
    env |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {"base": base, "env": env, "skywork": write_data(base / "Skywork-OR1-RL-Data")}


def launch(python: str, args: list[str], env: dict, *, torchrun: bool) -> str:
    cmd = [python, *(TORCHRUN if torchrun else []), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"exit {p.returncode}: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert "Traceback" not in out, (
        f"{' '.join(cmd)} exited 0 after a traceback:\n{out[out.index('Traceback') :][:5000]}"
    )
    return out


def composed(config_name: str, over: list[str], env: dict) -> dict:
    """The resolved config the command runs with, as the loop writes it to config.yaml."""
    old = os.environ.get("BAPO_DATA_DIR")
    os.environ["BAPO_DATA_DIR"] = env["BAPO_DATA_DIR"]
    try:
        return OmegaConf.to_container(_compose(config_name, over), resolve=True)
    finally:
        os.environ.pop("BAPO_DATA_DIR") if old is None else os.environ.__setitem__("BAPO_DATA_DIR", old)


def train_as_the_user(world: dict, engine: str, command: str, sizes: dict, run_dir: Path, *, torchrun: bool):
    """The user's training ``command``, in ``engine``'s variant and with the rehearsal's ``sizes``, run into
    ``run_dir``. Returns (the interpreter, the train.py arguments), for the runs that continue it."""
    py = python_for(engine)
    train = ["train.py", *variant(users(command, world["skywork"]), engine), *sized(sizes)]
    launch(py, [*train, f"hydra.run.dir={run_dir}"], world["env"], torchrun=torchrun)
    return py, train


def assert_ran_as_composed(run_dir: Path, over: list[str], env: dict, *, steps: int, version: int) -> list[dict]:
    """The run in ``run_dir`` ran what ``over`` composes to (its config.yaml), logged steps 0 to ``steps`` and
    ended at policy version ``version``. Returns its metrics rows."""
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == composed("config", over, env)
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(steps + 1))
    assert got[-1]["policy/version"] == version
    return got


def export_weights(folder: Path) -> dict:
    """Every tensor of the safetensors files in ``folder`` (or in its one subfolder: a cached snapshot)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*/*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


def resumed_after_step_3(full: Path, base: Path, py: str, train: list[str], env: dict) -> Path:
    """``full``'s run as if killed after step 3 (its step-4 checkpoint, export and end never happened), resumed
    with ``resume=auto`` under torchrun: it continues from step 2 and logs ``full``'s metrics. Its folder."""
    resumed = killed_after_step_3(full, base / "resumed", export=True)
    out = launch(py, [*train, f"hydra.run.dir={resumed}", "resume=auto"], env, torchrun=True)
    assert "resumed from" in out and "step_000002" in out
    assert untimed(rows(resumed)) == untimed(rows(full))
    return resumed


# ----------------------------------------------------------------------------- the rehearsals


@pytest.mark.slow
@pytest.mark.parametrize("engine", PAPER_7B_ENGINES)
def test_paper_7b_under_torchrun_checkpoints_resumes_exports_and_evaluates(world, engine):
    """`torchrun train.py experiment=paper_7b`, then `torchrun eval.py rollout=vllm checkpoint=<run> eval=aime24`."""
    env, base = world["env"], world["base"] / f"paper_7b-{engine}"
    full = base / "full"
    py, train = train_as_the_user(world, engine, PAPER_7B, PAPER_7B_SIZES, full, torchrun=True)
    got = assert_ran_as_composed(full, train[1:], env, steps=4, version=16)  # 4 steps x 4 mini-batches
    assert {"eval/accuracy", "eval/aime24/avg@2", "eval/aime25/avg@2"} <= got[-1].keys(), sorted(got[-1])
    assert any(r["learner/grad_norm"] > 0 for r in got[1:]), "no update had a signal"
    ckpt = full / "checkpoints" / "step_000002"
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 2

    resumed = resumed_after_step_3(full, base, py, train, env)
    a, b = export_weights(full / "export"), export_weights(resumed / "export")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    start = export_weights(world["base"] / "hub" / f"models--{HUB_IDS['paper_7b'].replace('/', '--')}" / "snapshots")
    assert any((a[k].float() != start[k].float()).any() for k in a), "the export holds the stand-in's weights"

    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(resumed / "export")
    assert config.model_type == "qwen2" and config.num_hidden_layers == 2  # the stand-in served for the hub id
    tok = AutoTokenizer.from_pretrained(resumed / "export")
    assert tok.eos_token == "<｜end▁of▁sentence｜>" and "<｜Assistant｜><think>" in tok.chat_template

    run_eval = ["eval.py", *with_checkpoint(variant(overrides(EVAL), engine), resumed), *sized(EVAL_SIZES)]
    launch(py, [*run_eval, f"hydra.run.dir={base / 'eval'}"], env, torchrun=True)
    report = json.loads((base / "eval" / "results.json").read_text())
    results = report["sets"]["aime24"]
    assert results["n_problems"] == 2 and results["k"] == 2
    samples = [json.loads(x) for x in (base / "eval" / "samples_aime24.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    # evaluated as the run was trained (its config.yaml): its response length, dtype and prompt
    trained = composed("config", train[1:], env)
    used = report["config"]
    assert (used["max_new_tokens"], used["model"]["dtype"]) == (16, trained["model"]["dtype"]), used
    assert all(trained["data"]["instruction"] in s["prompt"] for s in samples), samples[0]["prompt"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_qwen7b_without_torchrun_trains_and_exports(world, engine):
    """`python train.py algo=bapo model=qwen7b`: one process, the GPU placement (learner=fsdp)."""
    run_dir = world["base"] / f"qwen7b-{engine}"
    _, train = train_as_the_user(world, engine, QWEN7B, QWEN7B_SIZES, run_dir, torchrun=False)
    assert_ran_as_composed(run_dir, train[1:], world["env"], steps=2, version=4)  # 2 steps x 2 mini-batches
    assert (run_dir / "checkpoints" / "step_000002" / "state.pt").is_file()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run_dir / "export")
    assert tok.eos_token == "<|im_end|>" and "You are Qwen" in tok.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False
    )


# The same command through the launch (bapo/entry/launch.py) on a machine that reports N GPUs (BAPO_FAKE_DEVICES, its
# test hook: the ranks run gloo on the CPU): on 2 of 141 GB it starts 2 ranks as configured (the plan fits); on one of
# 80 GB it takes the memory plan's choice, the learner's state on the host, in one process. The HF variant.
LAUNCHES = {"2x141": (2, False), "1x80": (1, True)}  # devices reported: (ranks, learner.cpu_offload chosen)


@pytest.mark.slow
@pytest.mark.parametrize("devices", LAUNCHES)
def test_qwen7b_as_written_starts_the_ranks_of_the_devices_it_sees(world, devices):
    """`python train.py algo=bapo model=qwen7b` on a machine reporting 2 GPUs, then 1: the launch's choice, asserted
    against what bapo.entry.launch.decide chooses for that composition and those devices."""
    from unittest import mock

    from bapo.entry import launch as launcher

    ranks, offload = LAUNCHES[devices]
    env, run_dir = world["env"] | {launcher.FAKE_DEVICES: devices}, world["base"] / f"qwen7b-launch-{devices}"
    train = ["train.py", *variant(overrides(QWEN7B), "hf"), *sized(QWEN7B_SIZES)]
    out = launch(sys.executable, [*train, f"hydra.run.dir={run_dir}"], env, torchrun=False)
    with mock.patch.dict(os.environ, {launcher.FAKE_DEVICES: devices, "BAPO_DATA_DIR": env["BAPO_DATA_DIR"]}):
        expected = launcher.decide(_compose("config", train[1:]), train[1:])
    assert (expected.nproc, expected.changes) == (ranks, (("learner.cpu_offload", True),) if offload else ())
    assert out.count(f"launch: {expected.record}") == 1  # one log line says what and why
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["launcher"]["chosen"] == expected.record and cfg["learner"]["cpu_offload"] is offload
    # the user's command as composed, with the launch's choice and nothing else
    assert_ran_as_composed(run_dir, [*train[1:], *expected.overrides()], env, steps=2, version=4)
    meta = json.loads((run_dir / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["world_size"] == ranks


@pytest.mark.slow
def test_one_cell_of_the_staleness_sweep_runs_and_a_relaunch_skips_it(world):
    """`python train.py -m experiment=ablation_staleness`, one cell (algo=bapo, 3 mini-batches, seed 2)."""
    env, sweep_dir = world["env"], world["base"] / "sweep"
    cell = [*overrides(SWEEP), *SWEEP_CELL, *sized(SWEEP_SIZES)]
    args = ["train.py", "-m", *cell, f"hydra.sweep.dir={sweep_dir}"]
    launch(sys.executable, args, env, torchrun=False)
    (job,) = [p.parent for p in sweep_dir.glob("*/config.yaml")]
    assert {"algo=bapo", "learner.mini_batches_per_rollout=3", "seed=2"} <= set(job.name.split(","))
    assert_ran_as_composed(job, cell, env, steps=2, version=6)  # 2 steps x 3 mini-batches: staleness up to 2
    out = launch(sys.executable, args, env, torchrun=False)  # the sweep's resume=auto: a finished cell is skipped
    assert "is complete" in out and [r["step"] for r in rows(job)] == [0, 1, 2]


# Loaded into the ranks of the split rehearsal (PYTHONPATH): the device-to-host copy of a GPU (``Tensor.cpu`` makes a
# new tensor, so a freed gathered tensor's address comes back), and after every sync an independent check that the
# server read exactly the learner's weights: each name gathered on its own (``weights[name]``), in the engine's dtype.
SYNC_PROBE = """
import json, os
import torch

_cpu = torch.Tensor.cpu
torch.Tensor.cpu = lambda self, *a, **k: _cpu(self, *a, **k).clone()
if os.environ.get("LOCAL_RANK") is not None:  # a learner rank (a server's environment has no LOCAL_RANK)
    from bapo.engines import vllm_server
    from bapo.engines.staging import digest, fingerprint

    _load = vllm_server.VLLMServerRollout.load_weights

    def load_weights(self, weights, version):
        seconds = _load(self, weights, version)
        values = getattr(weights, "_sd", weights)  # tied names share one tensor object
        firsts, want = set(), {}
        for name in list(weights):
            if id(values[name]) in firsts:
                continue
            firsts.add(id(values[name]))
            t = weights[name]
            want[name] = fingerprint(t.to(self.dtype) if t.is_floating_point() else t)
        (reply,) = self.fingerprint()
        line = {"version": version, "want": digest(want), "tensors": len(want), "server": reply,
                "shared": bool(getattr(weights, "collective", False)), "parts": self.sync_parts,
                "dirs": [str(d) for d in (self.dir, self.node_dir) if d is not None],
                "server_group": self.proc.pid if self.proc is not None else None}
        out = os.path.join(os.environ["BAPO_SYNC_PROBE"], f"rank{os.environ['RANK']}.jsonl")
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\\n")
        return seconds

    vllm_server.VLLMServerRollout.load_weights = load_weights
"""


def assert_engine_matches_learner(got: list[dict]) -> None:
    """Every step's engine-vs-learner log-probs (paper_7b recomputes pi_old, so every row is scored): the bf16 server
    against the fp32 learner differs by rounding only (means about 0.002, maxima about 0.02 nats here); a server
    with another version's weights, or half-loaded layers, is off by nats."""
    checked = [r for r in got[1:] if "rollout/logp_mismatch_max" in r]
    assert checked, "no step logged the engine's log-prob mismatch"
    assert all(r["rollout/logp_mismatch_mean"] < 0.02 and r["rollout/logp_mismatch_max"] < 0.25 for r in checked), [
        (r["rollout/logp_mismatch_mean"], r["rollout/logp_mismatch_max"]) for r in checked
    ]


def with_sync_probe(env: dict, folder: Path) -> dict:
    probe = folder / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "sitecustomize.py").write_text(SYNC_PROBE)
    return env | {"PYTHONPATH": f"{probe}:{env['PYTHONPATH']}", "BAPO_SYNC_PROBE": str(probe)}


def assert_no_server_left(probe: Path) -> None:
    """No process of the servers the runs so far started (each its own process group, named by the sync probe) is
    alive: a run returns only after its servers have exited. Other tests' servers are none of its business."""
    groups = {json.loads(x)["server_group"] for f in probe.glob("rank*.jsonl") for x in f.read_text().splitlines()}
    assert groups and None not in groups, groups
    ps = subprocess.run(["ps", "-eo", "pgid=,stat=,args="], capture_output=True, text=True).stdout.splitlines()
    left = [p for p in ps if int(p.split()[0]) in groups and not p.split()[1].startswith("Z")]
    assert not left, f"the run returned before its servers exited: {left}"


def assert_every_sync_checked(probe: Path, *, async_mode: bool) -> int:
    syncs = 0
    for rank in (0, 1):
        lines = [json.loads(x) for x in (probe / f"rank{rank}.jsonl").read_text().splitlines()]
        assert lines, f"rank {rank} never synced"
        for x in lines:
            assert x["server"] == {"tensors": x["tensors"], "digest": x["want"]}, x
            assert set(x["parts"]) == {"write", "reload", "reset", "wait"}
        # sync mode: every sync is made by both ranks at once, so the node's ranks share one staged copy; async: a
        # producer syncs its own snapshot alone (private copies), and only an evaluation's borrow is shared
        shared = [x["shared"] for x in lines]
        assert (not all(shared) and any(shared)) if async_mode else all(shared), shared
        syncs += len(lines)
        left = [d for x in lines for d in x["dirs"] if Path(d).exists()]
        assert not left, f"staged weights outlived the run: {left}"
    return syncs


@pytest.mark.slow
def test_paper_7b_split_trains_ahead_through_vllm_servers_and_resumes_exactly(world):
    """`torchrun train.py experiment=paper_7b placement=gpu_node_split train.async_rollout=true`: each learner rank
    starts a vLLM server of its own, generation runs ahead of training (async, admission schedule), and a run
    killed after step 3 resumes to the same metrics; no server outlives its run. Every sync's weights are checked
    against the server's, under a GPU's copy semantics."""
    base = world["base"] / "paper_7b_split"
    env = with_sync_probe(world["env"], base)
    full = base / "full"
    py, train = train_as_the_user(world | {"env": env}, "vllm", PAPER_7B_SPLIT, PAPER_7B_SIZES, full, torchrun=True)
    got = assert_ran_as_composed(full, train[1:], env, steps=4, version=16)
    assert_no_server_left(base / "probe")
    cfg = yaml.safe_load((full / "config.yaml").read_text())
    assert cfg["rollout"]["engine"] == "vllm_server" and cfg["train"]["async_rollout"] is True
    assert_engine_matches_learner(got)
    resumed_after_step_3(full, base, py, train, env)
    assert_no_server_left(base / "probe")
    assert assert_every_sync_checked(base / "probe", async_mode=True) >= 8  # every batch's version, both ranks


@pytest.mark.slow
def test_paper_7b_split_in_sync_mode_stages_once_a_node_and_syncs_exact_weights(world):
    """`torchrun train.py experiment=paper_7b placement=gpu_node_split` (sync: every rank syncs at once, and the
    node's ranks share one staged copy). Every sync's weights are checked against the server's."""
    base = world["base"] / "paper_7b_split_sync"
    env = with_sync_probe(world["env"], base)
    run = base / "run"
    _, train = train_as_the_user(world | {"env": env}, "vllm", PAPER_7B_SPLIT_SYNC, PAPER_7B_SIZES, run, torchrun=True)
    got = assert_ran_as_composed(run, train[1:], env, steps=4, version=16)
    assert_no_server_left(base / "probe")
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["async_rollout"] is False
    assert_engine_matches_learner(got)
    assert assert_every_sync_checked(base / "probe", async_mode=False) >= 8
