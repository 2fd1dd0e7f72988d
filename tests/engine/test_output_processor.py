"""Incremental detokenization and stop strings, against decoding the whole completion."""
from __future__ import annotations

import random

import pytest

from loopline.engine.detokenizer import IncrementalDetokenizer
from loopline.models.loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_gqa):
    return load_tokenizer(tiny_gqa.path)


def completions(tokenizer, n=40, length=30, seed=0):
    rng = random.Random(seed)
    vocab = len(tokenizer)
    texts = ["héllo wörld — ünïcödé ✓ 漢字 😀", "The cat sat on the mat.\n  Indented", "<|im_end|>x"]
    out = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    out += [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]  # byte tokens split UTF-8 anywhere
    return out


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_text_equals_a_full_decode(tokenizer, skip_special):
    prompt = tokenizer.encode("Once upon", add_special_tokens=False)
    for ids in completions(tokenizer):
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special)
        pieces = [detok.push(t) for t in ids]
        full = tokenizer.decode(ids, skip_special_tokens=skip_special)
        assert "".join(pieces) == detok.text and full.startswith(detok.text)
        detok.flush()
        assert detok.text == full, ids


def test_incremental_detokenization_decodes_a_bounded_window(tokenizer):
    """O(1) per token: each push decodes a window that does not grow with the completion."""
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode("word " * 400, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(), [], True)
    for t in ids:
        detok.push(t)
    assert detok.text == tokenizer.decode(ids) and max(calls) <= 8


def test_stop_strings_cut_the_text_and_streamed_text_is_never_taken_back(tiny_gqa):
    from loopline import SamplingParams

    llm = tiny_gqa.llm()
    prompt = "Once upon a time"
    free = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[7:10]  # likely spans tokens
    first = text.find(stop)
    engine = llm.llm_engine
    engine.add_request("s", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    seen = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.append(o.outputs[0].text)
    assert seen[-1] == text[:first] and o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # every streamed text extends the previous one


def test_text_shorter_than_the_holdback_shows_nothing(tiny_gqa):
    """With a stop string of k characters the last k - 1 are held back, also while the whole text is
    shorter than that: no character a stop string could still start in is ever shown."""
    from loopline import SamplingParams

    llm = tiny_gqa.llm()
    engine, tok = llm.llm_engine, llm.llm_engine.tokenizer
    stop = "\x00" * 6  # never generated; the tiny model's first tokens decode to fewer than 5 characters
    engine.add_request("h", "Once upon a time", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                               stop=[stop]))
    seen = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            c = o.outputs[0]
            seen.append(c.text)
            if not o.finished:
                assert len(c.text) <= max(0, len(tok.decode(c.token_ids)) - (len(stop) - 1)), (c.text, c.token_ids)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    assert seen[-1] == tok.decode(c.token_ids)
