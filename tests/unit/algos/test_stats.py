"""Merging loss stats over micro-batches and ranks: each mean over its own denominator, maxima maxed."""

import pytest
import torch

from bapo.algos import stats


def test_hand_computed_merge():
    # call A: 4 tokens, 1 positive (clipped), 3 negative (1 clipped); ratio max 1.5, mean 1.1
    # call B: 6 tokens, 4 positive (1 clipped), 2 negative (0 clipped); ratio max 2.0, mean 0.9
    a = {"tokens": 4, "pos_tokens": 1, "neg_tokens": 3, "clip_frac_high": 1.0, "clip_frac_low": 1 / 3,
         "ratio_max": 1.5, "ratio_mean": 1.1, "pg_loss": 0.2}  # fmt: skip
    b = {"tokens": 6, "pos_tokens": 4, "neg_tokens": 2, "clip_frac_high": 0.25, "clip_frac_low": 0.0,
         "ratio_max": 2.0, "ratio_mean": 0.9, "pg_loss": -0.5}  # fmt: skip
    m = stats.merge([a, b])
    assert m["clip_frac_high"] == pytest.approx(2 / 5)  # (1 + 1) clipped of (1 + 4) positive tokens
    assert m["clip_frac_low"] == pytest.approx(1 / 5)  # 1 clipped of 5 negative tokens
    assert m["ratio_mean"] == pytest.approx((4 * 1.1 + 6 * 0.9) / 10)  # token-weighted
    assert m["ratio_max"] == 2.0  # the max, not the mean of maxima (1.75)
    assert m["pg_loss"] == pytest.approx(-0.3)  # shares of one loss add up
    assert (m["tokens"], m["pos_tokens"], m["neg_tokens"]) == (10, 5, 5)


def test_a_call_without_tokens_of_a_sign_adds_nothing_to_that_fraction():
    a = {"tokens": 3, "pos_tokens": 3, "neg_tokens": 0, "clip_frac_low": 0.0, "clip_frac_high": 1 / 3}
    b = {"tokens": 2, "pos_tokens": 0, "neg_tokens": 2, "clip_frac_low": 0.5, "clip_frac_high": 0.0}
    m = stats.merge([a, b])
    assert m["clip_frac_low"] == 0.5 and m["clip_frac_high"] == pytest.approx(1 / 3)
    assert stats.merge([{"tokens": 0, "pos_tokens": 0, "clip_frac_high": 0.0}])["clip_frac_high"] == 0.0


def test_ranks_reduce_sums_and_maxima_separately():
    a = stats.to_sums({"tokens": 4, "pos_tokens": 2, "clip_frac_high": 0.5, "ratio_max": 3.0})
    b = stats.to_sums({"tokens": 2, "pos_tokens": 2, "clip_frac_high": 0.0, "ratio_max": 5.0})
    seen = []

    def two_ranks_sum(t):  # what an all-reduce of the two ranks' vectors gives
        seen.append("sum")
        keys = sorted(k for k in a if k not in stats.MAXIMA)
        return t + torch.tensor([b[k] for k in keys], dtype=torch.float64)

    def two_ranks_max(t):
        seen.append("max")
        return torch.maximum(t, torch.tensor([b["ratio_max"]], dtype=torch.float64))

    m = stats.from_sums(stats.reduce_sums(a, two_ranks_sum, two_ranks_max))
    assert seen == ["sum", "max"]
    assert m == {"tokens": 6, "pos_tokens": 4, "clip_frac_high": 0.25, "ratio_max": 5.0}
    assert stats.reduce_sums(a, None, None) == a  # one process: unchanged
