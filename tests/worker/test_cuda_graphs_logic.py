"""The CUDA-graph input path on the CPU: replay simulated by running the captured function eagerly.

Checks what graphs add around the model -- persistent buffers, bucket padding
with scratch rows, device-side inputs for async scheduling -- so the GPU only
has to confirm the capture itself (tests/worker/test_gpu_engine.py).
"""
from __future__ import annotations

import random

import pytest
from matching import approx_floats

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.worker.cuda_graphs import DecodeGraphs, MixedGraphs


class _EagerReplay:
    """Stands in for a captured graph: replay() recomputes into the captured output tensors."""

    replays = 0

    def __init__(self, graphs: DecodeGraphs, b: int) -> None:
        self.graphs, self.b = graphs, b

    def replay(self) -> None:
        _EagerReplay.replays += 1
        for out, new in zip(self.graphs.outputs[self.b], self.graphs._forward(self.b)):
            if out is not None:
                out.copy_(new)


class _EagerMixedReplay(_EagerReplay):
    replays = 0

    def replay(self) -> None:
        _EagerMixedReplay.replays += 1
        super().replay()


def simulate_graphs(engine: LLMEngine, max_seq_len: int, max_tokens: int) -> DecodeGraphs:
    graphs = DecodeGraphs(engine.runner, engine.runner.max_num_seqs, max_seq_len)
    for b in graphs.sizes:
        graphs.reset_inputs(b)
        graphs.outputs[b] = tuple(t.clone() for t in graphs._forward(b))
        graphs.graphs[b] = _EagerReplay(graphs, b)
    engine.runner.graphs = graphs
    mixed = MixedGraphs(engine.runner, engine.runner.max_num_seqs, max_tokens, max_seq_len,
                        max_prefill_rows=3)
    for key in mixed.layouts:
        mixed.reset_inputs(key)
        mixed.outputs[key] = tuple(t.clone() if t is not None else None for t in mixed._forward(key))
        mixed.graphs[key] = _EagerMixedReplay(mixed, key)
    engine.runner.mixed_graphs = mixed
    return graphs


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(tiny, graphs: bool, params: SamplingParams | None = None, **kw):
    engine = LLMEngine(EngineArgs(model=str(tiny.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  block_size=4, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128, **kw))
    if graphs:
        simulate_graphs(engine, 64, 24)
    params = params or SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True, exit_threshold=0.7,
                                      logprobs=1)
    with_prompt_logprobs = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.7,
                                          prompt_logprobs=1, exit_depths=params.exit_depths)
    for i, n in enumerate((3, 14, 9, 21, 5)):  # 5 rows: padded to the bucket of 6 (sizes 1, 2, 4, 6)
        engine.add_request(f"r{i}", ids(n, seed=n), params)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 12:  # arrivals while others decode: steps with decode rows and prefill chunks
            engine.add_request("late-a", ids(17, seed=1), params)
            engine.add_request("late-b", ids(4, seed=2), params)
        if steps == 20:  # a cached prefix (prefill starts mid-prompt) and prompt logprobs through mixed steps
            engine.add_request("late-prefix", ids(17, seed=1)[:12] + [5, 6, 7], with_prompt_logprobs)
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                prompt_lps = None
                if out.prompt_logprobs:
                    prompt_lps = [None if d is None else sorted((t, lp.logprob) for t, lp in d.items())
                                  for d in out.prompt_logprobs]
                lps = list(c.token_logprobs) if c.token_logprobs is not None else None
                done[out.request_id] = (c.token_ids, c.exit_depths, lps, prompt_lps)
    run.engine = engine
    return done


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_input_path_equals_eager(tiny_gqa, layout, async_scheduling):
    kw = dict(kv_layout=layout, async_scheduling=async_scheduling, enable_prefix_caching=layout == "last_exited")
    _EagerReplay.replays = _EagerMixedReplay.replays = 0
    with_graphs = run(tiny_gqa, graphs=True, **kw)
    assert _EagerReplay.replays > 20  # decode steps really went through the graph path
    assert _EagerMixedReplay.replays > 5  # and so did steps with prefill chunks
    assert approx_floats(with_graphs) == run(tiny_gqa, graphs=False, **kw)


def test_async_graphs_with_trace_depths_and_penalties(tiny_gqa):
    """Under async scheduling the decode graph derives each row from the device state, trace depths
    and all; penalties read the device's counts after it."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=0.8, logprobs=1,
                            exit_depths=[3, 1, 4, 2])
    kw = dict(async_scheduling=True, exit_mode="trace")
    _EagerReplay.replays = 0
    with_graphs = run(tiny_gqa, graphs=True, params=params, **kw)
    assert _EagerReplay.replays > 20
    assert approx_floats(with_graphs) == run(tiny_gqa, graphs=False, params=params, **kw)
    assert all(depths[:4] == [3, 1, 4, 2] for _, depths, *_ in with_graphs.values() if len(depths) >= 4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graphs_under_preemption(tiny_gqa, async_scheduling):
    """Victims leave and re-enter slots while decode and mixed steps replay graphs."""
    kw = dict(async_scheduling=async_scheduling, kv_allocation="incremental", enable_preemption=True)
    _EagerReplay.replays = 0
    tight = run(tiny_gqa, graphs=True, num_kv_blocks=4 * 14, **kw)
    assert _EagerReplay.replays > 20 and run.engine.scheduler.num_preemptions > 0
    assert approx_floats(tight) == run(tiny_gqa, graphs=False)


def test_captures_run_with_python_gc_paused_and_restore_it():
    import gc

    from loopline.worker.cuda_graphs import _no_gc

    assert gc.isenabled()
    with _no_gc():
        assert not gc.isenabled()  # no collection (and no CUDA teardown) can start mid-capture
    assert gc.isenabled()
    gc.disable()
    try:
        with _no_gc():
            pass
        assert not gc.isenabled()  # a caller's own setting is left as it was
    finally:
        gc.enable()


def test_async_no_refill_graphs_equal_eager(tiny_gqa):
    """no_refill rows waiting for their cohort run on scratch: the graph masks their exits."""
    kw = dict(async_scheduling=True, scheduling_mode="no_refill")
    _EagerReplay.replays = 0
    with_graphs = run(tiny_gqa, graphs=True, **kw)
    assert _EagerReplay.replays > 20
    assert approx_floats(with_graphs) == run(tiny_gqa, graphs=False, **kw)


def test_inputs_upload_only_when_the_image_changes(tiny_gqa):
    import torch

    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  block_size=4, max_num_seqs=2, max_model_len=64))
    graphs = DecodeGraphs(engine.runner, 2, 64)
    image = torch.arange(16, dtype=torch.uint8)
    graphs._upload(image)
    assert torch.equal(graphs.inputs[:16], image)
    graphs.inputs[0] = 77  # stands in for a write the cache does not know of
    graphs._upload(image.clone())  # the same bytes: no copy
    assert int(graphs.inputs[0]) == 77
    graphs._upload(image + 1)  # other bytes: copied
    assert torch.equal(graphs.inputs[:16], image + 1)
    graphs.reset_inputs(graphs.sizes[0])  # forgets what the device holds
    graphs._upload(image + 1)
    assert torch.equal(graphs.inputs[:16], image + 1)
