"""``python -m bapo.entry.worker --connect host:port --index i``: a rollout worker process of a disaggregated run,
started by the learner (bapo.rollout.disaggregated.pool). Its life is :func:`bapo.rollout.disaggregated.worker.main`;
what it builds is :func:`bapo.build.worker_side`, the rollout side a colocated run builds in the learner's process."""

import sys

from bapo.build import worker_side
from bapo.rollout.disaggregated.worker import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], worker_side))
