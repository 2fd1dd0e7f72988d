"""Helpers for the RL-facing tests: engines on tiny checkpoints and a step-until-done driver."""
from __future__ import annotations

import random

import pytest

from loopline.config import EngineArgs
from loopline.engine import LLMEngine


def prompt_ids(n: int, seed: int = 0, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def make_engine(tiny, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineArgs(model=str(tiny.path), **kw))


def drain(engine: LLMEngine, requests: dict | None = None, max_steps: int = 10_000) -> dict:
    """Adds ``requests`` (id -> (prompt ids, params)), steps until nothing is unfinished;
    returns the final output of every request that finished meanwhile."""
    for rid, (prompt, params) in (requests or {}).items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("requests did not finish")


@pytest.fixture
def ids():
    return prompt_ids


@pytest.fixture
def engine_for():
    return make_engine


@pytest.fixture
def run():
    return drain
