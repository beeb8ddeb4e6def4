"""Every reward of the registry (bapo/reward/registry.py), and one plugged in from outside the package, against the
reward's contract: built from its composed config by the one builder training and eval.py use, it grades a batch (a
Grade per response, right answers 1, wrong ones ``format_reward`` or 0, the extracted text), reports RewardStats whose
counts add up, closes, and is a context manager. An import path that is not a reward class is refused by the
registry's one check, naming ``reward.kind``."""

import subprocess
import sys

import pytest

from bapo.config import build
from bapo.infra.checks import ConfigError
from bapo.reward import REWARDS, Grade, RewardStats, Verifier, build_verifier
from tests.helpers.config import compose
from tests.helpers.metrics import rows as metric_rows
from tests.helpers.paths import ROOT
from tests.helpers.processes import plugin_env, train_py

RESPONSES = [r"so \boxed{12}", r"\boxed{7}", "no answer here", r"\boxed{1/2}"]
ANSWERS = ["12", "8", "3", "1/2"]


def _contract(verifier, *, right: list[bool]) -> None:
    assert isinstance(verifier, Verifier)
    with verifier as v:
        grades, stats = v.grade(RESPONSES, ANSWERS)
        assert len(grades) == len(RESPONSES) and all(isinstance(g, Grade) for g in grades)
        assert [g.correct for g in grades] == right
        assert [g.extracted for g in grades] == ["12", "7", None, "1/2"]
        assert [g.reward for g in grades] == [1.0 if ok else 0.0 for ok in right]  # format_reward 0 by default
        assert isinstance(stats, RewardStats) and stats.total == 4 and stats.correct == sum(right)
        assert stats.no_answer + stats.fast_path + stats.verified == stats.total
        metrics = stats.as_dict()
        assert metrics["reward/accuracy"] == sum(right) / 4 and metrics["reward/no_answer"] == 1.0
        again, _ = v.grade(RESPONSES[:1], ANSWERS[:1])  # usable again
        assert again[0].correct


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_every_registered_reward_meets_the_contract(name, tmp_path):
    # its own YAML where it ships one (docs/extending.md: conf/reward/<name>.yaml), else the kind on math's keys
    pick = f"reward={name}" if (ROOT / "conf" / "reward" / f"{name}.yaml").exists() else f"reward.kind={name}"
    rc = build(compose(pick, "reward.num_workers=1"), tmp_path)
    assert rc.reward.kind == name
    _contract(build_verifier(rc.reward), right=[True, False, False, True])


def test_an_import_path_that_is_not_a_reward_class_is_refused(tmp_path):
    for path, why in (
        ("os:system", "a builtin_function_or_method is not a class"),
        ("bapo.reward.pool:Grade", "it needs"),
        ("bapo.reward:nope", "cannot import"),
    ):
        with pytest.raises(ConfigError, match=rf"^reward\.kind: .*{why}"):
            build(compose(f"reward.kind={path}"), tmp_path)


def _reward_plugin_from_docs() -> str:
    """The reward plugin of docs/extending.md, as a reader copies it: the python block after its marker."""
    text = (ROOT / "docs" / "extending.md").read_text()
    after = text.split("<!-- my_reward.py: read by tests/contracts/test_reward_contract.py -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow  # a step of train.py and an eval.py in subprocesses
def test_a_reward_plugged_in_from_an_import_path_runs_the_contract(tmp_path):
    """A module written outside the package, named in reward.kind: its own schema types its own key, it builds
    through the same config check and builder as the shipped reward, it meets the contract, and train.py and eval.py
    run with it. Nothing of the repository is edited."""
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "my_reward.py").write_text(_reward_plugin_from_docs())
    sys.path.insert(0, str(plug))
    try:
        over = ["reward.kind=my_reward:ExactMatch", "+reward.case_sensitive=false"]
        rc = build(compose(*over), tmp_path / "cfg")
        assert type(rc.reward).__name__ == "ExactConfig" and rc.reward.case_sensitive is False
        with pytest.raises(ConfigError, match=r"^reward\.case_sensitive: "):
            build(compose(over[0], "+reward.case_sensitive=3"), tmp_path / "cfg")
        # exact text: 1/2 is right by its text; math-verify would also accept 0.5, the plug-in does not
        _contract(build_verifier(rc.reward), right=[True, False, False, True])
    finally:
        sys.path.remove(str(plug))
        sys.modules.pop("my_reward", None)
    env = plugin_env(plug)
    run_dir = tmp_path / "run"
    train_py("debug=smoke", *over, "train.steps=1", "eval.every=0", "data.heldout_size=4",
             f"hydra.run.dir={run_dir}", timeout=300, env=env)  # fmt: skip
    assert [r["step"] for r in metric_rows(run_dir)] == [0, 1]
    assert "reward/accuracy" in metric_rows(run_dir)[1]
    out = tmp_path / "eval"
    cmd = [sys.executable, "eval.py", "model=tiny", "eval=arith", "eval.limit=4", "k=1", *over, f"hydra.run.dir={out}"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (out / "results.json").is_file()
