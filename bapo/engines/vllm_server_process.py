"""The process of a server that ``rollout=vllm_server`` starts, on both sides.

In the server: the wrapper ``python -m bapo.engines.vllm_server_process --parent PID [--staging DIR ...] -- <vllm
serve flags>`` (:func:`main`) runs vLLM's ``vllm.entrypoints.openai.api_server`` under a watch of its parent: once
the learner is gone, even by SIGKILL, the watch removes the learner's staged weights and stops the server, then its
whole process group.

In the learner: where a server may listen (a free port, or why ``rollout.host:rollout.port`` cannot be bound), its
devices (its local rank's share of ``rollout.gpus``), the error line of its log, and its stop. A launched server
runs in a session of its own (a Ctrl-C at the terminal reaches the learner only, which stops, saves and then stops
the server); :func:`_stop_group` (the engine's ``close``, run at the loop's teardown and at exit) sends SIGTERM to
the server's whole process group, SIGKILL after a grace period, and returns once none of the group is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bapo.infra.checks import require


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bind_error(host: str, port: int) -> str | None:
    """Why a server cannot listen on ``host:port`` (None: it can)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"rollout.host: {host!r} is not an address of this machine ({e.strerror})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == 98:  # EADDRINUSE
                return f"rollout.port: {host}:{port} is in use; choose another port, or 0 for any free one"
            return f"rollout.host: cannot listen on {host}:{port} ({e.strerror or e})"
    return None


def _last_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["(empty log)"])[-1][:400]


def _group_alive(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that have not exited (a zombie has: only its parent's wait is left).
    Read from /proc; where there is none, whether a signal still reaches the group."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    alive = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(int(d.name))
    return alive


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0, kill_wait_s: float = 30.0) -> None:
    """Stop the server's whole process group and return once none of it is left: SIGTERM (vLLM shuts its engine
    down), SIGKILL to whatever is left after ``grace_s``, then wait (up to ``kill_wait_s``) until every process
    of the group has exited: the engine core and the workers are the wrapper's children, not ours, so waiting
    for the wrapper alone would return while they still hold the GPU."""
    pgid = proc.pid  # the wrapper leads a session and process group of its own
    deadline = time.monotonic() + grace_s
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    while _group_alive(pgid) and time.monotonic() < deadline:  # the rest of the group, on its own SIGTERM
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5.0)
    deadline = time.monotonic() + kill_wait_s
    while (left := _group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        logging.getLogger(__name__).warning(
            "rollout=vllm_server: processes %s of the server's group outlived SIGKILL by %.0f s", left, kill_wait_s
        )


def server_devices(gpus: str, visible: str | None, ranks: int, local: int, tp: int) -> str:
    """This local rank's server devices: its share of ``gpus`` (indices into the parent's ``visible``
    ``CUDA_VISIBLE_DEVICES``, or device ids when it is unset), mapped through ``visible``."""
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    per = len(ids) // ranks if ranks else 0
    require(
        per >= tp and len(ids) % ranks == 0,
        "rollout.gpus",
        f"{gpus!r} has {len(ids)} devices for {ranks} local ranks' servers: give a multiple of {ranks}, "
        f"at least rollout.tensor_parallel_size={tp} each",
    )
    mine = ids[per * local : per * (local + 1)]
    if not visible:
        return ",".join(mine)
    parent = [v.strip() for v in visible.split(",") if v.strip()]
    bad = [g for g in mine if not g.isdigit() or int(g) >= len(parent)]
    require(
        not bad,
        "rollout.gpus",
        f"{bad} are not indices into this process's CUDA_VISIBLE_DEVICES={visible!r} (devices 0-{len(parent) - 1})",
    )
    return ",".join(parent[int(g)] for g in mine)


# ---------------------------------------------------------------------- the server's wrapper


def _watch_parent(parent: int, staging: list[str]) -> None:
    """In the server: once the learner is gone (even by SIGKILL), remove its staged weights, stop as SIGTERM
    would, then the whole group."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        for d in staging:
            shutil.rmtree(d, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=loop, name="bapo-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """``python -m bapo.engines.vllm_server_process --parent PID [--staging DIR ...] -- <vllm serve flags>``: vLLM's
    OpenAI server, stopped (and DIR removed) when process PID (the learner) is gone."""
    import runpy

    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m bapo.engines.vllm_server_process --parent PID [--staging DIR ...] -- <vllm serve flags>"
    if "--" not in argv or len(argv) < 3 or argv[0] != "--parent":
        raise SystemExit(usage)
    ours, theirs = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    staging = [ours[i + 1] for i, a in enumerate(ours) if a == "--staging" and i + 1 < len(ours)]
    _watch_parent(int(ours[1]), staging)
    sys.argv = ["vllm.entrypoints.openai.api_server", *theirs]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
