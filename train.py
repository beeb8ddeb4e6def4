"""Train a policy with BAPO (or a baseline): python train.py algo=bapo model=tiny

``python train.py <overrides> --plan [--nproc N] [--gpu-memory GiB]`` prints the run's memory plan
(per-GPU peaks of generation and of the update, host memory per node: ``bapo.plan``) and exits
without starting anything or creating a run folder.

Outside torchrun, ``python train.py ...`` starts one rank per GPU of the node itself, the memory plan choosing
what fits them (``bapo.entry.launch``, ``launcher.nproc_per_node``); under torchrun or SLURM nothing changes.

``python train.py -m <grid>`` runs a sweep: a failed cell is recorded and the next one runs, each cell
resumes (``resume=auto``) unless told otherwise, and ``-m <grid> --cfg job`` prints every cell's
config (``bapo.entry.sweep``)."""

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from bapo.entry.cli import guarded, hydra_files
    from bapo.entry.launch import announce, watch_launcher
    from bapo.entry.launch_step import launch_here
    from bapo.entry.sweep import cell_of, default_resume
    from bapo.infra.dist import from_slurm
    from bapo.loop import run

    watch_launcher()  # a rank this command's launch started ends with its launcher (bapo.entry.launch)
    from_slurm()  # SLURM with one task per rank: torchrun's variables, and nothing else changes
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    cell = cell_of(hc)
    if cell is not None:
        default_resume(cfg, hc.overrides.task)  # a relaunched sweep skips its complete cells
    if launch_here(cfg, hc, __file__, run_dir, cell, "train"):  # the node's ranks ran the job (bapo.entry.launch)
        return
    files = hydra_files(cfg)  # .hydra/, written once the folder is held (conf/config.yaml: output_subdir null)
    rank0 = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 holds the shared folder
    # the folder's lock first; bad input: one line, exit 2, the folder left as it was; a sweep goes on
    job = lambda: announce(cfg) or run(cfg, run_dir)  # noqa: E731
    metrics = guarded(job, run_dir, hold=rank0, files=files if rank0 else None, cell=cell)
    if metrics and "stopped_by_signal" in metrics:  # SIGTERM / Ctrl-C: checkpoint saved; say so the conventional way
        from bapo.infra.stop import leave

        leave(128 + int(metrics["stopped_by_signal"]))  # a rank: at once, inside its launcher's grace


if __name__ == "__main__":
    if "--plan" in sys.argv[1:]:  # composed by bapo.entry.plan with the same overrides, before Hydra's run folder
        from bapo.entry.plan import cli

        sys.exit(cli(sys.argv[1:]))
    from bapo.entry.cli import hydra_entry

    if "-m" in sys.argv[1:] or "--multirun" in sys.argv[1:]:
        from bapo.entry.sweep import show_cells, wants_cells

        if wants_cells(sys.argv[1:]):  # Hydra refuses -m with --cfg: every cell's config instead
            sys.exit(hydra_entry(lambda: show_cells(sys.argv[1:], Path(__file__).parent / "conf")))
    hydra_entry(main)  # Hydra's own start-up errors (a bad override, an unwritable run folder): one line too
