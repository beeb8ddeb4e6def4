"""Stopping a launched server (bapo/engines/vllm_server.py ``_stop_group``): it returns once the server's whole process
group is gone, whatever its wrapper did first. No vLLM needed: small stand-in process groups."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bapo.engines.vllm_server import _group_alive, _stop_group


def _ps_group(pgid: int) -> list[str]:
    """The live processes of a group as ``ps`` sees them (zombies have exited: only their parent's wait is left)."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,pid="], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if line.split()[0] == str(pgid) and not line.split()[1].startswith("Z")]


def _group(script: str, ready) -> subprocess.Popen:
    """``script`` as a session of its own; returns once its child has written ``ready`` (its signals are set)."""
    env = dict(os.environ, READY=str(ready))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], start_new_session=True, env=env)
    for _ in range(600):
        if ready.exists():
            return proc
        time.sleep(0.05)
    raise AssertionError("the stand-in never started its child")


@pytest.fixture()
def groups():
    made = []
    yield made
    for proc in made:  # whatever a failed test left
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


CHILD_IGNORES_TERM = """
    import signal, subprocess, sys, time
    child = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "open(os.environ['READY'], 'w').close(); time.sleep(300)")
    subprocess.Popen([sys.executable, "-c", child])  # the engine core: in the wrapper's group, not its caller's child
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # the wrapper leaves at once on SIGTERM
    time.sleep(300)
"""


def test_a_wrapper_that_already_exited_leaves_no_process_of_its_group(groups, tmp_path):
    """The API process died (or exited) and its engine core lives on: stopping the server stops the rest of the
    group too (it returned at once when the wrapper was gone, leaving the engine core on the GPU)."""
    proc = _group(
        """
        import subprocess, sys
        child = "import os, time; open(os.environ['READY'], 'w').close(); time.sleep(300)"
        subprocess.Popen([sys.executable, "-c", child])
        """,
        tmp_path / "ready",
    )
    groups.append(proc)
    proc.wait(30)
    assert _ps_group(proc.pid), "the child should outlive its wrapper"
    _stop_group(proc, grace_s=1.0)
    assert _ps_group(proc.pid) == [] and _group_alive(proc.pid) == []


def test_stopping_returns_once_the_engine_core_has_exited_too(groups, tmp_path):
    """The wrapper exits on SIGTERM at once, its child ignores SIGTERM: SIGKILL after the grace, and the stop returns
    only once the child has exited."""
    proc = _group(CHILD_IGNORES_TERM, tmp_path / "ready")
    groups.append(proc)
    t0 = time.monotonic()
    _stop_group(proc, grace_s=1.0)
    assert _ps_group(proc.pid) == [] and proc.returncode == 0
    assert 1.0 <= time.monotonic() - t0 < 20  # the grace was given to the child, then SIGKILL


def test_group_alive_names_live_processes_and_not_zombies(groups, tmp_path):
    proc = _group(CHILD_IGNORES_TERM, tmp_path / "ready")
    groups.append(proc)
    alive = _group_alive(proc.pid)
    assert proc.pid in alive and len(alive) == 2
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()  # the wrapper reaped; its child (SIGKILLed, unreaped or reaped by init) is not alive either
    for _ in range(100):
        if not _group_alive(proc.pid):
            break
        time.sleep(0.05)
    assert _group_alive(proc.pid) == []


# ----------------------------------------------------------------------------- admission


def test_a_child_is_expected_to_hold_the_time_weighted_half_of_a_response():
    """Before 32 whole responses have finished a child is expected to run to max_tokens; then to hold, on average
    over its run, E[L^2] / (2 E[L]) tokens: lengths 100 and 300 (half each) give (100^2 + 300^2) / 2 / (2 x 200)
    = 125 (a long response runs longer, so it is met more often than a short one)."""
    from bapo.engines.admission import Admission

    a = Admission(tokens=10_000, seqs=64)
    assert a.held(1000) == 1000.0
    with a.request(10, 32, 1000, learn=True) as ticket:
        for i in range(32):
            ticket.finish(i, 100 if i % 2 else 300)
    assert a.held(1000) == 125.0 and a.held(120) == 120.0  # never more than the request's cap
    with a.request(10, 8, 50, learn=False) as ticket:  # segments under a smaller cap teach nothing
        for i in range(8):
            ticket.finish(i, 50)
    assert a.held(1000) == 125.0 and len(a.lengths) == 32


def test_a_request_waits_for_room_and_each_finished_child_makes_some():
    import threading

    from bapo.engines.admission import Admission

    a = Admission(tokens=100, seqs=64)  # children of prompt 10 + max_tokens 40: 50 tokens each, 2 fit
    first = a.request(10, 2, 40, learn=True).__enter__()
    assert a.used_tokens == 100 and a.used_seqs == 2
    admitted = threading.Event()

    def second():
        with a.request(10, 1, 40, learn=True):
            admitted.set()

    t = threading.Thread(target=second)
    t.start()
    assert not admitted.wait(0.3)  # no room
    first.finish(0, 7)  # one child's 50 tokens are free: the waiting request fits
    assert admitted.wait(10)
    t.join()
    first.finish(0, 7)  # a second finish of the same child releases nothing
    assert a.used_tokens == 50 and a.used_seqs == 1
    first.__exit__(None, None, None)  # the request ended: its unfinished child is released too
    assert a.used_tokens == 0 and a.used_seqs == 0


def test_an_aborted_admission_refuses_the_requests_waiting_for_it():
    import threading

    from bapo.engines.admission import Admission, Stopped

    a = Admission(tokens=100, seqs=64, overcommit=0.5)  # 50 tokens of room: one child of 50 at a time
    held = a.request(10, 1, 40, learn=True).__enter__()
    errors = []

    def waiter():
        try:
            with a.request(10, 1, 40, learn=True):
                pass
        except Stopped as e:
            errors.append(str(e))

    t = threading.Thread(target=waiter)
    t.start()
    a.abort()
    t.join(10)
    assert errors and "stopped before this request was sent" in errors[0]
    a.reopen()
    held.__exit__(None, None, None)
    with a.request(10, 1, 40, learn=True):
        assert a.used_seqs == 1
