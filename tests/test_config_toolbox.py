"""The off-policy toolbox's config keys: the rivals' surrogate options, validated at startup naming the key."""

import pytest

from bapo.config import ConfigError, build
from bapo.loop import make_objective
from tests.conftest import compose

RIVALS = ["cispo", "m2po", "topr", "dppo", "gspo"]


@pytest.mark.parametrize("algo", RIVALS)
def test_each_rival_builds_its_objective(algo, tmp_path):
    rc = build(compose(f"algo={algo}"), tmp_path)
    obj = make_objective(rc.algo)
    assert obj.loss_kw["ratio_level"] == rc.algo.surrogate.ratio_level
    assert obj.prepass == (algo == "m2po")  # M2PO's mask is chosen over the whole update


def test_the_default_has_no_surrogate_keys(tmp_path):
    rc = build(compose(), tmp_path)
    assert rc.algo.surrogate is None
    with pytest.raises(Exception, match="surrogate"):
        build(compose("algo.surrogate.token_mask=divergence"), tmp_path)


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
