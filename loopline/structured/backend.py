"""Grammar compilation, matching and token masks, through xgrammar.

xgrammar is imported on the first constrained request (it pulls in a few seconds of imports), never at
engine start. One :class:`GrammarBackend` per tokenizer and vocabulary size (:func:`backend_for`) holds
xgrammar's ``TokenizerInfo`` and a caching ``GrammarCompiler``; :func:`compile_constraint` turns a
request's :class:`~loopline.structured.params.StructuredOutputsParams` into a compiled grammar or raises
``InvalidRequestError`` naming ``structured_outputs.<kind>`` and why.

Masks: :meth:`GrammarBackend.allocate_bitmask` gives host int32 words, 32 tokens a word (xgrammar's
layout; ``GrammarMatcher.fill_next_token_bitmask`` fills one row a matcher), and
:func:`apply_token_bitmask` unpacks them on the logits' device and sets every disallowed token's logit of
the given rows to ``-inf``. The model's vocabulary may be larger than the tokenizer's: ids the tokenizer
does not have are never allowed (``TokenizerInfo`` is built with the model's size, the extra ids special).
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from loopline.errors import InvalidRequestError
from loopline.structured.params import StructuredOutputsParams

# Compiled grammars kept per backend (xgrammar's compiler caches too, by bytes; this one also skips the
# schema's serialization and the compiler's lookup for the common case of one constraint used many times).
_CACHE_ENTRIES = 256
# How xgrammar's JSON grammars write "any whitespace" (replaced by a whitespace_pattern's rule).
_JSON_WS = "[ \\n\\r\\t]*"
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: ": the reason is what follows.
_ERROR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # a core dependency; absent only in a broken install
        raise InvalidRequestError(f"structured_outputs need the xgrammar package ({e})",
                                  param="structured_outputs") from e
    return xgrammar


class GrammarBackend:
    """xgrammar for one tokenizer and the model's vocabulary size: compiles constraints (cached) and
    makes matchers and bitmasks."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.xgr = xgr
        # The mask covers the model's logits; ids past the tokenizer's are padding that is never allowed.
        size = max(int(vocab_size), len(tokenizer))
        try:
            self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size)
        except Exception as e:
            raise InvalidRequestError(f"structured_outputs: this model's tokenizer is not supported by the grammar "
                                      f"engine ({_reason(e)})", param="structured_outputs") from e
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=8, cache_enabled=True,
                                            cache_limit_bytes=256 * 2**20)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of a constraint (an ``xgrammar.CompiledGrammar``); ``InvalidRequestError``
        naming ``structured_outputs.<kind>`` when it does not compile."""
        if not isinstance(spec, StructuredOutputsParams):
            raise InvalidRequestError(f"structured_outputs must be StructuredOutputsParams, got {type(spec).__name__}",
                                      param="structured_outputs")
        kind = spec.kind
        ws = spec.whitespace_pattern
        if ws is not None and (kind not in ("json", "json_object") or spec.disable_any_whitespace):
            raise InvalidRequestError("structured_outputs.whitespace_pattern applies to a JSON constraint (json or "
                                      "json_object) without disable_any_whitespace", param="structured_outputs.whitespace_pattern")
        any_ws = not spec.disable_any_whitespace
        if kind == "json":
            key: tuple = (kind, json.dumps(spec.json, sort_keys=True), any_ws, ws)
        elif kind == "choice":
            key = (kind, tuple(spec.choice))
        elif kind == "json_object":
            key = (kind, any_ws, ws)
        else:
            key = (kind, getattr(spec, kind))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(kind, spec, any_ws)
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's reason
            raise InvalidRequestError(f"structured_outputs.{kind} does not compile: {_reason(e)}",
                                      param=f"structured_outputs.{kind}") from e
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, spec: StructuredOutputsParams, any_ws: bool) -> Any:
        c = self.compiler
        if kind in ("json", "json_object"):
            if spec.json is False:  # JSON Schema's false: nothing matches
                raise InvalidRequestError("structured_outputs.json is the schema false: no output matches it",
                                          param="structured_outputs.json")
            # json_object: an object of any content (the builtin JSON grammar allows any value); true: any value
            schema = '{"type": "object"}' if kind == "json_object" else None if spec.json is True else json.dumps(spec.json)
            if spec.whitespace_pattern is not None:
                return c.compile_grammar(self._json_with_whitespace(schema, spec.whitespace_pattern))
            return c.compile_builtin_json_grammar() if schema is None else c.compile_json_schema(schema, any_whitespace=any_ws)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "grammar":
            return c.compile_grammar(spec.grammar)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(spec.choice))
        raise InvalidRequestError(f"structured_outputs: unknown kind {kind!r}", param="structured_outputs")

    def _json_with_whitespace(self, schema: str | None, pattern: str) -> str:
        """The EBNF of a JSON constraint whose whitespace (between tokens) matches the regex ``pattern``:
        xgrammar's grammar with any whitespace, each of its whitespace runs replaced by the pattern's rule."""
        grammar = self.xgr.Grammar
        loose = str(grammar.builtin_json_grammar() if schema is None else grammar.from_json_schema(schema, any_whitespace=True))
        try:
            ws = str(grammar.from_regex(pattern))
        except Exception as e:
            raise InvalidRequestError(f"structured_outputs.whitespace_pattern does not compile: {_reason(e)}",
                                      param="structured_outputs.whitespace_pattern") from e
        if _JSON_WS not in loose:  # no whitespace in this grammar -- or xgrammar prints it another way
            tight = str(grammar.builtin_json_grammar() if schema is None else
                        grammar.from_json_schema(schema, any_whitespace=False))
            if tight != loose:  # never silently ignored
                raise InvalidRequestError("structured_outputs.whitespace_pattern is not supported with this xgrammar "
                                          "version", param="structured_outputs.whitespace_pattern")
            return loose
        names = re.findall(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", ws, re.M)
        for name in sorted(names, key=len, reverse=True):  # its rules renamed apart from the JSON grammar's
            ws = re.sub(rf"(?<![A-Za-z0-9_\"]){name}(?![A-Za-z0-9_\"])", f"loopline_ws_{name}", ws)
        return loose.replace(_JSON_WS, "loopline_ws_root") + "\n" + ws

    def matcher(self, compiled: Any, stop_token_ids: list[int] | None = None) -> Any:
        """A fresh ``GrammarMatcher``: EOS (``stop_token_ids``) is allowed only where the grammar is complete."""
        if stop_token_ids:
            return self.xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))
        return self.xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> Tensor:
        """Host int32 words ``[rows, ceil(vocab / 32)]``, all bits set."""
        return self.xgr.allocate_token_bitmask(rows, self.info.vocab_size)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose strings are exactly ``choices`` (JSON's string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_backends_lock = threading.Lock()


def backend_for(tokenizer: Any, vocab_size: int) -> GrammarBackend:
    """The grammar backend of a tokenizer and vocabulary size (built once, on first use)."""
    if tokenizer is None:
        raise InvalidRequestError("structured_outputs need the engine's tokenizer (the engine was started with "
                                  "skip_tokenizer_init=True)", param="structured_outputs")
    with _backends_lock:
        per_tokenizer = _backends.setdefault(tokenizer, {})
        backend = per_tokenizer.get(vocab_size)
        if backend is None:
            backend = per_tokenizer[vocab_size] = GrammarBackend(tokenizer, vocab_size)
        return backend


def compile_constraint(tokenizer: Any, vocab_size: int, spec: StructuredOutputsParams) -> Any:
    """Compiles a constraint for a model (its tokenizer and logits width): the ``xgrammar.CompiledGrammar``,
    cached; ``InvalidRequestError`` naming ``structured_outputs.<kind>`` when it does not compile."""
    return backend_for(tokenizer, vocab_size).compile(spec)


_SHIFTS: dict[torch.device, Tensor] = {}


def apply_token_bitmask(logits: Tensor, rows: list[int], bitmask: Tensor) -> None:
    """Sets ``logits[rows[j], t] = -inf`` for every token ``t`` whose bit is clear in ``bitmask[j]``,
    in place, on the logits' device (one host-to-device copy of the words)."""
    device, vocab = logits.device, logits.shape[-1]
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))


def _reason(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return _ERROR_PREFIX.sub("", text.splitlines()[0] if text else text)[:500]
