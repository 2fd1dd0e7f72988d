"""Incremental detokenization: O(1) amortized work per generated token.

Decoding a completion from scratch at every token costs O(n) per token. The
detokenizer instead decodes a short window: the tokens since the last point
where the text was complete (``prefix``), with and without the new ones, and
appends the difference. A byte-level token can end inside a UTF-8 character;
the decoder then yields ``"\\ufffd"``, so text is held back until the character
completes (or the request finishes: :meth:`flush`).

:class:`StreamedText` reports a completion's text as deltas: only the characters decoded since
the previous report, less the last few a stop string could still start in.
"""
from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 4  # prompt tokens decoded before the first output token: leading spaces decode as in context


class IncrementalDetokenizer:
    """The text of one completion, grown token by token."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this are in ``text``
        self._pieces: list[str] = []  # the text, joined when read (appending to a str copies it)

    @property
    def text(self) -> str:
        """The text decoded so far."""
        if len(self._pieces) != 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Appends a token; returns the text it completed (may be empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        new = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self._pieces.append(new)
        return new

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end), as a full decode would show it."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        new = self._decode(self._ids[self._prefix:])[len(before):]
        self._prefix = self._read = len(self._ids)
        self._pieces.append(new)
        return new


class StreamedText:
    """A completion's visible text, reported in deltas.

    ``pending`` holds the text decoded but not reported yet: what is held back (the characters a
    stop string could still start in) and what the latest token added. The text reported before
    it is only counted (``reported``), never kept, so a report costs the size of what it adds.
    Reported text is never taken back.
    """

    __slots__ = ("reported", "pending")

    def __init__(self) -> None:
        self.reported = 0
        self.pending = ""

    def append(self, text: str) -> None:
        if text:
            self.pending += text  # NOTE: short: the held-back characters and one token's text

    def cut(self, end: int) -> None:
        """The text ends ``end`` characters into ``pending`` (a stop string ended it)."""
        self.pending = self.pending[:end]

    def report(self, holdback: int) -> tuple[int, str]:
        """``(start, text)``: the text to report now -- everything pending but its last ``holdback``
        characters -- and the character of the whole text it starts at."""
        start, n = self.reported, len(self.pending) - holdback
        if n <= 0:
            return start, ""
        text, self.pending = self.pending[:n], self.pending[n:]
        self.reported += n
        return start, text
