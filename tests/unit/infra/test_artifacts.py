"""What a run wrote is read as data (bapo/infra/artifacts.py): YAML bounded in size, aliases and expanded values, a
run's config never resolved, lines and files bounded, and a model folder checked before anything loads it. Each
hostile or damaged file is one ArtifactError naming the file and the key or line (a model folder's: a ConfigError
under the key that names the folder)."""

import gzip
import io
import json
import math
import os
import shutil
import time

import pytest

from bapo import rundir
from bapo.infra.artifacts import (
    ArtifactError,
    check_model_folder,
    load_config,
    load_yaml,
    read_json,
    read_lines,
)
from bapo.infra.checks import ConfigError
from bapo.infra.paths import exported_max_new_tokens
from tests.helpers import hostile
from tests.helpers.paths import TINY


def test_an_alias_bomb_is_refused_at_once_naming_the_file_and_line(tmp_path):
    """Before: rundir.saved_config (OmegaConf) spent minutes expanding 9^11 strings, and eval.py printed nothing."""
    export = hostile.alias_bomb(tmp_path / "export")
    t0 = time.monotonic()
    with pytest.raises(ArtifactError, match=r"bapo_config.yaml: line 9: more than 64 aliases") as e:
        load_yaml(export / "bapo_config.yaml")
    assert time.monotonic() - t0 < 10 and "\n" not in str(e.value)
    shutil.copy(export / "bapo_config.yaml", tmp_path / "config.yaml")  # the resume reads a run's config.yaml
    with pytest.raises(ConfigError, match="more than 64 aliases"):
        rundir.saved_config(tmp_path)
    assert exported_max_new_tokens(export) is None  # training's hint from an export: no advice, no hang


def test_a_few_aliases_expanding_past_the_value_bound_are_refused(tmp_path):
    """Under the alias bound, but 8 levels of 4 make 4^8 * 4 values."""
    lines, prev = ["a: &a [x, x, x, x]"], "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}]")
        prev = name
    f = tmp_path / "c.yaml"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ArtifactError, match=r"c.yaml: more than 100000 values once its aliases are expanded"):
        load_yaml(f)


def test_yaml_is_plain_data_bounded_in_size_and_depth(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("x: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ArtifactError, match=r"c.yaml: cannot be read: not YAML at line 1"):
        load_yaml(f)
    f.write_text("x: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ArtifactError, match=r"c.yaml: cannot be read \(nested too deeply to parse\)"):
        load_yaml(f)
    f.write_text("x: '" + "y" * (2 << 20) + "'\n")
    with pytest.raises(ArtifactError, match=r"c.yaml: larger than 1 MiB"):
        load_yaml(f)
    f.write_text("a: [1, 2]\nb: {c: null}\n")
    assert load_yaml(f) == {"a": [1, 2], "b": {"c": None}}


def test_an_interpolation_in_a_runs_config_is_refused_naming_the_file_and_key(tmp_path, monkeypatch):
    """Before: OmegaConf resolved it: the resume (rundir.saved_config) read the secret into the compared config."""
    monkeypatch.setenv(hostile.SECRET_VAR, hostile.SECRET)
    f = tmp_path / "config.yaml"
    f.write_text("seed: 1\ndata:\n  instruction: 'Answer. ${oc.env:" + hostile.SECRET_VAR + "}'\n")
    with pytest.raises(ArtifactError) as e:
        rundir.saved_config(tmp_path)
    assert str(e.value).startswith(f"{f}: data.instruction: 'Answer. ${{oc.env:{hostile.SECRET_VAR}}}' is an interp")
    assert hostile.SECRET not in str(e.value)
    f.write_text("seed: 1\nlogger:\n  tags: [a, '${seed}']\n")
    with pytest.raises(ArtifactError, match=r"config.yaml: logger.tags\[1\]: '\$\{seed\}' is an interpolation"):
        load_config(f)
    f.write_text("seed: 1\n'${oc.env:HOME}': 2\n")
    with pytest.raises(ArtifactError, match=r"config.yaml: \$\{oc.env:HOME\}: a key with an interpolation"):
        load_config(f)
    f.write_text("[1, 2]\n")
    with pytest.raises(ArtifactError, match="config.yaml: not a mapping of config groups"):
        load_config(f)


def test_hydras_own_config_resolves_its_references_and_keeps_every_other_interpolation(tmp_path, monkeypatch):
    monkeypatch.setenv(hostile.SECRET_VAR, hostile.SECRET)
    f = tmp_path / "config.yaml"
    f.write_text(
        "seed: 3\npaths: {data_dir: /d}\ndata: {train_seed: '${seed}', path: '${paths.data_dir}/x.jsonl'}\n"
        "logger: {tags: ['seed=${seed}'], run: '${hydra:runtime.output_dir}', token: '${oc.env:"
        + hostile.SECRET_VAR
        + "}', mix: 'a ${seed} ${oc.env:HOME}'}\n"
        "loop: {a: '${loop.b}', b: '${loop.a}', gone: '${no.such.key}'}\n"
    )
    assert load_config(f, interpolations="local") == {
        "seed": 3,
        "paths": {"data_dir": "/d"},
        "data": {"train_seed": 3, "path": "/d/x.jsonl"},
        "logger": {
            "tags": ["seed=3"],
            "run": "${hydra:runtime.output_dir}",
            "token": "${oc.env:" + hostile.SECRET_VAR + "}",  # as written: never the variable
            "mix": "a ${seed} ${oc.env:HOME}",
        },
        "loop": {"a": "${loop.b}", "b": "${loop.a}", "gone": "${no.such.key}"},  # a cycle, a missing key: as written
    }


def test_references_that_multiply_are_bounded(tmp_path):
    lines = ["a: [x, x, x, x, x, x, x, x]"] + [f"{c}: ['${{{p}}}', '${{{p}}}', '${{{p}}}', '${{{p}}}']"
                                                for p, c in zip("abcdefgh", "bcdefghi", strict=True)]  # fmt: skip
    f = tmp_path / "config.yaml"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ArtifactError, match="config.yaml: larger than 100000 values once its interpolations"):
        load_config(f, interpolations="local")


def test_read_json_is_bounded_and_names_the_file(tmp_path):
    f = tmp_path / "config.json"
    f.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ArtifactError, match=r"config.json: not readable JSON \(nested too deeply to parse\)"):
        read_json(f)
    f.write_text('{"a": NaN}')  # a run's final metrics may hold one
    assert math.isnan(read_json(f)["a"])
    f.write_text("[1]")
    with pytest.raises(ArtifactError, match="config.json: expected a JSON object, got list"):
        read_json(f)
    assert read_json(f, mapping=False) == [1]
    f.write_text('{"a": 1}' + " " * 100)
    with pytest.raises(ArtifactError, match="config.json: larger than 64 bytes"):
        read_json(f, max_bytes=64)


def test_read_lines_gives_a_long_line_as_none_without_holding_it():
    class Counting(io.BytesIO):
        largest = 0

        def readline(self, size=-1):
            line = super().readline(size)
            Counting.largest = max(Counting.largest, len(line))
            return line

    stream = Counting(b"a\n" + b"x" * 1_000_000 + b"\nb\nc")
    got = list(read_lines(stream, "f.jsonl", max_line=1000, max_total=None))
    assert got == [(1, b"a\n"), (2, None), (3, b"b\n"), (4, b"c")]
    assert Counting.largest <= 1 << 16  # read in chunks, never whole


def test_a_gzip_bomb_stops_at_the_bound_naming_the_file(tmp_path):
    f = tmp_path / "runs.jsonl.gz"
    with gzip.open(f, "wb") as g:
        for _ in range(64):
            g.write(b"x" * (1 << 20))  # 64 MiB on one line, 64 KiB compressed
    assert f.stat().st_size < 1 << 20
    with gzip.open(f, "rb") as g, pytest.raises(ArtifactError, match=r"runs.jsonl.gz: more than 16 MiB"):
        list(read_lines(g, f, max_line=1 << 30, max_total=16 << 20))


# ----------------------------------------------------------------------------- a model folder


def test_the_shipped_models_and_a_hub_snapshot_of_links_pass(tmp_path, standins):
    check_model_folder(TINY, "checkpoint")
    for snapshot in standins[1].values():  # its files are links into ../../blobs: outside the folder, by design
        check_model_folder(snapshot, "model.name_or_path")
    check_model_folder(tmp_path / "not-a-folder", "model.name_or_path")  # a hub name: its loaders' to check


@pytest.mark.parametrize(
    "name", ["wrong_shape", "huge_dims", "index_outside", "unknown_dtype", "generation_config_list",
             "generation_config_broken"],
)  # fmt: skip
def test_a_damaged_or_hostile_model_folder_is_one_line_naming_the_key_and_what(tmp_path, name):
    """Before: each was a 60-93 line traceback from transformers when the model loaded (eval.py, train.py)."""
    build, says = hostile.EXPORTS[name]
    folder = build(tmp_path / name)
    with pytest.raises(ConfigError) as e:
        check_model_folder(folder, "checkpoint")
    assert str(e.value).startswith("checkpoint: ") and says in str(e.value) and "\n" not in str(e.value)


def test_the_model_loader_checks_the_folder_before_it_allocates(tmp_path):
    """Before: load_model built the config's model (4 GiB of huge dims) and then raised transformers' size report."""
    from bapo.modeling import load_model

    folder = hostile.config_json(hidden_size=1 << 20, intermediate_size=1 << 22)(tmp_path / "huge")
    with pytest.raises(ConfigError, match=r"^model.name_or_path: .*config.json makes it \[343, 1048576\]"):
        load_model(str(folder))


def test_a_model_folder_is_checked_again_once_it_changes(tmp_path):
    folder = hostile.export(tmp_path / "export")
    check_model_folder(folder, "checkpoint")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": 999}))
    os.utime(folder / "config.json", ns=(1, 1))
    with pytest.raises(ConfigError, match="config.json makes it"):
        check_model_folder(folder, "checkpoint")
