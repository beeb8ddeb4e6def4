"""torch.distributed for the learner under torchrun: process group, rank helpers, plain-function collectives.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address;
:func:`init` joins the group from them (NCCL when CUDA is there, else gloo). Without
torchrun every helper degrades to one process: rank 0 of 1, and the collectives
return their input unchanged, so the same code runs in a plain ``python train.py``.

Under SLURM with one task per rank, :func:`from_slurm` maps SLURM's variables to torchrun's first.
:class:`LauncherConfig` is the ``launcher`` group's schema: how many ranks a plain ``python train.py`` starts
(bapo.entry.launch).

The collectives are plain functions of tensors or objects, so they can be handed
to code that must not know about process groups (``Learner(reduce_sum=...)``, the
bound search in ``bapo.algos``). They accept tensors on any device: under NCCL the
data goes through this rank's GPU and comes back to where it was.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from bapo.infra.checks import require, resumable

T = TypeVar("T")


_JOINED = False  # did init() create the process group (and so teardown() own it)?
_BEFORE_TEARDOWN: list = []  # callbacks teardown() runs first (colocated vLLM engines shut down)
_SET_ENV: list[str] = []  # launcher variables init_one_rank() set


@dataclass
class LauncherConfig:
    """``launcher``: how many ranks a plain ``python train.py`` starts, and what it chose (written by the launch)."""

    nproc_per_node: str = resumable()  # auto | N
    nnodes: str = resumable()  # auto (SLURM's node count, else 1) | N
    rdzv_endpoint: str | None = resumable()  # host:port of the first node; null: SLURM's first node, or this host
    grace_s: float = resumable()  # after a stop, the seconds the launcher waits for its ranks before SIGKILL
    chosen: str | None = resumable()  # written by the launch: what it started, and why (bapo.entry.launch)

    def __post_init__(self) -> None:
        for key in ("nproc_per_node", "nnodes"):
            value = getattr(self, key)
            require(
                value == "auto" or (value.isdigit() and int(value) >= 1),
                f"launcher.{key}",
                f"auto or N >= 1, got {value!r}",
            )
        require(
            isinstance(self.grace_s, int | float) and 0 < self.grace_s < 1e6,
            "launcher.grace_s",
            f"seconds > 0, got {self.grace_s!r}",
        )
        host, _, port = (self.rdzv_endpoint or "h:1").rpartition(":")
        require(bool(host) and port.isdigit(), "launcher.rdzv_endpoint", f"host:port, got {self.rdzv_endpoint!r}")
        require(int(port) <= 65535, "launcher.rdzv_endpoint", f"the port must be 0-65535, got {self.rdzv_endpoint!r}")


def launched() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ


def active() -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def init(backend: str = "auto", timeout_s: float = 1800.0) -> torch.device:
    """Join torchrun's process group (once) and return this rank's device.

    ``backend="auto"``: NCCL when CUDA is available (one GPU per local rank: :func:`rank_device`), else gloo
    on CPU. Without torchrun nothing is initialised and the device is cuda:0 or cpu.
    """
    cuda = torch.cuda.is_available() and backend != "gloo"
    device = rank_device() if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not launched() or (dist.is_available() and dist.is_initialized()):
        return device
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    global _JOINED
    _JOINED = True
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return device


def rank_device() -> torch.device:
    """This rank's GPU: ``cuda:<local rank>`` where the process sees the node's GPUs, and the one GPU it sees
    whatever its local rank where it sees one (SLURM's per-task binding: ``--gpus-per-task=1``,
    ``--gpu-bind=single:1``, cgroup devices). A local rank beyond the several GPUs it sees is a ConfigError."""
    count, local = torch.cuda.device_count(), local_rank()
    if count == 1:
        return torch.device("cuda", 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    require(
        local < count,
        "LOCAL_RANK",
        f"local rank {local} needs a GPU of its own, this process sees {count} "
        f"(CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'}): start at most {count} ranks a node, "
        "or give each task its GPU (srun --gpus-per-task=1)",
    )
    return torch.device("cuda", local)


def init_one_rank(backend: str = "auto") -> torch.device:
    """A process group of one rank when no launcher started one: what ``torchrun --nproc_per_node=1`` gives.

    ``learner=fsdp`` run as ``python train.py ...`` trains on one device through the same FSDP2 code path
    (sharding over one rank is a no-op, the collectives are real). The environment a launcher would set is set
    here too (rank 0 of 1, a free port on this host), so that vLLM's external launcher and anything else that
    reads it sees one consistent world. Under a launcher this is :func:`init`."""
    if not launched():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
        env |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for k, v in env.items():
            if k not in os.environ:
                os.environ[k] = v
                _SET_ENV.append(k)  # teardown() takes them back: a later run in this process starts clean
    return init(backend)


def before_teardown(fn) -> None:
    """Run ``fn()`` at the start of :func:`teardown`, before the process group goes (a colocated vLLM engine
    shuts down inside torchrun's group, and its shutdown destroys groups it built on it)."""
    _BEFORE_TEARDOWN.append(fn)


def teardown(barrier: bool = True) -> None:
    """Shut the colocated engines down and leave the process group that :func:`init` joined (a no-op for a
    group this module did not create: vLLM, for one, sets up its own).

    ``barrier=False`` on an error path: the other ranks may be stuck elsewhere and never reach a barrier;
    the launcher stops them."""
    global _JOINED
    ours = _JOINED and dist.is_available() and dist.is_initialized()
    if ours and barrier:
        dist.barrier()  # every rank is done with the group before an engine takes its part of it down
    while _BEFORE_TEARDOWN:
        fn = _BEFORE_TEARDOWN.pop()
        try:
            fn()
        except Exception as e:  # an engine that fails to shut down must not hide the run's own error
            if barrier:
                raise
            logging.getLogger(__name__).warning("teardown: %s failed: %s: %s", fn, type(e).__name__, e)
    if ours and dist.is_initialized():  # a colocated engine's shutdown may already have destroyed it
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    _JOINED = False
    while _SET_ENV:
        os.environ.pop(_SET_ENV.pop(), None)


def barrier() -> None:
    if active():
        dist.barrier()


def store():
    """The process group's key-value store (torchrun's rendezvous store), or None outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def _comm_device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones (for our purposes).
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    if not active():
        return t
    x = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(x, op=op)
    return x.to(t.device)


def reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of ``t`` over all ranks (a new tensor on ``t``'s device; ``t`` itself unchanged).

    The ``reduce_sum`` hook of ``Learner`` and of the bound search.
    """
    return _all_reduce(t, dist.ReduceOp.SUM)


def reduce_max(t: torch.Tensor) -> torch.Tensor:
    """The element-wise max of ``t`` over all ranks (e.g. agreeing on a number of micro-batches)."""
    return _all_reduce(t, dist.ReduceOp.MAX)


def broadcast_object(obj: T, src: int = 0) -> T:
    """``src``'s picklable ``obj`` on every rank (each rank passes something; only src's counts)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, as a list in rank order, on every rank."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def shard(items: Sequence[T], rank_: int | None = None, world: int | None = None) -> list[T]:
    """This rank's share of ``items``: every ``world``-th item from position ``rank`` on.

    Deterministic and a partition (the shards of all ranks together are ``items``, each once),
    with sizes that differ by at most one. Raises when some rank would get nothing, since a
    rank with no sample cannot take part in the update's collectives.
    """
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in [0, {w})")
    if len(items) < w:
        raise ValueError(f"{len(items)} samples cannot be sharded over {w} ranks: every rank needs at least one")
    return list(items[r::w])


def all_gather_tensors(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every rank's list of 1-D tensors (same count and dtypes on every rank, any lengths), in rank order.

    Two collectives per tensor: the lengths, then the data padded to the longest. The data
    moves as tensors, never pickled. Without a process group: ``[list(tensors)]``.
    """
    if not active():
        return [list(tensors)]
    device, world = _comm_device(), world_size()
    lengths = torch.tensor([t.numel() for t in tensors], dtype=torch.long, device=device)
    all_lengths = [torch.empty_like(lengths) for _ in range(world)]
    dist.all_gather(all_lengths, lengths)
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for i, t in enumerate(tensors):
        longest = max(int(n[i]) for n in all_lengths)
        padded = torch.zeros(longest, dtype=t.dtype, device=device)
        padded[: t.numel()] = t.reshape(-1).to(device)
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        for r in range(world):
            per_rank[r].append(parts[r][: int(all_lengths[r][i])].to(t.device))
    return per_rank


# ----------------------------------------------------------------------------- SLURM


def slurm_step() -> dict[str, Any] | None:
    """This task of a SLURM job step (``srun``), as numbers: ``tasks`` and ``nodes`` of the step, this task's ``rank``,
    ``local_rank`` and ``node``, the tasks on this node (``local_tasks``), the step's first node (``head``) and the
    job's id. None outside a step: a batch script or an ``salloc`` shell has SLURM's job variables but no step's."""
    env = os.environ
    if "SLURM_STEP_NUM_TASKS" not in env or "SLURM_PROCID" not in env:
        return None
    tasks, nodes = int(env["SLURM_STEP_NUM_TASKS"]), int(env.get("SLURM_STEP_NUM_NODES") or 1)
    node = int(env.get("SLURM_NODEID") or 0)
    per_node = _expand_counts(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    return {
        "tasks": tasks,
        "nodes": nodes,
        "rank": int(env["SLURM_PROCID"]),
        "local_rank": int(env.get("SLURM_LOCALID") or 0),
        "node": node,
        "local_tasks": per_node[node] if node < len(per_node) else max(1, tasks // nodes),
        "head": first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"),
        "job": env.get("SLURM_JOB_ID", "0"),
    }


def _expand_counts(text: str) -> list[int]:
    """SLURM's tasks per node, ``8(x2),4`` -> [8, 8, 4]."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        count, _, times = part.partition("(x")
        out += [int(count)] * int(times.rstrip(")") or 1)
    return out


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,9],cpu1`` -> ``gpu03`` (what ``scontrol show hostnames``
    prints first)."""
    head = nodelist.strip()
    depth, cut = 0, len(head)
    for i, c in enumerate(head):  # the first item: up to a comma outside brackets
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            cut = i
            break
    head = head[:cut]
    if "[" in head:
        prefix, _, rest = head.partition("[")
        ranges, _, suffix = rest.partition("]")
        head = prefix + ranges.split(",")[0].split("-")[0] + suffix
    return head or "localhost"


def from_slurm() -> bool:
    """Under SLURM with one task per rank (``srun --ntasks-per-node=<GPUs> python train.py ...``): set the
    variables torchrun would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
    ``MASTER_ADDR`` = the step's first node, ``MASTER_PORT`` = 20000 + the job id mod 20000), each only where it is
    not set, so that the run joins its group as under torchrun. A step of one task per node is not mapped: its task
    launches the node's ranks itself (bapo.entry.launch). Returns whether it mapped anything."""
    step = slurm_step()
    if step is None or launched() or step["tasks"] <= step["nodes"]:
        return False
    job = int(step["job"]) if str(step["job"]).isdigit() else 0
    env = dict(
        RANK=step["rank"], WORLD_SIZE=step["tasks"], LOCAL_RANK=step["local_rank"],
        LOCAL_WORLD_SIZE=step["local_tasks"], GROUP_RANK=step["node"], MASTER_ADDR=step["head"],
        MASTER_PORT=20000 + job % 20000,
    )  # fmt: skip
    for k, v in env.items():
        os.environ.setdefault(k, str(v))
    return True


def shared_path(path: str | os.PathLike) -> Path:
    """Rank 0's ``path`` on every rank (under torchrun; joins the process group first).

    Hydra's ``${now:...}`` run folder may differ by a second between ranks; they all use rank 0's."""
    if launched():
        init()
    return Path(broadcast_object(str(path)))
