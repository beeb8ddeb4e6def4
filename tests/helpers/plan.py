"""The memory plan's measurements: a model's peak memory measured in a fresh interpreter, and a model's shape as
the plan reads it."""

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bapo.plan.shape import ModelShape, model_shape
from tests.helpers.paths import ROOT

GiB = 2**30


MEASURE = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    from bapo.learner.logprobs import logp_entropy
    from bapo.modeling import arch_config

    def vm(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    arch, tokens, ckpt = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    model = AutoModelForCausalLM.from_config(arch_config(arch)).train()  # fp32
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def logp(ids):  # as the learner's packed forward: the logits live only inside the chain
        k = ids.shape[1] - 1
        logits = model(input_ids=ids[:, :-1], position_ids=torch.arange(k)[None], use_cache=False).logits[0]
        return logp_entropy(logits, ids[0, 1:])[0]

    for _ in range(2):  # gradients allocated, first-call allocations done
        logp(torch.randint(arch["vocab_size"], (1, 65))).sum().backward()
    ids = torch.randint(arch["vocab_size"], (1, tokens + 1))
    before = vm("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    logp(ids).sum().backward()
    print(json.dumps({"peak": vm("VmHWM") - before}))
    """
)


@functools.cache
def _measured(arch_json: str, tokens: int, ckpt: bool) -> int:
    arch = json.loads(arch_json)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", MEASURE, json.dumps(arch), str(tokens), str(int(ckpt))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak"]


def measured(arch: dict, tokens: int, ckpt: bool) -> int:
    """Peak RSS over a forward and backward, over the RSS before it (parameters and gradients already there).

    A fixed mmap threshold makes every tensor over 1 MB its own mapping, returned when freed (see
    tests/unit/learner/test_logprobs.py), so RSS follows the live tensors. Each shape is measured once."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to measure peak RSS")
    return _measured(json.dumps(arch, sort_keys=True), tokens, ckpt)


def shape(arch: dict) -> ModelShape:
    from bapo.modeling import arch_config

    return model_shape(arch_config(arch))
