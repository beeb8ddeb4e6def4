"""A plain ``python train.py`` / ``python eval.py`` starts the node's ranks itself (bapo/entry/launch.py).

Fast: what the memory plan chooses for the GPUs a machine reports (``bapo.entry.launch.usable_devices`` monkeypatched),
that an explicit key wins, the launcher keys' checks, SLURM's variables, and docs/gpu.md's table of what the launch
chooses for each shipped model on 1, 4 and 8 GPUs of 80 and 141 GB (regenerated here: ``python tests/e2e/test_launch.py
--record`` rewrites it). Slow (real processes, 2 gloo ranks on the CPU): launched ranks equal torchrun's metric for
metric, a killed rank ends the run with one line and a resume continues exactly, Ctrl-C reaches every rank and
leaves no process, a sweep of launched cells relaunched after a kill resumes its killed cell exactly, and eval.py on
2 launched ranks writes the results.json of one process."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if __name__ == "__main__":  # --record, run as a script from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bapo.entry import launch  # noqa: E402
from bapo.infra.checks import ConfigError  # noqa: E402
from tests.helpers.config import compose  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.processes import FSDP_LOOP, shared_torchrun  # noqa: E402

DOC = ROOT / "docs" / "gpu.md"
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
for _k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", launch.FAKE_DEVICES):
    ENV.pop(_k, None)
# The loop of tests/e2e/test_loop_fsdp.py; logp_check_share stays at its default (one row: 2 ranks need 2)
ARGS = FSDP_LOOP[1:]
TWO = ["launcher.nproc_per_node=2"]


def decided(devices: list[float], *overrides: str, entry: str = "train") -> launch.Launch:
    cfg = compose(*overrides)
    return launch.decide(cfg, list(overrides), entry)


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n, gib)``: this machine reports n GPUs of gib (the host memory unknown: not checked)."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch, "host_memory", lambda: None)

    def report(n: int, gib: float = 80.0) -> None:
        monkeypatch.setattr(launch, "usable_devices", lambda: [float(gib)] * n)

    return report


# ----------------------------------------------------------------------------- the plan chooses


def test_qwen7b_takes_every_gpu_of_a_node_it_fits_and_offloads_where_it_does_not(gpus):
    gpus(8)
    h = launch.decide(compose("algo=bapo", "model=qwen7b"), ["algo=bapo", "model=qwen7b"])
    assert (h.nproc, h.changes, h.spawns) == (8, (), True)
    assert h.chosen == "8 ranks on 8 GPUs of 80 GiB" and h.reason.startswith("the memory plan's peak is 68.1 GiB")
    gpus(1)  # one 80 GB GPU: the plan needs 143 GiB; the learner's state on the host fits
    h = launch.decide(compose("algo=bapo", "model=qwen7b"), ["algo=bapo", "model=qwen7b"])
    assert (h.nproc, h.changes, h.spawns) == (1, (("learner.cpu_offload", True),), False)
    assert h.chosen == "1 rank on 1 GPU of 80 GiB, learner.cpu_offload=true" and "57.5 GiB" in h.reason
    gpus(4, 141)
    h = launch.decide(compose("model=qwen7b"), ["model=qwen7b"])
    assert (h.nproc, h.changes) == (4, ())
    # an explicit learner key (or placement=) wins: kept, the plan's verdict only reported
    gpus(1)
    over = ["model=qwen7b", "learner.cpu_offload=false"]
    h = launch.decide(compose(*over), over)
    assert h.changes == () and h.reason.startswith("as the command line says;") and h.reason.endswith("does not fit")


def test_a_run_that_fits_nowhere_on_this_node_is_refused_naming_the_smallest_change(gpus):
    gpus(1)
    refusal = (
        r"^launcher.nproc_per_node: deepseek-ai/DeepSeek-R1-Distill-Qwen-32B does not fit 1 rank on 1 GPU of 80 GiB"
    )
    with pytest.raises(ConfigError, match=refusal + r" .*the smallest change that fits: 4 GPUs of 80 GiB"):
        launch.decide(compose("model=r1_distill_qwen_32b"), ["model=r1_distill_qwen_32b"])


def test_what_else_the_launch_decides(gpus, monkeypatch):
    gpus(8)
    split = ["experiment=paper_7b", "placement=gpu_node_split"]
    h = launch.decide(compose(*split), split)  # 4 learner ranks, the other 4 GPUs for the vLLM servers
    assert h.nproc == 4 and h.chosen == "4 ranks on 8 GPUs of 80 GiB (4 for vLLM servers)"
    h = launch.decide(compose(), [])  # learner=single: one process
    assert h.nproc == 1 and h.chosen.startswith("1 process") and h.changes == ()
    gpus(0)
    h = launch.decide(compose("model=qwen7b"), ["model=qwen7b"])  # no GPU: one process, nothing chosen
    assert (h.nproc, h.chosen, h.spawns) == (1, None, False)
    h = launch.decide(compose("learner=fsdp", *TWO), ["learner=fsdp", *TWO])  # asked for: on a CPU too
    assert (h.nproc, h.chosen, h.reason) == (2, "2 ranks", "launcher.nproc_per_node=2")
    gpus(8)
    monkeypatch.setenv("LOCAL_RANK", "0")  # under torchrun: nothing changes
    h = launch.decide(compose("model=qwen7b"), ["model=qwen7b"])
    assert (h.nproc, h.chosen, h.changes, h.spawns) == (1, None, (), False)


def test_the_refusals_smallest_change_is_never_the_change_that_just_failed(gpus, monkeypatch):
    """One 80 GB GPU and 125 GiB of host: the learner's state on the host needs 142 GiB of it. Before: the refusal
    offered learner.cpu_offload=true, the change the launch had just tried; an offered change is now one the plan
    finds fits once applied."""
    gpus(1)
    monkeypatch.setattr(launch, "host_memory", lambda: 125.0)
    with pytest.raises(ConfigError) as info:
        launch.decide(compose("model=qwen7b"), ["model=qwen7b"])
    why = str(info.value)
    assert "57.5 GiB a GPU with learner.cpu_offload=true, which needs 141.9 GiB of host, this node has 125)" in why
    offered = why.split("the smallest change that fits: ")[1]
    assert offered.startswith("more host memory (learner.cpu_offload=true needs 141.9 GiB of host a node, this node "
                              "has 125)")  # fmt: skip
    gpus(8)  # 8 ranks fit the GPUs, not 125 GiB of host; the offered change is checked against the plan
    with pytest.raises(ConfigError, match="the smallest change that fits: rollout.sleep_level=2 ") as info:
        launch.decide(compose("model=qwen7b"), ["model=qwen7b"])
    monkeypatch.setattr(launch, "host_memory", lambda: 150.0)  # room for it: the launch takes it
    h = launch.decide(compose("model=qwen7b"), ["model=qwen7b"])
    assert h.changes == () and "fits" not in h.reason
    gpus(1)
    assert launch.decide(compose("model=qwen7b"), ["model=qwen7b"]).changes == (("learner.cpu_offload", True),)


BAD = {
    "launcher.nproc_per_node=0": r"launcher.nproc_per_node: auto or N >= 1, got '0'",
    "launcher.nnodes=two": r"launcher.nnodes: auto or N >= 1, got 'two'",
    "launcher.rdzv_endpoint=nohost": r"launcher.rdzv_endpoint: host:port, got 'nohost'",
    "launcher.nnodes=2": r"launcher.rdzv_endpoint: launcher.nnodes=2 needs the first node's host:port",
    "launcher.nproc_per_node=2": r"launcher.nproc_per_node: 2 ranks, but learner=single trains in one process",
}


@pytest.mark.parametrize("override", BAD)
def test_bad_launcher_keys_are_refused_naming_the_key(gpus, override):
    gpus(0)
    with pytest.raises(ConfigError, match=BAD[override]):
        launch.decide(compose(override), [override])


def test_server_gpus_the_node_lacks_are_refused_naming_rollout_gpus(gpus):
    """Before: on 4 GPUs the split placement's servers on GPUs 4-7 left 1 learner rank ("3 for vLLM servers"), and
    each server then failed to start on devices that are not there."""
    split = ["experiment=paper_7b", "placement=gpu_node_split"]
    gpus(4)
    for over in (split, [*split, "launcher.nproc_per_node=2"]):
        lacks = r"^rollout.gpus: '4,5,6,7' names GPU\(s\) 4,5,6,7 for the vLLM servers, but this node has 4 GPUs"
        with pytest.raises(ConfigError, match=lacks):
            launch.decide(compose(*over), over)
    with pytest.raises(ConfigError, match=r"^rollout.gpus: '2,5' names GPU\(s\) 5 "):
        launch.decide(compose(*split, "rollout.gpus='2,5'"), [*split, "rollout.gpus='2,5'"])
    assert launch.decide(compose(*split, "rollout.gpus='2,3'"), split).nproc == 2  # the other 2 train
    gpus(8)
    assert launch.decide(compose(*split), split).nproc == 4


REFUSED = {  # the command line's overrides, the reported GPUs: the one line
    "learner=single": (TWO, None, "error: ConfigError: launcher.nproc_per_node: 2 ranks, but learner=single trains in "
                       "one process: use learner=fsdp"),
    "server gpus": (["experiment=paper_7b", "placement=gpu_node_split"], "4", "error: ConfigError: rollout.gpus: "
                    "'4,5,6,7' names GPU(s) 4,5,6,7 for the vLLM servers, but this node has 4 GPUs of 80 GiB (indices "
                    "0-3 of the GPUs this process sees)"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_launch_is_one_line_exit_2_and_leaves_no_folder(tmp_path, case):
    """Before any rank starts (the parent's refusal): as any bad input, one line and no run folder."""
    over, devices, line = REFUSED[case]
    run = tmp_path / "run"
    env = ENV | ({launch.FAKE_DEVICES: devices} if devices else {})
    p = subprocess.run([sys.executable, "train.py", *over, f"hydra.run.dir={run}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 2 and p.stderr.splitlines() == [line], p.stderr[-2000:]
    assert not run.exists()


def test_several_nodes_need_one_run_folder_every_node_names(gpus, tmp_path):
    """Before: each node's launch made its own time-stamped folder (Hydra's default run folder); here, on one
    machine, the launch waited for the second node's rendezvous instead of refusing."""
    gpus(0)
    over = ["learner=fsdp", "launcher.nnodes=2", "launcher.rdzv_endpoint=localhost:29400"]
    refusal = r"^hydra.run.dir: 2 nodes \(launcher.nnodes\) write one run folder, but 'outputs/\$\{now:%H\}' is named"
    with pytest.raises(ConfigError, match=refusal):
        launch.decide(compose(*over), over, stamped="outputs/${now:%H}")
    assert launch.decide(compose(*over), over).nnodes == 2  # a folder named on the command line: every node's
    stamped = f"{tmp_path}/runs/${{now:%H-%M-%S}}"
    p = subprocess.run([sys.executable, "train.py", *over, f"hydra.run.dir={stamped}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 2 and p.stderr.splitlines() == [
        f"error: ConfigError: hydra.run.dir: 2 nodes (launcher.nnodes) write one run folder, but {stamped!r} is named "
        "by the time each node started, so each would make its own: give every node the same hydra.run.dir=<a folder "
        "every node sees>"
    ], p.stderr[-2000:]
    assert not list((tmp_path / "runs").iterdir())  # no run folder left


def test_the_test_hook_reports_fake_devices(monkeypatch):
    monkeypatch.setenv(launch.FAKE_DEVICES, "4x141")
    assert launch.usable_devices() == [141.0] * 4 and launch.host_memory() is None
    monkeypatch.setenv(launch.FAKE_DEVICES, "2")
    assert launch.usable_devices() == [80.0, 80.0]
    monkeypatch.setenv(launch.FAKE_DEVICES, "two")
    with pytest.raises(ConfigError, match="BAPO_FAKE_DEVICES"):
        launch.usable_devices()


# ----------------------------------------------------------------------------- SLURM


SLURM_RANKS = {  # srun --nodes=2 --ntasks-per-node=4 python train.py ...: task 5 of 8
    "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}  # fmt: skip


def test_slurm_one_task_per_rank_is_mapped_to_torchruns_variables(monkeypatch):
    from bapo.infra import dist

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so that what from_slurm sets is undone after the test
        monkeypatch.delenv(k)
    for k, v in SLURM_RANKS.items():
        monkeypatch.setenv(k, v)
    assert dist.from_slurm()
    got = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    assert got == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu07", str(20000 + 123456 % 20000))
    assert launch.under_launcher() is not None  # and so the launch changes nothing
    assert not dist.from_slurm()  # once


def test_slurm_one_task_per_node_launches_the_nodes_ranks(monkeypatch, gpus):
    from bapo.infra import dist

    gpus(8)
    # srun --nodes=2 --ntasks-per-node=1 (hydra/launcher=slurm, one task per node): the task is a launching parent
    node = SLURM_RANKS | {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
                          "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}  # fmt: skip
    for k, v in node.items():
        monkeypatch.setenv(k, v)
    assert not dist.from_slurm() and launch.under_launcher() is None
    h = launch.decide(compose("model=qwen7b"), ["model=qwen7b"])
    assert (h.nproc, h.nnodes, h.rdzv_endpoint, h.run_id) == (8, 2, "gpu07:29400", "bapo-123456")
    assert h.chosen == "8 ranks on 8 GPUs of 80 GiB, on each of 2 nodes"
    # a batch script or salloc shell (no step): nothing of SLURM's is read
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    assert launch.decide(compose("model=qwen7b"), ["model=qwen7b"]).nnodes == 1


# ----------------------------------------------------------------------------- docs/gpu.md's table

TABLE_MODELS = ["qwen2.5_0.5b", "qwen2.5_1.5b", "qwen7b", "qwen2.5_math_7b", "r1_distill_qwen_7b",
                "r1_distill_qwen_32b"]  # fmt: skip
NODES = [(1, 80), (4, 80), (8, 80), (1, 141), (4, 141), (8, 141)]
BEGIN, END = "<!-- launch table: python tests/e2e/test_launch.py --record -->", "<!-- end of the launch table -->"


def _cell(over: list[str], n: int, gib: float) -> str:
    from unittest import mock

    with (
        mock.patch.object(launch, "usable_devices", lambda: [float(gib)] * n),
        mock.patch.object(launch, "host_memory", lambda: None),
    ):
        try:
            h = launch.decide(compose(*over), over)
        except ConfigError as e:
            return "refused: " + str(e).split("the smallest change that fits: ")[1].split(" (")[0]
    peak = h.reason.split("peak is ")[1].split(" GiB")[0] if "peak is " in h.reason else "?"
    off = h.changes[-1][1] if h.changes else False
    if h.reason.startswith("the memory plan's peak") and "with the learner's state on the host" in h.reason:
        peak = h.reason.split("on the host ")[1].split(" GiB")[0]
    return f"{h.nproc} rank{'s' if h.nproc > 1 else ''}" + (", offload" if off else "") + f" ({peak})"


def expected_table() -> str:
    """What ``python train.py model=<m>`` starts on each node: ranks, ``learner.cpu_offload=true`` where the plan
    picks it, and the plan's per-GPU peak in GiB; or the refusal's smallest change."""
    head = "| model | " + " | ".join(f"{n} x {g} GB" for n, g in NODES) + " |"
    lines = [head, "|---|" + "---|" * len(NODES)]
    for m in [*TABLE_MODELS, "experiment=paper_7b"]:
        over = [m] if "=" in m else [f"model={m}"]
        lines.append(f"| {over[0]} | " + " | ".join(_cell(over, n, g) for n, g in NODES) + " |")
    return "\n".join(lines)


def _doc_table(text: str) -> tuple[int, int]:
    """Where the table lies in docs/gpu.md: between the line after BEGIN and the line END."""
    start, end = text.index(BEGIN + "\n") + len(BEGIN) + 1, text.index("\n" + END) + 1
    assert start <= end, "docs/gpu.md: the launch table's markers are out of order"
    return start, end


@pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="the table is of a plain python start")
def test_the_launch_table_in_docs_gpu_md_is_todays():
    text = DOC.read_text()
    start, end = _doc_table(text)
    assert text[start:end] == expected_table() + "\n", (
        "docs/gpu.md is stale: run python tests/e2e/test_launch.py --record"
    )


def _record() -> None:
    text = DOC.read_text()
    start, end = _doc_table(text)
    DOC.write_text(text[:start] + expected_table() + "\n" + text[end:])


# ----------------------------------------------------------------------------- real processes


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def untimed(rs: list[dict]) -> list[dict]:
    from tests.helpers.metrics import untimed as drop_timings

    return drop_timings(rs)


def train(*args: str, launcher=(sys.executable,), env=ENV, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, **kw)  # fmt: skip


def popen(*args: str, script: str = "train.py") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, script, *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def children(pid: int) -> dict[int, int]:
    """The launched ranks of process ``pid``: its children with a $RANK, as {rank: pid}."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                env = dict(x.split("=", 1) for x in (d / "environ").read_bytes().decode().split("\0") if "=" in x)
                if "RANK" in env:
                    out[int(env["RANK"])] = int(d.name)
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: int) -> set[int]:
    parent = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit():
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parent.items() if pp == p}
        out |= kids
        todo += list(kids)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(path: Path, p: subprocess.Popen, timeout: float = 600) -> None:
    end = time.time() + timeout
    while not path.exists():
        assert p.poll() is None, f"ended before {path} appeared: {p.communicate()[1][-3000:]}"
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """``python train.py learner=fsdp launcher.nproc_per_node=2 ...``, run to the end, with a temporary folder of its
    own (``$TMPDIR``: ``<run>/../tmp``)."""
    base = tmp_path_factory.mktemp("launched")
    run, tmp = base / "run", base / "tmp"
    tmp.mkdir()
    p = train(*ARGS, *TWO, f"hydra.run.dir={run}", env=ENV | {"TMPDIR": str(tmp)})
    assert p.returncode == 0, p.stderr[-3000:]
    return run


@pytest.mark.slow
def test_two_launched_ranks_equal_torchrun_metric_for_metric(launched, tmp_path_factory):
    # `torchrun --standalone --nproc_per_node=2 train.py <ARGS>`: test_loop_fsdp's run, made once per session
    torchrun, _ = shared_torchrun(tmp_path_factory)
    assert untimed(rows(launched)) == untimed(rows(torchrun))
    assert [r["step"] for r in rows(launched)] == [0, 1, 2, 3, 4]
    meta = json.loads((launched / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert meta["world_size"] == 2  # two ranks, one folder (the parent pinned it): theirs and torchrun's alike
    import yaml

    cfg = yaml.safe_load((launched / "config.yaml").read_text())
    assert cfg["launcher"] == {
        "nproc_per_node": 2, "nnodes": "auto", "rdzv_endpoint": None, "grace_s": 120,
        "chosen": "2 ranks (launcher.nproc_per_node=2)"
    }  # fmt: skip
    log = (launched / "train.log").read_text()
    assert log.count("launch: 2 ranks (launcher.nproc_per_node=2)") == 1


@pytest.mark.slow
def test_a_launched_run_leaves_no_folder_of_the_elastic_agent_in_the_temporary_folder(launched):
    """Before: torch's elastic agent made a ``torchelastic_*`` folder of (empty) rank logs in $TMPDIR for every
    launch, and nothing removed it."""
    left = [p.name for p in (launched.parent / "tmp").iterdir() if p.name.startswith("torchelastic_")]
    assert not left, left


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_with_one_line_and_a_resume_continues_exactly(launched, tmp_path):
    run = tmp_path / "run"
    p = popen(*ARGS, *TWO, f"hydra.run.dir={run}")
    wait_for(run / "checkpoints" / "step_000002", p)
    rank1 = children(p.pid)[1]
    os.kill(rank1, signal.SIGKILL)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 1, err[-3000:]
    mine = [x for x in err.splitlines() if x.startswith("error: RankFailed")]
    assert (
        mine
        == [err.strip().splitlines()[-1]]
        == [
            f"error: RankFailed: rank 1 (pid {rank1}) was killed by SIGKILL; the launcher stopped the other ranks; "
            f"resume: the same command with resume=auto hydra.run.dir={run}"
        ]
    )
    assert "ChildFailedError" not in err and (run / "train.log").read_text().endswith(mine[0] + "\n")
    p = train(*ARGS, *TWO, f"hydra.run.dir={run}", "resume=auto")
    assert p.returncode == 0 and "resumed from" in p.stdout + p.stderr, p.stderr[-3000:]
    assert untimed(rows(run)) == untimed(rows(launched))


# A rank that outlives the grace: on SIGTERM it saves (or not) and then never exits, as a rank stuck leaving its group
HANGING_RANK = """
import json, signal, sys, time
from pathlib import Path

run, saves = Path(sys.argv[1]), sys.argv[2] == "saves"


def stop(signum, frame):
    if saves:
        step = run / "checkpoints" / "step_000003"
        step.mkdir(parents=True)
        (step / "state.pt").write_bytes(b"")
        (step / "meta.json").write_text(json.dumps({"step": 3, "time": time.time(), "seq": 1}))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)


signal.signal(signal.SIGTERM, stop)
(run / "ready").write_text("1")
while True:
    time.sleep(1)
"""
LAUNCHING = """
import sys
from pathlib import Path
from bapo.entry import launch

run = Path(sys.argv[1])
out = launch.start(launch.Launch(nproc=1), run / "rank.py", [str(run), sys.argv[2]], after="resume: as before",
                   grace_s=2, checkpoints=run / "checkpoints")
print("CODE", out.code)
"""


@pytest.mark.parametrize("saves", [True, False], ids=["saved-then-stuck", "stuck-before-saving"])
def test_a_rank_killed_after_the_grace_is_a_warning_when_its_stop_had_saved(tmp_path, saves):
    """The launcher's one line after it SIGKILLed a rank: "nothing was lost" (the code a stop's) when a checkpoint
    dated after the signal is there, and RankKilled when none is (an older checkpoint does not count)."""
    old = tmp_path / "checkpoints" / "step_000001"
    old.mkdir(parents=True)
    (old / "state.pt").write_bytes(b"")
    (old / "meta.json").write_text(json.dumps({"step": 1, "time": time.time() - 3600, "seq": 0}))
    (tmp_path / "rank.py").write_text(HANGING_RANK)
    p = subprocess.Popen([sys.executable, "-c", LAUNCHING, str(tmp_path), "saves" if saves else "stuck"], cwd=ROOT,
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        t0 = time.time()
        while not (tmp_path / "ready").exists():
            assert p.poll() is None and time.time() - t0 < 120, p.communicate()
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    lines = [x for x in err.splitlines() if x.startswith(("warning: ", "error: "))]
    assert f"CODE {128 + signal.SIGTERM}" in out, err[-3000:]
    if saves:
        assert lines == [
            "warning: a rank was still exiting 2 s after SIGTERM (launcher.grace_s) and was killed by SIGKILL after "
            f"its stop had saved {tmp_path / 'checkpoints' / 'step_000003'}: nothing was lost; resume: as before"
        ], err[-3000:]
    else:
        assert len(lines) == 1 and lines[0].startswith("error: RankKilled: a rank outlived the launcher's grace "
                                                       "after SIGTERM (launcher.grace_s=2)"), err[-3000:]  # fmt: skip
        assert "its stop did not finish saving" in lines[0] and lines[0].endswith("; resume: as before")


def gone_within(pids, seconds: float) -> list[int]:
    """The processes of ``pids`` still alive after up to ``seconds`` of waiting for them to end."""
    end = time.time() + seconds
    while (left := [q for q in pids if alive(q)]) and time.time() < end:
        time.sleep(0.1)
    return left


def killed_launcher(p: subprocess.Popen, ranks: dict[int, int]) -> str:
    """SIGKILL the launching process ``p``; its ``ranks`` must end on their own within seconds. Its stderr."""
    os.kill(p.pid, signal.SIGKILL)
    try:
        left = gone_within(ranks.values(), 20)
        assert not left, f"ranks outlived their launcher: {left}"
        return p.communicate(timeout=60)[1]  # the ranks held its pipes
    finally:
        for q in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(q, signal.SIGKILL)


@pytest.mark.slow
def test_ranks_die_with_their_launcher_and_a_resume_continues_exactly(launched, tmp_path):
    """SIGKILL of ``python train.py ...`` (a closed terminal's session, an OOM killer). Before: its ranks ran on,
    orphaned, holding the run folder's lock, and finished the run on their own; ``resume=auto`` was refused meanwhile.
    Now each rank's watch ends it with its launcher: no step after the kill, the lock free, and the resume equals
    the uninterrupted run."""
    run = tmp_path / "run"
    p = popen(*ARGS, *TWO, f"hydra.run.dir={run}")
    wait_for(run / "checkpoints" / "step_000002", p)
    ranks = children(p.pid)
    assert sorted(ranks) == [0, 1]
    err = killed_launcher(p, ranks)
    assert not (run / "final_metrics.json").exists() and not (run / "export").exists()  # they did not finish it
    assert sorted(x for x in err.splitlines() if x.startswith("error: LauncherGone")) == [
        f"error: LauncherGone: the launching process (pid {p.pid}) is gone: rank {r} stops with it" for r in (0, 1)
    ]
    p = train(*ARGS, *TWO, f"hydra.run.dir={run}", "resume=auto")
    assert p.returncode == 0 and "resumed from" in p.stdout + p.stderr, p.stderr[-3000:]
    assert untimed(rows(run)) == untimed(rows(launched))


@pytest.mark.slow
def test_ctrl_c_reaches_every_rank_and_leaves_no_process(tmp_path):
    run = tmp_path / "run"
    p = popen(*ARGS, *TWO, "train.steps=50", "checkpoint.every=0", f"hydra.run.dir={run}")
    end = time.time() + 600
    while not ((run / "metrics.jsonl").exists() and len(rows(run)) >= 2):  # a step done: every rank is in the loop
        assert p.poll() is None and time.time() < end, p.communicate()[1][-3000:]
        time.sleep(0.2)
    ranks, everyone = children(p.pid), descendants(p.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(p.pid, signal.SIGINT)  # to the launching process only, as a terminal's Ctrl-C (the ranks have sessions)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 128 + signal.SIGINT, err[-3000:]
    assert (out + err).count("SIGINT: stopping within seconds; the last consistent state is saved") == 2  # each rank
    saved = sorted(x.name for x in (run / "checkpoints").iterdir())
    assert saved and {"producer_rank0.pt", "producer_rank1.pt"} <= {
        x.name for x in (run / "checkpoints" / saved[-1]).iterdir()
    }
    time.sleep(1)
    left = [q for q in everyone | {p.pid} if alive(q)]
    assert not left, f"processes left: {left}"
    for group in {p.pid, *ranks.values()}:  # the launcher's process group and each rank's: empty
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)


def wait_for_cell(sweep_dir: Path, seed: int, p: subprocess.Popen, timeout: float = 600) -> Path:
    """The folder of the sweep's cell with ``seed``, once it holds its step-2 checkpoint."""
    end = time.time() + timeout
    while not (found := list(sweep_dir.glob(f"*seed={seed}*/checkpoints/step_000002"))):
        assert p.poll() is None, f"the sweep ended before cell seed={seed} saved step 2: {p.communicate()[1][-3000:]}"
        assert time.time() < end, f"the cell seed={seed} never saved step 2"
        time.sleep(0.1)
    return found[0].parents[1]


@pytest.mark.slow
def test_a_sweep_of_launched_cells_relaunched_after_a_kill_resumes_the_killed_cell_exactly(launched, tmp_path):
    """``python train.py -m <the launched run's overrides> seed=1,2``: a rank of the first cell is killed, the sweep
    goes on to the second and says so, and its relaunch resumes the first cell to the uninterrupted launched run's
    metrics (``launched``: the same command, seed 1 being the default) and leaves the complete one as it was."""
    cut = tmp_path / "cut"
    args = ["-m", *ARGS, *TWO, "seed=1,2", f"hydra.sweep.dir={cut}"]
    p = popen(*args)
    first = wait_for_cell(cut, 1, p)
    os.kill(children(p.pid)[1], signal.SIGKILL)  # a rank of the first cell
    out, err = p.communicate(timeout=900)
    assert p.returncode == 1, err[-3000:]  # the sweep went on: the second cell ran
    summary = [json.loads(x) for x in (cut / "sweep_summary.jsonl").read_text().splitlines()]
    assert [(r["job"], r["status"], r["exit"]) for r in summary] == [(0, "failed", 1), (1, "complete", 0)]
    assert (
        summary[0]["error"].startswith("error: RankFailed: rank 1")
        and "a relaunch of the sweep resumes it" in (summary[0]["error"])
    )
    assert not list(cut.glob(".cell-*"))  # the ranks' hand-off to their job, read and removed
    (second,) = cut.glob("*seed=2*/")
    complete = (second / "metrics.jsonl").read_bytes()
    p = train(*args)  # relaunched: the first cell resumes, the second is complete
    assert p.returncode == 0, p.stderr[-3000:]
    assert (p.stdout + p.stderr).count("nothing to do") == 1 and "resumed from" in p.stdout + p.stderr
    summary = [json.loads(x) for x in (cut / "sweep_summary.jsonl").read_text().splitlines()]
    assert [(r["job"], r["status"], r["exit"]) for r in summary][-2:] == [(0, "complete", 0), (1, "complete", 0)]
    assert untimed(rows(first)) == untimed(rows(launched))  # as if never killed
    assert (second / "metrics.jsonl").read_bytes() == complete  # the relaunch left the complete cell alone
    assert [r["step"] for r in rows(second)] == [0, 1, 2, 3, 4]
    for cell in (first, second):  # each cell ran on 2 launched ranks
        assert json.loads((cell / "checkpoints" / "step_000004" / "meta.json").read_text())["world_size"] == 2


HOLD = """import fcntl, os, sys, time
os.makedirs(sys.argv[1], exist_ok=True)
fd = os.open(os.path.join(sys.argv[1], sys.argv[2]), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(3600)
"""  # another process holding a run folder's lock


@pytest.mark.slow
def test_a_killed_sweep_takes_its_ranks_and_a_busy_cell_fails_as_a_row(launched, tmp_path):
    """``python train.py -m <the launched run's overrides> seed=1,2``, SIGKILLed in its first cell: the cell's ranks
    end with it (before: they ran on, holding the cell's folder, and a relaunch was refused). Relaunched while
    another process holds the second cell's folder: the first cell resumes to the uninterrupted launched run's
    metrics, and the second fails at once as a row (RunFolderBusy, exit 2). Before: that cell's rank 0 handed its
    row to the job and returned, its rank 1 waited for it in the process group, and the sweep stood still (194 s
    here before the store gave up; Ctrl-C did not end it)."""
    from bapo.rundir import LOCK_NAME

    cut = tmp_path / "cut"
    args = ["-m", *ARGS, *TWO, "seed=1,2", f"hydra.sweep.dir={cut}"]
    p = popen(*args)
    first = wait_for_cell(cut, 1, p)
    killed_launcher(p, children(p.pid))
    assert not (first / "final_metrics.json").exists()  # the ranks did not finish the cell on their own
    second = cut / first.name.replace("seed=1", "seed=2")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(second), LOCK_NAME], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = train(*args)
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 2, p.stderr[-3000:]  # every failed cell was bad input
    summary = [json.loads(x) for x in (cut / "sweep_summary.jsonl").read_text().splitlines()]
    assert [(r["job"], r["status"], r["exit"]) for r in summary] == [(0, "complete", 0), (1, "failed", 2)]
    assert summary[1]["error"].startswith(f"error: RunFolderBusy: {second} is in use by another run")
    assert summary[1]["wall_s"] < 120  # a refusal at start: the cell's start-up, not a wait for a timeout
    assert untimed(rows(first)) == untimed(rows(launched))
    assert not list(cut.glob(".cell-*"))


@pytest.mark.slow
def test_eval_on_two_launched_ranks_writes_the_results_of_one_process(tmp_path):
    common = ["eval=arith", "eval.limit=6", "k=1", "temperature=0"]
    one = subprocess.run([sys.executable, "eval.py", *common, f"hydra.run.dir={tmp_path / 'one'}"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "eval.py", *common, *TWO, f"hydra.run.dir={tmp_path / 'two'}"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (json.loads((tmp_path / x / "results.json").read_text()) for x in ("one", "two"))
    assert b["config"].pop("launcher")["chosen"] == "2 ranks (launcher.nproc_per_node=2)"
    assert a["config"].pop("launcher")["chosen"] is None
    assert a == b  # metrics, every problem's row, the config: one process's
    assert "launch: 2 ranks" in two.stdout + two.stderr


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:  # python tests/e2e/test_launch.py --record
    _record()
