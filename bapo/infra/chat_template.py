"""A model folder's chat template, rendered in Jinja's sandbox with bounds on time, size and output.

A chat template is code that comes with the weights (``chat_template.jinja``, ``tokenizer_config.json``). transformers
renders it in Jinja's ``ImmutableSandboxedEnvironment``, which keeps it from Python's internals but bounds nothing
else: two nested ``range(100000)`` loops run for hours (the sandbox bounds each range, not their product), and
``{{ 'x' * 10**10 }}`` asks for 10 GB. :func:`render_chat` renders it as transformers'
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` does (the same sandbox,
options, globals and variables: the same text, which tests/unit/infra/test_chat_template.py compares), with bounds:

* time: at most :data:`MAX_RENDER_S` seconds per conversation, checked on every line the compiled template runs
  (a trace function on this thread, only while it renders, only in the template's own code);
* size: no value over :data:`MAX_CHARS` characters or items is made (``*``, ``**``, ``+``, ``%``, ``~``, the
  arguments of every call and filter, and the result of the text methods that multiply, ``replace``, ``join`` and
  ``expandtabs``, are checked before they run), nor stored in a ``namespace``;
* output: at most :data:`MAX_CHARS` characters, counted as the template writes them;
* the template itself: at most :data:`MAX_TEMPLATE_CHARS` characters.

A template over a bound, or one that fails (``raise_exception``, an unsafe attribute, an undefined name, runaway
recursion) is one :class:`ChatTemplateError` naming the model folder. This module imports nothing of bapo above
``infra/``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from bapo.infra.checks import ConfigError

MAX_TEMPLATE_CHARS = 100_000  # real templates are 1-20 KB
MAX_RENDER_S = 2.0  # a conversation renders in well under a millisecond
MAX_CHARS = 4_000_000  # a rendered prompt of about a million tokens; no template makes a larger text or list
MAX_EXPONENT = 1024  # x ** n beyond this is a number no template prints


class ChatTemplateError(ConfigError):
    """A model folder's chat template that cannot be rendered within its bounds, or that fails: the message names
    the folder and what went wrong."""


class _Bound(Exception):
    """A bound of :func:`render_chat` was reached (raised inside the template, reported as a ChatTemplateError)."""


def _size(value: Any) -> int:
    """The characters or items ``value`` holds (a list's strings counted with it), or 0 for a scalar."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, list | tuple | dict | set | frozenset):
        return len(value) + sum(len(v) for v in value if isinstance(v, str))
    return 0


def _check(value: Any, what: str) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
        raise _Bound(f"{what} {value} is over the bound of {MAX_CHARS:,}")
    if _size(value) > MAX_CHARS:
        raise _Bound(f"{what} holds more than {MAX_CHARS:,} characters or items")
    return value


def _check_text_method(text: str, name: str, args: tuple) -> None:
    """Refuse the text methods whose result can be far longer than their arguments (``s.replace('', t)``,
    ``t.join(items)``, ``s.expandtabs(n)``) before they run, from the exact length they would make."""
    size = 0
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        found = text.count(args[0])
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            found = min(found, args[2])
        size = len(text) + found * (len(args[1]) - len(args[0]))
    elif name == "join" and args and isinstance(args[0], list | tuple):
        size = sum(len(x) for x in args[0] if isinstance(x, str)) + len(text) * max(len(args[0]) - 1, 0)
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else 8
        size = len(text) + text.count("\t") * max(tab, 0)
    if size > MAX_CHARS:
        raise _Bound(f"str.{name} would make {size:,} characters, over the bound of {MAX_CHARS:,}")


def _environment():
    """The sandbox transformers renders chat templates in (``_compile_jinja_template``), with the size checks."""
    import jinja2
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator, Frame, optimizeconst
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class Codegen(CodeGenerator):
        @optimizeconst
        def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:  # ``a ~ b``: checked before it is joined
            self.write("environment.bounded_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = Codegen

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, int | float) and abs(right) > MAX_EXPONENT:
                raise _Bound(f"the power {right} is over the bound of {MAX_EXPONENT}")
            if operator == "*":
                n, seq = (right, left) if isinstance(right, int) else (left, right)
                if isinstance(n, int) and _size(seq) and _size(seq) * max(n, 0) > MAX_CHARS:
                    raise _Bound(f"a repetition of {max(n, 0) * _size(seq):,} characters or items")
            if operator == "+" and _size(left) + _size(right) > MAX_CHARS:
                raise _Bound(f"a sum of more than {MAX_CHARS:,} characters or items")
            if operator == "%":
                _check(left, "a format")
                for v in right if isinstance(right, tuple) else (right,):
                    _check(v, "a format argument")
            return _check(super().call_binop(context, operator, left, right), "a result")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's own)
            for v in (*args, *kwargs.values()):
                _check(v, "an argument")
            if isinstance(getattr(__obj, "__self__", None), str):  # a text's method: its result's size, first
                _check_text_method(__obj.__self__, __obj.__name__, args)
            return _check(super().call(__context, __obj, *args, **kwargs), "a result")

        def bounded_join(self, parts: Sequence[Any]) -> str:
            texts = [str(p) for p in parts]
            if sum(len(t) for t in texts) > MAX_CHARS:
                raise _Bound(f"a text of more than {MAX_CHARS:,} characters (~)")
            return "".join(texts)

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens with it): its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class BoundedNamespace(Namespace):
        """transformers' namespace (no underscore names), whose values are checked for size."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature: self may be a keyword)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name, value in attrs.items():
                BoundedNamespace._check_item(name, value)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            BoundedNamespace._check_item(name, value)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_item(name: Any, value: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")
            _check(value, f"namespace.{name}")

    class TemplateDict:
        """transformers' ``dict`` global: a dict maker with no attributes to reach through."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals |= {
        "raise_exception": raise_exception,
        "strftime_now": strftime_now,
        "dict": TemplateDict(),
        "namespace": BoundedNamespace,
    }
    return env


def _bounded_filter(f: Any) -> Any:
    """A filter whose arguments and result are checked for size (filters run without the sandbox's ``call``)."""

    @functools.wraps(f)  # keeps Jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        for v in (*args, *kwargs.values()):
            _check(v, "a filter's argument")
        return _check(f(*args, **kwargs), "a filter's result")

    return bounded


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    return _environment().from_string(source)


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_Bound` in the template's own code (Jinja compiles it as ``<template>``) once ``seconds`` have
    passed: a trace function on this thread for the block only, restored to the one before (a debugger's)."""
    end = time.monotonic() + seconds

    def local(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > end:
            raise _Bound(f"rendering ran past {seconds:g} s (a template that loops)")
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(before)


def template_source(tokenizer: Any) -> str:
    """The chat template ``tokenizer`` renders with (its default, where it has several), checked for size."""
    name = getattr(tokenizer, "name_or_path", "the tokenizer")
    try:
        source = tokenizer.get_chat_template()
    except (ValueError, TypeError) as e:
        raise ChatTemplateError(f"{name}: no usable chat template ({str(e).splitlines()[0]})") from None
    if not isinstance(source, str):
        raise ChatTemplateError(f"{name}: its chat template is not text ({type(source).__name__})")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(
            f"{name}: its chat template has {len(source):,} characters, over the bound of {MAX_TEMPLATE_CHARS:,}"
        )
    return source


def render_chat(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """``messages`` through ``tokenizer``'s chat template, as transformers renders it (module docstring), within the
    bounds; a ChatTemplateError naming the model folder otherwise."""
    import jinja2

    name = getattr(tokenizer, "name_or_path", "the tokenizer")
    source = template_source(tokenizer)
    variables = dict(tokenizer.special_tokens_map)  # what apply_chat_template passes beside the conversation
    variables |= {
        "messages": messages,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    out: list[str] = []
    chars = 0
    try:
        template = _compiled(source)
        with _deadline(MAX_RENDER_S):
            for piece in template.generate(**variables):
                chars += len(piece)
                if chars > MAX_CHARS:
                    raise _Bound(f"its output passed {MAX_CHARS:,} characters")
                out.append(piece)
    except _Bound as e:
        raise ChatTemplateError(f"{name}: its chat template is refused: {e}") from None
    except (jinja2.TemplateError, RecursionError, MemoryError, ArithmeticError, TypeError, ValueError) as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        why = " ".join(str(e).split()) or type(e).__name__
        raise ChatTemplateError(f"{name}: its chat template failed{where}: {type(e).__name__}: {why[:200]}") from None
    return "".join(out)
