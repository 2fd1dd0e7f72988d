"""Logprobs as eval harnesses read them: echo tokens and offsets, distinct top_logprobs, token ids, chat bytes."""
from __future__ import annotations

import httpx
import pytest

from loopline.entrypoints.openai.logprobs import TokenNamer
from loopline.models.loader import load_tokenizer
from loopline.outputs import Logprob

API_KEY = "test-key"  # as the `server` fixture (conftest.py) is built
MODEL = "tiny-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MULTIBYTE = "日本 é"  # the tiny byte-level vocabulary splits each character into single-byte tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_gqa):
    return load_tokenizer(tiny_gqa.path)


def complete(server, **body) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, **body}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# --- units -------------------------------------------------------------------------------------
def test_colliding_texts_get_distinct_keys(tokenizer):
    namer = TokenNamer(tokenizer)
    a, b, c = tokenizer.encode(MULTIBYTE)[:3]  # three bytes of one character: each decodes to U+FFFD
    assert namer.name(a) == namer.name(b) == namer.name(c) == "\ufffd"
    entry = {b: Logprob(-3.0, 3), a: Logprob(-1.0, 1), c: Logprob(-2.0, 2)}
    top = namer.top_dict(b, entry, k=2)  # chosen b ranks 3rd: top 2 plus the chosen token
    assert top == {"\ufffd": -3.0, f"token_id:{a}": -1.0, f"token_id:{c}": -2.0}
    assert TokenNamer(tokenizer, tokens_as_ids=True).top_dict(a, entry, k=1) == {f"token_id:{a}": -1.0}


def test_token_bytes_are_the_raw_bytes(tokenizer):
    namer = TokenNamer(tokenizer)
    ids = tokenizer.encode(MULTIBYTE)
    assert b"".join(bytes(namer.token_bytes(t)) for t in ids) == MULTIBYTE.encode("utf-8")
    assert namer.token_bytes(ids[0]) == [0xE6]  # not the bytes of U+FFFD


def test_text_offsets_point_into_the_text(tokenizer):
    namer = TokenNamer(tokenizer)
    ids = tokenizer.encode("The cat sat")
    assert namer.text_offsets(ids, 0, len(ids)) == [0, 3, 5, 7, 9]
    assert namer.text_offsets(ids, 2, 4, base=10) == [15, 17]
    # a token that completes a character points at the character's start
    ids = tokenizer.encode(MULTIBYTE)
    assert namer.text_offsets(ids, 0, len(ids)) == [0, 0, 0, 1, 1, 1, 2, 3, 3]


def _exact_offsets(tok, ids: list[int], skip: bool = False) -> list[int]:
    """The definition: token i's offset is len(decode(ids[:i])) less a trailing U+FFFD."""
    out = []
    for i in range(len(ids)):
        text = tok.decode(ids[:i], skip_special_tokens=skip)
        out.append(len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else len(text))
    return out


@pytest.mark.parametrize("skip", [False, True])
def test_windowed_offsets_equal_the_definition_in_linear_time(tokenizer, skip):
    import random

    from loopline.entrypoints.openai.logprobs import TextOffsets

    rng = random.Random(0)
    ids = tokenizer.encode(("The river town woke slowly. " + MULTIBYTE + " <|im_end|> ") * 30)
    ids += [rng.randrange(0, tokenizer.vocab_size) for _ in range(150)]  # random bytes, specials, broken characters
    want = _exact_offsets(tokenizer, ids, skip)

    class Counting:  # counts the tokens decoded
        def __init__(self, tok):
            self.tok, self.decoded = tok, 0

        def decode(self, ids, **kw):
            self.decoded += len(ids)
            return self.tok.decode(ids, **kw)

        def batch_decode(self, seqs, **kw):
            self.decoded += sum(map(len, seqs))
            return self.tok.batch_decode(seqs, **kw)

    counting = Counting(tokenizer)
    offsets = TextOffsets(counting, skip)
    got = []
    for k in range(0, len(ids), 5):  # a stream: the sequence grows 5 tokens per chunk
        got += offsets.of(ids[:k + 5], k, min(len(ids), k + 5))
    assert got == want
    n = len(ids)
    assert counting.decoded < 3 * n * TextOffsets.WINDOW and counting.decoded < n * n // 4, (counting.decoded, n)


# --- over HTTP ---------------------------------------------------------------------------------
def test_echo_tokens_and_offsets(server):
    body = complete(server, prompt="The cat sat", max_tokens=0, echo=True, logprobs=1)
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "The cat sat"
    assert lp["tokens"] == ["The", " c", "at", " s", "at"]
    assert lp["text_offset"] == [0, 3, 5, 7, 9]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for tok, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[tok] == value and 1 <= len(top) <= 2


def test_echo_with_generated_tokens_offsets_continue(server):
    body = complete(server, prompt="The cat sat", max_tokens=5, echo=True, logprobs=0, seed=3, ignore_eos=True)
    ch = body["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == 10 and lp["text_offset"][:5] == [0, 3, 5, 7, 9]
    text = ch["text"]
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        if "\ufffd" not in tok:
            assert text[off:off + len(tok)] == tok


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_are_distinct_k_entries(server, stream):
    k = 5
    body = {"model": MODEL, "prompt": MULTIBYTE, "max_tokens": 6, "echo": True, "logprobs": k, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        tokens, values, tops = [], [], []
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    for ch in json.loads(line[6:])["choices"]:
                        tokens += ch["logprobs"]["tokens"]
                        values += ch["logprobs"]["token_logprobs"]
                        tops += ch["logprobs"]["top_logprobs"]
    else:
        lp = complete(server, **{k_: v for k_, v in body.items() if k_ != "model"})["choices"][0]["logprobs"]
        tokens, values, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    n_prompt = 9
    assert len(tokens) == n_prompt + 6
    for i, (tok, value, top) in enumerate(zip(tokens, values, tops)):
        if i == 0:
            assert top is None
            continue
        assert top[tok] == value
        assert len(top) in (k, k + 1)  # the top k, plus the chosen token when it ranks lower (vLLM)
        if i >= n_prompt:  # greedy: the chosen token is the top one
            assert len(top) == k and value == max(top.values())


def test_return_tokens_as_token_ids(async_llm, serve_app):
    from loopline.entrypoints.openai.api_server import build_app

    srv = serve_app(build_app(async_llm, MODEL, api_key=API_KEY, shutdown_engine=False, return_tokens_as_token_ids=True))
    lp = complete(srv, prompt="The cat sat", max_tokens=2, echo=True, logprobs=2, seed=1)["choices"][0]["logprobs"]
    assert lp["tokens"][:5] == ["token_id:305", "token_id:300", "token_id:275", "token_id:266", "token_id:275"]
    assert all(t.startswith("token_id:") for top in lp["top_logprobs"][1:] for t in top)
    assert lp["text_offset"][:5] == [0, 3, 5, 7, 9]  # offsets still index the text
    r = httpx.post(srv.base_url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 2, "seed": 1})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(t["token"].startswith("token_id:") for t in content)


def test_chat_bytes_are_raw_token_bytes(server, tokenizer):
    r = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": MULTIBYTE}], "max_tokens": 6, "logprobs": True,
        "top_logprobs": 3, "seed": 2, "return_token_ids": True})
    ch = r.json()["choices"][0]
    namer = TokenNamer(tokenizer)
    for tid, t in zip(ch["token_ids"], ch["logprobs"]["content"]):
        assert t["bytes"] == namer.token_bytes(tid) and t["token"] == tokenizer.decode([tid])
        assert len(t["top_logprobs"]) == 3 and all(x["bytes"] is not None for x in t["top_logprobs"])


def test_return_tokens_as_token_ids_per_request(server):
    lp = complete(server, prompt="The cat sat", max_tokens=1, echo=True, logprobs=1,
                  return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert lp["tokens"][:2] == ["token_id:305", "token_id:300"]
    lp = complete(server, prompt="The cat sat", max_tokens=1, echo=True, logprobs=1)["choices"][0]["logprobs"]
    assert lp["tokens"][:2] == ["The", " c"]  # the server default: text
