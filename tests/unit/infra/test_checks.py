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
