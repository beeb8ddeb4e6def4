"""Pack a study's raw data into one compressed file that a report can be regenerated from.

    python scripts/study/pack_study.py multirun/study_v4 --out docs/study/v4/runs.jsonl.gz
    python scripts/study/report.py docs/study/v4/runs.jsonl.gz --out docs/study/v4

A study is a Hydra multirun folder (``scripts/study/run_grid.py``, or ``train.py -m``): every folder under it that holds
``config.yaml``, ``.hydra/config.yaml`` or ``metrics.jsonl`` is a run (eval.py's folders excepted). The pack is
gzip'd JSON lines: a header, then one line per run, in folder order:

    {"format": "bapo-study", "runs": 10, "sweep": "multirun/demo", "version": 1}
    {"checkpoint": true, "config": {...}, "exception": null, "metrics": {"eval/accuracy": [0.43, null, ...],
     "step": [0, 1, ...], ...}, "overrides": ["algo=bapo", "seed=2"], "problems": [], "process_s": 41.3,
     "run": "algo=bapo,seed=2", "status": "complete", "wall_s": 35.2}

What a run's line keeps, and why:
- ``config``: the whole resolved config as the run wrote it (``config.yaml``; ``.hydra/config.yaml`` for a run
  that died before writing one). About 2 KB; the report reads a dozen keys (algo, learner, buffer, train, eval,
  data), and a reader checking a claim may need any other.
- ``overrides``: the job's command-line overrides (``.hydra/overrides.yaml``): the report's arm label keeps the
  ``algo.*`` ones.
- ``metrics``: every numeric key of ``metrics.jsonl`` at full precision, one column per key aligned with ``step``
  (null where a step did not log the key). The report reads about 20 of some 95 keys, but the rest (ratio
  extremes, ESS, truncation, response lengths, stage timers) are what an audit of a table asks for next, and
  they cost little once compressed. The rows are as the report reads them: a step logged twice (a resumed run
  logs again the steps after its checkpoint) is merged, the later value winning, and metrics renamed since a
  run was logged appear under their current names.
- ``status``: ``complete`` (``final_metrics.json`` exists), ``failed`` (not complete, and a log ends in an
  exception: ``exception`` holds its last line) or ``incomplete`` (interrupted, or still running);
  ``checkpoint`` says whether it can resume.
- ``wall_s``: the run's own time, the sum of ``time/step_s`` plus step 0's ``time/eval_s`` (what the report's
  wall-time column sums); ``process_s``: the seconds ``scripts/study/run_grid.py`` measured for the whole process,
  start-up and export included, summed over its attempts (null when the run did not come from run_grid).
- ``problems``: every line or file that could not be read, as ``<run>/<file>[:<line>]: <problem>``.
- ``folder`` (only when false): a run that ``scripts/study/run_grid.py`` queued or started (``logs/grid.jsonl``), or a
  cell of ``python train.py -m`` that failed (``sweep_summary.jsonl``), and that left no run folder: a start-up
  error may remove the folder it made (``bapo/entry/cli.py``), and an interrupted grid never starts the rest. Its
  ``overrides`` are the ones its launcher gave it, its ``exception`` the ``error:`` line of run_grid's log of it or
  of the sweep summary (``run_grid: queued, never started`` when it has no attempt), and its ``config`` and
  ``metrics`` are empty. Such a run is listed, never dropped. (A run with a folder whose logs name no failure
  takes the sweep summary's error line, if it has one.)

The same runs give the same bytes: keys sorted, compact separators, runs in folder order, and a gzip header
with no file name and mtime 0 (for a given zlib; the regenerate test compares reports, not packs).

A sweep folder and a pack are someone else's data, read through ``bapo/infra/artifacts.py``: a run's config is never
resolved (an interpolation in ``config.yaml`` is one of the run's ``problems``; Hydra's ``.hydra/config.yaml`` has
its references to its own keys resolved and any resolver kept as written), every file has a bound per line and in
all (``MAX_*`` below), and a pack is read as a gzip stream, so a bomb is one ``error: PackError`` line naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bapo, when this file runs as a script outside an install
from bapo.infra.artifacts import (  # noqa: E402
    ArtifactError,
    line_too_long,
    load_config,
    load_yaml,
    read_json,
    read_lines,
    read_tail,
)

FORMAT, VERSION = "bapo-study", 1
SKIP_DIRS = {".hydra", ".submitit", "checkpoints", "export", "wandb"}
GRID_LOG = "grid.jsonl"  # scripts/study/run_grid.py: one line per run queued and per attempt, in <sweep dir>/logs/
SWEEP_SUMMARY = (
    "sweep_summary.jsonl"  # python train.py -m: a row per cell run, in the sweep folder (bapo/entry/sweep.py)
)
NEVER_STARTED = "run_grid: queued, never started"  # the exception of a queued run with no attempt (an interrupted grid)
# Metrics of runs written before the clip window moved to clip/*: read under their new names.
RENAMED = {"bapo/ratio_low": "clip/low", "bapo/ratio_high": "clip/high", "bapo/rho": "clip/rho"}
# Bounds on what is read (a shared sweep folder or pack is someone else's data: bapo/infra/artifacts.py): a metrics line
# is about 4 KB and a pack's run line at most 60 KB, a pack about 5 MB unpacked and a log's last failure is at its end.
MAX_METRICS_LINE, MAX_METRICS = 1 << 20, 1 << 30
MAX_LOG_LINE, MAX_LOG = 1 << 20, 256 << 20  # grid.jsonl, sweep_summary.jsonl
MAX_PACK_LINE, MAX_PACK = 64 << 20, 256 << 20
LOG_TAIL = 1 << 20


class UsageParser(argparse.ArgumentParser):
    """argparse whose bad arguments are one line on stderr, ``error: UsageError: <what>``, and exit status 2 (the
    entry points' convention, ``bapo/entry/cli.py``), not argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        usage_error(f"{message} (see {self.prog} --help)")


def usage_error(message: str) -> NoReturn:
    """Bad input to a script: one line, exit status 2."""
    print(f"error: UsageError: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


def parse_metrics(path: Path, where: str | None = None) -> tuple[dict[int, dict], list[str]]:
    """step -> merged metrics, and one ``<where>:<line>: <problem>`` per line that could not be used
    (``where`` defaults to the path itself). Read a line at a time, with bounds (:data:`MAX_METRICS_LINE` a line,
    :data:`MAX_METRICS` in all: an ArtifactError naming the file)."""
    where = str(path) if where is None else where
    steps: dict[int, dict] = {}
    problems = []
    with open(path, "rb") as f:
        for i, raw in read_lines(f, where, max_line=MAX_METRICS_LINE, max_total=MAX_METRICS):
            at = f"{where}:{i}"
            if raw is None:
                problems.append(line_too_long(at, MAX_METRICS_LINE))
                continue
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line.strip():
                problems.append(f"{at}: empty line")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{at}: unparseable JSON ({e.msg})")
                continue
            except (ValueError, RecursionError):
                problems.append(f"{at}: unparseable JSON (nested too deeply or a number too long)")
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, bool) or not isinstance(step, int | float) or not float(step).is_integer():
                problems.append(f"{at}: no integer 'step'")
                continue
            values = {
                RENAMED.get(k, k): float(v)
                for k, v in row.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
            values.pop("step")
            steps.setdefault(int(step), {}).update(values)
    return dict(sorted(steps.items())), problems


def last_exception(path: Path) -> str | None:
    """The last failure a log records (:func:`last_exception_in`), read from its last :data:`LOG_TAIL` bytes."""
    try:
        return last_exception_in(read_tail(path, LOG_TAIL))
    except ArtifactError:
        return None


def last_exception_in(text: str) -> str | None:
    """The last failure a log's text records: the exception line of its last traceback, or the entry points'
    one-line ``error: <Class>: <message>`` (``bapo/entry/cli.py``), whichever comes later; cut to 120 characters."""
    lines = text.splitlines()
    found = None
    i = 0
    while i < len(lines):
        if lines[i].startswith("error: "):
            found = lines[i].strip()[:120]
        elif lines[i].startswith("Traceback"):
            found = "traceback"
            for j in range(i + 1, len(lines)):
                if lines[j].strip() and not lines[j][0].isspace():
                    found, i = lines[j].strip()[:120], j
                    break
        i += 1
    return found


def _exception(run_dir: Path) -> str | None:
    """``<log>: <last exception line>`` from the run's own logs, then from run_grid's log of it."""
    logs = [(run_dir / "crash.txt", "crash.txt"), (run_dir / "train.log", "train.log")]
    logs.append((run_dir.parent / "logs" / f"{run_dir.name}.log", "run_grid log"))
    for path, name in logs:
        if path.is_file() and (exc := last_exception(path)):
            return f"{name}: {exc}"
    return None


def _process_s(run_dir: Path) -> float | None:
    """Seconds run_grid measured for this run's processes, summed over attempts; None if it has no record."""
    total = None
    for row in _json_lines(run_dir.parent / "logs" / GRID_LOG):
        if row.get("run") == run_dir.name and isinstance(row.get("seconds"), int | float):
            total = (total or 0.0) + float(row["seconds"])
    return total


def _load_config(path: Path) -> dict:
    """A run's config as a plain mapping, read as data (bapo/infra/artifacts.py: bounded, never resolved by OmegaConf).
    ``config.yaml`` is written resolved: an interpolation in it is refused. Hydra's ``.hydra/config.yaml`` (a run that
    died before writing its own) keeps its interpolations (``data.train_seed: ${seed}``): those naming another key are
    resolved, so it reads as its finished siblings do; any other (a resolver: ``${oc.env:...}``) is kept as written."""
    return load_config(path, interpolations="local" if path.parent.name == ".hydra" else "refuse")


def _relative(path: Path, sweep: Path) -> str:
    return path.relative_to(sweep).as_posix() if path != sweep else "."


def read_run(run_dir: Path, sweep: Path | None = None) -> dict:
    """One run folder as a pack record (module docstring); file names in ``problems`` are relative to ``sweep``
    (default: the run's parent folder)."""
    sweep = run_dir.parent if sweep is None else sweep
    name = _relative(run_dir, sweep)

    def rel(path: Path) -> str:
        return _relative(path, sweep)

    problems: list[str] = []
    cfg: dict = {}
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        cfg_file = run_dir / ".hydra" / "config.yaml"  # written by Hydra before the job starts
    if cfg_file.is_file():
        try:
            cfg = _load_config(cfg_file)
        except ArtifactError as e:
            problems.append(f"{rel(cfg_file)}: unreadable config ({_after_path(e, cfg_file)})")
    else:
        problems.append(f"{name}: no config.yaml")
    overrides: list = []
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    if overrides_file.is_file():
        try:
            given = load_yaml(overrides_file)
            overrides = [str(o) for o in given] if isinstance(given, list) else []
            if given is not None and not isinstance(given, list):
                problems.append(f"{rel(overrides_file)}: unreadable overrides (not a list)")
        except ArtifactError:
            problems.append(f"{rel(overrides_file)}: unreadable overrides")
    steps: dict[int, dict] = {}
    if (run_dir / "metrics.jsonl").is_file():
        try:
            steps, bad = parse_metrics(run_dir / "metrics.jsonl", rel(run_dir / "metrics.jsonl"))
            problems += bad
        except ArtifactError as e:
            problems.append(str(e))
    complete = False
    if (run_dir / "final_metrics.json").is_file():
        try:
            read_json(run_dir / "final_metrics.json", mapping=False)
            complete = True
        except ArtifactError as e:
            final = run_dir / "final_metrics.json"
            problems.append(f"{rel(final)}: unparseable JSON ({_after_path(e, final)})")
    exception = None if complete else _exception(run_dir)
    keys = sorted({k for m in steps.values() for k in m})
    return {
        "run": name,
        "config": cfg if isinstance(cfg, dict) else {},
        "overrides": overrides,
        "status": "complete" if complete else "failed" if exception else "incomplete",
        "exception": exception,
        "checkpoint": (run_dir / "checkpoints").is_dir(),
        "wall_s": sum(m.get("time/step_s", m.get("time/eval_s", 0.0)) for m in steps.values()),
        "process_s": _process_s(run_dir),
        "metrics": {"step": list(steps), **{k: [m.get(k) for m in steps.values()] for k in keys}},
        "problems": problems,
    }


def record_steps(record: dict) -> dict[int, dict]:
    """A record's metrics as the report reads them: step -> {key: value}, absent keys left out."""
    columns = record["metrics"]
    steps = columns["step"]
    out: dict[int, dict] = {int(s): {} for s in steps}
    for key, values in columns.items():
        if key == "step":
            continue
        for s, v in zip(steps, values, strict=True):
            if v is not None:
                out[int(s)][key] = float(v)
    return out


def find_runs(sweep: Path) -> list[Path]:
    found = set()
    for f in sweep.rglob("*"):
        if f.name not in ("config.yaml", "metrics.jsonl") or not f.is_file():
            continue
        d = f.parent.parent if f.parent.name == ".hydra" else f.parent
        if not SKIP_DIRS & set(d.relative_to(sweep).parts):
            found.add(d)
    return sorted(found)


def is_training_run(record: dict) -> bool:
    """Not one of eval.py's folders (a config without a ``train`` key, and no metrics)."""
    cfg = record["config"]
    return bool(len(record["metrics"]["step"]) or record["status"] == "complete" or not cfg or "train" in cfg)


def read_folder(sweep: Path) -> list[dict]:
    """Every training run under ``sweep``, as pack records in folder order, then every run a launcher queued or
    started that left no folder (by name): ``launched_runs``."""
    records = [r for r in (read_run(d, sweep) for d in find_runs(sweep)) if is_training_run(r)]
    launched = launched_runs(sweep)
    for r in records:  # a failure the run's own logs do not name: its launcher's line for it
        error = launched.get(r["run"], {}).get("error")
        if r["status"] == "incomplete" and error:
            r["status"], r["exception"] = "failed", error
    found = {r["run"] for r in records}
    return records + [_folderless(sweep, n, launched[n]) for n in sorted(launched) if n not in found]


def launched_runs(sweep: Path) -> dict[str, dict]:
    """The runs the launchers of this sweep queued or started, name -> ``overrides``, ``started`` and ``error`` (the
    error line of its last failure, after where it was read): scripts/study/run_grid.py's ``logs/grid.jsonl`` (a line
    per run queued, a line per attempt) and ``python train.py -m``'s ``sweep_summary.jsonl`` (a row per cell run:
    ``bapo/entry/sweep.py``), the later line winning. A cell whose last row says complete is left out. Unreadable lines
    are skipped."""
    runs: dict[str, dict] = {}
    for row in _json_lines(sweep / "logs" / GRID_LOG):
        if isinstance(row.get("run"), str):
            run = runs.setdefault(row["run"], {"overrides": [], "started": False, "error": None})
            if isinstance(row.get("overrides"), list):
                run["overrides"] = [str(o) for o in row["overrides"]]
            if "rc" in row:
                error = row.get("error") if row["rc"] and isinstance(row.get("error"), str) else None
                run["started"], run["error"] = True, f"run_grid: {error}" if error else None
    for row in _json_lines(sweep / SWEEP_SUMMARY):
        if isinstance(row.get("cell"), str):
            if row.get("status") == "complete":
                runs.pop(row["cell"], None)
                continue
            run = runs.setdefault(row["cell"], {"overrides": [], "started": True, "error": None})
            if isinstance(row.get("overrides"), list):
                run["overrides"] = [str(o) for o in row["overrides"]]
            error = row.get("error") if isinstance(row.get("error"), str) else None
            run["started"], run["error"] = True, f"sweep summary: {error}" if error else None
    return runs


def _json_lines(path: Path) -> Iterator[dict]:
    """The JSON objects of a log of one object a line; other lines are skipped (a line cut short by a kill, one over
    :data:`MAX_LOG_LINE`). A log over :data:`MAX_LOG` is an ArtifactError naming it."""
    if not path.is_file():
        return
    with open(path, "rb") as f:
        for _, raw in read_lines(f, path, max_line=MAX_LOG_LINE, max_total=MAX_LOG):
            try:
                row = json.loads(raw) if raw is not None else None
            except (ValueError, RecursionError):
                continue
            if isinstance(row, dict):
                yield row


def _after_path(e: ArtifactError, path: Path) -> str:
    """An ArtifactError's message without the file's path it starts with (the record names the file itself)."""
    text = str(e)
    return text[len(str(path)) :].lstrip(":0123456789 ") if text.startswith(str(path)) else text


def _folderless(sweep: Path, name: str, launched: dict) -> dict:
    """The record of a run a launcher queued or started that has no folder (module docstring, ``folder``)."""
    log = sweep / "logs" / f"{name}.log"
    exception = last_exception(log) if log.is_file() else None
    exception = f"run_grid log: {exception}" if exception else launched["error"]
    return {
        "run": name,
        "config": {},
        "overrides": launched["overrides"],
        "status": "failed" if exception else "incomplete",
        "exception": exception if exception or launched["started"] else NEVER_STARTED,
        "checkpoint": False,
        "wall_s": 0.0,
        "process_s": _process_s(sweep / name),
        "metrics": {"step": []},
        "problems": [],
        "folder": False,
    }


def sweep_name(sweep: Path) -> str:
    """How a pack and a report name the sweep: relative to the working folder when inside it, else as given."""
    try:
        return sweep.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(sweep)


def write_pack(sweep: str, records: list[dict], out: Path) -> None:
    """The pack, byte-identical for the same records: compact, sorted JSON lines; gzip with mtime 0 and no name."""
    header = {"format": FORMAT, "version": VERSION, "sweep": sweep, "runs": len(records)}
    lines = [json.dumps(x, sort_keys=True, separators=(",", ":")) for x in (header, *records)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
            f.write(("\n".join(lines) + "\n").encode())
        tmp.replace(out)  # a reader never sees half a pack
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


class PackError(ValueError):
    """A file that is not a study pack, or a damaged one: the message names the file and line."""


def read_pack(path: Path) -> tuple[str, list[dict]]:
    """The sweep's name and the run records of a pack written by :func:`write_pack`, read as a stream: a line over
    :data:`MAX_PACK_LINE` or a pack over :data:`MAX_PACK` unpacked (a gzip bomb) is a PackError naming the file."""
    rows = []
    try:
        with gzip.open(path, "rb") as f:
            for i, raw in read_lines(f, path, max_line=MAX_PACK_LINE, max_total=MAX_PACK):
                if raw is None:
                    raise PackError(f"{path}:{i}: a line longer than {MAX_PACK_LINE >> 20} MiB: not a study pack")
                try:
                    rows.append(json.loads(raw))
                except json.JSONDecodeError as e:
                    raise PackError(f"{path}:{i}: unparseable JSON ({e.msg})") from None
                except (ValueError, RecursionError):
                    raise PackError(f"{path}:{i}: unparseable JSON (nested too deeply or a number too long)") from None
                if i == 1:
                    _check_header(path, rows[0])
    except ArtifactError as e:
        raise PackError(f"{e} (a study pack unpacks to a few MB)") from None
    except (OSError, EOFError, zlib.error) as e:
        raise PackError(f"{path}: not a gzip'd study pack ({e})") from None
    if not rows:
        _check_header(path, {})
    header = rows[0]
    if header.get("runs") != len(rows) - 1:
        raise PackError(f"{path}: the header counts {header.get('runs')} runs, the file holds {len(rows) - 1}")
    for i, record in enumerate(rows[1:], 2):
        missing = [k for k in ("run", "config", "status", "metrics") if not isinstance(record, dict) or k not in record]
        if missing:
            raise PackError(f"{path}:{i}: a run without {', '.join(missing)}")
    return header["sweep"], rows[1:]


def _check_header(path: Path, header: object) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise PackError(f'{path}:1: not a study pack (its first line has no "format": "{FORMAT}")')
    if header.get("version") != VERSION:
        raise PackError(f"{path}:1: pack version {header.get('version')!r}; this script reads version {VERSION}")


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep", type=Path, help="a multirun folder (or a single run folder)")
    parser.add_argument("--out", type=Path, required=True, help="the pack to write, e.g. docs/study/v4/runs.jsonl.gz")
    args = parser.parse_args(argv)
    if not args.sweep.is_dir():
        print(f"error: FileNotFoundError: not a folder: {args.sweep}", file=sys.stderr)
        return 2
    try:
        records = read_folder(args.sweep)
    except ArtifactError as e:  # a sweep's own log over its bound
        print(f"error: ArtifactError: {e}", file=sys.stderr)
        return 2
    if not records:
        print(
            f"error: FileNotFoundError: no runs under {args.sweep} (no config.yaml or metrics.jsonl)", file=sys.stderr
        )
        return 2
    blocked = next((p for p in args.out.parents if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        print(f"error: NotADirectoryError: --out {args.out}: {blocked} is a file, not a folder", file=sys.stderr)
        return 2
    try:
        write_pack(sweep_name(args.sweep), records, args.out)
    except OSError as e:
        print(
            f"error: {type(e).__name__}: --out {args.out}: {e.strerror or e} (choose a writable place)", file=sys.stderr
        )
        return 2
    by_status = {s: sum(r["status"] == s for r in records) for s in ("complete", "failed", "incomplete")}
    counts = ", ".join(f"{n} {s}" for s, n in by_status.items() if n)
    print(f"{args.out}: {len(records)} runs ({counts}), {args.out.stat().st_size / 1e3:.0f} kB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
