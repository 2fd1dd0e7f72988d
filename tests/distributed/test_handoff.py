"""The engine half of prefill/decode disaggregation, in one process: a prefill-only engine hands
each request off after its first token and a decode engine adopts it; together they give exactly
what one engine gives (tokens, exit depths, logprobs, text), in both KV layouts."""
from __future__ import annotations

import random

import pytest
import torch

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def engine_for(tiny, prefill_only=False, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 4)
    return LLMEngine(EngineArgs(model=str(tiny.path), **kw), prefill_only=prefill_only)


def drain(engine, requests):
    done = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def drain_pd(prefill, decode, requests):
    """Both engines stepped in turn; every ready request moves at once (its pages copied)."""
    done, moved = {}, 0
    for rid, (prompt, params) in requests.items():
        prefill.add_request(rid, {"prompt_token_ids": prompt}, params)
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        done.update((o.request_id, o) for o in prefill.step() if o.finished)
        for child in prefill.ready_handoffs():
            handoff, kv = prefill.hand_off(child)
            decode.adopt(handoff, kv.clone())
            moved += 1
        done.update((o.request_id, o) for o in decode.step() if o.finished)
    return done, moved


def result(out):
    """Tokens, exit depths, text and finish reason exactly; logprobs to float32 rounding (a decode
    worker's batches differ from the single engine's, and a batch's size moves the last bits)."""
    return [(c.token_ids, c.exit_depths, c.text, c.finish_reason,
             [{k: round(v.logprob, 4) for k, v in e.items()} for e in c.logprobs] if c.logprobs else None)
            for c in out.outputs]


def requests():
    system = ids(13, seed=99)
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, exit_threshold=0.6, logprobs=2)
    sampled = SamplingParams(max_tokens=9, temperature=1.0, seed=5, ignore_eos=True, exit_threshold=0.6)
    penalized = sampled.clone(seed=8, presence_penalty=0.5, repetition_penalty=1.2)
    return {"a": (system + ids(7, seed=1), greedy), "b": (system + ids(22, seed=2), sampled),
            "c": (ids(3, seed=3), greedy.clone(max_tokens=1)), "d": (ids(30, seed=4), penalized),
            "e": (system + ids(5, seed=5), sampled.clone(seed=None))}


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_handoff_gives_the_single_engines_outputs(tiny_gqa, layout):
    kw = dict(kv_layout=layout, max_num_batched_tokens=8, enable_prefix_caching=True)
    single = drain(engine_for(tiny_gqa, **kw), requests())
    prefill, decode = engine_for(tiny_gqa, prefill_only=True, **kw), engine_for(tiny_gqa, **kw)
    pd, moved = drain_pd(prefill, decode, requests())
    assert moved == 4  # "c" ends with its first token on the prefill engine
    assert {k: result(v) for k, v in pd.items()} == {k: result(v) for k, v in single.items()}
    depths = {d for out in single.values() for d in out.outputs[0].exit_depths}
    assert len(depths) > 1  # the adaptive exits vary
    assert prefill.kv.num_used_blocks == 0 and decode.kv.num_used_blocks == 0
    assert not decode.runner.snapshots and not prefill.runner.requests
