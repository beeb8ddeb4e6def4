"""The contract every objective keeps, over the registry and every shipped conf/algo/*.yaml.

A new loss is done when these pass for its YAML: ``choose`` then ``loss`` give a finite loss and gradient;
the chooser reports the common window stats ``clip/low``, ``clip/high``, ``clip/rho``; on-policy input
(ratio 1) gives the plain policy gradient of the objective's aggregation; masked tokens change nothing.
The last test plugs a loss in from an import path outside the package and trains a step of train.py with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bapo.algos import OBJECTIVES, LossInputs, build_objective, register_objective
from bapo.algos.config import algo_config
from bapo.algos.surrogate import aggregate
from bapo.infra.checks import ConfigError, to_plain
from tests.helpers.config import compose
from tests.helpers.metrics import rows as metric_rows
from tests.helpers.processes import plugin_env, train_py

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (ROOT / "conf" / "algo").glob("*.yaml"))
B, T = 6, 7


def algo_of(name: str, *overrides: str):
    """The typed algo group of conf/algo/<name>.yaml, as train.py composes it."""
    return algo_config(to_plain(compose(f"algo={name}", *overrides))["algo"])


def batch(seed: int = 0, drift: float = 0.3):
    """logp (a leaf), old_logp, adv, mask [B, T]: two signs of advantage per sequence, ragged lengths."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05  # log-probs in (-3.05, -0.05)
    logp = (old + drift * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)[:, None].expand(B, T).clone()
    lengths = torch.tensor([7, 5, 3, 7, 1, 6])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return logp.requires_grad_(True), old, adv, mask


def choose_as_the_learner(obj, ratio, adv, mask, old):
    """``obj.choose`` called as ``Learner._choose`` calls it: the update's masked tokens as 1-D tensors, a float mask
    of ones, and ``reduce_sum`` (None: one rank)."""
    m = mask.bool()
    r, a, o = ratio[m], adv[m], old[m]
    return obj.choose(r, a, torch.ones_like(r), o, reduce_sum=None)


def step(obj, logp, old, adv, mask):
    ratio = torch.exp(logp.detach() - old)
    params, stats = choose_as_the_learner(obj, ratio, adv, mask, old)
    loss, loss_stats = obj.loss(LossInputs(logp, old, adv, mask), **params, **obj.loss_kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, stats, loss_stats


def test_every_registered_objective_ships_a_config():
    shipped = {algo_of(name).objective for name in SHIPPED}
    assert set(OBJECTIVES) <= shipped, sorted(set(OBJECTIVES) - shipped)


@pytest.mark.parametrize("name", SHIPPED)
def test_choose_then_loss_is_finite_and_reports_the_window(name):
    obj = build_objective(algo_of(name))
    loss, grad, stats, loss_stats = step(obj, *batch())
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad.abs().sum() > 0
    for key in ("clip/low", "clip/high", "clip/rho"):
        assert isinstance(stats[key], float) and torch.isfinite(torch.tensor(stats[key])), (key, stats.get(key))
    assert 0.0 <= stats["clip/low"] < stats["clip/high"] and 0.0 <= stats["clip/rho"] <= 1.0
    assert "pg_loss" in loss_stats


@pytest.mark.parametrize("name", SHIPPED)
def test_on_policy_ratios_give_the_policy_gradient(name):
    """At ratio 1 no window clips, no mask drops and every weight is 1: the gradient is the one of
    -agg(A * logp), REINFORCE under the objective's own aggregation."""
    algo = algo_of(name)
    logp, _, adv, mask = batch()
    old = logp.detach().clone()
    _, grad, _, _ = step(build_objective(algo), logp, old, adv, mask)
    ref = torch.zeros_like(logp, requires_grad=True)
    (want,) = torch.autograd.grad(-aggregate(adv * (ref + logp.detach()), mask, agg=algo.agg), ref)
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", SHIPPED)
def test_masked_tokens_change_nothing(name):
    obj = build_objective(algo_of(name))
    logp, old, adv, mask = batch(seed=1)
    loss, grad, stats, _ = step(obj, logp, old, adv, mask)
    dirty_logp = torch.where(mask, logp.detach(), torch.tensor(float("nan"))).requires_grad_(True)
    dirty_old = torch.where(mask, old, torch.tensor(50.0))
    dirty_adv = torch.where(mask, adv, torch.tensor(float("inf")))
    loss2, grad2, stats2, _ = step(obj, dirty_logp, dirty_old, dirty_adv, mask)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad2, grad)
    assert (grad2[~mask] == 0).all()
    assert {k: stats2[k] for k in ("clip/low", "clip/high", "clip/rho")} == {
        k: stats[k] for k in ("clip/low", "clip/high", "clip/rho")
    }


def test_no_clip_is_null_and_means_what_the_old_wide_window_did():
    """m2po and dppo clip no ratio: ``ratio_low``/``ratio_high`` null gives the loss of the window [0, 1e9]
    (and so do GRPO's clip and CISPO's truncation with both bounds null, where no mask hides a bound)."""
    from bapo.algos import surrogate_objective

    no_clip = ("algo.bounds.ratio_low=null", "algo.bounds.ratio_high=null")
    for name, over in (("m2po", ()), ("dppo", ()), ("grpo", no_clip), ("cispo", no_clip)):
        algo = algo_of(name, *over)
        assert algo.bounds.ratio_low is None and algo.bounds.ratio_high is None
        opts = vars(algo.surrogate)
        loss, grad, _, st = step(build_objective(algo), *batch(seed=2, drift=2.0))
        wide = surrogate_objective("fixed", ratio_low=0.0, ratio_high=1e9, **opts, agg=algo.agg)
        loss_w, grad_w, _, st_w = step(wide, *batch(seed=2, drift=2.0))
        assert loss.item() == loss_w.item() and torch.equal(grad, grad_w)
        assert st["clip_frac"] == st_w["clip_frac"]


def test_unknown_or_unimportable_objectives_fail_in_one_line_naming_the_key():
    for value, words in [
        ("ppo_magic", "unknown objective 'ppo_magic'"),
        ("no_such_pkg.loss:build", "cannot import 'no_such_pkg.loss:build' (ModuleNotFoundError"),
        ("bapo.algos.objective:no_such_factory", "cannot import"),
        ("bapo.algos.objective:OBJECTIVES", "is not a function"),
        # before: imported and called with the algo group (os.system(AlgoConfig): a TypeError traceback)
        ("os:system", "'os:system' is not a loss factory: a builtin_function_or_method is not a function build(algo)"),
        ("subprocess:Popen", "is not a loss factory: a type is not a function"),
        ("subprocess:call", "is not a loss factory: it takes (*popenargs, timeout=None, **kwargs), not the one arg"),
    ]:
        with pytest.raises(ConfigError) as e:
            algo_of("grpo", f"algo.objective={value}")
        assert str(e.value).startswith("algo.objective: ") and words in str(e.value) and "\n" not in str(e.value)


def test_a_built_in_objective_refuses_options():
    with pytest.raises(ConfigError, match=r"^algo\.options: surrogate reads no options, got \['eps'\]"):
        algo_of("grpo", "+algo.options.eps=0.1")


def test_a_registered_factory_is_picked_by_name(monkeypatch):
    monkeypatch.setattr("bapo.algos.objective.OBJECTIVES", dict(OBJECTIVES))
    from bapo.algos import objective

    @register_objective("halved")
    def halved(algo):
        obj = objective.build_surrogate(algo)
        loss = obj.loss
        obj.loss = lambda *a, **kw: (lambda out: (out[0] / 2, out[1]))(loss(*a, **kw))
        return obj

    algo = algo_of("grpo", "algo.objective=halved")
    full = step(build_objective(algo_of("grpo")), *batch())[0]
    assert step(build_objective(algo), *batch())[0].item() == pytest.approx(full.item() / 2)
    with pytest.raises(ValueError, match="already registered"):
        register_objective("halved")(halved)


def _plugin_from_docs() -> str:
    """The plugin of docs/extending.md, as a reader copies it: the python block after its marker."""
    text = (ROOT / "docs" / "extending.md").read_text()
    after = text.split("<!-- my_loss.py: read by tests/contracts/test_objective_contract.py -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


PLUGIN = _plugin_from_docs()


@pytest.mark.slow  # one step of train.py in a subprocess
def test_a_loss_plugged_in_from_an_import_path_trains_a_step(tmp_path):
    """A module written outside the package, put on the path, named in algo.objective: nothing of the
    repository is edited. Its options are its own and validated by it; train.py runs a step with it."""
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "my_loss.py").write_text(PLUGIN)
    sys.path.insert(0, str(tmp_path / "plug"))
    try:
        algo = algo_of("grpo", "algo.objective=my_loss:build", "+algo.options.eps=0.25")
        _, grad, stats, _ = step(build_objective(algo), *batch())
        assert stats["clip/high"] == 1.25 and torch.isfinite(grad).all()
        with pytest.raises(ConfigError, match=r"^algo\.options\.eps: must be in \(0, 1\), got 2\.0"):
            algo_of("grpo", "algo.objective=my_loss:build", "+algo.options.eps=2.0")
    finally:
        sys.path.remove(str(tmp_path / "plug"))
        sys.modules.pop("my_loss", None)
    run_dir = tmp_path / "run"
    over = ["algo=grpo", "algo.objective=my_loss:build", "+algo.options.eps=0.25", "train.steps=1", "eval.every=0"]
    train_py("debug=smoke", *over, "data.heldout_size=4", f"hydra.run.dir={run_dir}", timeout=300,
             env=plugin_env(tmp_path / "plug"))  # fmt: skip
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["clip/high"] == 1.25 and rows[1]["clip/low"] == 0.75


def test_decoupled_ppos_loglinear_proximal_is_hooked_by_the_factory():
    exact = build_objective(algo_of("grpo", "algo/correction=decoupled"))
    loglinear = build_objective(algo_of("grpo", "algo/correction=decoupled", "algo.correction.proximal=loglinear"))
    assert exact.proximal is None and callable(loglinear.proximal)


def test_every_algo_config_starts_from_a_base_not_from_another_algorithm():
    """A variant lists conf/algo/base/common (its own loss) or base/surrogate first, never another algorithm."""
    import yaml

    for name in SHIPPED:
        defaults = yaml.safe_load((ROOT / "conf" / "algo" / f"{name}.yaml").read_text())["defaults"]
        assert defaults[0] in ("base/common@_here_", "base/surrogate@_here_"), (name, defaults)
