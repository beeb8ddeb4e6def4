"""The ``data`` group's schema (conf/data/), one per source picked by ``data.kind``;
the loaders are bapo/data/loading.py.

Types and range checks only: the defaults live in the YAML files. ``ArithConfig`` is also the synthetic
held-out set's spec of eval.py (``bapo.eval.job.ArithSetConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from bapo.data.rows import ANSWER_FORMATS
from bapo.infra.checks import choice, require, resumable


@dataclass
class ArithConfig:
    min_terms: int = MISSING
    max_terms: int = MISSING
    min_value: int = MISSING
    max_value: int = MISSING
    ops: str = MISSING

    def __post_init__(self) -> None:
        check_arith(self, "data.arith")


def check_arith(a: ArithConfig, key: str) -> None:
    """The synthetic task's ranges, reported under ``key`` (``data.arith``, or an eval set's ``eval.<name>.arith``)."""
    require(2 <= a.min_terms <= a.max_terms, f"{key}.min_terms", "need 2 <= min_terms <= max_terms")
    require(a.min_value <= a.max_value, f"{key}.min_value", "need min_value <= max_value")
    require(bool(a.ops) and set(a.ops) <= set("+-*"), f"{key}.ops", "use characters from '+-*'")


@dataclass
class DataCommon:
    """Keys every data source reads: the split seeds, the held-out size, the prompt and its length limit."""

    kind: str = MISSING
    train_seed: int = MISSING
    heldout_seed: int = MISSING
    heldout_frac: float = MISSING  # arith, or files without eval_path: the hash-chosen held-out share
    heldout_size: int = MISSING
    instruction: str = MISSING
    max_prompt_tokens: int = MISSING  # longer prompts are skipped and counted (data/skipped_rows)

    def __post_init__(self) -> None:
        require(0 < self.heldout_frac < 1, "data.heldout_frac", "must be in (0, 1)")
        require(self.heldout_size > 0, "data.heldout_size", "must be > 0")
        require(self.max_prompt_tokens > 0, "data.max_prompt_tokens", f"must be > 0, got {self.max_prompt_tokens}")


@dataclass
class ArithDataConfig(DataCommon):
    arith: ArithConfig = MISSING


@dataclass
class FileDataConfig(DataCommon):
    """``data=jsonl``: local JSONL files. The row mapping (``problem_key`` ... ``strip_instructions``) is
    ``bapo.data.rows.RowFields``'s; ``missing_hint`` is what a missing file's error adds: where to get it."""

    path: str = MISSING
    eval_path: str | None = MISSING
    problem_key: str = MISSING  # a dotted path reaches a nested field; a chat list's last user message is the problem
    answer_key: str = MISSING
    answer_format: str = MISSING  # plain | gsm8k ("... #### 72") | json_list ('["72"]')
    strip_instructions: list[str] = MISSING  # texts cut from the start or end of each problem
    missing_hint: str | None = resumable()  # words an error only

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self.answer_format, "data.answer_format", ANSWER_FORMATS)
        require(bool(self.path), "data.path", f"required for data.kind={self.kind} (a file or hub name)")


@dataclass
class HubDataConfig(FileDataConfig):
    """``data=hub`` and the named hub sets (``data=skywork_or1``, ...): any ``datasets`` dataset by hub name, local
    folder or data file."""

    split: str = MISSING
    eval_split: str | None = MISSING
    subset: str | None = MISSING


DATA: dict[str, type] = {"arith": ArithDataConfig, "jsonl": FileDataConfig, "hub": HubDataConfig}
