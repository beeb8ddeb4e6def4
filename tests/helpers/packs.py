"""Study pack records built in memory, in the layout scripts/study/pack_study.py writes from run folders."""

from collections.abc import Callable


def pack_record(
    run: str, config: dict, accs: dict[int, float], metrics: Callable[[int], dict], *, steps=50, status="complete"
) -> dict:
    """The pack record of the run ``run`` with ``config``, steps 0 to ``steps``: eval/accuracy ``accs[step]`` at the
    steps in ``accs`` and ``metrics(step)`` at every step after 0; no overrides, checkpoint, exception or problems."""
    rows = []
    for step in range(steps + 1):
        row = {"step": step}
        if step in accs:
            row["eval/accuracy"] = accs[step]
        if step:
            row |= metrics(step)
        rows.append(row)
    keys = sorted({k for r in rows for k in r})
    metrics_of = {k: [r.get(k) for r in rows] for k in keys}
    return {"run": run, "config": config, "overrides": [], "status": status, "exception": None, "checkpoint": False,
            "problems": [], "wall_s": 1.0, "process_s": None, "metrics": metrics_of}  # fmt: skip
