"""conf/experiment/study_gpu.yaml, the GPU study on paper (docs/study/README.md): every arm composes into a typed run
config, and the design holds arm by arm: the same model, data, learning rate, update count and update size; the
staleness of its name; its window; the evaluations after the same numbers of updates.
"""

import pytest
import yaml

from tests.helpers.config import run_config
from tests.helpers.paths import ROOT

EXPERIMENT = ROOT / "conf" / "experiment" / "study_gpu.yaml"
# arm -> its overrides beside experiment=study_gpu, as the config's header lists them
ARMS = {
    "grpo": "algo=grpo",
    "bapo": "algo=bapo",
    "bapo_rho05": "algo=bapo algo.bounds.rho0=0.5",
    "corner": "algo=grpo algo.bounds.ratio_low=0.9 algo.bounds.ratio_high=3.0",
    "loose_low": "algo=grpo algo.bounds.ratio_low=0.69 algo.bounds.ratio_high=1.2",
    "onpolicy": "algo=grpo learner.mini_batches_per_rollout=1 train.prompts_per_step=8 train.steps=500 "
    "eval.every=100 checkpoint.every=250",
}
UPDATES, SAMPLES_PER_UPDATE = 500, 64
WINDOWS = {"grpo": (0.8, 1.2), "corner": (0.9, 3.0), "loose_low": (0.69, 1.2), "onpolicy": (0.8, 1.2)}


def test_the_header_lists_every_arm_as_tested():
    text = EXPERIMENT.read_text()
    for arm, over in ARMS.items():
        line = " ".join(next(ln for ln in text.splitlines() if ln.startswith(f"#   {arm} ")).split()[2:])
        if arm == "onpolicy":  # its overrides continue on the next line
            rest = text.split(line, 1)[1].splitlines()[1].lstrip("# ").split(":")[0]
            line = f"{line} {rest}"
        assert line.startswith(over) or over.startswith(line), (arm, line)


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_composes_to_the_design(arm):
    rc = run_config("experiment=study_gpu", *ARMS[arm].split(), "seed=1")
    assert rc.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and rc.learner.kind == "fsdp"
    assert rc.data.path.endswith("/train_math.jsonl") and rc.data.eval_path == "assets/evalsets/math500.jsonl"
    assert (rc.learner.lr, rc.learner.old_logp, rc.rollout.engine) == (1e-5, "recompute", "vllm")
    # the same 500 updates of 64 samples (32,000 samples) in every arm; only the on-policy arm's samples are fresh
    assert rc.train.steps * rc.sizes.updates_per_step == UPDATES
    assert rc.sizes.mini_batch_size == SAMPLES_PER_UPDATE
    assert rc.sizes.max_reuse_staleness == (0 if arm == "onpolicy" else 4)
    # evaluated after the same update counts: 0, 100, ..., 500
    evals = {s * rc.sizes.updates_per_step for s in range(0, rc.train.steps + 1, rc.eval.every)}
    assert evals == set(range(0, UPDATES + 1, 100)) and rc.eval.n == 4 and rc.data.heldout_size == 500
    bounds = rc.algo.bounds
    if arm.startswith("bapo"):
        assert bounds.kind == "bapo" and bounds.rho0 == (0.5 if arm == "bapo_rho05" else 0.4)
    else:
        assert bounds.kind == "fixed" and (bounds.ratio_low, bounds.ratio_high) == WINDOWS[arm]


def test_the_sweep_is_thirty_seeds_in_a_folder_of_its_own():
    hydra = yaml.safe_load(EXPERIMENT.read_text())["hydra"]
    seeds = [int(s) for s in str(hydra["sweeper"]["params"]["seed"]).split(",")]
    assert seeds == list(range(1, 31)) and hydra["sweep"]["dir"] == "multirun/study_gpu"
