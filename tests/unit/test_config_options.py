"""What the config refuses before anything runs, by rule rather than by key: an option of a config group that does
not exist (every group, train.py's and eval.py's; the closest options named), a boolean field given anything but
true or false (every bool field of every typed schema), a seed numpy cannot take. Each is one line naming the key
or group, exit status 2, and no run folder; the subprocess tests run the users' commands."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bapo.infra.checks import ConfigError, _members, known_options, typed
from tests.helpers.config import run_config

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


def _compose(config: str, *overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)), known_options():
        return compose(config_name=config, overrides=list(overrides))


def _groups(config: str) -> list[str]:
    """The groups of ``config``'s defaults list (``- optional experiment: null`` counts as ``experiment``)."""
    out = []
    for d in OmegaConf.load(CONF / f"{config}.yaml").defaults:
        if isinstance(d, (dict, type(OmegaConf.create({})))):
            out += [str(k).removeprefix("optional ").removeprefix("override ") for k in d]
    return out


CASES = [(c, g) for c in ("config", "eval_config") for g in _groups(c)] + [("config", "algo/bounds")]


@pytest.mark.parametrize("config, group", CASES)
def test_every_group_refuses_an_option_it_does_not_have(config, group):
    # Before: experiment, debug (train.py) and learner (eval.py) were `optional` defaults, and Hydra skips an
    # optional group's missing option, so `experiment=paper_8b` composed the tiny default without a word.
    with pytest.raises(ConfigError, match=rf"^{group}: 'no_such_option' is not an option of this config group; "):
        _compose(config, f"{group}=no_such_option")


@pytest.mark.parametrize(
    "config, override, closest",
    [
        ("config", "experiment=paper_8b", "did you mean paper_7b?"),
        ("config", "experiment=paper_7B", "did you mean paper_7b?"),
        ("config", "debug=smok", "did you mean smoke?"),
        ("config", "algo/bounds=fixd", "did you mean fixed?"),
        ("eval_config", "eval=[arith,aime2x]", "did you mean aime25 or aime24?"),  # an item of a list
        ("config", "debug=zzz", "choose from smoke"),  # nothing close: every option
    ],
)
def test_a_mistyped_option_names_the_closest(config, override, closest):
    with pytest.raises(ConfigError) as e:
        _compose(config, override)
    assert str(e.value).endswith(closest) and "\n" not in str(e.value)


def test_the_named_options_still_compose():
    assert _compose("config", "experiment=paper_7b").model.name_or_path.endswith("DeepSeek-R1-Distill-Qwen-7B")
    assert _compose("config", "debug=smoke").train.steps == 3
    assert "experiment" not in _compose("config")  # the empty slots compose nothing
    assert _compose("eval_config", "model=qwen7b").learner.kind == "fsdp"


# ----------------------------------------------------------------------------- booleans


def _schemas() -> dict[str, type]:
    """Every typed schema a run or an evaluation is built with, by the key it is read under (one variant's key
    stands for its group), with the schemas nested in their fields."""
    from bapo.algos import config as algos
    from bapo.config import PLAIN, VARIANTS
    from bapo.eval import job

    out = {g: s for g, s in PLAIN.items()}
    out |= {f"{g}[{name}]": s for g, (_, variants) in VARIANTS.items() for name, s in variants.items()}
    out |= {"algo": algos.AlgoConfig} | {f"algo.{k}": s for k, s in algos.SUBGROUPS.items()}
    out |= {f"algo.bounds[{k}]": s for k, s in algos.BOUNDS.items()}
    out |= {f"algo.correction[{k}]": s for k, s in algos.CORRECTIONS.items()}
    out |= {f"eval.py:{n}": s for n, s in vars(job).items() if dataclasses.is_dataclass(s) and n.endswith("Config")}
    return out


def _bool_fields() -> list[tuple[str, type, str, bool]]:
    """(key, schema, field, takes null) for every bool field of every schema (no hand-kept list)."""
    out = []
    for key, schema in _schemas().items():
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            members = _members(hints[f.name])
            if bool in members:
                out.append((key, schema, f.name, type(None) in members))
    return out


def test_the_schemas_have_bool_fields_to_check():
    keys = {f"{k}.{f}" for k, _, f, _ in _bool_fields()}
    assert {"train.async_rollout", "learner[single].packing", "model.trust_remote_code"} <= keys
    assert len(keys) >= 12


@pytest.mark.parametrize("key, schema, name, nullable", [pytest.param(*f, id=f"{f[0]}.{f[2]}") for f in _bool_fields()])
@pytest.mark.parametrize("bad", [2, 0, "yes", "1"])
def test_every_bool_field_refuses_a_non_boolean_naming_the_key(key, schema, name, nullable, bad):
    # Before: OmegaConf read 2, 0 and "yes" as booleans; the run trained with them.
    with pytest.raises(ConfigError, match=rf"^k\.{name}: must be true or false, got {bad!r}$"):
        typed("k", {name: bad}, schema)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.async_rollout=2", "train.async_rollout"),
        ("learner.packing=2", "learner.packing"),
        ("learner.packing=yes", "learner.packing"),
        ("model.trust_remote_code=2", "model.trust_remote_code"),
        ("algo.filter_groups=0", "algo.filter_groups"),
        ("eval.greedy=1", "eval.greedy"),
    ],
)
def test_a_run_with_a_non_boolean_is_refused_at_startup(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be true or false, got "):
        run_config(override)


def test_a_nullable_bool_takes_null_and_booleans():
    from bapo.config import PlacementConfig

    node = OmegaConf.to_container(_compose("config").placement, resolve=True)
    for ok in (None, True, False):
        assert typed("placement", node | {"cpu_offload": ok}, PlacementConfig).cpu_offload is ok
    with pytest.raises(ConfigError, match=r"^placement\.cpu_offload: must be true or false, got 2$"):
        typed("placement", node | {"cpu_offload": 2}, PlacementConfig)


# ----------------------------------------------------------------------------- the seed


@pytest.mark.parametrize("seed", [-1, 2**32, 2**40, True, 1.5])
def test_a_seed_numpy_cannot_take_is_refused(seed):
    # Before: -1 and 2**32 passed, and numpy's np.random.seed raised at the first step, leaving a run folder.
    with pytest.raises(ConfigError, match=r"^seed: must be an integer in \[0, 2\*\*32\), got "):
        run_config(f"seed={seed}")


def test_the_seeds_at_the_ends_of_the_range_are_taken():
    assert run_config("seed=0").seed == 0 and run_config(f"seed={2**32 - 1}").seed == 2**32 - 1
