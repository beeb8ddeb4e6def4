"""Reading artifacts: what a run wrote (its folder, its export, a study's pack) is someone else's data.

A run folder, an export or a pack is shared and downloaded, so everything here reads it as data, with bounds:

* :func:`load_yaml`: YAML through PyYAML's safe loader (plain types, no object tags), at most
  :data:`MAX_YAML_BYTES`, at most :data:`MAX_ALIASES` aliases, and at most :data:`MAX_NODES` values once the aliases
  are expanded, so a kilobyte of aliases (a "billion laughs") is one error and not minutes of OmegaConf copying.
* :func:`load_config`: a run's config (``config.yaml``, an export's ``bapo_config.yaml``). It is never resolved:
  OmegaConf would run ``${oc.env:HF_TOKEN}`` in an export's instruction and put the evaluator's token into every
  prompt and report. The loop writes these files resolved, so a ``${`` in one is refused, naming the file and the
  key (``interpolations="refuse"``). Hydra's own ``.hydra/config.yaml`` keeps the composition's interpolations
  (``data.train_seed: ${seed}``); ``interpolations="local"`` resolves those that name another key of the same file
  and keeps every other one (a resolver: ``${oc.env:...}``, ``${now:...}``) as literal text, within the same bound.
* :func:`read_json`: a JSON file of at most a given size, as a mapping where one is expected.
* :func:`read_tail`: the end of a log, where its last failure is.
* :func:`read_lines`: a stream of lines (a JSONL file, a gzip'd pack) with a bound per line and in all; a line
  over its bound comes back as None (its caller skips and counts it, or refuses the file) and a file over its
  bound is one :class:`ArtifactError` naming it, so a 2 MB gzip of 2 GB on one line costs a bounded read.
* :func:`check_model_folder`: a model folder before anything loads it: its weight index names files inside the
  folder only, every safetensors header is whole, config.json and generation_config.json are JSON objects with a
  known dtype, and the shapes config.json implies (a model built on the meta device: nothing is allocated) match the
  shapes the safetensors headers give (read from the header only), so a damaged or hostile export is one line.

Chat templates from a model folder are rendered with bounds of their own (:mod:`bapo.infra.chat_template`).
Every error is an :class:`ArtifactError` (a ConfigError: one line, exit status 2) naming the file and, where there
is one, the key or line. This module imports nothing of bapo above ``infra/``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from bapo.infra.checks import ConfigError

MAX_YAML_BYTES = 1 << 20  # a run's config is about 5 KB
MAX_ALIASES = 64  # the loop writes none (OmegaConf.to_yaml); a hand-written file may share a few
MAX_NODES = 100_000  # values once aliases (and local interpolations) are expanded; a run's config has about 300
MAX_JSON_BYTES = 16 << 20  # config.json, generation_config.json, a weight index, final_metrics.json
LINE_CHUNK = 1 << 16  # how much of an over-long line is read at a time while it is skipped


class ArtifactError(ConfigError):
    """An artifact (a run folder's file, an export, a pack) that cannot be read as data: the message names the
    file and the key or line."""


# ----------------------------------------------------------------------------- bounded bytes


def read_bytes(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, refused (naming it) when it holds more than ``max_bytes``."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise ArtifactError(f"{path}: larger than {_size(max_bytes)}, more than this file ever holds: not read")
    return data


def read_tail(path: str | Path, max_bytes: int) -> str:
    """The last ``max_bytes`` of ``path`` as text (a log's end: where its last failure is), undecodable bytes
    replaced."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read(max_bytes).decode("utf-8", errors="replace")
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror or e})") from None


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} bytes"


def read_json(path: str | Path, *, max_bytes: int = MAX_JSON_BYTES, mapping: bool = True) -> Any:
    """A JSON file of at most ``max_bytes`` (a JSON object, unless ``mapping=False``); a document nested too deeply
    to parse is refused. (NaN is read as Python's json reads it: a run's final metrics may hold one.)"""
    data = read_bytes(path, max_bytes)
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"{path}: not readable JSON ({_why(e)})") from None
    if mapping and not isinstance(value, dict):
        raise ArtifactError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _why(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "nested too deeply to parse"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- YAML


def _loader(max_aliases: int) -> type:
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        """PyYAML's safe loader counting aliases as it composes the document."""

        aliases = 0

        def compose_node(self, parent, index):  # noqa: ANN001, ANN202 (PyYAML's own signature)
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > max_aliases:
                    mark = self.peek_event().start_mark
                    raise _TooManyAliases(f"line {mark.line + 1}: more than {max_aliases} aliases")
            return super().compose_node(parent, index)

    return BoundedLoader


class _TooManyAliases(Exception):
    pass


def load_yaml(path: str | Path, *, max_bytes: int = MAX_YAML_BYTES, max_aliases: int = MAX_ALIASES) -> Any:
    """A YAML file as plain Python values (module docstring: bounded in size, aliases and expanded values)."""
    import yaml

    text = read_bytes(path, max_bytes).decode("utf-8", errors="replace")
    try:
        value = yaml.load(text, Loader=_loader(max_aliases))  # noqa: S506 (a SafeLoader subclass)
    except _TooManyAliases as e:
        raise ArtifactError(f"{path}: {e} (a file that expands to more than it holds): not read") from None
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}" if e.problem_mark is not None else ""
        raise ArtifactError(f"{path}: cannot be read: not YAML{where} ({e.problem or e.context})") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise ArtifactError(f"{path}: cannot be read ({_why(e)})") from None
    _count_nodes(value, path)
    return value


def _count_nodes(value: Any, path: str | Path, limit: int = MAX_NODES) -> None:
    """Refuse a document of more than ``limit`` values once its aliases are expanded (a shared list counts each time
    it is reached, as every copy OmegaConf or JSON would make of it does)."""
    seen, stack = 0, [value]
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            raise ArtifactError(f"{path}: more than {limit} values once its aliases are expanded: not read")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


# ----------------------------------------------------------------------------- a run's config

_INTERPOLATION = "${"
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w-]*(?:\.[\w-]+)*)\}")  # ${key} or ${group.key}: another key's value


def load_config(path: str | Path, *, interpolations: str = "refuse") -> dict:
    """A run's config file as a plain mapping, never resolved by OmegaConf (module docstring). ``interpolations``:
    ``refuse`` (a file the loop wrote resolved: a ``${`` anywhere is an :class:`ArtifactError` naming the key) or
    ``local`` (Hydra's ``.hydra/config.yaml``: references to other keys of the file resolved, any other
    interpolation kept as literal text)."""
    value = load_yaml(path)
    if not isinstance(value, dict):
        raise ArtifactError(f"{path}: not a mapping of config groups (got {type(value).__name__})")
    if interpolations == "refuse":
        _refuse_interpolations(value, path)
        return value
    if interpolations == "local":
        return _Local(value, path).resolve()
    raise ValueError(f"interpolations: 'refuse' or 'local', got {interpolations!r}")


def _refuse_interpolations(node: Any, path: str | Path, key: str = "") -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            here = f"{key}.{k}" if key else str(k)
            if isinstance(k, str) and _INTERPOLATION in k:
                raise ArtifactError(f"{path}: {here}: a key with an interpolation, {_DATA}")
            _refuse_interpolations(v, path, here)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _refuse_interpolations(v, path, f"{key}[{i}]")
    elif isinstance(node, str) and _INTERPOLATION in node:
        raise ArtifactError(f"{path}: {key}: {_short(node)} is an interpolation, {_DATA}")


_DATA = (
    "never resolved here: the loop writes a run's config resolved, and an interpolation could read this machine's "
    "environment"
)


def _short(text: str, n: int = 80) -> str:
    r = repr(text)
    return r if len(r) <= n else f"{r[:n]}... ({len(text)} characters)"


class _Local:
    """The references ``${a.b}`` of one document resolved against the document itself, as OmegaConf resolves them
    (a whole-value reference keeps the referenced value's type; one inside text is formatted into it), with every
    other interpolation, an unknown key and a cycle left as written. The copies count against :data:`MAX_NODES`
    and the text against :data:`MAX_YAML_BYTES` x 16, so a chain of references cannot grow without bound."""

    def __init__(self, root: dict, path: str | Path) -> None:
        self.root, self.path = root, path
        self.nodes, self.chars = 0, 0

    def resolve(self) -> dict:
        return self._value(self.root, ())

    def _spend(self, nodes: int = 1, chars: int = 0) -> None:
        self.nodes, self.chars = self.nodes + nodes, self.chars + chars
        if self.nodes > MAX_NODES or self.chars > 16 * MAX_YAML_BYTES:
            raise ArtifactError(f"{self.path}: larger than {MAX_NODES} values once its interpolations are resolved")

    def _value(self, node: Any, stack: tuple[str, ...]) -> Any:
        self._spend()
        if isinstance(node, dict):
            return {k: self._value(v, stack) for k, v in node.items()}
        if isinstance(node, list):
            return [self._value(v, stack) for v in node]
        if not isinstance(node, str) or _INTERPOLATION not in node:
            return node
        whole = _REFERENCE.fullmatch(node)
        if whole:
            found = self._lookup(whole.group(1), stack)
            return node if found is _MISSING else found
        if _has_other_interpolation(node):
            return node  # a resolver (or a nested interpolation) inside: all of it as written

        def part(m: re.Match) -> str:
            found = self._lookup(m.group(1), stack)
            text = m.group(0) if found is _MISSING or isinstance(found, dict | list) else str(found)
            self._spend(chars=len(text))
            return text

        return _REFERENCE.sub(part, node)

    def _lookup(self, dotted: str, stack: tuple[str, ...]) -> Any:
        if dotted in stack:
            return _MISSING  # a cycle: left as written
        node: Any = self.root
        for k in dotted.split("."):
            if not isinstance(node, dict) or k not in node:
                return _MISSING
            node = node[k]
        return self._value(node, (*stack, dotted))


_MISSING = object()


def _has_other_interpolation(text: str) -> bool:
    """Whether ``text`` holds an interpolation that is not a plain reference (``${oc.env:X}``, ``${a.${b}}``)."""
    return _INTERPOLATION in _REFERENCE.sub("", text)


# ----------------------------------------------------------------------------- bounded lines


def read_lines(
    f: IO[bytes], where: str | Path, *, max_line: int, max_total: int | None
) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, the line's bytes)`` of the binary stream ``f`` (a file, a ``gzip.open`` stream), read a line at
    a time: a line over ``max_line`` bytes comes back as None, read past in chunks, never held whole; a stream over
    ``max_total`` bytes in all (None: no bound) is an :class:`ArtifactError` naming ``where``."""
    total, lineno = 0, 0

    def count(raw: bytes) -> None:
        nonlocal total
        total += len(raw)
        if max_total is not None and total > max_total:
            raise ArtifactError(f"{where}: more than {_size(max_total)}, more than this file ever holds: not read")

    while True:
        raw = f.readline(max_line + 1)
        if not raw:
            return
        lineno += 1
        count(raw)
        if len(raw) <= max_line or raw.endswith(b"\n"):
            yield lineno, raw
            continue
        yield lineno, None  # first: a caller that refuses the file reads no further
        while raw and not raw.endswith(b"\n"):  # the rest of an over-long line, a chunk at a time
            raw = f.readline(LINE_CHUNK)
            count(raw)


def line_too_long(where: str, max_line: int) -> str:
    """The problem a caller reports for a line :func:`read_lines` gave as None."""
    return f"{where}: longer than {_size(max_line)}: skipped"


# ----------------------------------------------------------------------------- a model folder

WEIGHT_INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
SHAPE_SLACK = 0.05  # the parameters config.json implies may exceed the weights' by this share (tied, untracked)


def check_model_folder(path: str | Path, key: str, *, trust_remote_code: bool = False) -> None:
    """A local model folder checked before anything loads it (module docstring); ``key``: the config key that names
    it (``checkpoint``, ``model.name_or_path``), which starts the ConfigError of a folder that fails. A hub name (not a
    folder) is left to its loaders. Checked once per folder and content in a process."""
    folder = Path(path)
    if not folder.is_dir():
        return
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file())
    try:
        _check_folder(str(folder.resolve()), trust_remote_code, stamp)
    except ArtifactError as e:  # under the key that names the folder: the entry points' ConfigError
        raise ConfigError(f"{key}: {e}") from None


@functools.lru_cache(maxsize=16)
def _check_folder(folder_s: str, trust_remote_code: bool, stamp: tuple) -> None:
    folder = Path(folder_s)
    shapes = _weight_shapes(folder)
    config = folder / "config.json"
    if config.is_file():
        fields = read_json(config)
        for name in ("dtype", "torch_dtype"):
            dtype = fields.get(name)
            if dtype is not None and dtype != "auto" and dtype not in FLOAT_DTYPES:
                raise ArtifactError(f"{config}: {name}: {_short(str(dtype))} is not a dtype a model is kept in")
    gen = folder / "generation_config.json"
    if gen.is_file():
        read_json(gen)
        _generation_config(folder, gen)
    if config.is_file() and shapes:
        _check_shapes(folder, shapes, trust_remote_code)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``: those its index names (each inside the folder), else every one."""
    index = folder / WEIGHT_INDEX
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ArtifactError(f"{index}: its weight_map is not a mapping of tensor names to file names")
    files = []
    for name in sorted(set(weight_map.values())):
        target, norm = folder / name, os.path.normpath(name)  # by name: a hub snapshot's files are links out
        if os.path.isabs(name) or norm == os.pardir or norm.startswith(os.pardir + os.sep):
            raise ArtifactError(f"{index}: names {_short(name)}, which is not a file of {folder}")
        if not target.is_file():
            raise ArtifactError(f"{folder} lacks the weight file its index names: {name}")
        files.append(target)
    return files


def _weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from every weight file's header (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in _weight_files(folder):
        try:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError) as e:
            raise ArtifactError(f"{file} is damaged or truncated ({_why(e)}); export the run again") from None
    return shapes


def _generation_config(folder: Path, file: Path) -> None:
    from transformers import GenerationConfig

    try:
        GenerationConfig.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 (transformers' own errors have no common type)
        raise ArtifactError(f"{file}: transformers refuses it ({type(e).__name__}: {_why(e)})") from None


def _check_shapes(folder: Path, shapes: dict[str, tuple[int, ...]], trust_remote_code: bool) -> None:
    """The shapes config.json implies against the weights' (module docstring). A quantised model (its config has a
    ``quantization_config``: packed shapes) is compared by nothing but its header's readability."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    where = folder / "config.json"
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ArtifactError(f"{where}: transformers refuses it ({type(e).__name__}: {_why(e)})") from None
    if getattr(config, "quantization_config", None) is not None:
        return
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ArtifactError(f"{where}: no model can be built from it ({type(e).__name__}: {_why(e)})") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, shape in shapes.items():
        if name in expected and expected[name] != shape:
            raise ArtifactError(
                f"{folder}: the weight {name} has shape {list(shape)}, config.json makes it "
                f"{list(expected[name])}: the weights are not this config's"
            )
    want = sum(p.numel() for p in model.parameters())
    have = sum(math.prod(s) for s in shapes.values())
    if want > have * (1 + SHAPE_SLACK) + 1024:
        raise ArtifactError(
            f"{where} describes a model of {want:,} parameters, its weights hold {have:,}: the sizes in "
            "config.json are not the weights'"
        )
