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

    def offsets(self, skip_special_tokens: bool = False) -> "TextOffsets":
        """A :class:`TextOffsets` for one token sequence (keep it while the sequence grows)."""
        return TextOffsets(self.tokenizer, skip_special_tokens)

    def text_offsets(self, token_ids: list[int], start: int, end: int, base: int = 0,
                     skip_special_tokens: bool = False) -> list[int]:
        """Offsets of tokens ``start..end-1`` in ``base`` + the text of ``token_ids`` (see :class:`TextOffsets`)."""
        return [base + o for o in self.offsets(skip_special_tokens).of(token_ids, start, end)]


class TextOffsets:
    """Character offsets of a growing token sequence in the text it decodes to, in linear time.

    Token i's offset is the length of the text ``ids[:i]`` decodes to, less a
    trailing U+FFFD (an incomplete character that token i completes), so a
    token that finishes a multi-byte character points at the character's start.
    Decoding every prefix costs O(n^2) (over a second for a 2k-token echo), so
    prefixes are decoded from an *anchor* a instead: ``decode(ids[:i]) ==
    decode(ids[:a]) + decode(ids[a:i])`` when the tokens around a decode the
    same apart as together (checked on ``CONTEXT`` tokens each side: byte-level
    pieces of one character, or a decoder that strips a leading space, fail the
    check). Anchors advance ``WINDOW`` tokens at a time; where no position near
    the window's end passes the check, that window decodes whole prefixes (exact,
    slower).
    """

    WINDOW = 32
    CONTEXT = 4

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.lengths = [0]  # lengths[i] = len(decode(ids[:i])) for i <= anchor
        self.offsets = [0]  # offsets[i]: token i's offset, for i <= anchor
        self.anchor = 0
        self.exact = False  # the anchor failed the check: the next window decodes whole prefixes

    def of(self, ids: list[int], start: int, end: int) -> list[int]:
        """Offsets of tokens ``start..end-1`` of ``ids`` (the whole sequence so far)."""
        if self.tokenizer is None:
            return [0] * (end - start)
        while len(ids) >= self.anchor + self.WINDOW + self.CONTEXT:
            self._advance(ids)
        # token i's offset comes from the prefix ids[:i]: positions up to end - 1 are needed
        tail = self._window(ids, self.anchor, end - 1)[1] if end - 1 > self.anchor else []
        known = self.offsets[start:min(end, self.anchor + 1)]
        return known + tail[max(0, start - self.anchor - 1):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _window(self, ids: list[int], a: int, b: int) -> tuple[list[int], list[int]]:
        """(lengths, offsets) of positions a+1..b, decoded from anchor a (or whole, in exact mode)."""
        base = 0 if self.exact else self.lengths[a]
        texts = self.tokenizer.batch_decode([ids[0 if self.exact else a:i] for i in range(a + 1, b + 1)],
                                            skip_special_tokens=self.skip)
        lengths = [base + len(t) for t in texts]
        # a suffix of nothing but U+FFFD strips back into the anchor's own trailing U+FFFD
        floor = 0 if self.exact else self.offsets[a]
        return lengths, [base + len(t.rstrip("\ufffd")) if t.rstrip("\ufffd") else floor
                         for t in texts]

    def _advance(self, ids: list[int]) -> None:
        a, w, c = self.anchor, self.WINDOW, self.CONTEXT
        lengths, offsets = self._window(ids, a, a + w)
        self.lengths += lengths
        self.offsets += offsets
        for p in range(a + w, a + w - c, -1):  # the window's end, or a few tokens before it
            near = ids[p - c:p + c]
            if self._decode(near) == self._decode(ids[p - c:p]) + self._decode(ids[p:p + c]):
                self.lengths, self.offsets = self.lengths[:p + 1], self.offsets[:p + 1]
                self.anchor, self.exact = p, False
                return
        self.anchor, self.exact = a + w, True


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


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None] | None,
                         namer: TokenNamer | None = None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``null`` (the first token) or
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}``; ``-inf`` as -9999.0."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for step in entries:
        if step is None:
            out.append(None)
            continue
        out.append({str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank,
                               "decoded_token": namer.name(tid, lp) if namer is not None else lp.decoded_token}
                    for tid, lp in step.items()})
    return out
