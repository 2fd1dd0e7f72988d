"""Verifiable rewards and prompts of the GRPO recipe (loopline.train.grpo; docs/rl.md §9).

A reward is ``f(prompt text, completion text) -> float``, computed from the text alone: nothing
learned, nothing sampled. :func:`make_reward` builds one from its ``--reward`` spelling.
"""
from __future__ import annotations

import ast
from typing import Any, Callable

from loopline.errors import InvalidRequestError

#: Python statements left open inside a bracket: a completion whose first line completes one
#: (``prompt + line`` parses with :func:`ast.parse`) earns the ``python_parses`` reward.
PROMPTS: tuple[str, ...] = (
    "x = foo(1, ", "result = max(a, ", "print(", "values = [1, 2, ", "total = sum(", "y = (a + ",
    "items = {'a': 1, ", "name = str(", "ok = check(x, ", "more = has(n, ", "r = range(", "data = dict(a=",
    "return_value = len(", "point = (0, ", "z = abs(", "assert check(x, ", "s = ''.join(", "n = int(",
    "pairs = list(zip(a, ", "k = min(", "flag = isinstance(x, ", "text = f(",
)


_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _first_line(completion: str) -> str:
    return completion.split("\n", 1)[0]


def python_parses(prompt: str, completion: str) -> float:
    """1.0 when ``prompt`` + the completion's first line is valid Python (and the line is not empty)."""
    line = _first_line(completion)
    if not line.strip():
        return 0.0
    try:
        ast.parse(prompt + line)
    except (SyntaxError, ValueError):  # ValueError: a NUL byte
        return 0.0
    return 1.0


def _closes(prompt: str, line: str) -> bool:
    """Whether ``line`` closes, in order, every bracket ``prompt`` left open (string contents ignored)."""
    stack: list[str] = []
    for ch in prompt:
        if ch in "([{":
            stack.append(ch)
        elif ch in _CLOSERS and stack and stack[-1] == _CLOSERS[ch]:
            stack.pop()
    if not stack:
        return False
    quote = None
    for ch in line:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in _CLOSERS:
            if stack[-1] != _CLOSERS[ch]:
                return False
            stack.pop()
            if not stack:
                return True
    return False


def python_closes(prompt: str, completion: str) -> float:
    """A shaped :func:`python_parses`: 1.0 when it parses, 0.5 when the first line at least closes the
    brackets the prompt opened, else 0. One right token earns the half reward, so a barely trained
    model finds signal in its first groups."""
    if python_parses(prompt, completion):
        return 1.0
    return 0.5 if _closes(prompt, _first_line(completion)) else 0.0


def contains(word: str) -> Callable[[str, str], float]:
    """1.0 when the completion contains ``word``."""
    def reward(prompt: str, completion: str) -> float:
        return 1.0 if word in completion else 0.0
    return reward


REWARDS: dict[str, Callable[..., Any]] = {"python_closes": lambda: python_closes, "python_parses": lambda: python_parses,
                                          "contains": contains}


def make_reward(spec: str) -> Callable[[str, str], float]:
    """``"python_closes"``, ``"python_parses"`` or ``"contains:WORD"``."""
    name, _, arg = spec.partition(":")
    if name not in REWARDS or (name == "contains") != bool(arg):
        raise InvalidRequestError(f"reward={spec!r}; allowed: 'python_closes', 'python_parses', 'contains:WORD'")
    return REWARDS[name](arg) if arg else REWARDS[name]()
