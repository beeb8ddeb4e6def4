"""The engine-vs-learner log-prob check with ``learner.old_logp=rollout``: the learner re-scores a sampled share of
a batch's rows at the weights that generated them and logs ``rollout/logp_mismatch_*``, leaving the engine's
log-probs as the behaviour policy. Hand-checked values: an engine whose log-probs are the learner's plus known
offsets."""

import dataclasses

import pytest
import torch

from bapo.algos import surrogate_objective
from bapo.algos.correction import logp_mismatch
from bapo.experience.scoring import check_logp, check_rows
from bapo.learner import Learner
from bapo.samples import Problem, Prompt, RolloutBatch, Sample
from tests.helpers.config import learner_cfg

KEYS = {f"rollout/logp_mismatch_{k}" for k in ("mean", "max", "frac", "tokens")}


def batch_of(rows: int, length: int = 5, version: int = 0, vocab: int = 300) -> RolloutBatch:
    """``rows`` samples of ``length`` random response tokens, in groups of two; engine log-probs -1."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(rows):
        prompt = Prompt(Problem(str(i // 2), "p", "1"), "p", (5, 6, 7 + i // 2))
        ids = torch.randint(3, vocab, (length,), generator=g)
        samples.append(Sample(prompt, i // 2, ids, torch.full((length,), -1.0), "t", version, False))
    n = len(samples)
    return RolloutBatch(1, version, tuple(samples), (0.0,) * n, (False,) * n, (None,) * n, {})


def learner(model) -> Learner:
    return Learner(
        model, learner_cfg(), objective=surrogate_objective("fixed", ratio_low=0.8, ratio_high=1.2), pad_id=0
    )


class Counting:
    """Wraps ``learner.response_logp``: counts the learner's scoring calls and the rows they score."""

    def __init__(self, lrn):
        self.fn, self.calls, self.rows = lrn.response_logp, 0, 0
        lrn.response_logp = self

    def __call__(self, samples, weights=None):
        self.calls, self.rows = self.calls + 1, self.rows + len(samples)
        return self.fn(samples, weights)


def with_offsets(batch: RolloutBatch, lrn, offsets) -> RolloutBatch:
    """The batch with engine log-probs = the learner's own + ``offsets[i]`` for row i."""
    lp = lrn.response_logp(list(batch.samples))  # [B, T]
    rows = [dataclasses.replace(s, logp=lp[i, : len(s.response_ids)] + offsets[i]) for i, s in enumerate(batch.samples)]
    return dataclasses.replace(batch, samples=tuple(rows))


def test_logp_mismatch_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    engine = torch.tensor([-1.05, -2.0, -0.25, -3.5])  # |d| = 0.05, 0, 0.25, 0.5
    got = logp_mismatch(logp, engine)
    assert got["mean"] == pytest.approx(0.2, abs=1e-6)  # (0.05 + 0 + 0.25 + 0.5) / 4
    assert got["max"] == pytest.approx(0.5) and got["frac"] == 0.5 and got["tokens"] == 4.0  # 0.25, 0.5 > 0.1
    assert logp_mismatch(torch.zeros(0), torch.zeros(0)) == {"mean": 0.0, "max": 0.0, "frac": 0.0, "tokens": 0.0}


def test_an_engine_off_by_known_offsets_gives_their_mean_max_and_share(tiny_model):
    lrn = learner(tiny_model)
    # 4 rows of 5 tokens, engine = learner + 0.05, - 0.3, + 0.05, - 0.3 nats on every token of the row
    batch = with_offsets(batch_of(4), lrn, [0.05, -0.3, 0.05, -0.3])
    got = check_logp(batch, lrn, share=1.0, seed=1)
    assert set(got) == KEYS
    assert got["rollout/logp_mismatch_mean"] == pytest.approx(0.175, abs=1e-5)  # (10 x 0.05 + 10 x 0.3) / 20
    assert got["rollout/logp_mismatch_max"] == pytest.approx(0.3, abs=1e-5)
    assert got["rollout/logp_mismatch_frac"] == 0.5  # the 10 tokens 0.3 off; 0.05 is under 0.1
    assert got["rollout/logp_mismatch_tokens"] == 20.0
    # one offset for all: mean = max = the offset, and nothing over the threshold
    same = with_offsets(batch_of(4), lrn, [0.07] * 4)
    one = check_logp(same, lrn, share=0.25, seed=3)  # a quarter of 4 rows: one row
    assert one["rollout/logp_mismatch_mean"] == pytest.approx(0.07, abs=1e-5)
    assert one["rollout/logp_mismatch_frac"] == 0.0 and one["rollout/logp_mismatch_tokens"] == 5.0


def test_the_batch_is_left_as_it_is(tiny_model):
    lrn = learner(tiny_model)
    batch = with_offsets(batch_of(4), lrn, [0.3] * 4)
    before = [s.logp.clone() for s in batch.samples]
    check_logp(batch, lrn, share=1.0, seed=0)
    assert all(torch.equal(s.logp, b) for s, b in zip(batch.samples, before, strict=True))


def test_the_rows_are_a_share_drawn_by_the_seed_alone():
    batch = batch_of(64)
    a = check_rows(batch, 1 / 16, seed=11)
    assert len(a) == 4 and a == sorted(a) and len(set(a)) == 4
    assert check_rows(batch, 1 / 16, seed=11) == a  # the same seed, the same rows
    assert len({tuple(check_rows(batch, 1 / 16, seed=s)) for s in range(8)}) > 1  # other seeds, other rows
    assert len(check_rows(batch, 1e-6, seed=0)) == 1  # at least one row
    assert check_rows(batch, 1.0, seed=0) == list(range(64))
    assert check_rows(batch, 0.0, seed=0) == []


def test_rows_partly_made_by_older_weights_are_not_checked():
    batch = batch_of(6, version=3)
    mixed = [dataclasses.replace(s, versions=torch.tensor([2, 2, 3, 3, 3])) if i % 2 else s
             for i, s in enumerate(batch.samples)]  # fmt: skip
    batch = dataclasses.replace(batch, samples=tuple(mixed))
    assert check_rows(batch, 1.0, seed=0) == [0, 2, 4]


def test_an_older_batch_is_not_checked(tiny_model):
    """A batch made at an older version (async) is not checked: whether its snapshot is still held depends on the
    producer thread's timing, and which steps log the mismatch must not (an async run's metrics resumed and
    straight differed at step 7 when it was checked whenever the snapshot happened to be there)."""
    lrn = learner(tiny_model)
    batch = with_offsets(batch_of(4), lrn, [0.0] * 4)
    lrn.version = 2
    counted = Counting(lrn)
    assert check_logp(batch, lrn, share=1.0, seed=0) == {}
    assert counted.calls == 0


def test_share_zero_runs_no_forward(tiny_model):
    lrn = learner(tiny_model)
    counted = Counting(lrn)
    assert check_logp(batch_of(8), lrn, share=0.0, seed=0) == {}
    assert counted.calls == 0
    check_logp(batch_of(8), lrn, share=0.25, seed=0)
    assert (counted.calls, counted.rows) == (1, 2)  # one forward, over the sampled rows only


@pytest.mark.parametrize("bad", ["-0.1", "1.5", "nan"])
def test_a_share_outside_0_1_is_refused_naming_the_key(bad):
    from bapo.infra.checks import ConfigError
    from tests.helpers.config import run_config

    with pytest.raises(ConfigError, match=r"^learner\.logp_check_share: must be"):
        run_config(f"learner.logp_check_share={bad}")
