"""The off-policy toolbox's config keys: the rivals' surrogate options, validated at startup naming the key."""

from pathlib import Path

import pytest

from bapo.algos import build_objective
from bapo.config import ConfigError, build
from tests.conftest import compose

RIVALS = ["cispo", "m2po", "topr", "dppo", "gspo"]


@pytest.mark.parametrize("algo", RIVALS)
def test_each_rival_builds_its_objective(algo, tmp_path):
    rc = build(compose(f"algo={algo}"), tmp_path)
    obj = build_objective(rc.algo)
    assert obj.loss_kw["ratio_level"] == rc.algo.surrogate.ratio_level
    assert obj.prepass == (algo == "m2po")  # M2PO's mask is chosen over the whole update


def test_the_default_surrogate_is_ppos_clip_stated_once(tmp_path):
    """BAPO and GRPO get the surrogate's defaults from conf/algo/base/surrogate.yaml; a rival states only what
    it changes, and the eps-feedback heuristic (its own loss) has no surrogate keys to set."""
    for algo in ("bapo", "grpo"):
        s = build(compose(f"algo={algo}"), tmp_path).algo.surrogate
        assert vars(s) == dict(
            ratio_level="token", is_weight="clip", positive_weight="ratio", token_mask="none", mask_threshold=None
        )
    rival = (Path(__file__).resolve().parents[1] / "conf" / "algo" / "cispo.yaml").read_text()
    assert "is_weight: stop_grad" in rival and "ratio_level" not in rival and "token_mask" not in rival
    with pytest.raises(Exception, match="surrogate"):
        build(compose("algo=eps_feedback", "algo.surrogate.token_mask=divergence"), tmp_path)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["algo=cispo", "algo.surrogate.mask_threshold=0.1"], "algo.surrogate.mask_threshold"),
        (["algo=dppo", "algo.surrogate.mask_threshold=null"], "algo.surrogate.mask_threshold"),
        (["algo=dppo", "algo.surrogate.mask_threshold=-1"], "algo.surrogate.mask_threshold"),
        (["algo=gspo", "algo.surrogate.ratio_level=segment"], "algo.surrogate.ratio_level"),
        (["algo=gspo", "algo.surrogate.positive_weight=one"], "algo.surrogate.positive_weight"),
        (["algo=cispo", "algo.dual_clip=3.0"], "algo.dual_clip"),
        (["algo=topr", "algo.bounds.ratio_low=1.5"], "algo.bounds"),
    ],
)
def test_bad_surrogate_values_name_the_key(overrides, key, tmp_path):
    with pytest.raises(ConfigError, match=f"^{key}"):
        build(compose(*overrides), tmp_path)
