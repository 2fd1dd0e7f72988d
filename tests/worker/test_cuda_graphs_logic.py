"""The CUDA-graph input path on the CPU: replay simulated by running the captured function eagerly.

Checks what graphs add around the model -- persistent buffers, bucket padding
with scratch rows, device-side inputs for async scheduling -- so the GPU only
has to confirm the capture itself (tests/worker/test_gpu_engine.py).
"""
from __future__ import annotations

import random

import pytest
import torch
from graph_testing import EagerCapturer
from matching import approx_floats

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.worker.cuda_graphs import StepGraphs


def simulate_graphs(engine: LLMEngine, max_seq_len: int, max_tokens: int) -> StepGraphs:
    engine.runner.capture_graphs(max_seq_len, max_tokens, max_prefill_rows=3, capturer=EagerCapturer())
    return engine.runner.graphs


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(tiny, graphs: bool, params: SamplingParams | None = None, hook=None, **kw):
    engine = LLMEngine(EngineArgs(model=str(tiny.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  block_size=4, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128, **kw))
    if graphs:
        simulate_graphs(engine, 64, 24)
    if hook is not None:
        hook(engine)
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


# default run: each layout under one engine order (the other two pairings, ~1.2 s each, slow)
@pytest.mark.parametrize("layout, async_scheduling", [
    pytest.param("last_exited", False, id="False-last_exited"),
    pytest.param("shared", False, id="False-shared", marks=pytest.mark.slow),
    pytest.param("last_exited", True, id="True-last_exited", marks=pytest.mark.slow),
    pytest.param("shared", True, id="True-shared")])
def test_graph_input_path_equals_eager(tiny_gqa, layout, async_scheduling):
    kw = dict(kv_layout=layout, async_scheduling=async_scheduling, enable_prefix_caching=layout == "last_exited")
    with_graphs = run(tiny_gqa, graphs=True, **kw)
    assert run.engine.runner.graphs.replays["decode"] > 20  # decode steps really went through the graph path
    assert run.engine.runner.graphs.replays["mixed"] > 5  # and so did steps with prefill chunks
    assert approx_floats(with_graphs) == run(tiny_gqa, graphs=False, **kw)


def record_forward_outputs(steps: list):
    """A ``run`` hook: appends each step's forward outputs, per row kind and cut to its rows, to ``steps``."""

    def hook(engine):
        builder = engine.runner.builder
        split = builder.split

        def recording(outputs, plan):
            parts = split(outputs, plan)
            steps.append((tuple(p.num_rows for p in plan.kinds),
                           [None if part is None else [t if t is None else t.clone() for t in part] for part in parts]))
            return parts

        builder.split = recording

    return hook


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_every_step_through_a_graph_equals_the_same_step_eagerly(tiny_gqa, layout):
    """Step for step, the forward's outputs for every row kind -- decode rows' exits, logits, slots, loops and
    token indices; prefill chunks' hidden states and gates -- are the same from a graph's padded bucket views
    as from an eager step's exact-size views, in steps that mix decode rows and prefill chunks too."""
    graphed, eager = [], []
    run(tiny_gqa, graphs=True, hook=record_forward_outputs(graphed), kv_layout=layout)
    replays = run.engine.runner.graphs.replays
    run(tiny_gqa, graphs=False, hook=record_forward_outputs(eager), kv_layout=layout)
    assert replays["decode"] > 20 and replays["mixed"] > 5
    assert any(all(counts) for counts, _ in graphed)  # steps with both kinds of rows
    assert [counts for counts, _ in graphed] == [counts for counts, _ in eager]
    for step, ((_, got), (_, want)) in enumerate(zip(graphed, eager)):
        for kind, (g, w) in enumerate(zip(got, want)):
            assert (g is None) == (w is None), (step, kind)
            for a, b in zip(g or [], w or []):
                assert (a is None) == (b is None), (step, kind)  # (outputs a step does not compute: None)
                if a is None:
                    continue
                assert a.dtype == b.dtype and a.shape == b.shape, (step, kind)
                if a.is_floating_point():  # (a padded GEMM may round differently in the last bits)
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}, kind {kind}")
                else:
                    assert torch.equal(a, b), (step, kind)


# (one engine order in the default run)
@pytest.mark.parametrize("async_scheduling", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_backend_that_graphs_decode_steps_only_runs_prompt_steps_eagerly(tiny_gqa, async_scheduling):
    """A backend whose ``graph_steps`` is "decode" (FlashInfer: it plans steps with prompt chunks on the host)
    gets the decode families only; steps with prompt chunks run eagerly, and the outputs are the same."""
    def decode_only(engine):
        engine.runner.backend.graph_steps = "decode"
        simulate_graphs(engine, 64, 24)

    kw = dict(async_scheduling=async_scheduling)
    with_graphs = run(tiny_gqa, graphs=False, hook=decode_only, **kw)
    graphs = run.engine.runner.graphs
    assert set(graphs.replays) == {"decode"} and graphs.replays["decode"] > 20
    assert [f.name for f in graphs.families] and all(s.max_query_len == 1 for f in graphs.families for s in f.shapes)
    assert approx_floats(with_graphs) == run(tiny_gqa, graphs=False, **kw)


def test_async_graphs_with_trace_depths_and_penalties(tiny_gqa):
    """Under async scheduling the decode graph derives each row from the device state, trace depths
    and all; penalties read the device's counts after it."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=0.8, logprobs=1,
                            exit_depths=[3, 1, 4, 2])
    kw = dict(async_scheduling=True, exit_mode="trace")
    with_graphs = run(tiny_gqa, graphs=True, params=params, **kw)
    assert run.engine.runner.graphs.replays["decode"] > 20
    assert approx_floats(with_graphs) == run(tiny_gqa, graphs=False, params=params, **kw)
    assert all(depths[:4] == [3, 1, 4, 2] for _, depths, *_ in with_graphs.values() if len(depths) >= 4)


# (one engine order in the default run)
@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_graphs_under_preemption(tiny_gqa, async_scheduling):
    """Victims leave and re-enter slots while decode and mixed steps replay graphs."""
    kw = dict(async_scheduling=async_scheduling, kv_allocation="incremental", enable_preemption=True)
    tight = run(tiny_gqa, graphs=True, num_kv_blocks=4 * 14, **kw)
    assert run.engine.runner.graphs.replays["decode"] > 20 and run.engine.scheduler.num_preemptions > 0
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
    with_graphs = run(tiny_gqa, graphs=True, **kw)
    assert run.engine.runner.graphs.replays["decode"] > 20
    assert approx_floats(with_graphs) == run(tiny_gqa, graphs=False, **kw)


def test_inputs_upload_only_when_the_image_changes(tiny_gqa):
    import torch

    from loopline.worker.step_inputs import StepShape

    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  block_size=4, max_num_seqs=2, max_model_len=64))
    builder = engine.runner.builder
    inp = builder.inputs(StepShape(((2, 2), (0, 0)), width=16, work=0, max_query_len=1, max_seq_len=64))
    lay = inp.layout
    # a decode-only step sends its query offsets and the rows' four arrays, nothing it derives on the device
    assert lay.host_start == lay.fields["query_start_loc"].offset
    device_image = inp.buffer[lay.host_start:lay.nbytes]
    image = torch.arange(lay.nbytes - lay.host_start, dtype=torch.uint8)
    builder.upload(inp, image, steady=True)
    assert torch.equal(device_image, image)
    device_image[0] = 77  # stands in for a write the cache does not know of
    builder.upload(inp, image.clone(), steady=True)  # the same bytes: no copy
    assert int(device_image[0]) == 77
    builder.upload(inp, image + 1, steady=True)  # other bytes: copied
    assert torch.equal(device_image, image + 1)
    builder.reset(inp)  # forgets what the device holds
    builder.upload(inp, image + 1, steady=True)
    assert torch.equal(device_image, image + 1)
    device_image[0] = 77
    builder.upload(inp, image + 1, steady=False)  # a step with prefill rows always sends its image
    assert torch.equal(device_image, image + 1)


def test_graph_lookup_takes_the_smallest_bucket_that_holds_the_step(tiny_gqa):
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64))
    runner = engine.runner
    runner.capture_graphs(32, 16, max_prefill_rows=2, capturer=EagerCapturer())
    graphs: StepGraphs = runner.graphs
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", ids(9), params)
    engine.add_request("b", ids(20, seed=1), params)  # 20 + 5 > 16 tokens: its prompt is chunked
    found = []
    find = graphs.find

    def spy(plan):
        graph = find(plan)
        found.append((tuple((p.num_rows, p.num_tokens) for p in plan.kinds), plan.max_seq_len,
                      None if graph is None else (graph.family, graph.shape.counts)))
        return graph

    graphs.find = spy
    while engine.has_unfinished_requests():
        engine.step()
    for (decode, prefill), max_seq, graph in found:
        if max_seq > 32 or prefill[0] > 2:
            assert graph is None
        elif prefill[0] == 0:
            assert graph[0] == "decode" and graph[1][0][0] == min(b for b in (1, 2, 4) if b >= decode[0])
        else:
            assert graph[0] == "mixed" and graph[1][1] == (2, 16) and graph[1][0][0] >= decode[0]
    assert {g[0] for *_, g in found if g is not None} == {"decode", "mixed"}
