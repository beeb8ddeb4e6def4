"""Making a rollout batch (RolloutMaker) and moving the ranks' shares of it as flat tensors."""

from types import SimpleNamespace

import torch

from bapo.infra.seeding import derive_seed
from bapo.rollout.maker import RolloutMaker, decode_share, encode_share, merge_stats
from bapo.samples import Partial, Problem, Prompt, RolloutBatch, Sample


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


# ----------------------------------------------------------------------------- partial rollouts


class SegmentEngine(FakeEngine):
    """An engine whose response with seed s is ``length(s)`` tokens long (stopping with id 2, unless it
    reaches max_new_tokens): ``extend`` draws at most ``budget`` of them and tags them with its version."""

    stop_ids = (2,)

    def __init__(self, n=2, max_new_tokens=12, lengths=None):
        super().__init__()
        self.n, self.max_new_tokens = n, max_new_tokens
        self.lengths = lengths or (lambda seed: 1 + seed % (2 * max_new_tokens))
        self.calls = []

    def extend(self, partials, *, budget):
        self.calls.append(len(partials))
        out = []
        for p in partials:
            total = min(self.lengths(p.seed), self.max_new_tokens)
            k = min(budget, total - len(p.response_ids))
            stops = total < self.max_new_tokens and len(p.response_ids) + k == total
            ids = torch.tensor([5] * (k - 1) + [2 if stops else 5], dtype=torch.long)
            out.append(Partial(p.prompt, torch.cat([p.response_ids, ids]), torch.cat([p.logp, -0.1 * torch.ones(k)]),
                               torch.cat([p.versions, torch.full((k,), self.version)]), p.seed, p.segments + 1,
                               stops))  # fmt: skip
        return out

    def complete(self, p, group):
        return Sample(p.prompt, group, p.response_ids, p.logp, f"\\boxed{{{p.prompt.problem.answer}}}",
                      int(p.versions.min()), not p.stopped, p.versions)  # fmt: skip


def partial_maker(engine, quota=3, budget=4, seed=5):
    return RolloutMaker(Stream(), engine, FakeVerifier(), prompts_per_step=quota, seed=seed, partial_budget=budget)


def test_every_step_emits_the_quota_of_whole_groups_within_s_minus_1_steps_of_admission():
    assert max(emit_and_check(seed) for seed in range(40)) == 2  # the bound holds, and is reached


def emit_and_check(seed):
    # S = ceil(12 / 4) = 3 segments at most: a group admitted at step t0 must be out by step t0 + 2, the pool
    # never holds more than 2 x quota groups, and every emitted response has finished.
    engine = SegmentEngine(n=2, max_new_tokens=12)
    quota, maker = 3, partial_maker(engine, quota=3, budget=4, seed=seed)
    admitted_at, ages, emitted = {}, [], set()
    for t in range(1, 16):
        engine.version = 10 * t
        batch = maker.make(t, 10 * t, {})
        for g in maker.pool.groups:
            admitted_at.setdefault(g[0].prompt.problem.id, t)
        assert len(batch.samples) == quota * engine.n and len(batch.prompts) == quota
        assert [s.group for s in batch.samples] == [g for g in range(quota) for _ in range(engine.n)]
        for s in batch.samples:
            pid = s.prompt.problem.id
            assert pid not in emitted  # each group goes out once
            ages.append(t - admitted_at.get(pid, t))
            assert not s.truncated or len(s.response_ids) == 12
            assert s.version == int(s.versions.min()) and s.versions.tolist() == sorted(s.versions.tolist())
            assert (s.versions >= 10 * (t - 2)).all() and (s.versions <= 10 * t).all()  # no token older than S - 1
        emitted |= {s.prompt.problem.id for s in batch.samples}
        assert len(maker.pool.groups) <= quota  # what is left for the next step: at most 2q - q
        assert batch.stats["rollout/pool_groups"] == len(maker.pool.groups)
    assert max(ages) <= 2
    return max(ages)


def test_a_pool_of_short_responses_is_one_round_of_fresh_groups():
    # Every response fits in one segment: each step admits the quota, extends it once, emits it; nothing waits.
    engine = SegmentEngine(n=2, max_new_tokens=12, lengths=lambda seed: 3)
    maker = partial_maker(engine, quota=3, budget=4)
    for t in range(1, 4):
        batch = maker.make(t, t, {})
        st = batch.stats
        assert st["rollout/admitted_groups"] == 3 and st["rollout/pool_groups"] == st["rollout/forced_groups"] == 0
        assert st["rollout/resumed_frac"] == 0 and st["rollout/segments_per_response"] == 1
        assert st["rollout/reprefill_tokens"] == 0 and st["rollout/new_tokens"] == 18
    assert [p.problem.id for p in batch.prompts] == ["p7", "p8", "p9"]


def test_long_responses_fill_the_pool_then_the_oldest_are_completed_with_the_steps_weights():
    engine = SegmentEngine(n=2, max_new_tokens=12, lengths=lambda seed: 100)  # every response is truncated
    maker = partial_maker(engine, quota=2, budget=4)
    engine.version = 7
    batch = maker.make(1, 7, {})
    st = batch.stats
    # Admitted 2, none finished; admitted 2 more (the pool's cap, 2 x 2); the 2 oldest completed at once.
    assert st["rollout/admitted_groups"] == 4 and st["rollout/forced_groups"] == 2 and st["rollout/pool_groups"] == 2
    assert [p.problem.id for p in batch.prompts] == ["p1", "p2"]
    assert all(s.truncated and s.versions.tolist() == [7] * 12 for s in batch.samples)
    assert engine.calls == [4, 4, 4]  # 2 groups x 2, then the 2 fresh ones, then the 2 oldest in one segment
    engine.version = 8
    batch = maker.make(2, 8, {})
    assert [p.problem.id for p in batch.prompts] == ["p3", "p4"]  # the leftovers, 4 tokens old, finished now
    assert all(s.versions.tolist() == [7] * 4 + [8] * 8 for s in batch.samples)
    # step 2: the leftovers extended (4 x 4 tokens re-prefilled), p5 and p6 admitted, then the leftovers completed
    assert batch.stats["rollout/reprefill_tokens"] == 4 * 4 + 4 * 8


def test_the_pool_is_in_the_makers_state_and_a_reloaded_maker_makes_the_same_batches(tmp_path):
    from bapo import checkpoint

    def run(maker, engine, steps):
        out = []
        for t in steps:
            engine.version = t
            b = maker.make(t, t, {})
            out.append([(s.prompt.problem.id, s.response_ids.tolist(), s.versions.tolist()) for s in b.samples])
        return out

    lengths = lambda seed: 2 + seed % 20  # noqa: E731
    engine = SegmentEngine(n=3, max_new_tokens=12, lengths=lengths)
    a = partial_maker(engine, quota=2, budget=4, seed=3)
    full = run(a, engine, range(1, 9))
    engine = SegmentEngine(n=3, max_new_tokens=12, lengths=lengths)
    b = partial_maker(engine, quota=2, budget=4, seed=3)
    first = run(b, engine, range(1, 5))
    assert b.pool.groups  # something is in flight at the checkpoint
    checkpoint.write(tmp_path / "m.pt", {"maker": b.state_dict()})  # the checkpoint's own format: no pickle
    state = checkpoint.from_plain(torch.load(tmp_path / "m.pt", weights_only=True))["maker"]
    engine = SegmentEngine(n=3, max_new_tokens=12, lengths=lengths)
    c = partial_maker(engine, quota=2, budget=4, seed=3)
    c.load_state_dict(state)
    assert first + run(c, engine, range(5, 9)) == full
