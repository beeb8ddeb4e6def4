"""Where the repository is, and how a relative path that a config names is found."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL_SETS_DIR = ROOT / "conf" / "evaluation" / "eval"  # eval.py's `eval` group; training runs them by name


def resolve_path(p: str) -> str:
    """A relative path that exists from the working directory, else from the repo root, else unchanged."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return str(path)
    if (ROOT / path).exists():
        return str(ROOT / path)
    return p
