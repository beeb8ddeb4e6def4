"""Configs as train.py composes them: the Hydra composition, the typed config, and a learner group."""

import copy
import dataclasses
import functools
import os
from pathlib import Path

from tests.helpers.paths import ROOT


def compose(*overrides: str):
    """conf/config.yaml composed by Hydra with ``overrides``, as train.py would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return hydra_compose(config_name="config", overrides=list(overrides))


def flatten(node, prefix: str = "") -> dict:
    """A nested container (``OmegaConf.to_container``) as {dotted key: leaf}; an empty mapping is a leaf, ``{}``."""
    if isinstance(node, dict):
        out: dict = {}
        for k, v in node.items():
            out |= flatten(v, f"{prefix}{k}.")
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def differing_keys(a, b) -> set[str]:
    """The dotted keys whose unresolved values differ between the composed configs ``a`` and ``b`` (a key that only
    one of them has counts)."""
    from omegaconf import OmegaConf

    x, y = (flatten(OmegaConf.to_container(c, resolve=False)) for c in (a, b))
    return {k for k in x.keys() | y.keys() if x.get(k, KeyError) != y.get(k, KeyError)}


def smoke_cfg(overrides):
    """``compose`` of the smoke-sized debug run (``debug=smoke``) with the list ``overrides``."""
    return compose("debug=smoke", *overrides)


def run_config(*overrides: str, run_dir: str | Path = "/tmp/bapo-test-run"):
    """The typed config (``bapo.config.RunConfig``) of ``compose(*overrides)``."""
    from bapo.config import build

    return build(compose(*overrides), run_dir)


def learner_cfg(**fields):
    """The default ``learner=single`` group, typed, with ``fields`` replaced (``lr``, ``micro_batch_size``, ...)."""
    return dataclasses.replace(_default_learner(), **fields)


_LEARNER = []


def _default_learner():
    if not _LEARNER:
        _LEARNER.append(run_config("logger=none").learner)
    return _LEARNER[0]


# ----------------------------------------------------------------------------- one composition per session
#
# The suite composes the same configurations again and again (paper_7b's config 17 times in the unit tier, each model
# 6-10 times): one Hydra composition costs 0.2-0.5 s on 2 cores, a copy of its result 0.01 s. Every composition in
# the test process goes through ``Hydra.compose_config`` (tests' ``compose``, ``--plan``'s, Hydra's own ``main`` does
# not run here), so it is memoised there, keyed by everything the result depends on: the config sources and the
# stamps of their files, the config name, the overrides, the run mode and flags, the working directory and the job
# name. A failure is not stored: a bad composition raises afresh each time. Each caller gets its own deep copy.

_COMPOSED: dict = {}


def _stamps(paths: tuple[str, ...]) -> tuple:
    """(path, mtime, size) of every file under the file-system config sources: an edited YAML is a new key."""
    out = []
    for root in paths:
        for folder, _, files in os.walk(root):
            for name in files:
                st = os.stat(os.path.join(folder, name))
                out.append((folder, name, st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


def memoise_compositions() -> None:
    """Install the session's composition memo (tests/conftest.py does, once per test process)."""
    from hydra._internal.hydra import Hydra
    from hydra.core.utils import JobRuntime
    from omegaconf import OmegaConf

    if getattr(Hydra.compose_config, "memoised", False):
        return
    compose_config = Hydra.compose_config

    @functools.wraps(compose_config)
    def memoised(self, config_name, overrides, run_mode, with_log_configuration=False, **flags):
        if with_log_configuration:  # configures logging: a side effect, never skipped
            return compose_config(self, config_name, overrides, run_mode, with_log_configuration, **flags)
        sources = tuple((s.scheme(), s.path) for s in self.config_loader.get_sources())
        files = tuple(path for scheme, path in sources if scheme == "file")
        job = OmegaConf.select(JobRuntime().conf, "name")
        key = (sources, _stamps(files), config_name, tuple(overrides), run_mode, tuple(sorted(flags.items())))
        key += (os.getcwd(), job)
        if key not in _COMPOSED:
            _COMPOSED[key] = compose_config(self, config_name, list(overrides), run_mode, **flags)
        return copy.deepcopy(_COMPOSED[key])

    memoised.memoised = True
    Hydra.compose_config = memoised
