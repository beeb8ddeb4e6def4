"""Rollout correction on vLLM's engine (runs in .venv-vllm): vLLM's log-probs against the learner's own.

In fp32 on the CPU vLLM's sampled-token log-probs match the HF forward to about 1e-6, so token TIS weights
pi / mu are 1 within 1e-4 and nothing is truncated: the correction is the identity where no mismatch exists.
"""

import pytest

pytest.importorskip("vllm")

from bapo.loop import run  # noqa: E402
from tests.helpers.config import smoke_cfg  # noqa: E402
from tests.helpers.metrics import rows  # noqa: E402

pytestmark = pytest.mark.slow  # end to end: a real run of the loop


def test_vllm_tis_weights_are_one_within_1e_4(tmp_path):
    over = ["rollout=vllm", "rollout.enforce_eager=true", "train.steps=2", "eval.every=0", "eval.greedy=false"]
    run(smoke_cfg([*over, "algo/correction=tis", "learner.old_logp=recompute", "data.heldout_size=4"]), tmp_path)
    for r in rows(tmp_path)[1:]:
        assert abs(r["correction/weight_mean"] - 1) < 1e-4 and abs(r["correction/weight_max"] - 1) < 1e-4
        assert abs(r["correction/raw_weight_mean"] - 1) < 1e-4 and r["correction/cut_frac"] == 0.0
        assert r["correction/ess"] > 1 - 1e-6
