"""The engine-vs-learner log-prob check in the real loop: with the engine's log-probs as the behaviour policy
(``learner.old_logp=rollout``, the default) the learner re-scores ``learner.logp_check_share`` of each batch's
rows and logs ``rollout/logp_mismatch_*``; nothing else in the run moves, and share 0 runs no extra forward.
With ``old_logp=recompute`` every row is already scored once, and nothing is scored twice."""

import json

import pytest

from bapo.learner import Learner
from bapo.loop import run
from bapo.rollout.producer import Producer
from tests.helpers.config import smoke_cfg

pytestmark = pytest.mark.slow  # end to end: real runs of the loop

KEYS = {f"rollout/logp_mismatch_{k}" for k in ("mean", "max", "frac", "tokens")}
TIMING = ("time/", "reward/verify_s", "rollout/tokens_per_s", "buffer/consumer_wait_s", "buffer/producer_wait_s")


def rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def counted_run(monkeypatch, path, overrides) -> list[int]:
    """Run ``debug=smoke`` with ``overrides``; the sizes of the learner's scoring calls (``response_logp``). Each
    comes after the source was told to free the device (``before_updates``: a colocated vLLM sleeps), as the
    learner's updates do: a forward beside an awake engine is in no memory plan."""
    calls, events, real, freed = [], [], Learner.response_logp, Producer.before_updates

    def counting(self, samples, weights=None):
        calls.append(len(samples))
        events.append("score")
        return real(self, samples, weights)

    def freeing(self):
        events.append("free")
        return freed(self)

    monkeypatch.setattr(Learner, "response_logp", counting)
    monkeypatch.setattr(Producer, "before_updates", freeing)
    run(smoke_cfg(overrides), path)
    monkeypatch.undo()
    assert all(i > 0 and events[i - 1] == "free" for i, e in enumerate(events) if e == "score"), events
    return calls


def test_the_check_is_on_by_default_logs_its_keys_and_moves_nothing_else(tmp_path, monkeypatch):
    calls = counted_run(monkeypatch, tmp_path / "on", [])
    off = counted_run(monkeypatch, tmp_path / "off", ["learner.logp_check_share=0"])
    # debug=smoke: 3 batches of 4 prompts x 4 samples; 1/16 of 16 rows is one row a batch
    assert calls == [1, 1, 1] and off == []  # share 0: no extra forward
    on_rows, off_rows = rows(tmp_path / "on"), rows(tmp_path / "off")
    for r in on_rows[1:]:
        assert KEYS <= r.keys(), sorted(r)
        # the HF engine samples with the learner's fp32 weights and kernels: the same log-probs up to rounding
        assert 0 <= r["rollout/logp_mismatch_mean"] <= r["rollout/logp_mismatch_max"] < 1e-4
        assert r["rollout/logp_mismatch_frac"] == 0.0 and r["rollout/logp_mismatch_tokens"] >= 1
    assert not any(KEYS & r.keys() for r in off_rows)
    for a, b in zip(on_rows, off_rows, strict=True):  # every other metric is the run without the check's
        keep = {k: v for k, v in a.items() if k not in KEYS and not k.startswith(TIMING)}
        assert keep == {k: v for k, v in b.items() if not k.startswith(TIMING)}


def test_recompute_scores_every_row_once_and_logs_the_same_keys(tmp_path, monkeypatch):
    calls = counted_run(monkeypatch, tmp_path, ["learner.old_logp=recompute"])
    assert calls == [16, 16, 16]  # the whole batch, once: no sampled check on top
    for r in rows(tmp_path)[1:]:
        assert KEYS <= r.keys() and r["rollout/logp_mismatch_max"] < 1e-4
        assert r["rollout/logp_mismatch_tokens"] == pytest.approx(16 * r["rollout/response_len"])  # every token
