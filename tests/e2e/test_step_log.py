"""train.py's log through the entry point, with the default progress bar."""

import pytest

from tests.helpers.processes import train_py


def steps_written(lines: list[str]) -> list[int]:
    return [int(x.split(" - step ")[1].split(" |")[0].split()[0]) for x in lines if " - step " in x]


@pytest.mark.slow
def test_train_log_keeps_step_lines_under_the_progress_bar(tmp_path):
    """Through the entry point, with the default progress bar (about 30 s on an idle core)."""
    run_dir = tmp_path / "run"
    train_py("debug=smoke", "logger.progress=true", "train.steps=11", f"hydra.run.dir={run_dir}", timeout=900)
    lines = (run_dir / "train.log").read_text().splitlines()
    written = steps_written([x.replace("][bapo.infra.tracking][INFO]", "") for x in lines])
    # steps 0 and 10, and 11 (the last, held until the end); on a loaded machine (a step over a minute) others too
    assert {0, 10, 11} <= set(written) and written == sorted(written), written
    last = next(x for x in lines if "step 11 |" in x)
    assert "| reward " in last and "| ent " in last and "| s/step " in last
