"""Finished runs turned into the runs a test needs."""

import shutil
from pathlib import Path


def killed_after_step_3(full: Path, to: Path, *, export: bool = False) -> Path:
    """A copy of the finished 4-step run ``full`` at ``to``, as if it had been killed after step 3: its step-4
    checkpoint and the end of the run (``final_metrics.json``; with ``export``, its HF export too) never happened.
    Resumed with ``resume=auto``, it continues from the step-2 checkpoint."""
    shutil.copytree(full, to, symlinks=True)
    shutil.rmtree(to / "checkpoints" / "step_000004")
    if export:
        shutil.rmtree(to / "export")
    (to / "final_metrics.json").unlink()
    return to
