"""The off-policy toolbox's config keys: each rival's surrogate options build its objective, and the surrogate's
defaults are stated once. Their bad values fail at startup naming the key: tests/unit/test_config.py, with every
variant's."""

from pathlib import Path

import pytest

from bapo.algos import build_objective
from bapo.config import build
from tests.helpers.config import compose

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
    rival = (Path(__file__).resolve().parents[2] / "conf" / "algo" / "cispo.yaml").read_text()
    assert "is_weight: stop_grad" in rival and "ratio_level" not in rival and "token_mask" not in rival
    with pytest.raises(Exception, match="surrogate"):
        build(compose("algo=eps_feedback", "algo.surrogate.token_mask=divergence"), tmp_path)
