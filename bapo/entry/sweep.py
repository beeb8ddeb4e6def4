"""A sweep (``python train.py -m ...``): every cell runs, each cell's outcome is recorded, and the exit status
says whether any failed.

Hydra runs a sweep's cells as jobs of one process (the basic launcher) or as jobs elsewhere (submitit). A cell
that fails for a reason its one line explains (bad input, exit status 2; a failed run, 1) or for a bug (its
traceback) is recorded and the next cell runs (``bapo.entry.cli.guarded``): ``sys.exit`` inside a job would end the
whole sweep. Each cell, failed or not, appends one row to ``<sweep dir>/sweep_summary.jsonl``:

    {"launch": "host-pid-time", "job": 1, "cell": "algo=grpo,learner.lr=-1", "overrides": ["algo=grpo", ...],
     "status": "failed", "exit": 2, "error": "error: ConfigError: learner.lr: ...",
     "started": "2026-12-05T10:00:00+0000", "ended": "...", "wall_s": 4.1, "host": "...", "pid": 1234}

``status`` is ``complete`` (exit 0: trained to the end, or found complete), ``failed`` (exit 2 for bad input,
1 for a failed run or a bug) or ``stopped`` (a signal, exit 128 + its number: the sweep stops there too);
``cell`` is the cell's folder under the sweep folder; ``error`` is the line printed (a bug: its exception line).
Rows of every launch of the sweep accumulate; ``launch`` tells one launch's rows from another's. When the sweep
ends, :class:`SweepSummary` (a Hydra callback, conf/config.yaml) reads this launch's rows and, if a cell failed,
prints one line naming each failed cell and exits 2 if every failure was bad input, else 1.

In a sweep ``resume`` defaults to ``auto`` (:func:`default_resume`): a relaunch of the same command, into a
fixed ``hydra.sweep.dir``, skips the complete cells and resumes the interrupted ones (docs/sweeps.md).
``python train.py -m ... --cfg job`` prints every cell's composed config (:func:`show_cells`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUMMARY = "sweep_summary.jsonl"
LAUNCH_ENV = "BAPO_SWEEP_LAUNCH"  # set by the sweep's process; its jobs inherit it (submitit's too)
CELL_ENV = (
    "BAPO_SWEEP_CELL"  # set by a cell's job for the ranks it launches (bapo.entry.launch): the cell, and its handoff
)


class SweepFailed(RuntimeError):
    """A sweep ended with failed cells (each named)."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One job of a sweep: where its row goes and what it is."""

    sweep_dir: Path
    name: str  # its folder under the sweep folder (Hydra's override_dirname by default)
    job: int
    overrides: tuple[str, ...]
    handoff_to: Path | None = None  # in the ranks a cell's job launched: where rank 0 leaves the row for that job

    def handoff(self, path: Path) -> dict[str, str]:
        """The environment that makes this cell's launched ranks this cell, their rank 0 writing its row to ``path``
        (the job reads it and records it: one row a cell, whoever ran it)."""
        fields = {"sweep_dir": str(self.sweep_dir), "name": self.name, "job": self.job, "overrides": self.overrides}
        return {CELL_ENV: json.dumps(fields | {"handoff_to": str(path)})}

    def record(self, status: str, code: int, error: str | None, began: float) -> None:
        """Append this cell's row to the sweep's summary (module docstring); one ``write`` under a lock, so rows
        of cells running at once (submitit) never interleave. In launched ranks: the row goes to ``handoff_to``."""
        row = {
            "launch": os.environ.get(LAUNCH_ENV),
            "job": self.job,
            "cell": self.name,
            "overrides": list(self.overrides),
            "status": status,
            "exit": code,
            "error": error,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(began)),
            "ended": _now(),
            "wall_s": round(time.time() - began, 3),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        if self.handoff_to is not None:
            tmp = self.handoff_to.with_name(self.handoff_to.name + ".tmp")
            tmp.write_text(json.dumps(row))
            os.replace(tmp, self.handoff_to)
            return
        try:
            self.sweep_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.sweep_dir / SUMMARY, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, (json.dumps(row) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:  # a full or read-only disk: the cell's outcome is on stderr; the sweep goes on
            logging.getLogger(__name__).warning("%s: cannot record cell %s: %s", self.sweep_dir / SUMMARY, self.name, e)


def cell_of(hydra_cfg: Any) -> Cell | None:
    """The sweep cell this Hydra job is (``HydraConfig.get()``); None outside a sweep."""
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        handed = json.loads(os.environ.get(CELL_ENV) or "null")  # a rank its cell's job launched (bapo.entry.launch)
        if not handed:
            return None
        fields = handed | {"sweep_dir": Path(handed["sweep_dir"]), "overrides": tuple(handed["overrides"])}
        return Cell(**fields | {"handoff_to": Path(handed["handoff_to"])})
    sweep_dir = Path(hydra_cfg.sweep.dir).absolute()
    name = os.path.relpath(hydra_cfg.runtime.output_dir, sweep_dir)
    return Cell(sweep_dir, name, int(hydra_cfg.job.num), tuple(hydra_cfg.overrides.task))


def outcome_file(cell: Cell) -> Path:
    """Where a launched cell's rank 0 leaves its row for the cell's job (:meth:`Cell.handoff`)."""
    return cell.sweep_dir / f".cell-{cell.job}-{os.getpid()}.json"


def default_resume(cfg: Any, overrides: Sequence[str]) -> bool:
    """A sweep's cell resumes (``resume=auto``) unless the command line set ``resume``, or ``overwrite=true``
    asks to replace the cell's run. Edits ``cfg``; returns whether it did."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if cfg.resume is not None or "resume" in keys or cfg.overwrite:
        return False
    cfg.resume = "auto"
    return True


def rows(sweep_dir: str | Path, launch: str | None = None) -> list[dict]:
    """The rows of ``<sweep_dir>/sweep_summary.jsonl`` (of one ``launch`` if given); unreadable lines skipped."""
    f = Path(sweep_dir) / SUMMARY
    out = []
    for line in f.read_text(errors="replace").splitlines() if f.is_file() else ():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and (launch is None or row.get("launch") == launch):
            out.append(row)
    return out


def summarize(sweep_dir: str | Path, launch: str | None) -> tuple[int, str]:
    """(exit status, the line to print) for one launch of a sweep: 0 when no cell failed, else 2 when every
    failure was bad input (exit 2) and 1 otherwise; the line names each failed cell and its exit status."""
    mine = rows(sweep_dir, launch)
    failed = [r for r in mine if r.get("status") == "failed"]
    where = Path(sweep_dir) / SUMMARY
    if not failed:
        return 0, f"sweep {sweep_dir}: {len(mine)} of {len(mine)} cells complete ({where})"
    status = 2 if all(r.get("exit") == 2 for r in failed) else 1
    names = ", ".join(f"{r.get('cell')} (exit {r.get('exit')})" for r in failed)
    return status, (
        f"{len(failed)} of {len(mine)} cells failed: {names}; the other cells ran. Each error line is in {where} "
        "and in the cell's log"
    )


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra-core < 1.1
    Callback = object  # type: ignore[misc,assignment]


class SweepSummary(Callback):
    """The Hydra callback that gives a sweep its launch id and, at the end, its one summary line and exit status."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        os.environ[LAUNCH_ENV] = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        status, line = summarize(config.hydra.sweep.dir, os.environ.get(LAUNCH_ENV))
        if status == 0:
            print(line, flush=True)
            return
        from bapo.infra.checks import fail

        sys.stdout.flush()
        fail(SweepFailed(line), status)


# ----------------------------------------------------------------------------- a sweep's configs


def wants_cells(argv: Sequence[str]) -> bool:
    """``-m`` (or ``--multirun``) together with ``--cfg`` / ``-c``: Hydra refuses the pair with a traceback."""
    args = set(argv)
    return bool(args & {"-m", "--multirun"}) and any(a in ("-c", "--cfg") or a.startswith("--cfg=") for a in argv)


def show_cells(argv: Sequence[str], conf_dir: str | Path, config_name: str = "config") -> None:
    """Print the composed config of every cell of the sweep ``argv`` describes (``--cfg job|hydra|all``, with
    ``--resolve`` and ``--package`` as Hydra reads them), each under a ``# cell i of n: <overrides>`` line, in
    the order the basic launcher runs them; its grid is ``hydra.sweeper.params`` plus the command line's."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path, get_args_parser
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    args = get_args_parser().parse_intermixed_args(list(argv))  # overrides after --cfg job too
    hydra = Hydra.create_main_hydra2(task_name="train", config_search_path=create_config_search_path(str(conf_dir)))
    master = hydra.compose_config(config_name, args.overrides, run_mode=RunMode.MULTIRUN, with_log_configuration=False)
    sweeper = str(master.hydra.sweeper.get("_target_", ""))
    if not sweeper.endswith("BasicSweeper"):
        raise ConfigCompositionException(
            f"--cfg with -m lists the basic sweeper's cells only; this sweep uses {sweeper}"
        )
    params = master.hydra.sweeper.get("params") or {}
    lines = [f"{k}={v}" for k, v in params.items()] + list(master.hydra.overrides.task)
    parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(lines)
    cells = [list(c) for batch in BasicSweeper.split_arguments(parsed, None) for c in batch]
    texts = []  # every cell composes (or nothing prints), as Hydra checks a batch before it launches it
    for i, overrides in enumerate(cells, 1):
        cfg = hydra.config_loader.load_sweep_config(master, overrides)
        HydraConfig.instance().set_config(cfg)  # what ${hydra:...} reads, as in the cell's job
        OmegaConf.set_readonly(cfg.hydra, None)
        with open_dict(cfg.hydra.runtime):  # the cell's folder, as the launcher sets it (hydra.core.utils.run_job)
            cfg.hydra.runtime.output_dir = os.path.abspath(os.path.join(cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir))
        cfg = hydra.get_sanitized_cfg(cfg, args.cfg)
        if args.package and args.package != "_global_":
            cfg = OmegaConf.select(cfg, args.package)
            if cfg is None:
                raise ConfigCompositionException(f"--package {args.package}: not in the {args.cfg} config")
        if OmegaConf.is_config(cfg) and args.resolve:
            OmegaConf.resolve(cfg)
        body = OmegaConf.to_yaml(cfg) if OmegaConf.is_config(cfg) else f"{cfg}\n"
        texts.append(f"# cell {i} of {len(cells)}: {' '.join(overrides)}\n{body}")
    try:
        sys.stdout.write("".join(texts))
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
