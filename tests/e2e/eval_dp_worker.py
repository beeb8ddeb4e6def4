"""Run under torchrun (2 gloo ranks) by tests/e2e/test_eval_entry.py; writes ``$OUT/rank{r}.json``.

Data-parallel evaluation with a canned engine and a verifier that counts what it grades: for
one share per rank (a plain engine), one share for both (a 2-rank tensor-parallel engine), and a
set of one problem (rank 1's share is empty),
the grades each rank performed, and the set's metrics, problem rows and sample rows it ended with.
:func:`evaluate_all` (tests/helpers/evaluation.py) also runs in one process, as the reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers.evaluation import PROMPTS, evaluate_all


def main(out: Path) -> None:
    from bapo.infra import dist

    dist.init(timeout_s=120)  # a collective left waiting by a bug fails instead of hanging
    result = {"dp": evaluate_all(), "tp": evaluate_all(tp=2), "one_prompt": evaluate_all(prompts=PROMPTS[:1])}
    (out / f"rank{dist.rank()}.json").write_text(json.dumps(result))
    dist.teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
