"""Making a rollout batch (RolloutMaker) and moving the ranks' shares of it as flat tensors."""

from types import SimpleNamespace

import torch

from bapo.rollout_maker import RolloutMaker, decode_share, encode_share, merge_stats
from bapo.samples import Problem, Prompt, RolloutBatch, Sample
from bapo.seeding import derive_seed


def prompt(i: int) -> Prompt:
    return Prompt(Problem(f"p{i}", f"What is {i}?", str(i)), f"<{i}>", (1, 2, i))


def share(prompts, rank: int, world: int) -> RolloutBatch:
    """Rank ``rank``'s share: two samples per prompt of its slice, with awkward texts and answers."""
    samples, extracted = [], []
    for j, p in enumerate(prompts[rank::world]):
        for k in range(2):
            n = 3 + j + k
            ids = torch.arange(n, dtype=torch.long) + 10 * rank
            logp = -torch.rand(n, generator=torch.Generator().manual_seed(100 * rank + 10 * j + k))
            text = f"rank {rank} ünïcødé ∑ {j}.{k}\n\\boxed{{{j}}}"
            samples.append(Sample(p, rank + world * j, ids, logp, text, 7, bool(k)))
            extracted.append(None if k else f"{j}½")
    n = len(samples)
    stats = {"reward/accuracy": 0.5, "time/rollout_s": 1.0 + rank, "reward/timeouts": 1.0}
    rewards, correct = tuple(float(i) for i in range(n)), tuple(i % 2 == 0 for i in range(n))
    return RolloutBatch(3, 7, tuple(samples), rewards, correct, tuple(extracted), stats, tuple(prompts))


def test_a_share_survives_the_tensor_encoding_exactly():
    prompts = [prompt(i) for i in range(5)]
    mine = share(prompts, 1, 2)
    back = decode_share(encode_share(mine), mine)
    assert len(back.samples) == len(mine.samples)
    for a, b in zip(mine.samples, back.samples, strict=True):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp, b.logp)
        assert (a.text, a.group, a.truncated, a.version) == (b.text, b.group, b.truncated, b.version)
        assert b.prompt is prompts[b.group]  # rebuilt from the batch's prompts, the same on every rank
    assert (back.rewards, back.correct, back.extracted) == (mine.rewards, mine.correct, mine.extracted)
    assert back.stats == mine.stats and all(isinstance(t, torch.Tensor) for t in encode_share(mine))


def test_merged_stats_take_the_slowest_rank_and_add_counts():
    m = merge_stats([{"time/rollout_s": 1.0, "reward/timeouts": 1.0, "x": 2.0}, {"time/rollout_s": 3.0,
                     "reward/timeouts": 2.0, "x": 4.0}])  # fmt: skip
    assert m == {"time/rollout_s": 3.0, "reward/timeouts": 3.0, "x": 3.0}


class FakeEngine:
    version = 0

    def __init__(self):
        self.loads, self.seeds = [], []

    def load_weights(self, weights, version):
        self.loads.append(version)
        self.version = version
        return 0.5

    def generate(self, prompts, *, seed=None):
        self.seeds.append(seed)
        return [Sample(p, g, torch.tensor([5, 2]), torch.tensor([-0.5, -0.1]), f"\\boxed{{{p.problem.answer}}}",
                       self.version, False) for g, p in enumerate(prompts)]  # fmt: skip


class FakeVerifier:
    def grade(self, texts, answers):
        grades = [SimpleNamespace(reward=1.0, correct=True, extracted=a) for a in answers]
        return grades, SimpleNamespace(as_dict=lambda: {"reward/accuracy": 1.0}, verify_s=0.01)


class Stream:
    def __init__(self):
        self.i = 0

    def __next__(self):
        self.i += 1
        return prompt(self.i)

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def test_the_maker_loads_the_asked_version_seeds_by_batch_and_keeps_the_cursor():
    engine = FakeEngine()
    maker = RolloutMaker(Stream(), engine, FakeVerifier(), prompts_per_step=4, seed=9, rank=1, world=2,
                         skipped=SimpleNamespace(skipped=3))  # fmt: skip
    batch = maker.make(5, 2, {"w": 0})
    assert engine.loads == [2] and batch.version == 2 and batch.index == 5
    assert engine.seeds == [derive_seed(9, "rollout/rank1", 5)]  # rank 1's own seed for batch 5
    assert [p.problem.id for p in batch.prompts] == ["p1", "p2", "p3", "p4"]  # every rank draws all prompts
    assert [s.prompt.problem.id for s in batch.samples] == ["p2", "p4"]  # and generates its share
    assert [s.group for s in batch.samples] == [1, 3]  # group = the prompt's index in the whole batch
    assert batch.stats["time/sync_s"] == 0.5 and batch.stats["data/skipped_rows"] == 3.0
    maker.make(6, 2, {"w": 0})
    assert engine.loads == [2]  # the engine already holds version 2
    assert maker.state_dict() == {"prompts": {"i": 8}}
