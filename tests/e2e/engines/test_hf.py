"""The HF engine's decode memory, measured in a fresh interpreter per decode path (slow)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PATHS = ["lean", "generate"]


# A random-init model with a 32k vocabulary: the decode paths must not keep a [B, T, V] history of
# logits (here 64 x 128 x 32000 fp32 = 1.05 GB); one step is 8 MB. glibc is told to map every buffer
# over 64 kB on its own, so that freed steps leave the process and the peak RSS counts live tensors,
# not heap that glibc's sliding mmap threshold keeps for reuse (about 0.7 GB with `generate` here).
MEMORY_PROBE = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from bapo.engines.decode import Sampling
from bapo.engines.hf import DECODERS
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(3, 32000, (8, 8))
kw = dict(n=8, temperature=1.0, stop_ids=(2,), pad_id=0)
DECODERS[sys.argv[1]](model, ids, torch.ones_like(ids), Sampling(max_new_tokens=4, **kw))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tokens, logp = DECODERS[sys.argv[1]](model, ids, torch.ones_like(ids), Sampling(max_new_tokens=128, **kw))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(tokens.shape[1], grown // 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("decode", PATHS)
def test_decode_memory_is_one_step_of_logits(decode):
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, decode], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    steps, grown_mb = map(int, out.stdout.split()[-2:])
    assert steps == 128  # nothing stopped early: the full history would have been 1 GB
    assert grown_mb < 200, f"peak RSS grew {grown_mb} MB during decoding"
