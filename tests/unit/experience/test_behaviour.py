"""The behaviour policy (bapo/experience/behaviour.py): what each config makes pi_old, and what it asks of the run."""

import pytest
import torch

from bapo.experience.behaviour import BehaviourPolicy
from bapo.samples import RolloutBatch, TokenVersionWeights
from tests.helpers.config import run_config


@pytest.mark.parametrize(
    "over,want",
    [
        ([], (False, None, 0.0625, False, False, False, True)),
        (["learner.old_logp=recompute"], (True, None, 0.0625, True, False, False, False)),
        (["learner.logp_check_share=0"], (False, None, 0.0, False, False, False, False)),
        (["rollout.partial_budget=12", "buffer.max_staleness=7"], (False, 12, 0.0625, False, True, False, True)),
        (
            ["rollout.partial_budget=12", "buffer.max_staleness=7", "learner.old_logp=recompute"],
            (True, 12, 0.0625, True, True, True, False),
        ),
        (["rollout.partial_budget=48", "buffer.max_staleness=1"], (False, None, 0.0625, False, False, False, True)),
    ],  # fmt: skip
    ids=["engine", "recompute", "no-check", "partial", "partial-recompute", "budget-never-interrupts"],
)
def test_each_config_makes_its_behaviour_policy(over, want):
    b = run_config("debug=smoke", *over).behaviour  # debug=smoke: max_new_tokens 48
    got = (b.recompute, b.partial_budget, b.check_share, b.keeps_window, b.per_token, b.needs_copies, b.checks)
    assert got == want
    assert b.snapshot_dtype("bf16") == (None if b.recompute else "bf16")


def test_recompute_scores_under_the_generating_weights_or_each_tokens_own():
    snaps = {1: {"w": torch.ones(1)}, 2: {"w": 2 * torch.ones(1)}}
    whole = BehaviourPolicy(recompute=True, partial_budget=None, check_share=0.0)
    batch = RolloutBatch(0, 1, (), (), (), (), {}, ())
    assert whole.weights(batch, 1, snaps.__getitem__) is None  # the learner is still at the generating version
    assert whole.weights(batch, 3, snaps.__getitem__) is snaps[1]
    with pytest.raises(KeyError):
        whole.weights(RolloutBatch(0, 5, (), (), (), (), {}, ()), 6, snaps.__getitem__)  # a version not held


def test_per_token_recompute_names_every_tokens_version():
    class S:
        def __init__(self, versions):
            self.v = torch.tensor(versions)

        def token_versions(self):
            return self.v

    batch = RolloutBatch(0, 1, (S([1, 1, 2]), S([2, 3])), (), (), (), {}, ())
    snaps = {1: {"w": torch.ones(1)}, 2: {"w": 2 * torch.ones(1)}}
    per_token = BehaviourPolicy(recompute=True, partial_budget=12, check_share=0.0)
    got = per_token.weights(batch, 3, snaps.__getitem__)
    assert isinstance(got, TokenVersionWeights)
    assert got.by_version == {1: snaps[1], 2: snaps[2], 3: None}  # version 3: the learner's own weights
