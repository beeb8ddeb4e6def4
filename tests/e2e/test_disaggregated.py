"""placement=disaggregated: rollout workers in processes of their own (the package bapo/rollout/disaggregated/).

Every test here starts real worker processes. The end-to-end ones compare whole runs' metrics: one worker makes
the colocated run's batches, a worker killed (or hung) mid-run is replaced without changing a metric, a learner
killed with SIGKILL leaves no worker behind and resumes to the same metrics, Ctrl-C stops every process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bapo import checkpoint
from bapo.config import build
from bapo.infra.checks import ConfigError
from bapo.loop import run
from bapo.rollout.disaggregated.pool import Worker, WorkerError, WorkerLost, WorkerPool, WorkerSpec, last_error
from bapo.rollout.disaggregated.remote import merge_shares
from bapo.rollout.disaggregated.wire import send
from bapo.rollout.disaggregated.worker import check_weights
from tests.helpers.config import smoke_cfg
from tests.helpers.runs import killed_after_step_3

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("time/", "reward/verify_s", "rollout/tokens_per_s", "buffer/consumer_wait_s", "buffer/producer_wait_s")
DIS = ["placement=disaggregated"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def untimed(rs: list[dict]) -> list[dict]:
    drop = (*TIMING, "rollout/worker_restarts")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rs]


def alive(pid: int) -> bool:
    """Is ``pid`` a live process (not gone, not a zombie nobody reaped)?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def worker_log(pid: int) -> str:
    """The log file of the rollout worker ``pid`` (its ``--log`` argument)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--log") + 1]


def worker_pids(parent: int) -> list[int]:
    """The rollout workers among ``parent``'s children (from /proc)."""
    out = []
    for task in Path(f"/proc/{parent}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for k in kids:
            try:
                cmd = Path(f"/proc/{k}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"bapo.entry.worker" in cmd:
                out.append(int(k))
    return sorted(out)


def wait_until(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        time.sleep(0.05)


# ----------------------------------------------------------------------------- config and bad input (fast)


@pytest.mark.parametrize(
    "over, key",
    [
        (["placement.workers=0"], "placement.workers"),
        (["placement.mode=elsewhere"], "placement.mode"),
        (["placement.port=70000"], "placement.port"),
        (["placement.worker_threads=0"], "placement.worker_threads"),
        (["placement.worker_timeout_s=0"], "placement.worker_timeout_s"),
        (["placement.worker_restarts=-1"], "placement.worker_restarts"),
        (["placement.workers=2", "rollout.partial_budget=12", "buffer.max_staleness=7"], "placement.workers"),
        (["placement.workers=9", "train.prompts_per_step=8"], "placement.workers"),
    ],
)
def test_bad_values_are_refused_at_startup_naming_the_key(tmp_path, over, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        build(smoke_cfg([*DIS, *over]), tmp_path)


def test_a_port_in_use_is_one_line_naming_placement_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        spec = WorkerSpec(config={}, path="", limit=1, run_dir=str(tmp_path))
        with pytest.raises(ConfigError, match=rf"^placement.port: cannot listen on 127.0.0.1:{port}") as e:
            WorkerPool(spec, count=1, port=port)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "host, why",
    [
        ("nosuch.invalid", "cannot resolve it"),
        ("10.255.255.1", "cannot listen there"),  # not an address of this machine
        ("", "the learner's address is needed"),  # before: TCPStore('') waited 900 s for itself
    ],
)
def test_a_bad_host_is_one_line_naming_placement_host_not_the_port(tmp_path, host, why):
    # Before: every listener error said "placement.port: ... choose a free port"; a busy port still does (above).
    spec = WorkerSpec(config={}, path="", limit=1, run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^placement\.host: {host!r} for rollout workers: {why}") as e:
        WorkerPool(spec, count=1, host=host)
    assert "\n" not in str(e.value) and "port" not in str(e.value)


BAR = "Loading weights: 100%|██████████| 39/39 [00:00<00:00, 5148.98it/s]"


def test_a_workers_log_gives_its_traceback_line_never_a_progress_bar():
    assert last_error(f"{BAR}\r{BAR}\n[INFO] loaded\n") == ""  # before: the bar was quoted as the reason
    log = f'{BAR}\nTraceback (most recent call last):\n  File "x.py", line 1\n    boom()\nRuntimeError: boom\n{BAR}\n'
    assert last_error("Traceback (most recent call last):\n  x\nValueError: old\n" + log) == "RuntimeError: boom"


def _dying_worker(pool, tmp_path, code: str) -> Worker:
    """A stand-in worker process that prints a progress bar and ends as ``code`` says, logged as the pool logs."""
    log = tmp_path / f"worker{len(pool.workers)}.log"
    with log.open("w") as out:
        src = f"import os, signal, sys; sys.stderr.write({BAR!r} + chr(13)); sys.stderr.flush(); {code}"
        proc = subprocess.Popen([sys.executable, "-c", src], stdout=out, stderr=subprocess.STDOUT)
    w = Worker(len(pool.workers), proc, str(log))
    pool.workers.append(w)
    proc.wait(timeout=30)
    return w


def test_a_lost_workers_reason_is_how_it_ended_and_a_named_log_outlives_the_pool(tmp_path):
    spec = WorkerSpec(config={}, path="", limit=1, run_dir=str(tmp_path))
    pool = WorkerPool(spec, count=1)
    killed = _dying_worker(pool, tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    failed = _dying_worker(pool, tmp_path, "raise RuntimeError('boom')")
    with pytest.raises(WorkerLost) as e:
        pool._accept(killed, time.monotonic() + 5)
    assert str(e.value) == "was killed by SIGKILL before connecting"  # before: "exited with code -9 ...: Loading..."
    with pytest.raises(WorkerLost) as e:
        pool._accept(failed, time.monotonic() + 5)
    assert str(e.value) == f"exited with code 1 before connecting: RuntimeError: boom (log: {failed.log_path})"
    pool.stop()
    assert not Path(killed.log_path).exists()  # named nowhere: removed with the pool
    assert "RuntimeError: boom" in Path(failed.log_path).read_text()  # before: stop() removed the log the error named


@pytest.mark.parametrize("restarts", [0, 2])
def test_a_worker_lost_more_often_than_allowed_is_a_worker_error_that_says_what_was_tried(tmp_path, restarts):
    spec = WorkerSpec(config={}, path="", limit=1, run_dir=str(tmp_path))
    pool = WorkerPool(spec, count=1, restarts=restarts)
    pool.workers = [Worker(0, None, str(tmp_path / "none.log"))]
    replaced = []
    pool.replace = lambda w, why: replaced.append(why) or w

    def lost(w, fresh):
        raise WorkerLost("was killed by SIGKILL during make")

    with pytest.raises(WorkerError) as e:  # before: a RuntimeError (a traceback at the entry point)
        pool.retrying(0, lost, lambda w: None)
    assert len(replaced) == restarts
    if restarts == 0:  # before: "failed 1 times in a row ...; its replacements failed too"
        assert str(e.value) == (
            "rollout worker 0 was killed by SIGKILL during make, and placement.worker_restarts=0 allows no replacement"
        )
    else:
        assert str(e.value) == (
            "rollout worker 0 failed 3 times in a row, the worker and its 2 replacements "
            "(placement.worker_restarts=2); the last time it was killed by SIGKILL during make"
        )
    pool.workers = []
    pool.stop()


def test_a_worker_error_on_the_producer_thread_reaches_the_learner_as_itself():
    # train.async_rollout=true makes batches on the producer's thread; the entry point reports a WorkerError in one
    # line (exit 1), which it cannot when the error arrives wrapped in the producer's RuntimeError (before).
    from bapo.rollout.producer import Producer
    from tests.helpers.fakes import CursorMaker

    class Lost(CursorMaker):
        def make(self, t, version, weights):
            raise WorkerError("rollout worker 0 was killed by SIGKILL during make, and ...")

    producer = Producer(Lost(), mode="admission", updates_per_batch=1, max_staleness=0, sync_every=1)
    producer.publish(0, {})
    producer.start()
    with pytest.raises(WorkerError, match="^rollout worker 0 was killed by SIGKILL"):
        producer.take()
    producer.stop()


def test_the_weight_check_names_the_first_difference():
    expected = {"a.weight": (2, 3), "b.weight": (4,)}
    check_weights([("a.weight", (2, 3), "float32"), ("b.weight", (4,), "float32")], expected)
    with pytest.raises(ValueError, match=r"1 missing \(e.g. \['b.weight'\]\), 1 unexpected \(e.g. \['c'\]\)"):
        check_weights([("a.weight", (2, 3), "float32"), ("c", (4,), "float32")], expected)
    with pytest.raises(ValueError, match=r"a.weight has shape \[3, 2\], this worker's model \[2, 3\]"):
        check_weights([("a.weight", (3, 2), "float32"), ("b.weight", (4,), "float32")], expected)


def test_merge_shares_joins_in_share_order_and_recounts_accuracy():
    from bapo.samples import RolloutBatch

    def share(correct, stats):
        return RolloutBatch(
            3, 2, tuple(correct), tuple(float(c) for c in correct), tuple(correct), ("1",) * len(correct), stats, ()
        )

    a = share(
        [True, False, False, False], {"reward/accuracy": 0.25, "time/rollout_s": 1.0, "rollout/tokens_per_s": 10.0}
    )
    b = share([True, True], {"reward/accuracy": 1.0, "time/rollout_s": 3.0, "rollout/tokens_per_s": 5.0})
    m = merge_shares([a, b])
    assert m.correct == (True, False, False, False, True, True)
    assert m.stats["reward/accuracy"] == pytest.approx(3 / 6)  # over samples, not the mean of the shares' 0.625
    assert m.stats["time/rollout_s"] == 3.0 and m.stats["rollout/tokens_per_s"] == 15.0  # slowest; summed
    with pytest.raises(RuntimeError, match="different batches"):
        merge_shares([a, RolloutBatch(4, 2, (), (), (), (), {}, ())])


HELLO = """
import os, pickle, sys
from multiprocessing.connection import Client
conn = Client((sys.argv[1], int(sys.argv[2])), authkey=bytes.fromhex(os.environ["KEY"]))
conn.send_bytes(pickle.dumps(("hello", 0, os.getpid())))
conn.recv_bytes()  # until the learner lets go
"""


def test_a_silent_or_garbling_local_client_does_not_keep_the_worker_out(tmp_path):
    """Before: the listener ran the authkey challenge inside accept(), with no timeout: a client that connected and
    said nothing blocked it, the real worker never got in, and the run failed after worker_start_timeout_s."""
    import threading

    spec = WorkerSpec(config={}, path="", limit=1, run_dir=str(tmp_path))
    pool = WorkerPool(spec, count=1)
    host, port = pool.listener.address
    silent, garbling = socket.create_connection((host, port)), socket.create_connection((host, port))
    garbling.sendall(b"\xff" * 64)
    time.sleep(0.5)  # both are in (before: the first in accept's challenge) when the worker comes
    env = dict(os.environ, KEY=pool.authkey.hex())
    proc = subprocess.Popen([sys.executable, "-c", HELLO, host, str(port)], env=env)
    w = Worker(0, proc, str(tmp_path / "worker0.log"))
    pool.workers.append(w)
    got, t0 = [], time.monotonic()
    waiter = threading.Thread(target=lambda: got.append(pool._accept(w, time.monotonic() + 60)), daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    try:
        assert got, "the real worker did not get in within 30 s beside a silent client"
        assert time.monotonic() - t0 < 20  # in a second or two: its own start, not the silent client's timeout
        silent.settimeout(30)
        assert silent.recv(1024)  # the silent one only ever gets the challenge, then is cut off
        send(got[0], ("stop",))
    finally:
        silent.close(), garbling.close()
        proc.kill()
        proc.wait()
        pool.stop()


def test_a_client_without_the_key_is_cut_off_after_the_handshake_time():
    from multiprocessing.connection import Client

    from bapo.infra.listener import AuthListener

    door = AuthListener(("127.0.0.1", 0), b"k" * 32, handshake_s=0.5)
    try:
        silent = socket.create_connection(door.address)
        silent.settimeout(10)
        assert silent.recv(1024)  # the challenge
        t0 = time.monotonic()
        assert silent.recv(1024) == b""  # then nothing more: cut off
        assert time.monotonic() - t0 < 5
        with pytest.raises(Exception, match="digest|authentication"):
            Client(door.address, authkey=b"x" * 32)  # a wrong key never gets a connection
        client = Client(door.address, authkey=b"k" * 32)
        server = door.accept(timeout=5)
        client.send_bytes(b"hi")
        assert server.recv_bytes() == b"hi"
        client.close(), server.close(), silent.close()
    finally:
        door.close()


# ----------------------------------------------------------------------------- real workers


def test_a_worker_that_cannot_start_is_one_error_naming_why(tmp_path):
    cfg = smoke_cfg(DIS)
    from omegaconf import OmegaConf

    spec = WorkerSpec(
        config=OmegaConf.to_container(cfg, resolve=True),
        path=str(tmp_path / "no-model"),
        limit=64,
        run_dir=str(tmp_path),
    )
    pool = WorkerPool(spec, count=1, start_timeout_s=120)
    pool.spawn()
    pids = pool.pids()
    with pytest.raises(WorkerError, match=r"^rollout worker 0 could not start: .*no-model.* \(log: (.*)\)$") as e:
        pool.wait()
    assert "\n" not in str(e.value)
    log = Path(str(e.value).rsplit("(log: ", 1)[1].removesuffix(")"))
    assert "Traceback" in log.read_text()  # before: the error named the log that stop() had just removed
    log.unlink()
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the worker outlived its failed start")


@pytest.mark.slow
def test_train_py_with_a_worker_that_cannot_start_leaves_no_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", "debug=smoke", *DIS, "placement.worker_start_timeout_s=0.001"]
    p = subprocess.run([*cmd, f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    err = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode == 1, p.stderr
    assert err == [err[0]] and "rollout worker 0 could not start" in err[0] and "worker_start_timeout" not in err[0]
    assert not run_dir.exists()


@pytest.fixture
def threads():
    """placement.learner_threads sets this process's torch threads: give the other tests theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [[], ["train.async_rollout=true", "buffer.max_staleness=3", "learner.mini_batches_per_rollout=1"]],
    ids=["sync", "async-admission-k3"],
)
def test_one_worker_makes_the_colocated_runs_batches(tmp_path, mode, threads):
    common = ["train.steps=4", "checkpoint.every=0", "placement.learner_threads=1", *mode]
    run(smoke_cfg(common), tmp_path / "colocated")
    run(smoke_cfg([*common, *DIS]), tmp_path / "disaggregated")
    a, b = rows(tmp_path / "colocated"), rows(tmp_path / "disaggregated")
    assert len(a) == 5 and untimed(a) == untimed(b)
    assert {r["rollout/worker_restarts"] for r in b[1:]} == {0.0}
    if not mode:  # (admission at k = 3 makes batches 1-4 with version 0)
        assert b[2]["time/sync_s"] > 0  # version 2's weights went over gloo for batch 2 (evaluations loaded 0 and 4)


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_partial_rollouts_take_new_weights_between_segments_in_the_worker(tmp_path, asynchronous, threads):
    # In-flight weight updates: a worker continues its unfinished responses with each step's weights, every
    # token tagged with the version that sampled it, and the run is the colocated partial run, metric for metric.
    common = ["train.steps=4", "checkpoint.every=0", "placement.learner_threads=1"]
    common += ["rollout.partial_budget=12", "buffer.max_staleness=7"]
    if asynchronous:
        common += ["train.async_rollout=true"]
    run(smoke_cfg(common), tmp_path / "colocated")
    run(smoke_cfg([*common, *DIS]), tmp_path / "disaggregated")
    a, b = rows(tmp_path / "colocated"), rows(tmp_path / "disaggregated")
    assert untimed(a) == untimed(b)
    assert max(r["rollout/resumed_frac"] for r in b[1:]) > 0  # responses spanned segments
    assert max(r["buffer/token_staleness_max"] for r in b[1:]) > 0  # ... and versions


@pytest.mark.slow
def test_two_workers_each_make_a_share_and_the_run_is_reproducible(tmp_path):
    common = ["train.steps=3", "checkpoint.every=0", *DIS, "placement.workers=2"]
    run(smoke_cfg(common), tmp_path / "a")
    run(smoke_cfg(common), tmp_path / "b")
    run(smoke_cfg(["train.steps=3", "checkpoint.every=0", *DIS]), tmp_path / "one")
    a, b, one = rows(tmp_path / "a"), rows(tmp_path / "b"), rows(tmp_path / "one")
    assert untimed(a) == untimed(b)
    # share 1 samples with its own seed (as torchrun's rank 1 does): the batches differ from one worker's
    assert [r["reward/accuracy"] for r in a[1:]] != [r["reward/accuracy"] for r in one[1:]]


def _kill_worker_before(batch: int, monkeypatch, how=signal.SIGKILL, resume_after: float | None = None):
    """Make the worker of batch ``batch`` die (or hang: SIGSTOP) right after it was asked for it."""
    real = WorkerPool._send
    seen = {"killed": []}

    def send(self, w, msg):
        real(self, w, msg)
        if msg[0] == "make" and msg[1] == batch and not seen["killed"]:
            seen["killed"].append(w.proc.pid)
            os.kill(w.proc.pid, how)

    monkeypatch.setattr(WorkerPool, "_send", send)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "hang"])
def test_a_worker_lost_mid_run_is_replaced_and_no_metric_changes(tmp_path, monkeypatch, how):
    common = ["train.steps=4", "checkpoint.every=0", *DIS, "train.async_rollout=true", "buffer.max_staleness=2"]
    run(smoke_cfg(common), tmp_path / "clean")
    sig = signal.SIGKILL if how == "sigkill" else signal.SIGSTOP
    seen = _kill_worker_before(2, monkeypatch, sig)
    t0 = time.monotonic()
    run(smoke_cfg([*common, "placement.worker_timeout_s=3"]), tmp_path / "lost")
    assert time.monotonic() - t0 < 120
    assert seen["killed"] and not alive(seen["killed"][0])
    a, b = rows(tmp_path / "clean"), rows(tmp_path / "lost")
    assert untimed(a) == untimed(b)  # the replacement made batch 2 from the state after batch 1, with its weights
    assert [r["rollout/worker_restarts"] for r in b[1:]] == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.slow
def test_a_slow_worker_beats_and_is_not_replaced(tmp_path):
    # Silence is a lost worker, slowness is not: each batch takes longer than the timeout, and the worker's
    # heartbeats keep it (without them every batch would time out and the run would stop after 3 restarts). 2 s
    # (a beat every 0.4 s), not less: at 0.5 s a worker starved on 2 busy cores (CI, two test workers beside it)
    # went 0.5 s without a beat and was restarted twice. 256 x 8 samples a batch: 5-6 s on 2 shared cores.
    timeout = 2.0
    big = ["train.prompts_per_step=256", "rollout.n=8", "eval.every=0"]
    run(
        smoke_cfg(["train.steps=2", "checkpoint.every=0", *big, *DIS, f"placement.worker_timeout_s={timeout}"]),
        tmp_path,
    )
    rs = rows(tmp_path)[1:]
    assert min(r["time/worker_batch_s"] for r in rs) > timeout  # the test means something on this machine
    assert [r["rollout/worker_restarts"] for r in rs] == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "over, message",
    [
        (
            ["placement.worker_restarts=1"],
            "rollout worker 0 failed 2 times in a row, the worker and its 1 replacement (placement.worker_restarts=1); "
            "the last time it was killed by SIGKILL during make",
        ),
        (  # on the producer's thread, where it was a RuntimeError wrapping it (a traceback at the entry point)
            ["placement.worker_restarts=0", "train.async_rollout=true", "buffer.max_staleness=2"],
            "rollout worker 0 was killed by SIGKILL during make, and placement.worker_restarts=0 allows no replacement",
        ),
    ],
)
def test_a_worker_that_keeps_failing_stops_the_run_with_the_reason(tmp_path, monkeypatch, over, message):
    real = WorkerPool._send

    def send(self, w, msg):
        real(self, w, msg)
        if msg[0] == "make" and msg[1] >= 2:
            os.kill(w.proc.pid, signal.SIGKILL)

    monkeypatch.setattr(WorkerPool, "_send", send)
    with pytest.raises(WorkerError) as e:
        run(smoke_cfg(["train.steps=4", *DIS, *over]), tmp_path)
    assert str(e.value) == message


# ----------------------------------------------------------------------------- train.py: kills and Ctrl-C


TRAIN = ["debug=smoke", *DIS, "train.steps=6", "eval.every=3", "checkpoint.every=1", "checkpoint.keep=2"]


def launch(run_dir: Path, *extra: str, session: bool = False) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "train.py", *TRAIN, *extra, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=session
    )


def wait_for_step(p: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    def reached() -> bool:
        f = run_dir / "metrics.jsonl"
        assert p.poll() is None, p.communicate()[0]
        lines = f.read_text().splitlines() if f.exists() else []
        return any(json.loads(x)["step"] >= step for x in lines if x.endswith("}"))

    wait_until(reached, timeout, f"step {step} not reached")


@pytest.mark.slow
def test_sigkill_of_the_learner_leaves_no_worker_and_resume_gives_the_same_metrics(tmp_path):
    async_k3 = ["train.async_rollout=true", "buffer.max_staleness=3"]
    full = launch(tmp_path / "full", *async_k3)
    out = full.communicate(timeout=300)[0]
    assert full.returncode == 0, out
    p = launch(tmp_path / "killed", *async_k3)
    wait_for_step(p, tmp_path / "killed", 3)
    pids = worker_pids(p.pid)
    assert len(pids) == 1
    logs = [worker_log(x) for x in pids]
    assert all(Path(x).is_file() for x in logs), logs
    p.send_signal(signal.SIGKILL)
    p.wait()
    wait_until(lambda: not any(alive(x) for x in pids), 10, "a worker outlived its learner")
    assert not [x for x in logs if Path(x).exists()]  # before: one file per worker left in /tmp by every kill
    resumed = launch(tmp_path / "killed", *async_k3, "resume=auto")
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, out
    assert "resumed from" in out
    a, b = rows(tmp_path / "full"), rows(tmp_path / "killed")
    assert [r["step"] for r in b] == list(range(7))
    assert untimed(a) == untimed(b)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_and_sigterm_save_a_checkpoint_and_stop_every_process(tmp_path, sig):
    p = launch(tmp_path, "train.steps=50", "checkpoint.every=0", session=True)
    wait_for_step(p, tmp_path, 1)
    pids = worker_pids(p.pid)
    assert len(pids) == 1
    os.killpg(p.pid, sig)  # a terminal's Ctrl-C reaches the whole process group; SIGTERM, a scheduler's kill
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 128 + sig, out
    assert "resume=auto" in out
    wait_until(lambda: not any(alive(x) for x in pids), 10, "a worker outlived its learner")
    saved = checkpoint.step_dirs(tmp_path / "checkpoints")
    assert [s for s, _ in saved] == [rows(tmp_path)[-1]["step"]]


def test_weights_cross_the_gloo_group_bit_for_bit(tmp_path):
    # random weights pushed at version 7: the worker's engine holds exactly them (sums compared exactly)
    from omegaconf import OmegaConf

    cfg = smoke_cfg(DIS)
    from bapo.build import model_files

    rc = build(cfg, tmp_path)
    path, tok, load = model_files(rc)
    spec = WorkerSpec(config=OmegaConf.to_container(cfg, resolve=True), path=path, limit=64, run_dir=str(tmp_path))
    pool = WorkerPool(spec, count=1)
    try:
        pool.spawn()
        pool.wait()
        from bapo.modeling import load_model

        model = load_model(path, dtype="float32", **load)
        weights = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        pool.push_weights(pool.workers[0], weights, 7)
        got = pool.call(pool.workers[0], ("checksum",))
        assert got == pytest.approx({k: float(v.double().sum()) for k, v in weights.items()}, rel=0, abs=0)
        assert pool.workers[0].version == 7
    finally:
        pool.stop()


def test_a_busy_worker_exits_by_itself_once_its_learner_is_gone(tmp_path):
    # A worker mid-batch does not read its connection, so it cannot see the learner's end close: the parent
    # watch (bapo.rollout.disaggregated.worker.watch_parent) is what ends it. Here a "learner" starts a "worker"
    # that only watches and sleeps, and is then killed with SIGKILL.
    flag = tmp_path / "watching"
    child = (
        "from bapo.rollout.disaggregated.worker import watch_parent; import os, pathlib, time; "
        "watch_parent(os.getppid()); "
        f"pathlib.Path({str(flag)!r}).touch(); time.sleep(600)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); print(p.pid, flush=True); time.sleep(600)"
    )
    p = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid = int(p.stdout.readline())
    wait_until(flag.exists, 60, "the worker did not start watching")
    assert alive(pid)
    p.kill()
    p.wait()
    wait_until(lambda: not alive(pid), 5, "the worker outlived its learner")


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["train.async_rollout=true", "buffer.max_staleness=3"]], ids=["sync", "async"])
def test_torchrun_learner_ranks_with_workers_train_as_the_colocated_ranks_and_resume_exactly(
    tmp_path, tmp_path_factory, mode
):
    # `torchrun --nproc_per_node=2 train.py learner=fsdp placement=disaggregated placement.workers=2`: rank 0 holds
    # the workers, every rank reads the FSDP weights together, and each worker makes the share its rank would
    # have. Training metrics equal the colocated 2-rank run's; evaluation is one generator (worker 0) here
    # where the colocated ranks are two, so its metrics are not compared.

    from tests.helpers.processes import shared_torchrun, torchrun

    dis = [*DIS, "placement.workers=2", *mode]
    colocated, _ = shared_torchrun(tmp_path_factory, *mode)  # test_loop_fsdp's run of the mode
    out = torchrun(tmp_path / "full", *dis)
    assert "2 rollout worker(s) ready" in out and out.count("2 rollout worker(s) ready") == 1  # rank 0's only

    def training(rs):
        return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in untimed(rs)]

    full = rows(tmp_path / "full")
    assert [r["step"] for r in full] == [0, 1, 2, 3, 4]
    assert training(rows(colocated)) == training(full)
    killed_after_step_3(tmp_path / "full", tmp_path / "resumed")
    out = torchrun(tmp_path / "resumed", *dis, "resume=auto")
    assert "resumed from" in out and "step_000002" in out
    assert untimed(rows(tmp_path / "resumed")) == untimed(full)
