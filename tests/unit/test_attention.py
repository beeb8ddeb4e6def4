"""``model.attn_implementation``: which attention kernel the learner (and the HF engine's copy) runs.

``auto`` picks flash-attention 2 on a GPU where flash-attn is installed, so that the learner takes its padding-free
varlen path (``bapo.learner.batching.pack``); everywhere else sdpa, where it shares each prompt across its group
under a 4-D mask (``pack_shared``). Without the key the learner could never reach the varlen path on a GPU."""

import importlib.util

import pytest

from bapo.config import ConfigError
from bapo.modeling import attention_kernel, load_model
from tests.helpers.config import compose, run_config
from tests.helpers.paths import TINY


def test_auto_is_flash_attention_only_on_a_gpu_with_flash_attn(monkeypatch):
    assert attention_kernel("auto", on_cuda=False) == "sdpa"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else real(name))
    assert attention_kernel("auto", on_cuda=True) == "flash_attention_2"
    assert attention_kernel("auto", on_cuda=False) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "flash_attn" else real(name))
    assert attention_kernel("auto", on_cuda=True) == "sdpa"  # a GPU without the package
    assert attention_kernel("eager", on_cuda=True) == "eager"  # an explicit choice is kept


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_kernel_reaches_the_model(device):
    model = load_model(str(TINY), device=device, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert load_model(str(TINY), device=device, attn_implementation="sdpa").config._attn_implementation == "sdpa"


def test_every_model_config_sets_it_and_bad_values_are_refused():
    for name in ("tiny", "qwen7b", "r1_distill_qwen_7b", "smollm2_135m", "hf"):
        assert compose(f"model={name}").model.attn_implementation == "auto", name
    with pytest.raises(ConfigError, match=r"model.attn_implementation: must be one of .*got 'flash'"):
        run_config("model.attn_implementation=flash")
