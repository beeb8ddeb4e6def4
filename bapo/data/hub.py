"""Problems from a ``datasets`` set: a hub name, a local folder (a copy of a hub set), or a data file.

:func:`load_hub` reads one split through ``datasets.load_dataset`` and maps each row with a
:class:`~bapo.data.rows.RowFields` (dotted keys, chat prompts, the set's own instruction cut, answer formats).
Only the columns the mapping reads are decoded. A row that cannot be read or graded is skipped and counted, as
the JSONL loader does; rows that repeat a problem with its answer are kept once (DAPO-Math-17k ships each of its
17,917 problems 100 times), and their count is logged.

A hub name is tried only where the hub can answer. With ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set, or when
the hub's endpoint does not answer one request within :data:`HUB_PROBE_TIMEOUT_S`, the set is read from the
``datasets`` cache alone: ``datasets`` itself retries each request five times with back-off, for minutes where
connections hang, and prints a line per retry. A set that is neither reachable nor cached is one
:class:`~bapo.data.rows.DataFileError` naming the set, the split and the three ways to give it locally: a copy of
the set as the path, ``HF_DATASETS_CACHE``, or the problems as JSONL.
:func:`check_hub` raises it before anything slow starts (``bapo.data.loading.check_files``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bapo.data.rows import ROWS_LOGGED, DataFileError, LoadReport, RowFields, log_skipped, tried
from bapo.infra.paths import resolve_path
from bapo.samples import Problem

log = logging.getLogger(__name__)

HUB_PROBE_TIMEOUT_S = 5.0  # one request to the hub's endpoint; no answer in this long: read from the cache only
KEPT_COLUMNS = ("id", "source", "data_source")  # read with the mapped fields where a set has them
BATCH_ROWS = 1000  # rows decoded at a time


def is_hub_name(value: str) -> bool:
    """Whether a data path names a hub set: it is neither a file nor a folder here (from the working folder, else
    from the repository), which is how ``datasets`` tells them apart too."""
    return not Path(resolve_path(value)).exists()


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the hub cannot be asked for a set (offline mode, or its endpoint did not answer one request within
    ``timeout`` seconds), or None when it answered."""
    import datasets
    from huggingface_hub import get_session

    if datasets.config.HF_HUB_OFFLINE:
        return "offline mode: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set"
    url = datasets.config.HF_ENDPOINT
    try:
        get_session().head(url, timeout=timeout)
    except Exception as e:  # any failure to get an answer (DNS, refused, timeout, offline mode, a proxy)
        msg = str(e).splitlines()[0][:120] if str(e) else ""
        return f"no answer from {url} within {timeout:g} s ({type(e).__name__}{': ' + msg if msg else ''})"
    return None


@contextlib.contextmanager
def cache_only() -> Iterator[None]:
    """``datasets`` reads sets from its cache alone, as under ``HF_DATASETS_OFFLINE=1``, for the block."""
    import datasets

    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def _set_name(name: str, split: str, subset: str | None) -> str:
    return f"{name} (split {split!r}{f', subset {subset!r}' if subset else ''})"


def unreachable(key: str, name: str, split: str, subset: str | None, why: str) -> DataFileError:
    """The one line for a hub set that is neither reachable nor cached: the set, the split, the three ways."""
    prefix = key.rsplit(".", 1)[0]  # data, or eval.<set>
    jsonl = "data=jsonl data.path=<file.jsonl>" if prefix == "data" else f"{prefix}.kind=jsonl {key}=<file.jsonl>"
    return DataFileError(
        f"{key}: {name!r} is not a local file or folder, and the hub set {_set_name(name, split, subset)} is neither "
        f"reachable nor cached here ({why}). Give it locally: a copy of the set as {key}=<its folder> "
        f"(`hf download {name} --repo-type dataset --local-dir <folder>` where there is network), a datasets cache "
        f"that holds it as HF_DATASETS_CACHE=<folder> (load it once where there is network), or its problems as "
        f"JSONL with {jsonl}"
    )


def open_set(name: str, *, split: str, subset: str | None = None, key: str = "data.path") -> Any:
    """The ``datasets.Dataset`` of ``split`` of a data file, a local folder or a hub set (module docstring).
    Anything that cannot be loaded is a :class:`DataFileError` naming ``key``."""
    import datasets

    p = Path(resolve_path(name))
    if p.is_file():
        if p.stat().st_size == 0:
            raise DataFileError(f"{key}: {p.absolute()}: the data file is empty")
        try:
            return datasets.load_dataset(p.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(p), split=split)
        except Exception as e:  # StopIteration, ValueError, DatasetGenerationError, ...: all mean "this file"
            raise DataFileError(
                f"{key}: {p.absolute()}: datasets could not load split {split!r} from this file ({_first(e)}); "
                "data.kind=jsonl reads a JSONL file row by row and skips malformed rows"
            ) from None
    if p.is_dir():
        try:
            return datasets.load_dataset(str(p), subset, split=split, cache_dir=local_cache(p))
        except Exception as e:
            raise DataFileError(
                f"{key}: {p.absolute()}: datasets could not load split {split!r} from this folder ({_first(e)})"
            ) from None
    why = hub_unreachable()
    if why is None:
        try:
            return datasets.load_dataset(name, subset, split=split)
        except Exception as e:  # a name that is neither a local file or folder nor loadable from the hub
            raise DataFileError(
                f"{key}: {name!r} is not a local file or folder (tried {tried(name)}), and datasets could not load "
                f"{_set_name(name, split, subset)} as a hub set ({_first(e)})"
            ) from None
    try:
        with cache_only():
            return datasets.load_dataset(name, subset, split=split)
    except (ConnectionError, FileNotFoundError):  # not in the cache
        raise unreachable(key, name, split, subset, why) from None
    except Exception as e:  # in the cache, but not this split or subset
        raise DataFileError(
            f"{key}: the hub set {_set_name(name, split, subset)} is not reachable ({why}) and its cached copy "
            f"does not serve it ({_first(e)})"
        ) from None


def local_cache(folder: Path) -> str:
    """Where ``datasets`` keeps its prepared copy of a local folder: a folder of the cache named after this folder's
    absolute path and its files' sizes and modification times. ``datasets`` itself (5.2) names its copy of a folder
    whose card lists the data files (a hub set's layout) by the folder's name and those patterns alone, so a second
    folder of the same name, or this one rewritten, would be served the first one's rows or fail its split check."""
    import datasets

    files = sorted(f for f in folder.rglob("*") if f.is_file() and ".cache" not in f.relative_to(folder).parts)
    stamp = [(str(f.relative_to(folder)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha1(json.dumps([str(folder.resolve()), stamp]).encode()).hexdigest()[:16]
    return str(Path(datasets.config.HF_DATASETS_CACHE) / "bapo-local" / f"{folder.name}-{key}")


def check_hub(name: str, *, split: str, subset: str | None = None, key: str = "data.path") -> None:
    """Raise :class:`DataFileError` now for a hub set that cannot be loaded (offline and not cached, a name the hub
    does not know), before a model load; a reachable set is fetched into the cache here, once."""
    if is_hub_name(name):
        open_set(name, split=split, subset=subset, key=key)


def _first(e: BaseException) -> str:
    msg = str(e).split("\n")[0]
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _rows(ds: Any) -> Iterator[dict]:
    """The rows of a ``datasets.Dataset``, decoded a batch at a time."""
    for batch in ds.iter(batch_size=BATCH_ROWS):
        cols = list(batch)
        for j in range(len(batch[cols[0]]) if cols else 0):
            yield {c: batch[c][j] for c in cols}


def load_hub(
    name: str,
    *,
    split: str,
    subset: str | None = None,
    fields: RowFields | None = None,
    report: LoadReport | None = None,
    key: str = "data.path",
) -> list[Problem]:
    """Load problems through ``datasets`` (a hub name, a local folder, or a data file), mapped by ``fields``.

    ``datasets`` parses a local file as a whole: an empty or unparsable file is a :class:`DataFileError` that names
    it and ``key``, and so is a set whose rows lack a field the mapping reads, or a name that is neither a local
    path nor loadable (module docstring). Rows that parse but are malformed are skipped and counted; a row that
    repeats an earlier row's problem and answer is kept once."""
    fields = fields or RowFields()
    report = report if report is not None else LoadReport()
    ds = open_set(name, split=split, subset=subset, key=key)
    where = f"{name}[{split}]"
    have = list(ds.column_names)
    for field, k in ((fields.problem_key, "problem_key"), (fields.answer_key, "answer_key")):
        if field not in have and field.split(".")[0] not in have:
            raise DataFileError(
                f"{key.rsplit('.', 1)[0]}.{k}: {where} has no field {field!r} (its fields: {have}); name the field "
                "that holds it (a dotted path reaches a nested one)"
            )
    wanted = {*fields.columns(), fields.problem_key, fields.answer_key, *KEPT_COLUMNS}
    ds = ds.select_columns([c for c in have if c in wanted])
    out, seen, whys, skipped, repeats = [], set(), [], 0, 0
    for i, row in enumerate(_rows(ds)):
        try:
            problem = fields.problem_of(row, f"{where} row {i}", i)
        except (ValueError, RecursionError) as e:
            report.skipped += 1
            skipped += 1
            if len(whys) < ROWS_LOGGED:
                whys.append(str(e).split("\n")[0])
            continue
        report.rows += 1
        if (problem.problem, problem.answer) in seen:
            repeats += 1
            continue
        seen.add((problem.problem, problem.answer))
        out.append(problem)
    if not out:
        first = f"; the first: {whys[0]}" if whys else ""
        raise DataFileError(f"{key}: {where}: no valid rows ({skipped} skipped{first})")
    log_skipped(where, whys, skipped)
    if repeats:
        log.info("%s: %d rows repeat an earlier row's problem and answer; each problem is kept once", where, repeats)
    return out
