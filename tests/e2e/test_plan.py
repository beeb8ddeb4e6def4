"""The memory plan against models measured in subprocesses, and ``train.py --plan`` as users run it."""

import os
import subprocess
import sys

import pytest
import torch

from bapo.learner.logprobs import peak_bytes
from bapo.plan.shape import (
    checkpoint_per_token,
    head_activations_per_token,
    layer_activations_per_token,
    layer_backward_per_token,
)
from tests.helpers.paths import ROOT
from tests.helpers.plan import measured, shape

# ----------------------------------------------------------------------------- per-token figures, measured


def tiny_arch(layers: int, vocab: int = 2048) -> dict:
    return dict(
        model_type="qwen2", hidden_size=256, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip


TOKENS = 4096  # [tokens, hidden] fp32 is 4 MB: every activation is a mapping of its own


# ----------------------------------------------------------------------------- docs/gpu.md, generated here


@pytest.mark.slow  # models measured in subprocesses (about 10 s of CPU each)
def test_activations_per_token_per_layer_without_checkpointing():
    """Two layers against four: the two more layers' saved activations, per token, are the plan's figure."""
    per_layer = (measured(tiny_arch(4), TOKENS, False) - measured(tiny_arch(2), TOKENS, False)) / (2 * TOKENS)
    plan = layer_activations_per_token(shape(tiny_arch(2)), 4)  # fp32: 25,624 bytes a token
    print(f"one layer, all saved: measured {per_layer:.0f} B/token, plan {plan}")
    assert plan == pytest.approx(per_layer, rel=0.03)


@pytest.mark.slow  # models measured in subprocesses (about 10 s of CPU each)
def test_checkpointed_activations_per_token_per_layer():
    per_layer = (measured(tiny_arch(6), TOKENS, True) - measured(tiny_arch(2), TOKENS, True)) / (4 * TOKENS)
    plan = checkpoint_per_token(shape(tiny_arch(2)), 4)  # its fp32 input: 1,024 bytes a token
    print(f"one layer, checkpointed: measured {per_layer:.0f} B/token, plan {plan}")
    assert plan == pytest.approx(per_layer, rel=0.15)


@pytest.mark.slow  # models measured in subprocesses (about 10 s of CPU each)
@pytest.mark.parametrize("vocab", [2048, 8192])  # the first decoder layer's backward peaks, then the chain's
def test_checkpointed_peak_of_a_forward_and_backward(vocab):
    """The plan's activations and logits chain at their largest moment, against the whole measured peak."""
    arch = tiny_arch(2, vocab)
    s, K = shape(arch), TOKENS
    layers = s.layers * checkpoint_per_token(s, 4) * K
    chain = layers + head_activations_per_token(s, 4) * K + peak_bytes(K, vocab, torch.float32)
    layer = layers + (layer_activations_per_token(s, 4) + layer_backward_per_token(s, 4)) * K
    peak = measured(arch, K, True)
    print(f"V={vocab}: measured {peak / 2**20:.1f} MiB, plan: chain {chain / 2**20:.1f}, layer {layer / 2**20:.1f}")
    assert max(chain, layer) == pytest.approx(peak, rel=0.05)
    assert (chain > layer) == (vocab == 8192)


def test_train_py_plan_prints_and_creates_no_run_folder(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, str(ROOT / "train.py"), "experiment=paper_7b", "--plan", "--gpu-memory", "80"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "memory plan: experiment=paper_7b" in proc.stdout and "fits: per-GPU peak 68.14 GiB" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no outputs/, no .hydra

    cmd = [sys.executable, str(ROOT / "train.py"), "rollout.temperature=-1", "--plan"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: ConfigError: rollout.")
    assert list(tmp_path.iterdir()) == []
