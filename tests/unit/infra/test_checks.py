"""bapo/infra/checks.py: a group typed against its schema."""

from dataclasses import dataclass, field

import pytest

from bapo.infra.checks import ConfigError, typed


@dataclass
class Inner:
    k: int = 1


@dataclass
class Group:
    a: int = 0
    names: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)


def test_each_group_is_typed_from_the_schema_alone():
    # the schema's template is built once and reused: one group's values never reach the next
    first = typed("g", {"a": 5, "names": ["x"], "inner": {"k": 7}}, Group)
    assert first == Group(a=5, names=["x"], inner=Inner(k=7))
    assert typed("g", {}, Group) == Group()
    first.names.append("y")
    first.inner.k = 9
    assert typed("g", {"a": 2}, Group) == Group(a=2)


def test_a_bad_value_names_its_key_every_time():
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"g\.inner\.k"):
            typed("g", {"inner": {"k": "many"}}, Group)
    assert typed("g", {"inner": {"k": 3}}, Group).inner.k == 3


def test_a_registry_takes_only_its_own_kind_from_an_import_path():
    """``plugin``: one check for every registry (objectives, engines, placements, and the next one, a reward)."""
    from bapo.infra.checks import lacks_factory, plugin

    def build(cfg):
        return ("built", cfg)

    registry = {"mine": build, "dotted": "tests.unit.infra.test_checks:_one_arg"}  # an object, or where it is
    lacks = lacks_factory("make(cfg) -> Thing")
    assert plugin("mine", registry, "thing.kind", kind="a thing factory", lacks=lacks) is build
    assert plugin("dotted", registry, "thing.kind", kind="a thing factory", lacks=lacks) is _one_arg
    assert plugin("json:dumps", registry, "thing.kind", kind="a thing factory", lacks=lacks)  # one argument: the kind
    for name, says in [
        ("os:system", "'os:system' is not a thing factory: a builtin_function_or_method is not a function make(cfg)"),
        ("subprocess:Popen", "a type is not a function"),
        ("subprocess:run", "it takes (*popenargs, input=None"),
        ("nowhere", "thing.kind: must be one of ['dotted', 'mine'] or an import path package.module:Name"),
        ("no_such_pkg:x", "thing.kind: cannot import 'no_such_pkg:x'"),
    ]:
        with pytest.raises(ConfigError) as e:
            plugin(name, registry, "thing.kind", kind="a thing factory", lacks=lacks)
        assert str(e.value).startswith("thing.kind: ") and says in str(e.value) and "\n" not in str(e.value), e.value


def _one_arg(cfg, *, option=1):
    return cfg
