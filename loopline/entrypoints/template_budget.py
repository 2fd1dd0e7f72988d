"""Budgets a chat template cannot escape: time, output size, and the size of one operation.

A chat template is a program (Jinja compiles it to Python) that runs for every chat request; one
that loops for minutes (``{% for i in range(100000) %}{% for j in range(100000) %}``) would hold a
tokenizer thread, and every other chat, ``/tokenize`` and text completion queued behind it.

* **Time and output** (:func:`bounded_render`): while a template renders, a trace function
  (``sys.settrace``, this thread only) sees every line the compiled template runs and every chunk it
  yields. Past ``RENDER_TIME_BUDGET_S`` or ``RENDER_OUTPUT_BUDGET_CHARS`` it raises
  :class:`TemplateBudgetError` inside the template, which ends the render and frees the thread. A
  template's variables (``{% set %}``, namespaces) are held to the output budget too, so a string
  doubled in a loop is caught long before it fills memory.
* **One operation** (:func:`check_template_source`): a single C-level operation (``"x" * 10**10``,
  ``"%0999999999d" % 1``) cannot be interrupted, so such templates are refused before they run:
  no ``**``; every ``*`` multiplies by an integer literal of at most ``MAX_REPEAT`` (a chain of
  them by at most the output budget); no literal padding width above the output budget, no literal
  format width of a million or more; a template that does not parse is refused too (it would run
  unchecked). A width computed while rendering is not bounded: such a template needs reading.

Errors name ``chat_template`` and the budget, and are 400s over HTTP.
"""
from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from loopline.errors import InvalidRequestError

T = TypeVar("T")

RENDER_TIME_BUDGET_S = 2.0
RENDER_OUTPUT_BUDGET_CHARS = 4 * 1024 * 1024
MAX_REPEAT = 256  # the largest literal a template may multiply by (one step of "x" * n)

_PADDING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "truncate"})
# a width or precision of a million or more: "%09999999d", "%.9999999s", "{:>9999999}"
_WIDTH = re.compile(r"%[-#0 +]*(?:\d{7,}|\d*\.\d{7,})|\{[^{}]*:[^{}]*?\d{7,}[^{}]*\}")
_VALUES_CHECK_INTERVAL_S = 0.001
_TEMPLATE_FILE = "<template>"  # the file name Jinja gives code compiled from a string
_ROOT = "root"  # Jinja's top-level render function: every chunk of output is yielded from it


class TemplateBudgetError(InvalidRequestError):
    """A chat template ran past a budget or uses an operation whose size it cannot bound."""

    def __init__(self, message: str) -> None:
        super().__init__(f"the chat template {message}", param="chat_template")


class _Tracer:
    """The trace functions of one render: a deadline and output/variable size checks."""

    def __init__(self, time_s: float, output_chars: int) -> None:
        self.time_s, self.output_chars = time_s, output_chars
        self.deadline = time.monotonic() + time_s
        self.output = 0
        self.next_values_check = 0.0

    def on_call(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        # NOTE: called for every Python call in this thread while rendering (the tokenizer's own
        # code included): kept to one comparison; the checks run on the template's lines only
        return self.on_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    def on_line(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        if event == "line":
            now = time.monotonic()
            if now > self.deadline:
                self._check_time()
            self.check_output()
            if now > self.next_values_check:  # NOTE: sampled: reading f_locals costs more than the line
                # itself; a value can at most double a few times in the interval (copying costs time)
                self.next_values_check = now + _VALUES_CHECK_INTERVAL_S
                _check_values(frame.f_locals.values(), self.output_chars)
        elif event == "return" and isinstance(arg, str) and frame.f_code.co_name == _ROOT:
            self.output += len(arg)  # NOTE: raising here would not reach the template; the next line does
        return self.on_line

    def _check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"ran past its time budget of {self.time_s:g} s (RENDER_TIME_BUDGET_S)")

    def check_output(self) -> None:
        if self.output > self.output_chars:
            raise TemplateBudgetError(f"rendered more than its output budget of {self.output_chars} characters "
                                      "(RENDER_OUTPUT_BUDGET_CHARS)")


def _check_values(values: Any, limit: int, depth: int = 0) -> None:
    """Refuses a template variable (or a namespace attribute) longer than ``limit``."""
    for v in values:
        if isinstance(v, (str, list, tuple, dict)) and len(v) > limit:
            raise TemplateBudgetError(f"built a value of {len(v)} items, above its budget of {limit} "
                                      "(RENDER_OUTPUT_BUDGET_CHARS)")
        attrs = getattr(v, "_Namespace__attrs", None)  # {% set ns = namespace(...) %}
        if isinstance(attrs, dict) and depth == 0:
            _check_values(attrs.values(), limit, depth + 1)


def bounded_render(render: Callable[[], T], time_s: float | None = None, output_chars: int | None = None) -> T:
    """``render()`` (which renders a Jinja template in this thread) under a time and output budget
    (None: ``RENDER_TIME_BUDGET_S`` / ``RENDER_OUTPUT_BUDGET_CHARS``); raises
    :class:`TemplateBudgetError` when it runs past either."""
    tracer = _Tracer(RENDER_TIME_BUDGET_S if time_s is None else time_s,
                     RENDER_OUTPUT_BUDGET_CHARS if output_chars is None else output_chars)
    previous = sys.gettrace()
    sys.settrace(tracer.on_call)
    try:
        result = render()
    finally:
        sys.settrace(previous)
    tracer.check_output()
    return result


def check_template_source(source: str) -> None:
    """Refuses a template using an operation one step of which could exceed the budgets (module docstring)."""
    _checked(source)


@functools.lru_cache(maxsize=16)
def _checked(source: str) -> None:
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError as e:  # unchecked is unbounded: never rendered
        raise InvalidRequestError(f"the chat template does not parse: {e}", param="chat_template") from None
    limit = RENDER_OUTPUT_BUDGET_CHARS
    for node in tree.find_all(nodes.Pow):
        raise TemplateBudgetError(f"uses '**' (line {node.lineno}): its result's size has no bound")
    for node in tree.find_all((nodes.Call, nodes.Filter)):  # "x".center(10**9), "x"|indent(10**9)
        name = node.node.attr if isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) else \
            getattr(node, "name", None)
        args = [*node.args, *(k.value for k in node.kwargs)]
        if name in _PADDING and any(isinstance(a, nodes.Const) and isinstance(a.value, int) and a.value > limit
                                    for a in args):
            raise TemplateBudgetError(f"pads to more than {limit} characters with {name!r} (line {node.lineno})")
    for node in tree.find_all((nodes.Mod, nodes.Call, nodes.Filter)):  # "%0999999999d" % 1, "{:>999999999}".format(1)
        fmt = node.left if isinstance(node, nodes.Mod) else \
            node.node if isinstance(node, nodes.Filter) and node.name == "format" else \
            node.node.node if isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) and \
            node.node.attr == "format" else None
        if isinstance(fmt, nodes.Const) and isinstance(fmt.value, str) and _WIDTH.search(fmt.value):
            raise TemplateBudgetError(f"formats to a width of a million characters or more (line {node.lineno})")
    for node in tree.find_all(nodes.Mul):
        if _repeat(node) > limit:
            raise TemplateBudgetError(f"multiplies by more than {limit} in one expression (line {node.lineno})")


def _repeat(node: Any) -> int:
    """The factor a ``*`` chain multiplies by: its integer literals' product (each at most
    ``MAX_REPEAT``); a ``*`` with no such literal has no bound."""
    from jinja2 import nodes

    if not isinstance(node, nodes.Mul):
        return 1
    literals = [n.value for n in (node.left, node.right) if isinstance(n, nodes.Const) and isinstance(n.value, int)]
    if not literals or any(abs(v) > MAX_REPEAT for v in literals):
        raise TemplateBudgetError(f"multiplies by something other than an integer literal of at most {MAX_REPEAT} "
                                  f"(line {node.lineno}): the size of the result would have no bound")
    return abs(literals[0]) * _repeat(node.left) * _repeat(node.right)
