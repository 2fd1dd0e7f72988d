"""Tool-call parsers: model text -> OpenAI ``tool_calls`` (vLLM's ``--tool-call-parser`` names).

:data:`TOOL_PARSERS` maps a parser name to its class. A parser turns a whole completion into
``(content, calls)`` (:meth:`ToolParser.extract`) and, for streams, a sequence of text deltas into
content deltas and tool-call deltas (:meth:`ToolParser.feed` / :meth:`ToolParser.finish`); the
streamed pieces reassemble to the same content and calls.

``hermes``: calls are ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes / Qwen
style). A block whose JSON does not parse (or lacks a string ``name``) stays in the content, as text.
Streaming: a block that starts ``{"name": "X", "arguments": {`` is announced (id, name) as soon as
that much has arrived, and its arguments follow as string pieces (the text as the model wrote it, up
to the block's closing brace, held back from the last ``}`` seen); any other block is sent whole when
``</tool_call>`` arrives. NOTE: an announced block cannot be taken back: if it turns out malformed or
is cut off, the stream keeps its partial call (as vLLM), while the whole response leaves it in content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamPiece:
    """What one streamed text delta adds: content text and/or tool-call deltas (OpenAI's
    ``delta.tool_calls`` entries: ``{index, id, type, function: {name, arguments}}``)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def call_from_json(obj: Any) -> ToolCall | None:
    """A call from a parsed ``{"name": str, "arguments": object|str}`` (``parameters`` accepted too), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    else:
        text = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


class ToolParser:
    """Base class: subclasses implement :meth:`extract`; streaming holds back text that may start a
    call and hands completed calls out as they close."""

    name = ""

    def __init__(self) -> None:
        self._buf = ""
        self._calls = 0

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    # --- streaming --------------------------------------------------------------------------------
    def feed(self, delta: str) -> StreamPiece:
        raise NotImplementedError

    def finish(self) -> StreamPiece:
        raise NotImplementedError

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        d = {"index": self._calls, **call.as_dict()}
        self._calls += 1
        return d

    @property
    def calls_sent(self) -> int:
        return self._calls


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._open: dict[str, int] | None = None  # the announced call being streamed: index, args start, sent

    @staticmethod
    def _raw_arguments(body: str, head: re.Match) -> str:
        """The arguments as written: from the head's end to the block's last ``}`` (the outer object's)."""
        return body[head.end():body.rfind("}")]

    def _parse_block(self, body: str) -> ToolCall | None:
        try:
            call = call_from_json(json.loads(body.strip()))
        except ValueError:
            return None
        head = _HEAD.match(body)
        if call is not None and head is not None and head.group(1) == call.name:
            call.arguments = self._raw_arguments(body, head)  # as streamed
        return call

    def _stream_open(self, body: str, piece: StreamPiece, final: bool) -> None:
        """Announces the open block's call once its head arrived, then sends the arguments that are safe."""
        if self._open is None:
            head = _HEAD.match(body)
            if head is None:
                return
            call = ToolCall(head.group(1), "")
            piece.tool_calls.append(self._call_delta(call))
            self._open = {"index": self._calls - 1, "start": head.end(), "sent": 0}
        o = self._open
        avail = body[o["start"]:]
        last = avail.rfind("}")
        safe = last if (final or last >= 0) else len(avail)
        if safe > o["sent"]:
            piece.tool_calls.append({"index": o["index"], "function": {"arguments": avail[o["sent"]:safe]}})
            o["sent"] = safe

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        rest = text
        while True:
            i = rest.find(self.START)
            if i < 0:
                content.append(rest)
                break
            j = rest.find(self.END, i + len(self.START))
            if j < 0:  # unterminated: stays text
                content.append(rest)
                break
            call = self._parse_block(rest[i + len(self.START):j])
            if call is None:  # malformed: the block stays in the content
                content.append(rest[:j + len(self.END)])
            else:
                content.append(rest[:i])
                calls.append(call)
            rest = rest[j + len(self.END):]
        text_out = "".join(content)
        if calls:
            text_out = text_out.strip()
        return text_out or None, calls

    def feed(self, delta: str) -> StreamPiece:
        self._buf += delta
        piece = StreamPiece()
        out: list[str] = []
        while True:
            i = self._buf.find(self.START)
            if i < 0:
                # hold back a suffix that could be the start of "<tool_call>"
                keep = 0
                for k in range(min(len(self.START) - 1, len(self._buf)), 0, -1):
                    if self.START.startswith(self._buf[-k:]):
                        keep = k
                        break
                out.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            j = self._buf.find(self.END, i + len(self.START))
            if j < 0:  # inside a call: send the text before it, stream what is safe, wait for the end
                out.append(self._buf[:i])
                self._buf = self._buf[i:]
                self._stream_open(self._buf[len(self.START):], piece, final=False)
                break
            if self._open is not None:  # announced: its last arguments
                out.append(self._buf[:i])
                self._stream_open(self._buf[i + len(self.START):j], piece, final=True)
                self._open = None
            else:
                call = self._parse_block(self._buf[i + len(self.START):j])
                if call is None:
                    out.append(self._buf[:j + len(self.END)])
                else:
                    out.append(self._buf[:i])
                    piece.tool_calls.append(self._call_delta(call))
            self._buf = self._buf[j + len(self.END):]
        piece.content = "".join(out)
        return piece

    def finish(self) -> StreamPiece:
        """The held-back rest (an unterminated call stays text, unless it was announced: then it stays partial)."""
        rest, self._buf = self._buf, ""
        if self._open is not None:
            self._open = None
            return StreamPiece()
        return StreamPiece(content=rest)


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {sorted(TOOL_PARSERS)})") from None

