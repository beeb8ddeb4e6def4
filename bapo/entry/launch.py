"""The launch as part of the run: ``python train.py ...`` and ``python eval.py ...`` start the node's ranks themselves.

An entry point started outside any launcher (no ``$LOCAL_RANK``, ``$TORCHELASTIC_RUN_ID`` or ``$WORLD_SIZE``, and
not one task per rank of a SLURM step: ``bapo.infra.dist.from_slurm`` maps those) decides, in its Hydra job and before
anything loads, how many ranks to start (:func:`decide`), from the ``launcher`` group (conf/launcher/node.yaml) and
the GPUs it may use (:func:`usable_devices`):

* ``launcher.nproc_per_node=auto`` (the default): one rank per usable GPU (less the GPUs that launched vLLM servers
  take, ``placement=gpu_node_split``), and one process on a machine without a GPU. For training with
  ``learner=fsdp`` the memory plan (bapo/plan/) then picks what fits those GPUs: every rank as configured
  (colocated), else the learner's state on the host (``learner.cpu_offload=true``), else a refusal naming the
  smallest change that fits. ``learner=single`` trains in one process. An explicit ``placement=``, ``learner`` key
  or ``launcher`` key on the command line is never changed; the plan's verdict is then only reported.
* ``launcher.nproc_per_node=N``: N ranks, as asked (on a CPU too: gloo).

More than one rank, or node: the job starts this node's ranks through torch.distributed's elastic launcher
(:func:`start`: ``elastic_launch``, what torchrun runs: a c10d rendezvous, torchrun's environment in every rank, a
failed rank stops the others, SIGINT / SIGTERM / SIGHUP passed on to every rank; the ranks write to this process's
streams, and the agent keeps no log folder of its own) with the same overrides, its run folder pinned
(``hydra.run.dir``) and its choice passed on, and waits. It holds no lock (rank 0 holds the folder, as
under torchrun). One rank: the run goes on in this process. Either way what was chosen and why is one log line and
``launcher.chosen`` in the run's config.yaml (null where nothing was chosen: under a launcher, or on a machine
without a GPU with ``nproc_per_node=auto``).

Several nodes: ``launcher.nnodes`` and ``launcher.rdzv_endpoint`` (``host:port`` of the first node) on every node,
or under SLURM with one task per node (``srun --ntasks-per-node=1``, ``hydra/launcher=slurm``) both come from SLURM's
variables (the step's node count, its first node, port 29400). Every node gives the same ``hydra.run.dir`` (a folder
they all see): a run folder named by the time each node started (Hydra's default) is refused before any rank starts.

A rank this launch started dies with the launching process (:func:`watch_launcher`, from ``$BAPO_LAUNCHER_PID``): a
launcher or sweep killed by SIGKILL leaves no rank behind holding the run folder, finishing the run on its own or
waiting in a collective, so that ``resume=auto`` and a relaunched sweep find the folder free.

Test hook: ``$BAPO_FAKE_DEVICES`` (``N`` or ``NxGiB``; 80 GiB by default) makes :func:`usable_devices` report N GPUs
on a machine without them, and the ranks then run on the CPU with gloo; in-process tests monkeypatch
:func:`usable_devices` instead. Never set it for a real run: the plan would be of GPUs that are not there.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import re
import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo.engines.registry import engine_traits
from bapo.infra.checks import ConfigError, require
from bapo.infra.ckpt_folder import written_since
from bapo.infra.dist import LauncherConfig

log = logging.getLogger(__name__)

FAKE_DEVICES = "BAPO_FAKE_DEVICES"  # test hook (module docstring)
LAUNCHER_ENV = "BAPO_LAUNCHER_PID"  # in the ranks a launch starts: the launching process's pid (watch_launcher)
RDZV_PORT = 29400  # the first node's rendezvous port under SLURM (torchrun's default)
LAYOUT_GROUPS = ("placement", "learner", "launcher")  # on the command line, the plan changes none of them
# What the elastic agent passes on to the ranks: the stop signals (bapo.infra.stop.STOP_SIGNALS) and SIGQUIT.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT)
KILLED_AFTER_GRACE = "forcefully exiting"  # what torch's agent logs when a rank outlived the grace (then SIGKILL)
SIGNAL_PASSED_ON = "closing signal"  # what torch's agent logs as it passes a signal on to a rank


# ----------------------------------------------------------------------------- what this machine has


def usable_devices() -> list[float]:
    """The memory (GiB) of each GPU this process may use (``CUDA_VISIBLE_DEVICES`` applies); [] without one.
    ``$BAPO_FAKE_DEVICES`` (test hook): ``N`` or ``NxGiB`` GPUs reported instead."""
    fake = os.environ.get(FAKE_DEVICES)
    if fake:
        count, _, gib = fake.lower().partition("x")
        if not count.isdigit() or (gib and not gib.replace(".", "", 1).isdigit()):
            raise ConfigError(f"${FAKE_DEVICES}: N or NxGiB (a test hook), got {fake!r}")
        return [float(gib or 80)] * int(count)
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(torch.cuda.device_count())]


def under_launcher() -> str | None:
    """The launcher that started this process (torchrun, SLURM one task per rank, or anything that sets
    ``$WORLD_SIZE``); None for a plain ``python``."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env:
        return "torchrun"
    return "a launcher ($WORLD_SIZE)" if "WORLD_SIZE" in env else None


# ----------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class Launch:
    """What :func:`decide` chose: this node's ranks, the nodes, and what the plan changed."""

    nproc: int
    nnodes: int = 1
    rdzv_endpoint: str | None = None  # None: this host, a free port (torchrun --standalone)
    run_id: str | None = None  # the rendezvous' id (None: a fresh one)
    chosen: str | None = None
    reason: str | None = None
    changes: tuple[tuple[str, Any], ...] = ()  # keys the plan set: (("learner.cpu_offload", True),)

    @property
    def spawns(self) -> bool:
        return self.nproc > 1 or self.nnodes > 1

    def overrides(self) -> list[str]:
        """The choice as Hydra overrides, for the ranks this launch starts."""
        out = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.changes]
        if self.chosen is not None:
            out.append(f"launcher.chosen={quoted(self.record)}")  # commas, colons, parentheses
        return out

    @property
    def record(self) -> str | None:
        """``launcher.chosen`` in the run's config: what, and why."""
        return None if self.chosen is None else f"{self.chosen} ({self.reason})"

    def apply(self, cfg) -> None:
        """Write the choice into the composed config (the run in this process)."""
        from omegaconf import OmegaConf

        for key, value in self.changes:
            OmegaConf.update(cfg, key, value, merge=False)
        if self.chosen is not None:
            cfg.launcher.chosen = self.record


def announce(cfg) -> None:
    """The launch's one log line, from the run's config (rank 0, once the run folder is held)."""
    chosen = (cfg.get("launcher") or {}).get("chosen")
    if chosen and os.environ.get("RANK", "0") == "0":
        log.info("launch: %s", chosen)


def decide(
    cfg, overrides: Sequence[str], entry: str = "train", run_dir: str | Path = "launch", *, stamped: str | None = None
) -> Launch:
    """How this job starts (module docstring). ``overrides``: the command line's (Hydra's task overrides); ``entry``:
    train or eval; ``stamped``: the run folder's pattern where the time this process started names it
    (:func:`stamped_folder`), which several nodes cannot share. Raises ConfigError (one line, before any rank
    starts) for a config that cannot start, and for a run the memory plan finds no way to fit."""
    if under_launcher() is not None:
        return Launch(nproc=1)  # torchrun or SLURM started this rank: nothing changes
    from bapo.infra.checks import typed

    node = cfg.get("launcher")
    lc = typed("launcher", dict(node) if node is not None else {}, LauncherConfig)
    nnodes, endpoint, run_id = _nodes(lc)
    require(nnodes == 1 or stamped is None, "hydra.run.dir",
            f"{nnodes} nodes (launcher.nnodes) write one run folder, but {stamped!r} is named by the time each node "
            "started, so each would make its own: give every node the same hydra.run.dir=<a folder every node "
            "sees>")  # fmt: skip
    devices = usable_devices()
    if devices and entry == "train":
        _check_server_gpus(cfg, devices)
    keys = {o.split("=", 1)[0].lstrip("+~").split(".")[0].split("/")[0] for o in overrides}
    if lc.nproc_per_node != "auto":
        n = int(lc.nproc_per_node)
        how = Launch(n, nnodes, endpoint, run_id, f"{_ranks(n)} on each of {nnodes} node(s)" if nnodes > 1 else
                     _ranks(n), f"launcher.nproc_per_node={n}")  # fmt: skip
        if entry == "train":
            require(n == 1 or cfg.learner.kind == "fsdp", "launcher.nproc_per_node",
                    f"{n} ranks, but learner={cfg.learner.kind} trains in one process: use learner=fsdp")  # fmt: skip
            if how.spawns:
                rc = _validated(cfg, n * nnodes, run_dir)  # a bad config is refused once, here, not by every rank
                if engine_traits(rc.rollout.engine).spans_ranks:  # tensor parallel over whole groups of ranks
                    from bapo.engines.vllm import check_tensor_parallel

                    check_tensor_parallel(rc.rollout.tensor_parallel_size, n * nnodes)
        elif how.spawns:
            _validated_eval(cfg, overrides)
        return how
    if not devices:
        return Launch(1, nnodes, endpoint, run_id)  # no GPU: one process, nothing to choose
    if entry == "eval":
        n = len(devices)
        if n * nnodes > 1:
            _validated_eval(cfg, overrides)
        return Launch(n, nnodes, endpoint, run_id, f"{_ranks(n)}, data-parallel", f"{_gpus(devices)} seen")
    if cfg.learner.kind != "fsdp":
        reason = f"learner={cfg.learner.kind} trains in one process; learner=fsdp shards over the node's GPUs"
        return Launch(1, nnodes, endpoint, run_id, f"1 process, on 1 of {_gpus(devices)}", reason)
    return _plan_choice(
        cfg, devices, nnodes, endpoint, run_id, explicit=bool(keys & set(LAYOUT_GROUPS)), run_dir=run_dir
    )


def stamped_folder(hc) -> str | None:
    """The job's run folder as configured (``hydra.run.dir``, unresolved) where the time names it (Hydra's default
    ``outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}``), else None."""
    from omegaconf import OmegaConf

    pattern = str(OmegaConf.to_container(hc.run, resolve=False).get("dir"))
    return pattern if "${now:" in pattern else None


def _check_server_gpus(cfg, devices: list[float]) -> None:
    """The launched vLLM servers' ``rollout.gpus`` (indices into this process's GPUs) are GPUs of this node: a
    ConfigError naming the key before any rank starts, not a server that fails to start in every rank."""
    r = cfg.rollout
    if r.get("url") is not None or engine_traits(r.engine).gpu_memory != "vllm_own_gpus":
        return
    ids = [g.strip() for g in str(r.get("gpus") or "").split(",") if g.strip()]
    bad = [g for g in ids if not g.isdigit() or int(g) >= len(devices)]
    require(not bad, "rollout.gpus",
            f"{','.join(ids)!r} names GPU(s) {','.join(bad)} for the vLLM servers, but this node has "
            f"{_gpus(devices)} (indices 0-{len(devices) - 1} of the GPUs this process sees)")  # fmt: skip


def _plan_choice(cfg, devices, nnodes, endpoint, run_id, *, explicit: bool, run_dir) -> Launch:
    """learner=fsdp on GPUs, ``nproc_per_node=auto``: the memory plan picks (module docstring)."""
    from bapo.entry.plan import learner_ranks
    from bapo.plan import verdict as plan

    node = copy.deepcopy(cfg)
    node.placement.gpus = len(devices)
    ranks = learner_ranks(node)
    servers = len(devices) - ranks
    require(ranks >= 1 and servers < len(devices), "rollout.gpus",
            f"the vLLM servers take {servers} of this node's {len(devices)} GPUs: none is left to train")  # fmt: skip
    world, gib, host = ranks * nnodes, min(devices), host_memory()
    rc = _validated(cfg, world, run_dir)
    where = f"{_ranks(ranks)} on {_gpus(devices)}" + (f" ({servers} for vLLM servers)" if servers else "")
    where += f", on each of {nnodes} nodes" if nnodes > 1 else ""
    how = dict(nproc=ranks, nnodes=nnodes, rdzv_endpoint=endpoint, run_id=run_id)
    try:
        p = plan.make_plan(rc, world=world, gpu_memory_gib=gib, host_memory_gib=host)
    except ConfigError as e:  # the model's shape is not known before it loads (no model.arch, a hub id)
        return Launch(**how, chosen=where, reason=f"no memory plan ({str(e).splitlines()[0]})")
    tp = _engine_ranks(rc)
    verdict = f"the memory plan's peak is {_gib(p.peak)} GiB a GPU of {_gib(p.limit)} usable"
    verdict += f", host {_gib(p.host_total)} GiB of {host:.0f}" if host is not None else ""
    if world % tp:
        verdict = f"rollout.tensor_parallel_size={tp} needs a multiple of {tp} GPUs"
    if _fits(p) and not world % tp:
        return Launch(**how, chosen=where, reason=verdict)
    if explicit:
        log.warning("launch: %s does not fit: %s; kept as the command line says (--plan prints it)", where, verdict)
        return Launch(**how, chosen=where, reason=f"as the command line says; {verdict}: does not fit")
    off = plan.with_offload(rc, world, gib) if not world % tp else None
    if off is not None:
        off.host_limit = None if host is None else int(host * 2**30)
    if off is not None and _fits(off):
        why = f"{verdict}; with the learner's state on the host {_gib(off.peak)} GiB"
        return Launch(**how, chosen=f"{where}, learner.cpu_offload=true", reason=why,
                      changes=(("learner.cpu_offload", True),))  # fmt: skip
    offloaded = ""
    if off is not None:
        offloaded = f"; {_gib(off.peak)} GiB a GPU with learner.cpu_offload=true"
        if off.host_limit is not None and off.host_total > off.host_limit:
            offloaded += f", which needs {_gib(off.host_total)} GiB of host, this node has {host:.0f}"
    raise ConfigError(
        f"launcher.nproc_per_node: {rc.model.name_or_path} does not fit {where} ({verdict}{offloaded}); the smallest "
        f"change that fits: {smallest_change(rc, world, gib, len(devices), p, host, tried=off)} "
        f"(python train.py ... --plan --nproc {world} --gpu-memory {gib:.0f} prints the plan)"
    )


def smallest_change(rc, world: int, gib: float, per_node: int, p, host: float | None = None, tried=None) -> str:
    """The fewest GPUs of ``gib`` on which ``rc`` fits (with the learner's state on the host if need be), else the
    first of the plan's own advice for these GPUs (``p``; and ``tried``'s, the plan with the learner's state on the
    host, together with that change) that makes it fit once applied: never a change that was tried and fails."""
    import dataclasses

    from bapo.plan import verdict as plan

    tp = _engine_ranks(rc)
    for t in (t for t in range(tp - 1, 0, -1) if world % tp and not world % t):  # a smaller engine on these GPUs
        smaller = dataclasses.replace(rc, rollout=dataclasses.replace(rc.rollout, tensor_parallel_size=t))
        for offload in (False, True):
            q = (
                plan.with_offload(smaller, world, gib)
                if offload
                else plan.make_plan(smaller, world=world, gpu_memory_gib=gib)
            )
            if q is not None:
                q.host_limit = None if host is None else int(host * 2**30)
            if q is not None and _fits(q):
                return f"rollout.tensor_parallel_size={t}" + (" learner.cpu_offload=true" if offload else "")
    for w in (2**k for k in range(1, 10)):
        if w <= world or w % tp:
            continue
        for offload in (False, True):
            q = plan.with_offload(rc, w, gib) if offload else plan.make_plan(rc, world=w, gpu_memory_gib=gib)
            if q is not None:
                q.host_limit = None if host is None else int(host * 2**30)
            if q is not None and _fits(q):
                nodes = math.ceil(w / per_node)
                more = f"{nodes} nodes of {per_node}: launcher.nnodes={nodes}" if nodes > 1 else f"a node of {w}"
                return f"{w} GPUs of {gib:.0f} GiB ({more})" + (", with learner.cpu_offload=true" if offload else "")
    offload = "learner.cpu_offload=true"
    candidates = _changes(p.advice())
    candidates += [f"{offload} {a}" for a in _changes(tried.advice()) if offload not in a] if tried is not None else []
    for change in candidates:
        if _fits_with(rc, change, world, gib, host):
            return change
    for q, what in ((tried, offload), (p, "the run")):
        gpus_hold = q is not None and q.peak <= q.limit and q.startup_ok and not world % tp
        if gpus_hold and not q.fits:  # the GPUs hold it, the host does not
            return f"more host memory ({what} needs {_gib(q.host_total)} GiB of host a node, this node has {host:.0f})"
    return "a smaller model (no GPU count up to 512 fits)"


ASSIGNMENT = re.compile(r"\b([a-z_]+(?:\.[a-z_]+)+)=([^\s,;:()]+)")  # key=value in the plan's advice


def _changes(advice: list[str]) -> list[str]:
    """The plan's advice lines that name a change (``key=value``), as the change and the advice's words."""
    return [a.strip().removeprefix("host: ") for a in advice if ASSIGNMENT.search(a)]


def _fits_with(rc, change: str, world: int, gib: float, host: float | None) -> bool:
    """Whether ``rc`` with every ``key=value`` of ``change`` fits ``world`` GPUs of ``gib`` (and this node's host)."""
    import dataclasses

    import yaml

    from bapo.plan import verdict as plan

    try:
        for key, value in ASSIGNMENT.findall(change):
            group, _, name = key.partition(".")
            node = getattr(rc, group)
            rc = dataclasses.replace(rc, **{group: dataclasses.replace(node, **{name: yaml.safe_load(value)})})
        q = plan.make_plan(rc, world=world, gpu_memory_gib=gib, host_memory_gib=host)
    except (ConfigError, TypeError, ValueError, AttributeError):  # not a key of that group, or not a value it takes
        return False
    return _fits(q) and not world % _engine_ranks(rc)


def _fits(p) -> bool:
    """The plan fits, and its vLLM engine's KV cache holds one full-length sequence at least (else it cannot
    generate)."""
    return p.fits and (p.engine is None or p.engine.kv_tokens >= p.setup.seq)


def _engine_ranks(rc) -> int:
    """The ranks one engine spans (its tensor parallelism, where its traits say it spans ranks); 1 otherwise."""
    spans = engine_traits(rc.rollout.engine).spans_ranks
    return int(getattr(rc.rollout, "tensor_parallel_size", 1)) if spans else 1


def host_memory() -> float | None:
    """This node's memory in GiB, for the plan's host check (None under ``$BAPO_FAKE_DEVICES``: the GPUs are not
    this machine's, nor is its host)."""
    if os.environ.get(FAKE_DEVICES):
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


def _validated(cfg, world: int, run_dir):
    """The typed run config, checked for ``world`` ranks as the ranks will check it (every config error here)."""
    from bapo.config import build

    with _env({"WORLD_SIZE": str(world)}):
        return build(cfg, run_dir)


def _validated_eval(cfg, overrides: Sequence[str]) -> None:
    """eval.py's config and sets, checked once before its ranks start (each rank adopts the run again)."""
    from bapo.eval.adopt import adopt_run
    from bapo.eval.job import build_job, load_evalset

    mine = copy.deepcopy(cfg)
    adopt_run(mine, overrides)
    job = build_job(mine)
    for s in job.sets.values():
        load_evalset(s, limit=job.run.limit)


def _nodes(lc: LauncherConfig) -> tuple[int, str | None, str | None]:
    """(nodes, the rendezvous endpoint, its id): the keys', else a SLURM step's of one task per node, else 1 node."""
    from bapo.infra import dist

    step = dist.slurm_step()
    slurm = step is not None and step["tasks"] == step["nodes"]
    nnodes = int(lc.nnodes) if lc.nnodes != "auto" else (step["nodes"] if slurm else 1)
    endpoint = lc.rdzv_endpoint or (f"{step['head']}:{RDZV_PORT}" if slurm and nnodes > 1 else None)
    require(nnodes == 1 or endpoint is not None, "launcher.rdzv_endpoint",
            f"launcher.nnodes={nnodes} needs the first node's host:port (the same on every node)")  # fmt: skip
    run_id = f"bapo-{step['job']}" if slurm else (f"bapo-{endpoint}" if endpoint else None)
    return nnodes, endpoint, run_id


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n > 1 else "")


def _gpus(devices: list[float]) -> str:
    return f"{len(devices)} GPU{'s' if len(devices) > 1 else ''} of {min(devices):.0f} GiB"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


@contextlib.contextmanager
def _env(values: dict[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: removed), as it was afterwards."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _put_env(values)
        yield
    finally:
        _put_env(old)


def _put_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# ----------------------------------------------------------------------------- starting the ranks


def watch_launcher(period_s: float = 0.2) -> None:
    """In a rank a launch started (``$BAPO_LAUNCHER_PID``; taken out of the environment, so the rank's own children
    do not inherit it): end this process, with one line, once the launching process is gone, whatever the rank is
    doing (a step, a collective whose other ranks died too). The rank's children follow it as they follow any
    learner that dies: rollout workers and vLLM servers watch their parent, reward workers read their end of a
    pipe. A no-op in any other process (torchrun, SLURM or a plain run)."""
    import threading
    import time

    value = os.environ.pop(LAUNCHER_ENV, None)
    if not value or not value.isdigit():
        return
    launcher = int(value)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(period_s)
        try:
            rank = os.environ.get("RANK", "?")
            print(f"error: LauncherGone: the launching process (pid {launcher}) is gone: rank {rank} stops with it",
                  file=sys.stderr, flush=True)  # fmt: skip
        finally:  # its stream may have gone with it
            os._exit(1)

    threading.Thread(target=watch, name="bapo-launcher-watch", daemon=True).start()


DROPPED_HYDRA = ("hydra.run.dir", "hydra.sweep", "hydra.mode", "hydra/launcher", "hydra.launcher", "hydra/sweeper",
                 "hydra.sweeper", "hydra.job.num", "hydra.job.id", "hydra.runtime")  # fmt: skip


def rank_args(hc, run_dir: Path, how: Launch) -> list[str]:
    """The arguments of the entry point in each rank: the job's config name and folders, its overrides, the choice,
    and the run folder pinned (the ranks and this process must agree on it)."""
    args = [f"--config-name={hc.job.config_name}"]
    args += [f"--config-dir={s.path}" for s in hc.runtime.config_sources if s.provider == "command-line"]
    args += [o for o in hc.overrides.hydra if not o.lstrip("+~").startswith(DROPPED_HYDRA)]
    return [*args, *hc.overrides.task, *how.overrides(), f"hydra.run.dir={quoted(str(Path(run_dir).absolute()))}"]


def quoted(value: str) -> str:
    """``value`` as a quoted Hydra override value (a sweep cell's folder holds ``=`` and ``,``)."""
    return "'" + value.replace("'", "\\'") + "'"


@dataclass(frozen=True)
class Outcome:
    """How the ranks ended: ``code`` 0, a rank's own exit status (it printed its error), 1 after a rank was killed,
    or 128 + the signal that stopped the launch; ``line``: the one line this process printed, if any."""

    code: int
    line: str | None = None


class _AgentLines(logging.Filter):
    """Drops the elastic agent's own log lines (this process prints one line of its own instead) and notes when it
    passed a signal on to the ranks and whether it had to SIGKILL a rank that outlived the grace."""

    def __init__(self) -> None:
        super().__init__()
        self.killed = False
        self.signalled: float | None = None  # time.time() of the first signal passed on

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        self.signalled = self.signalled or (record.created if SIGNAL_PASSED_ON in message else None)
        self.killed = self.killed or KILLED_AFTER_GRACE in message
        return False


@contextlib.contextmanager
def _agent_quiet() -> Iterator[_AgentLines]:
    """torch.distributed's loggers silenced for the block, the agent's shutdown lines read (:class:`_AgentLines`)."""
    lines = _AgentLines()
    quiet = logging.getLogger("torch.distributed")
    agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    levels = (quiet.level, agent.level)
    quiet.setLevel(logging.CRITICAL + 1)
    agent.setLevel(logging.WARNING)
    agent.addFilter(lines)
    try:
        yield lines
    finally:
        agent.removeFilter(lines)
        quiet.setLevel(levels[0])
        agent.setLevel(levels[1])


def start(
    how: Launch,
    script: str | Path,
    args: Sequence[str],
    env: dict[str, str | None] | None = None,
    after: str = "",
    grace_s: float = 120.0,
    checkpoints: Path | None = None,
) -> Outcome:
    """Start this node's ranks of ``how`` running ``python -u script args`` through torch's elastic launcher (module
    docstring), with ``env`` added to their environment (a None value: that variable removed), and wait for them.
    ``after``: what the line of a killed rank adds (how to resume). A signal of :data:`SIGNALS` is passed on to
    every rank, which then has ``grace_s`` seconds (``launcher.grace_s``) to save and exit before SIGKILL. A rank
    killed after its stop saved (a checkpoint in ``checkpoints`` dated after the signal) is a warning line and the
    signal's exit code, as a stop that exited in time; killed before, the line is ``RankKilled``."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=how.nnodes,
        max_nodes=how.nnodes,
        nproc_per_node=how.nproc,
        run_id=how.run_id or str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=how.rdzv_endpoint or "localhost:0",
        max_restarts=0,
        signals_to_handle=",".join(s.name for s in SIGNALS),
        shutdown_timeout=max(1, math.ceil(grace_s)),
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),  # the ranks write to our streams: no torchelastic_* folder
    )
    ranks_env = dict(env or {}) | {"TORCHELASTIC_SIGNALS_TO_HANDLE": None}
    if how.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        ranks_env["OMP_NUM_THREADS"] = "1"  # torchrun's default for several ranks a node
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    quiet = logging.root.manager.disable
    logging.disable(logging.NOTSET)
    agent = _agent_quiet()
    lines = agent.__enter__()
    try:
        with _env(ranks_env):
            elastic_launch(config, sys.executable)("-u", str(script), *args)
        return Outcome(0)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode >= 0 and failure.exitcode in (1, 2) or failure.exitcode >= 128:
            return Outcome(failure.exitcode)  # the rank said why (its error line), or it stopped for a signal
        how_ = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited {failure.exitcode}"
        line = f"error: RankFailed: rank {rank} (pid {failure.pid}) {how_}; the launcher stopped the other ranks"
        line += f"; {after}" if after else ""
        print(line, file=sys.stderr, flush=True)
        return Outcome(1, line)
    except SignalException as e:  # the agent passed it on to every rank and waited for them
        if not lines.killed:
            return Outcome(128 + int(e.sigval))
        name = signal.Signals(e.sigval).name
        kept = written_since(checkpoints, lines.signalled) if checkpoints and lines.signalled else None
        line = (
            f"warning: a rank was still exiting {grace_s:g} s after {name} (launcher.grace_s) and was killed by "
            f"SIGKILL after its stop had saved {kept}: nothing was lost"
            if kept
            else f"error: RankKilled: a rank outlived the launcher's grace after {name} (launcher.grace_s="
            f"{grace_s:g}) and was killed by SIGKILL: its stop did not finish saving (raise launcher.grace_s; python "
            "train.py ... --plan prints the estimated save time)"
        )
        line += f"; {after}" if after else ""
        print(line, file=sys.stderr, flush=True)
        return Outcome(128 + int(e.sigval), line)
    finally:
        agent.__exit__(None, None, None)
        logging.disable(quiet)
        for s, h in handlers.items():
            signal.signal(s, h)


__all__ = ["Launch", "LauncherConfig", "Outcome", "announce", "decide", "start", "usable_devices", "watch_launcher"]
