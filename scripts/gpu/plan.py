"""The memory plan of a training command, read before launching it (``bapo.plan``).

    python scripts/gpu/plan.py experiment=paper_7b                  # = python train.py experiment=paper_7b --plan
    python scripts/gpu/plan.py experiment=paper_7b --gpu-memory 139 --nproc 16

Prints per-GPU peaks of generation and of the update and the host memory per node, and which knob to
turn when it does not fit; exits 0 when it fits, 1 when it does not, 2 on a bad config.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bapo.entry.plan import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli([a for a in sys.argv[1:] if a != "--plan"], prog="scripts/gpu/plan.py"))
