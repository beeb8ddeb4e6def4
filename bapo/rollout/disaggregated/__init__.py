"""Rollout workers in other processes: ``placement.mode=disaggregated``.

The learner process keeps the loop, the schedule and the weights; ``placement.workers`` worker processes
(``python -m bapo.entry.worker``) each hold an engine, a reward pool and the prompt stream, and make
their share of every rollout batch with the weights the learner pushes. The in-process producer
(:class:`bapo.rollout.producer.Producer`) drives them unchanged: this package gives it a batch maker
(:class:`~bapo.rollout.disaggregated.remote.RemoteMaker`) and an engine to lend for evaluation
(:class:`~bapo.rollout.disaggregated.remote.RemoteEngine`), so the schedule, the queue, ``run()`` and the
checkpoint format are the colocated run's.

Transport: libraries only. Requests and results (rollout batches, the maker's state) go over an
authenticated ``multiprocessing.connection`` to each worker (:class:`bapo.infra.listener.AuthListener`: the key's
challenge off the accept loop, timed, so a silent local client keeps no worker out; what the key protects and
what it does not is in its docstring and docs/offpolicy.md); weights go over a two-rank gloo process
group per worker (``torch.distributed.ProcessGroupGloo`` on a ``TCPStore``), one flat buffer per dtype,
the way a GPU trainer sends them over NCCL. One pair group per worker, so a worker can be replaced
without disturbing the others.

One job a module:

- :mod:`~bapo.rollout.disaggregated.wire`: the messages, the key, the learner's listener;
- :mod:`~bapo.rollout.disaggregated.pool`: the worker processes, started, fed, replaced and stopped (faults);
- :mod:`~bapo.rollout.disaggregated.remote`: the batch maker and the engine the producer drives (determinism);
- :mod:`~bapo.rollout.disaggregated.placement`: the placement and its schema (``placement.*``);
- :mod:`~bapo.rollout.disaggregated.worker`: the worker process's life (its requests, its heartbeat).
"""

from bapo.rollout.disaggregated.placement import Disaggregated, DisaggregatedConfig

__all__ = ["Disaggregated", "DisaggregatedConfig"]
