"""Stopping a launched server (bapo/engines/vllm_server_process.py ``_stop_group``): it returns once the server's
whole process group is gone, whatever its wrapper did first. No vLLM needed: small stand-in process groups."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bapo.engines.vllm_server_process import _group_alive, _stop_group


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
