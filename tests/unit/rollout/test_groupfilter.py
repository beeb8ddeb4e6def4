"""DAPO's dynamic sampling: groups judged by correctness, refilled with fresh groups, bounded rounds, exact sizes."""

import torch

from bapo.rollout.groupfilter import REFILL_STRIDE, GroupFilter, groups_of
from bapo.samples import Problem, Prompt, RolloutBatch, Sample
from tests.helpers.fakes import CursorMaker


class FakeMaker(CursorMaker):
    """Makes batches of ``groups_per_batch`` groups of 2; ``verdicts`` gives each successive group's correctness.

    Records the batch index of every call (the sampling seed derives from it) and keeps a prompt cursor."""

    def __init__(self, verdicts, groups_per_batch=3):
        self.verdicts = list(verdicts)
        self.groups_per_batch = groups_per_batch
        self.cursor = 0
        self.calls = []

    def make(self, t, version, weights):
        self.calls.append(t)
        samples, rewards, correct, prompts = [], [], [], []
        for g in range(self.groups_per_batch):
            prompt = Prompt(Problem(str(self.cursor), "p", "1"), "p", (1, 2))
            prompts.append(prompt)
            for c in self.verdicts[self.cursor]:
                samples.append(Sample(prompt, g, torch.tensor([3, 4]), torch.zeros(2), "t", version, False))
                # shaped rewards differ even where correctness is equal: the filter must not look at them
                rewards.append((1.0 if c else 0.0) + 0.1 * len(samples))
                correct.append(c)
            self.cursor += 1
        stats = {"reward/accuracy": sum(correct) / len(correct), "time/rollout_s": 1.0, "time/reward_s": 0.5}
        n = len(samples)
        return RolloutBatch(
            t, version, tuple(samples), tuple(rewards), tuple(correct), (None,) * n, stats, tuple(prompts)
        )


MIXED, ALL_RIGHT, ALL_WRONG = (True, False), (True, True), (False, False)


def test_uninformative_groups_are_dropped_and_refilled_at_the_same_version():
    # round 0: mixed, all right, all wrong -> 1 kept; round 1: all wrong, mixed, mixed -> 3 kept
    maker = FakeMaker([MIXED, ALL_RIGHT, ALL_WRONG, ALL_WRONG, MIXED, MIXED, MIXED, MIXED, MIXED])
    batch = GroupFilter(maker, prompts_per_step=3).make(7, 5, {})
    assert batch.index == 7 and batch.version == 5 and all(s.version == 5 for s in batch.samples)
    assert [g.prompt.problem.id for g in groups_of(batch)] == ["0", "4", "5"]  # every kept group is informative
    assert [s.group for s in batch.samples] == [0, 0, 1, 1, 2, 2]  # renumbered, contiguous
    assert len(batch.correct) == len(batch.rewards) == len(batch.samples) == 6
    assert maker.calls == [7, 7 + REFILL_STRIDE]  # the refill's seed index is never a real batch's
    assert batch.stats["filter/extra_rounds"] == 1 and batch.stats["filter/dropped_groups"] == 3
    assert batch.stats["reward/accuracy"] == 0.5  # the first round's, on fresh prompts
    assert batch.stats["time/rollout_s"] == 2.0 and batch.stats["filter/topped_up_groups"] == 0
    assert maker.cursor == 6  # the surplus group of round 1 was discarded, its prompt consumed


def test_rounds_are_bounded_and_a_short_batch_is_topped_up_with_dropped_groups():
    maker = FakeMaker([ALL_WRONG] * 30)
    batch = GroupFilter(maker, prompts_per_step=3, max_extra_rounds=2).make(1, 0, {})
    assert len(maker.calls) == 3  # the batch and two refills, no more
    assert len(groups_of(batch)) == 3 and len(batch.samples) == 6  # sizes stay what the config says
    assert batch.stats["filter/extra_rounds"] == 2 and batch.stats["filter/topped_up_groups"] == 3


def test_a_full_batch_needs_no_refill_and_state_is_the_makers():
    maker = FakeMaker([MIXED] * 6)
    f = GroupFilter(maker, prompts_per_step=3)
    batch = f.make(1, 0, {})
    assert maker.calls == [1] and batch.stats["filter/extra_rounds"] == 0
    assert f.state_dict() == {"cursor": 3}
    f.load_state_dict({"cursor": 0})
    assert maker.cursor == 0


def test_correctness_not_shaped_reward_decides():
    # all-wrong groups whose shaped rewards differ (overlong penalty) are still dropped
    maker = FakeMaker([ALL_WRONG, MIXED, MIXED, MIXED])
    batch = GroupFilter(maker, prompts_per_step=1).make(1, 0, {})
    assert [g.prompt.problem.id for g in groups_of(batch)] == ["1"]
