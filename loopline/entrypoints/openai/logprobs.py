"""Engine logprobs (vLLM shape: per token ``{token_id: Logprob}``) in the two OpenAI formats.

Eval harnesses (lm-eval-harness ``local-completions``, HELM) read the legacy
completions format literally: ``tokens[i]`` must be the i-th token's text,
``text_offset[i]`` its character offset in the returned text, and
``top_logprobs[i]`` a dict with one key per distinct token. A
:class:`TokenNamer` provides those strings: each token's own text, or
``token_id:<id>`` (vLLM's ``--return-tokens-as-token-ids``), and inside one
``top_logprobs`` dict a token whose text another one already took (two
byte-level pieces of one UTF-8 character both decode to U+FFFD) is named by
its id, so no entry overwrites another.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from loopline.entrypoints.openai.protocol import ChatTokenLogprob, CompletionLogProbs, TopLogprob
from loopline.outputs import Logprob


_MIN_LOGPROB = -9999.0  # JSON has no -inf (a token outside top-k/top-p under processed_logprobs)
_NO_RANK = 1 << 30


def finite(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of each byte used by byte-level BPE vocabularies (GPT-2 style):
    printable Latin-1 bytes stand for themselves, the other bytes map in order to U+0100 upwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


class TokenNamer:
    """Strings and bytes of single tokens, for logprobs (one per server, built from its tokenizer)."""

    def __init__(self, tokenizer: Any, tokens_as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids or tokenizer is None
        self._text: dict[int, str] = {}

    def for_request(self, tokens_as_ids: bool | None) -> "TokenNamer":
        """This namer, or one with the request's own ``return_tokens_as_token_ids`` (``None``: the server's)."""
        if tokens_as_ids is None or tokens_as_ids == self.tokens_as_ids or self.tokenizer is None:
            return self
        return TokenNamer(self.tokenizer, tokens_as_ids)

    def name(self, token_id: int, lp: Logprob | None = None) -> str:
        """The token's own text (``token_id:<id>`` with ``tokens_as_ids`` or without a tokenizer)."""
        if self.tokens_as_ids:
            return id_name(token_id)
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes (a byte-level piece of a multi-byte character gives its one byte,
        not the bytes of U+FFFD), as OpenAI's chat ``bytes`` field means them."""
        if self.tokenizer is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_level_alphabet()
            if isinstance(piece, str) and piece and all(c in table for c in piece):
                return [table[c] for c in piece]
            return list(self.tokenizer.decode([token_id]).encode("utf-8"))
        return list(id_name(token_id).encode("utf-8"))

    def top_dict(self, chosen: int, entry: dict[int, Logprob], k: int) -> dict[str, float]:
        """The top-``k`` tokens of one position, plus the chosen token when it ranks lower (as vLLM),
        keyed by distinct strings: the chosen token keeps its name, then tokens in rank order, and a
        name already taken becomes ``token_id:<id>``."""
        keep = [t for t, v in sorted(entry.items(), key=lambda tv: _rank(tv[1])) if _rank(entry[t]) <= k]
        order = [chosen] + [t for t in keep if t != chosen] if chosen in entry else keep
        out: dict[str, float] = {}
        for tid in order:
            key = self.name(tid, entry[tid])
            if key in out:
                key = id_name(tid)
            out[key] = finite(entry[tid].logprob)
        return out

    def text_offsets(self, token_ids: list[int], start: int, end: int, base: int = 0,
                     skip_special_tokens: bool = False) -> list[int]:
        """Offsets of tokens ``start..end-1`` in ``base`` + the text of ``token_ids``.

        A token's offset is the length of the text the tokens before it decode to, less a trailing
        U+FFFD (an incomplete character, completed by this token): so a token that finishes a
        multi-byte character points at that character's start.
        """
        if self.tokenizer is None:
            return [base] * (end - start)
        prefixes = self.tokenizer.batch_decode([token_ids[:i] for i in range(start, end)],
                                               skip_special_tokens=skip_special_tokens)
        return [base + len(p) - (len(p) - len(p.rstrip("\ufffd"))) for p in prefixes]


def _rank(lp: Logprob) -> int:
    return lp.rank if lp.rank is not None else _NO_RANK


def completion_logprobs(namer: TokenNamer, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                        offsets: list[int], k: int) -> CompletionLogProbs:
    """Legacy format: parallel ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset`` lists.

    ``entries[i]`` is ``None`` where no logprob exists (the first prompt
    position under ``echo``); ``offsets`` come from :meth:`TokenNamer.text_offsets`.
    """
    out = CompletionLogProbs()
    for tid, entry, offset in zip(token_ids, entries, offsets):
        lp = entry.get(tid) if entry else None
        out.tokens.append(namer.name(tid, lp))
        out.token_logprobs.append(finite(lp.logprob) if lp is not None else None)
        out.top_logprobs.append(namer.top_dict(tid, entry, k) if entry else None)
        out.text_offset.append(offset)
    return out


def chat_logprobs(namer: TokenNamer, token_ids: list[int], entries: list[dict[int, Logprob]],
                  top_k: int) -> list[ChatTokenLogprob]:
    """Chat format: one ``{token, logprob, bytes, top_logprobs}`` per token, ``top_logprobs`` ranked, k entries."""
    content = []
    for tid, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda tv: _rank(tv[1]))
        top = [_top(namer, t, v) for t, v in ranked if _rank(v) <= top_k][:top_k]
        chosen = _top(namer, tid, entry[tid])
        content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=top))
    return content


def _top(namer: TokenNamer, token_id: int, lp: Logprob) -> TopLogprob:
    return TopLogprob(token=namer.name(token_id, lp), logprob=finite(lp.logprob), bytes=namer.token_bytes(token_id))
