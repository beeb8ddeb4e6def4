"""The placement seam (``bapo.rollout.placement``): every registered placement, and every YAML in conf/placement/,
meets the contract by itself; the config, the composition and the memory plan read a placement's class and traits,
never its name."""

import dataclasses
import re

import pytest

from bapo.config import build
from bapo.infra.checks import ConfigError
from bapo.plan.memory import setup
from bapo.rollout.disaggregated import Disaggregated
from bapo.rollout.placement import (
    PLACEMENT_CONFIGS,
    PLACEMENTS,
    Colocated,
    Placement,
    PlacementConfig,
    PlacementTraits,
    placement_class,
)
from tests.helpers.config import compose, run_config
from tests.helpers.paths import ROOT

YAMLS = sorted(p.stem for p in (ROOT / "conf" / "placement").glob("*.yaml"))


@pytest.mark.parametrize("mode", sorted(PLACEMENTS))
def test_each_registered_placement_declares_its_traits_schema_and_interface(mode):
    cls = placement_class(mode)
    assert issubclass(cls, Placement) and isinstance(cls.traits, PlacementTraits)
    assert issubclass(cls.config, PlacementConfig) and PLACEMENT_CONFIGS[mode] is cls.config
    for method in ("check", "rollout", "source", "stop"):
        assert callable(getattr(cls, method)), (mode, method)
    # every placement has the keys the stages and the plan read, whatever else it adds
    common = {f.name for f in dataclasses.fields(PlacementConfig)}
    assert common <= {f.name for f in dataclasses.fields(cls.config)}


@pytest.mark.parametrize("name", YAMLS)
def test_each_placement_yaml_builds_into_its_modes_schema(name):
    rc = run_config(f"placement={name}", "logger=none")
    cls = placement_class(rc.placement.mode)
    assert type(rc.placement) is cls.config, name
    assert rc.placement.name == name
    cls.check(rc, 1)  # the shipped YAML passes its own placement's start-up checks


def test_the_registry_names_the_modes_the_yamls_use():
    modes = {run_config(f"placement={n}", "logger=none").placement.mode for n in YAMLS}
    assert modes == set(PLACEMENTS)


def test_a_key_of_another_mode_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"^placement\.host: Key 'host' not in 'PlacementConfig'"):
        run_config("+placement.host=10.0.0.1")
    assert run_config("placement=disaggregated", "placement.host=10.0.0.1").placement.host == "10.0.0.1"


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("nowhere", re.escape(f"must be one of {sorted(PLACEMENTS)}")),
        ("collections:OrderedDict", r"is not a placement: it needs to subclass"),
        ("no_such_module:Placement", r"cannot import 'no_such_module:Placement'"),
    ],
)
def test_an_unknown_or_foreign_mode_is_one_config_error_naming_the_key(mode, says):
    with pytest.raises(ConfigError, match=rf"^placement\.mode: .*{says}"):
        build(compose(f"+placement.mode={mode}", "logger=none"), "/tmp/bapo-test-run")


class Elsewhere(Colocated):
    """A user's placement, named by import path: rollout said to be in processes of its own."""

    traits = PlacementTraits(in_workers=True)


def test_the_memory_plan_and_the_start_up_check_read_the_traits_not_the_name(monkeypatch):
    rc = run_config("logger=none")
    assert not setup(rc, world=1, gpu_memory_gib=80).workers
    monkeypatch.setitem(PLACEMENTS, "colocated", f"{__name__}:Elsewhere")
    assert setup(rc, world=1, gpu_memory_gib=80).workers  # the same config, the traits of another class
    # the disaggregated mode's refusal follows its check, run through the config's own combination check
    monkeypatch.setattr(Disaggregated, "check", staticmethod(lambda rc, world: None))
    run_config("placement=disaggregated", "rollout=vllm", "logger=none")
