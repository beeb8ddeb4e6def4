"""Config errors and the checks every schema uses: one small module for training and evaluation alike.

A schema is a dataclass with ``MISSING`` fields (the defaults live in ``conf/``) whose ``__post_init__``
checks ranges with :func:`require` / :func:`choice`; :func:`typed` merges a plain dict into it through
OmegaConf, so a wrong type, an unknown key or a missing one is refused in one line naming the full key
(``rollout.temperature: must be > 0, got -1.0``), with a ``did you mean`` hint for a key that exists one
sub-group further down. :func:`variant` picks a group's schema by its selector key. A field marked
:func:`resumable` may change when a run is resumed (``bapo.rundir`` derives its list from the marks).

Why OmegaConf structured dataclasses and not pydantic models: Hydra composes the config as OmegaConf
nodes and refuses an unknown override itself (struct mode), with the exception fields (``full_key``,
``key``, ``parent_node``) that ``bapo/entry/cli.py`` reads for its ``did you mean`` hint; merging a group into
its structured schema gives the type checks, unknown keys and the full dotted key of the first error
with no translation. pydantic would be a second validation system beside Hydra's: its ValidationError
lists every error over several lines, with locations that carry a discriminated union's tag
(``('bounds', 'fixed', 'ratio_low')``), all of which must be mapped back to one line per config key;
and the bounds it states on the field (``Field(gt=0)``) are one :func:`require` line here, worded the
same for every key. A variant is picked by its selector key (:func:`variant`) as a discriminator would.

This module imports nothing else of bapo, so ``bapo/algos/`` (the pure math) can use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import inspect
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

RESUMABLE_MARK = "resumable"


class UserError(Exception):
    """Bad input: an entry point reports it in one line, ``error: <Class>: <message>``, and exits with status 2."""


class RunFailed(Exception):
    """A run that failed for a reason its message explains (a full disk, a diverged update, a rollout worker lost
    too often): one line, exit status 1."""


EVERY_RANK = "bapo_every_rank"  # the attribute every_rank() sets on an exception


def every_rank(e: BaseException) -> BaseException:
    """Mark ``e`` as raised by every rank of the run at once (a collective's failure: the same error everywhere),
    so that rank 0's line speaks for the run and the other ranks say nothing (bapo.entry.cli); returns ``e``."""
    setattr(e, EVERY_RANK, True)
    return e


def raised_by_every_rank(e: BaseException) -> bool:
    return bool(getattr(e, EVERY_RANK, False))


class ConfigError(UserError, ValueError):
    """A config key has a bad value; the message names the key."""


def error_line(e: BaseException, message: str | None = None) -> str:
    """``error: <Class>: <message>`` in one line."""
    text = " ".join((str(e) if message is None else message).split("\n")).strip()
    return f"error: {type(e).__name__}: {text}"


def fail(e: BaseException, status: int, message: str | None = None) -> None:
    """Print ``error: <Class>: <message>`` (one line) to stderr and exit with ``status``."""
    print(error_line(e, message), file=sys.stderr)
    sys.exit(status)


def require(cond: bool, key: str, msg: str) -> None:
    """Raise ``ConfigError("<key>: <msg>")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def choice(value: Any, key: str, allowed: tuple) -> None:
    require(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")


def imported(path: str, key: str) -> Any:
    """The object an import path ``package.module:name`` in the config names (a user's own loss or engine,
    outside this repository); a path that does not import is one ConfigError naming ``key``."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # not importable, no such attribute, or the module failed while importing
        raise ConfigError(f"{key}: cannot import {path!r} ({type(e).__name__}: {e})") from None


def plugin(name: str, registry: Mapping[str, Any], key: str, *, kind: str, lacks: Callable[[Any], str | None]) -> Any:
    """The object ``registry`` registers as ``name`` (itself, or a dotted path ``package.module:Name`` imported now), or
    the one the import path ``name`` names (a user's own, outside this repository), checked to be of the registry's
    kind: ``lacks(obj)`` says what it lacks, None when nothing. The one check of every registry (the objectives, the
    engines, the placements, and the next one), since an import path reaches any object of any module (``os:system``,
    ``subprocess:Popen``) and only the registry's own kind may go on to be called with the config. Refused in one line
    naming ``key``: ``'<name>' is not <kind>: <what it lacks>``; an unknown name names the choices."""
    if name in registry:
        obj = registry[name]
        obj = imported(obj, key) if isinstance(obj, str) else obj
    else:
        require(
            ":" in name, key, f"must be one of {sorted(registry)} or an import path package.module:Name, got {name!r}"
        )
        obj = imported(name, key)
    why = lacks(obj)
    require(why is None, key, f"{name!r} is not {kind}: {why}")
    return obj


def lacks_factory(signature: str) -> Callable[[Any], str | None]:
    """:func:`plugin`'s ``lacks`` for a registry of factories: a Python function (not a builtin, not a class) of one
    argument, the config group (``signature``: how the docs write it, e.g. ``build(algo) -> Objective``)."""

    def lacks(obj: Any) -> str | None:
        if not inspect.isfunction(obj):
            return f"a {type(obj).__name__} is not a function {signature}"
        params = list(inspect.signature(obj).parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        required = [p for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
        if len(required) != 1 or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            return f"it takes {inspect.signature(obj)}, not the one argument of a function {signature}"
        return None

    return lacks


class Schemas(Mapping):
    """A registry's names to their schemas, read from the registered classes (``cls_of``) when looked up, so a
    config check imports only the chosen class's module (the selector of a group with variants: :func:`variant`).
    An import path ``package.module:Class`` is a member too."""

    def __init__(self, registry: Mapping[str, str], cls_of: Callable[[str], type]) -> None:
        self.registry, self.cls_of = registry, cls_of

    def __getitem__(self, name: str) -> type:
        if name not in self:
            raise KeyError(name)
        return self.cls_of(name).config

    def __contains__(self, name: object) -> bool:
        return name in self.registry or (isinstance(name, str) and ":" in name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry)

    def __len__(self) -> int:
        return len(self.registry)


def delegated(key: str, check: Callable, *args: Any, **kwargs: Any) -> None:
    """Run a range check that lives with the math (``ValueError``) and report it under ``key``."""
    try:
        check(*args, **kwargs)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def resumable(default: Any = MISSING) -> Any:
    """A schema field that a resumed run may change (a speed, memory or reporting knob: the same loss)."""
    return dataclasses.field(default=default, metadata={RESUMABLE_MARK: True})


def resumable_fields(schema: type) -> set[str]:
    """The names of ``schema``'s fields marked :func:`resumable`."""
    return {f.name for f in dataclasses.fields(schema) if f.metadata.get(RESUMABLE_MARK)}


def did_you_mean(group: str, key: str, tree: Any) -> list[str]:
    """The dotted keys below ``group`` (its plain dict ``tree``) that end in ``key`` one sub-group or more down:
    where a user who wrote ``group.key`` meant to go (``algo.contribution`` -> ``algo.bounds.contribution``)."""
    hits: list[str] = []

    def walk(node: Any, path: str, depth: int) -> None:
        if not isinstance(node, dict) or depth > 8:
            return
        for k, v in node.items():
            here = f"{path}.{k}" if path else str(k)
            if k == key and depth > 0:
                hits.append(here)
            walk(v, here, depth + 1)

    walk(tree, group, 0)
    return sorted(hits)


def typed(key: str, node: Any, schema: type, tree: Any = None) -> Any:
    """``node`` (a plain dict) as an instance of ``schema``; errors name ``key`` and the offending field.

    ``tree``: the whole group as composed (``node`` with its sub-groups), searched for a key that ``node``
    does not have (:func:`did_you_mean`); default ``node``."""
    if not isinstance(node, dict):
        raise ConfigError(f"{key}: expected a group of keys, got {node!r}")
    check_bools(key, node, schema)
    try:
        merged = OmegaConf.merge(_template(schema), node)  # merge copies the template: it stays as built
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        sub = getattr(e, "full_key", None)
        full = (f"{key}.{sub}" if sub and key else (sub or key)) or "config"
        msg = str(e).split("\n")[0]
        unknown = getattr(e, "key", None) if "not in" in msg else None
        hits = did_you_mean(key, unknown, node if tree is None else tree) if isinstance(unknown, str) else []
        hint = f"; did you mean {' or '.join(hits)}?" if hits else ""
        raise ConfigError(f"{full}: {msg}{hint}") from None


@functools.cache
def _template(schema: type) -> DictConfig:
    """``OmegaConf.structured(schema)``, built once per schema (a run checks each group once; the tests, thousands of
    times)."""
    return OmegaConf.structured(schema)


@functools.cache
def _hints(schema: type) -> dict:
    try:
        return typing.get_type_hints(schema)
    except Exception:  # noqa: BLE001 (a name only its module's type checker sees: fall back to the annotation text)
        return {}


def _members(tp: Any) -> set:
    """The types a field's annotation admits: each member of a union (``bool | None``), else the type itself; an
    annotation left as a string (unresolvable) is split on ``|``."""
    if isinstance(tp, str):
        return {{"bool": bool, "None": type(None)}.get(t.strip(), t.strip()) for t in tp.split("|")}
    return set(typing.get_args(tp)) if typing.get_origin(tp) in (typing.Union, types.UnionType) else {tp}


def check_bools(key: str, node: dict, schema: type) -> None:
    """Refuse anything but true or false (or null, where the field allows it) for every ``bool`` field of ``schema``
    and of the schemas nested in it, naming the key: OmegaConf would read ``2``, ``"yes"`` or ``"0"`` as a boolean."""
    hints = _hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in node:
            continue
        value, full, members = node[f.name], f"{key}.{f.name}" if key else f.name, _members(hints.get(f.name, f.type))
        if bool in members and not isinstance(value, bool):
            require(value is None and type(None) in members, full, f"must be true or false, got {value!r}")
        for m in members:
            if dataclasses.is_dataclass(m) and isinstance(value, dict):
                check_bools(full, value, m)


def variant(key: str, node: Any, selector: str, schemas: Mapping[str, type], default: str | None = None) -> Any:
    """The schema of a group with variants, picked by ``node[selector]`` (``default`` where the group has none)."""
    kind = node.get(selector, default) if isinstance(node, dict) else None
    require(kind in schemas, f"{key}.{selector}", f"must be one of {sorted(schemas)}, got {kind!r}")
    return typed(key, node, schemas[kind])


def to_plain(cfg: DictConfig) -> dict:
    """The composed config as plain dicts, interpolations resolved; a missing or unresolvable value names its key."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.full_key or 'config'}: {str(e).splitlines()[0]}") from None


def check_finite(node: Any, prefix: str = "") -> None:
    """Refuse a NaN or an infinity anywhere in the plain config ``node``: no key of this project means anything
    by them (``learner.lr=inf`` would pass ``> 0`` and diverge after the model load; ``nan`` fails every
    comparison in its own way; "no bound" is ``null``). Checked once, before any group's range checks."""
    if isinstance(node, dict):
        for k, v in node.items():
            check_finite(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            check_finite(v, f"{prefix}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{prefix}: must be a finite number, got {node}")


def unknown_option(e: BaseException) -> ConfigError | None:
    """Hydra's error for a config group option that does not exist (``experiment=paper_8b``) as one line naming the
    group and its closest options (``experiment: 'paper_8b' is not an option of this config group; did you mean
    paper_7b?``); None for any other error. The one rule of ``train.py`` and ``eval.py``
    (``bapo.entry.cli.hydra_entry``) and of ``--plan`` (``bapo.entry.plan``, through :func:`known_options`).

    Hydra raises that error only for a group whose default is not ``optional``: an optional default skips a
    missing option, and an override keeps the default's ``optional`` flag, so ``experiment=paper_8b`` on an
    ``- optional experiment: null`` default composed nothing and trained the defaults. conf/ therefore declares
    its placeholder groups as ``- experiment: null``."""
    options, missing = getattr(e, "options", None), getattr(e, "missing_cfg_file", None)
    if not isinstance(missing, str) or "/" not in missing or not type(e).__name__ == "MissingConfigException":
        return None
    group, _, name = missing.rpartition("/")
    if options is None:  # an item of a list (eval=[arith,aime2x]): Hydra names no options, its search path does
        roots = re.findall(r"path=file://(\S+)", str(e))
        options = sorted({p.stem for root in roots for p in Path(root, group).glob("*.yaml")})
    if not options:
        return None
    lower = {o.lower(): o for o in options}
    close = [lower[o] for o in difflib.get_close_matches(name.lower(), list(lower), n=3, cutoff=0.6)]
    hint = f"did you mean {' or '.join(close)}?" if close else f"choose from {', '.join(sorted(options))}"
    return ConfigError(f"{group}: {name!r} is not an option of this config group; {hint}")


@contextlib.contextmanager
def known_options() -> Iterator[None]:
    """Raise :func:`unknown_option`'s ConfigError in place of Hydra's error for an unknown group option."""
    try:
        yield
    except Exception as e:
        err = unknown_option(e)
        if err is None:
            raise
        raise err from None
