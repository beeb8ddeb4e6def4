"""A memory plan, read before launching: per-GPU peaks of generation and of the update, host memory per node.

``python train.py experiment=paper_7b --plan [--nproc N] [--gpu-memory GiB] [--host-memory GiB]`` (or
``scripts/gpu/plan.py`` with the same arguments; their command line is :mod:`bapo.entry.plan`) composes the config
as training would, prints the plan and exits 0 when it fits, 1 when it does not, 2 on a bad config; it starts
nothing and writes no run folder. Bad input (a GPU of no memory, a zero width) is a one-line ``error:`` and exit 2.

- :mod:`bapo.plan.shape`: the model's shape and its bytes per token (activations, KV cache, vLLM's profile);
- :mod:`bapo.plan.memory`: what a GPU holds at the largest moments of generation and of the update, and what a
  node's host memory holds;
- :mod:`bapo.plan.verdict`: the :class:`~bapo.plan.verdict.Plan` (its peaks, whether it fits, which knob to turn,
  its printout), and the training entry's check that one GPU holds a run in one process.
"""
