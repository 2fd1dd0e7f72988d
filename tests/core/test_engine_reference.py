"""Engine vs the independent reference (tests/reference.py), token for token.

Every path (batched, chunked prefill, small pages, staggered arrivals, both
layouts, refill and no_refill) must reproduce the serial dense oracle's greedy
tokens and exit depths exactly, and its logprobs to fp32 tolerance.
"""
from __future__ import annotations

import random

import pytest

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from reference import reference_generate


def prompts_for(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def oracle(tiny, prompt, max_tokens, **kw):
    return reference_generate(tiny.state_dict, tiny.cfg, prompt, max_tokens, **kw)


def run_engine(tiny, prompts, params, arrivals=None, **engine_kwargs):
    """Runs the engine directly; ``arrivals[i]`` is the step at which prompt i is added."""
    engine_kwargs.setdefault("dtype", "float32")
    engine_kwargs.setdefault("device", "cpu")
    engine_kwargs.setdefault("skip_tokenizer_init", True)
    engine = LLMEngine(EngineArgs(model=str(tiny.path), **engine_kwargs))
    arrivals = arrivals or [0] * len(prompts)
    done, step = {}, 0
    while len(done) < len(prompts):
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 10_000
    assert engine.kv.num_used_blocks == 0, "finished requests must free their KV"
    return [done[f"r{i}"].outputs[0] for i in range(len(prompts))], engine


LENGTHS = [3, 9, 17, 30]


@pytest.mark.parametrize("which", ["tiny_gqa", "tiny_mha"])
@pytest.mark.parametrize("budget,block_size", [(64, 4), (8, 2), (2048, 16)])
def test_fixed_depth_matches_reference(request, which, budget, block_size):
    tiny = request.getfixturevalue(which)
    prompts = prompts_for(tiny.cfg["vocab_size"], LENGTHS)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs, engine = run_engine(tiny, prompts, params, arrivals=[0, 0, 3, 7], block_size=block_size,
                              max_num_batched_tokens=budget, max_num_seqs=min(budget, 8))
    for prompt, out in zip(prompts, outs):
        tokens, depths, logprobs = oracle(tiny, prompt, 6)
        assert out.token_ids == tokens
        assert out.exit_depths == depths == [tiny.cfg["total_ut_steps"]] * 6
        for tid, step_lps, ref in zip(out.token_ids, out.logprobs, logprobs):
            assert abs(step_lps[tid].logprob - ref) < 1e-4
            assert step_lps[tid].rank == 1  # greedy picks the top token
    assert engine.stats.rows_per_step > 1.0  # rows really were batched


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_adaptive_exits_match_serial_oracle(tiny_gqa, layout, mode):
    tiny = tiny_gqa
    prompts = prompts_for(tiny.cfg["vocab_size"], [5, 12, 20], seed=3)
    rule = dict(min_loops=1, max_loops=4, exit_threshold=0.7)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **rule)
    outs, engine = run_engine(tiny, prompts, params, arrivals=[0, 2, 5], kv_layout=layout, scheduling_mode=mode,
                              block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    all_depths = []
    for prompt, out in zip(prompts, outs):
        tokens, depths, _ = oracle(tiny, prompt, 8, layout=layout, **rule)
        assert (out.token_ids, out.exit_depths) == (tokens, depths)
        all_depths += depths
    assert len(set(all_depths)) > 1, "the test model must exit at varied depths"


def test_batched_equals_serial_adaptive(tiny_gqa):
    tiny = tiny_gqa
    prompts = prompts_for(tiny.cfg["vocab_size"], [4, 11, 7, 15, 6], seed=5)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.6, min_loops=2)
    batched, _ = run_engine(tiny, prompts, params, block_size=4, max_num_batched_tokens=12, max_num_seqs=5)
    for prompt, out in zip(prompts, batched):
        serial, _ = run_engine(tiny, [prompt], params, block_size=8)
        assert (out.token_ids, out.exit_depths) == (serial[0].token_ids, serial[0].exit_depths)
        assert min(out.exit_depths) >= 2


def test_trace_mode_replays_a_recorded_run(tiny_gqa):
    tiny = tiny_gqa
    prompts = prompts_for(tiny.cfg["vocab_size"], [6, 13], seed=9)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.65)
    recorded, _ = run_engine(tiny, prompts, params)
    replay = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_depths=o.exit_depths) for o in recorded]
    engine = LLMEngine(EngineArgs(model=str(tiny.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  exit_mode="trace"))
    for i, (p, sp) in enumerate(zip(prompts, replay)):
        engine.add_request(f"t{i}", {"prompt_token_ids": p}, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0]
    for i, rec in enumerate(recorded):
        assert outs[f"t{i}"].exit_depths == rec.exit_depths
        assert outs[f"t{i}"].token_ids == rec.token_ids
    # A different trace gives the oracle's answer for that trace.
    trace = [1, 2, 3, 4, 4, 3, 2, 1]
    engine.add_request("x", {"prompt_token_ids": prompts[0]},
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_depths=trace))
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0]
    tokens, depths, _ = oracle(tiny, prompts[0], 8, trace_depths=trace)
    assert outs["x"].token_ids == tokens and outs["x"].exit_depths == depths == trace
