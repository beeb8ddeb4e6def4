"""A model folder's chat template renders as transformers renders it, in the sandbox, within bounds on time, size and
output (bapo/infra/chat_template.py); a template that loops, grows or fails is one ChatTemplateError naming the
folder."""

import sys
import time

import pytest

from bapo.data.loading import render_prompt
from bapo.infra import chat_template
from bapo.infra.chat_template import ChatTemplateError, render_chat
from bapo.samples import Problem
from tests.helpers import hostile
from tests.helpers.modeling import CHAT, QWEN, R1, RENDERED
from tests.helpers.paths import ROOT

PROBLEM = Problem(id="p", problem="What is 2 + 3?", answer="5")
CONVERSATIONS = [
    CHAT,
    [{"role": "user", "content": "What is 2+3?\nPut the final answer in \\boxed{}."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum: 1 + 1 = ?"}],
    [{"role": "user", "content": "déjà vu ~ {{ x }} {% raw %} $\\frac12$"}],
]


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("asset", ["tiny-math", "tiny-explore", "tiny-longcot", "tiny-ramble"])
def test_the_shipped_templates_render_as_transformers_renders_them(asset):
    tok = _tokenizer(ROOT / "assets" / asset)
    for chat in CONVERSATIONS:
        for gen in (True, False):
            assert render_chat(tok, chat, add_generation_prompt=gen) == tok.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen
            )


@pytest.mark.parametrize("repo_id", [QWEN, R1])
def test_the_families_templates_render_as_transformers_renders_them(standins, repo_id):
    """Qwen2.5's and DeepSeek-R1's own templates (the stand-ins carry them): system prompts, special tokens, loops."""
    tok = _tokenizer(standins[1][repo_id])
    assert render_chat(tok, CHAT) == RENDERED[repo_id]
    for chat in CONVERSATIONS:
        assert render_chat(tok, chat) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def _with(tmp_path, source: str):
    return _tokenizer(hostile.template(source)(tmp_path / "export"))


def test_a_template_that_loops_is_refused_within_its_time_bound(tmp_path, monkeypatch):
    """Before: render_prompt ran the two nested range(100000) loops for hours (the sandbox bounds each range)."""
    monkeypatch.setattr(chat_template, "MAX_RENDER_S", 1.0)
    tok = _with(tmp_path, hostile.LOOP)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"export: its chat template is refused: rendering ran past 1 s"):
        render_prompt(PROBLEM, tok)
    assert time.monotonic() - t0 < 20


def test_the_time_bound_leaves_a_debuggers_trace_function_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_S", 0.2)
    tok = _with(tmp_path, hostile.LOOP)

    def tracer(frame, event, arg):
        return None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        with pytest.raises(ChatTemplateError):
            render_chat(tok, CHAT)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(before)


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 10**9 }}",  # one repetition
        "{{ [1] * 10**9 }}",
        "{{ 9 ** 9 ** 9 }}",  # a number of 370 million digits
        "{{ 'x'|center(10**9) }}",  # a filter's width
        "{{ 'x'.ljust(10**9) }}",  # a method's
        "{{ '%*s' % (10**9, 'x') }}",  # a format's
        "{% set ns = namespace(s='x' * 4000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set a = 'x' * 3000000 %}{{ a ~ a }}",  # a concatenation
        "{% set a = 'x' * 3000000 %}{{ a + a }}",
        "{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('x') }}",  # doubling by recursion
        "{% set a = 'x' * 3000000 %}{{ [a, a]|join }}",
    ],
)
def test_no_value_over_the_size_bound_is_made(tmp_path, source):
    """Before: each asked Python for gigabytes (or minutes of big-number arithmetic) in one step."""
    tok = _with(tmp_path, source)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        render_chat(tok, CHAT)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 10, str(e.value)


@pytest.mark.parametrize(
    "source",
    [
        "{% set a = 'x' * 3000000 %}{{ a.replace('x', 'yyyyyyyyyy') }}",
        "{% set a = 'x' * 3000 %}{{ a.replace('', a) }}",
        "{% set a = 'x' * 1000000 %}{{ a.join([a, a, a]) }}",
        "{% set a = '\t' * 3000000 %}{{ a.expandtabs(8) }}",
    ],
)
def test_a_texts_methods_that_multiply_are_refused_before_they_run(tmp_path, source):
    with pytest.raises(ChatTemplateError, match=r"its chat template is refused: str\.\w+ would make [\d,]+ characters"):
        render_chat(_with(tmp_path, source), CHAT)


def test_the_output_is_bounded_as_it_is_written(tmp_path):
    tok = _with(tmp_path, hostile.HUGE_OUTPUT)
    with pytest.raises(ChatTemplateError, match="its output passed 4,000,000 characters"):
        render_chat(tok, CHAT)


@pytest.mark.parametrize(
    "source, says",
    [
        (hostile.RAISES, "its chat template failed: TemplateError: this template refuses every conversation"),
        (hostile.DUNDER, "its chat template failed: SecurityError: access to attribute '__class__'"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
        ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", "No filter named 'nosuchfilter'"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "SecurityError"),
        ("{# " + "x" * 200_000 + " #}hi", "has 200,008 characters, over the bound of 100,000"),  # the template itself
    ],
)
def test_a_template_that_fails_is_one_line_naming_the_folder(tmp_path, source, says):
    """Before: transformers' TemplateError or SecurityError, 76-84 lines of traceback through eval.py."""
    tok = _with(tmp_path, source)
    with pytest.raises(ChatTemplateError) as e:
        render_prompt(PROBLEM, tok)
    assert str(e.value).startswith(str(tmp_path / "export")) and says in str(e.value) and "\n" not in str(e.value)
