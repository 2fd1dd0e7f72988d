"""Huginn (``huginn_raven``) served by the engine's paged path (issue #46), held to the plain path
(models/plain.py) and to the independent oracle (tests/huginn_reference.py).

Fixed iterations (exit_threshold 1.0) and the convergence exit: batched requests of different prompt lengths
and depths, chunked prefill, requests joining while others decode (refill), the seeded latent state, prefix
caching; the KV pool sized from the family's KV stages; bad engine options and request fields refused by name.
"""
from __future__ import annotations

import json

import pytest
import torch
from engine_testing import run_arrivals  # tests/ is on pythonpath (pyproject.toml)
from huginn_reference import reference_generate
from safetensors.torch import load_file

from loopline.config import EngineArgs
from loopline.engine.llm_engine import LLMEngine
from loopline.errors import InvalidRequestError
from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopline.models.loader import load_looped_model
from loopline.models.plain import plain_generate
from loopline.sampling_params import SamplingParams

PROMPTS = {"a": [5, 9, 100, 3], "b": list(range(7, 26)), "c": [300, 2, 41, 41, 8, 90, 17], "d": [11] * 12}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn_engine"), seed=0)
    return path, load_looped_model(path)


def engine(path, **kw) -> LLMEngine:
    kw = {"skip_tokenizer_init": True, "device": "cpu", "max_num_seqs": 4, "block_size": 4, **kw}
    return LLMEngine(EngineArgs(model=str(path), **kw))


def greedy(max_tokens: int = 5, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, **kw)


def assert_equal_plain(model, outputs: dict, requests: dict) -> None:
    """Each output's tokens and exit depths equal plain_generate's, logprobs within fp32 tolerance."""
    for rid, (prompt, params) in requests.items():
        c = outputs[rid].outputs[0]
        ref = plain_generate(model, prompt, params.max_tokens, max_loops=params.max_loops, min_loops=params.min_loops,
                             exit_threshold=params.exit_threshold, seed=params.latent_seed)
        assert c.token_ids == ref.tokens, rid
        assert c.exit_depths == ref.exit_loops, rid
        assert torch.tensor(c.token_logprobs) == pytest.approx(torch.tensor(ref.logprobs), abs=1e-4), rid


def test_fixed_depth_batch_equals_plain_path_and_oracle(tiny):
    path, model = tiny
    requests = {rid: (p, greedy()) for rid, p in PROMPTS.items()}
    outputs = run_arrivals(engine(path), requests)
    assert_equal_plain(model, outputs, requests)
    # and the oracle written from upstream's semantics (no loopline code), for one of them
    cfg, sd = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    prompt = PROMPTS["c"]
    n = len(prompt) + 5
    init = model.initial_state(torch.zeros(n, model.config.hidden_size), torch.arange(n), torch.zeros(n, dtype=torch.long))
    tokens, depths, logprobs = reference_generate(sd, cfg, prompt, 5, max_steps=model.config.mean_recurrence,
                                                  init_states=init)
    c = outputs["c"].outputs[0]
    assert (c.token_ids, c.exit_depths) == (tokens, depths)
    assert torch.tensor(c.token_logprobs) == pytest.approx(torch.tensor(logprobs), abs=1e-4)


def test_chunked_prefill_refill_depths_and_seeds(tiny):
    """Prompts in chunks of 6 tokens, requests of different max_loops (prompts run that many loops) and
    latent seeds, two of them joining while the others decode."""
    path, model = tiny
    requests = {"a": (PROMPTS["a"], greedy(6, max_loops=3)), "b": (PROMPTS["b"], greedy(4, latent_seed=7)),
                "c": (PROMPTS["c"], greedy(5, max_loops=8, latent_seed=123456)), "d": (PROMPTS["d"], greedy(3))}
    eng = engine(path, max_num_batched_tokens=6, max_num_seqs=3, max_num_loops=8)
    outputs = run_arrivals(eng, requests, arrivals={"c": 4, "d": 9})
    assert_equal_plain(model, outputs, requests)


def test_latent_seed_changes_the_output_and_joins_the_prefix_cache_key(tiny):
    path, model = tiny
    prompt = list(range(30, 50))
    requests = {"s0": (prompt, greedy(4)), "s1": (prompt, greedy(4, latent_seed=1))}
    eng = engine(path, enable_prefix_caching=True)
    outputs = run_arrivals(eng, requests, arrivals={"s1": 40})
    assert outputs["s0"].outputs[0].token_logprobs != outputs["s1"].outputs[0].token_logprobs
    assert_equal_plain(model, outputs, requests)


def test_kv_pool_from_the_kv_stages(tiny):
    path, model = tiny
    eng = engine(path, max_num_loops=9)
    runner, c = eng.runner, model.config
    # planes: one per core iteration (the bound), the prelude's and the coda's; layers: the largest stage's
    assert eng.kv.layout.num_planes == 9 + 2
    assert runner.k_cache.shape[0] == max(c.n_layers_in_prelude, c.n_layers_in_recurrent_block, c.n_layers_in_coda)
    assert eng.config.num_loops == 9


@pytest.mark.parametrize("kw, field", [
    ({"max_num_loops": 0}, "max_num_loops"),
    ({"max_num_loops": True}, "max_num_loops"),
    ({"kv_layout": "shared"}, "kv_layout"),
    ({"kernel_backend": "triton"}, "kernel_backend"),
    ({"speculative_config": {"method": "loop", "num_speculative_tokens": 2, "draft_loops": 1}}, "speculative_config"),
])
def test_bad_engine_options_are_named(tiny, kw, field):
    with pytest.raises(InvalidRequestError, match=field) as err:
        engine(tiny[0], **kw)
    assert err.value.param == field


def test_ouro_keeps_its_fixed_depth(tmp_path):
    from loopline.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "ouro")
    with pytest.raises(InvalidRequestError, match=r"max_num_loops=3 .* allowed: 4"):
        engine(path, max_num_loops=3)


@pytest.mark.parametrize("kw, field, match", [
    ({"max_loops": 7}, "max_loops", r"\[min_loops, 6\] \(the engine's max_num_loops\)"),
    ({"min_loops": 7}, "min_loops", r"\[1, 6\]"),
    ({"latent_seed": -1}, "latent_seed", r"latent_seed"),
    ({"latent_seed": 2**32}, "latent_seed", r"latent_seed"),
])
def test_bad_request_fields_are_named_and_others_still_run(tiny, kw, field, match):
    path, model = tiny
    eng = engine(path)
    eng.add_request("ok", {"prompt_token_ids": PROMPTS["a"]}, greedy(2))
    with pytest.raises(InvalidRequestError, match=match) as err:
        eng.add_request("bad", {"prompt_token_ids": PROMPTS["a"]}, SamplingParams(max_tokens=2, **kw))
    assert err.value.param == field
    outputs = run_arrivals(eng, {})
    assert outputs["ok"].outputs[0].token_ids == plain_generate(model, PROMPTS["a"], 2).tokens


@pytest.mark.slow  # ~5 s on 2 cores; default run: test_convergence_exit_equals_the_oracle, and refill with chunked
# prefill and per-request seeds in test_chunked_prefill_refill_depths_and_seeds
def test_convergence_exit_under_refill_equals_plain_path(tiny):
    """The convergence (KL) exit with per-request thresholds and min/max iterations, decode rows at
    different depths in one step, requests refilling slots: exit depths, tokens and logprobs equal the
    plain path's (early-exited tokens' K/V: the latest iteration they ran, in deeper planes)."""
    path, model = tiny
    requests = {"a": (PROMPTS["a"], greedy(8, max_loops=10, min_loops=2, exit_threshold=0.05)),
                "b": (PROMPTS["b"], greedy(6, max_loops=8, exit_threshold=0.2)),
                "c": (PROMPTS["c"], greedy(7, max_loops=10, min_loops=3, exit_threshold=0.02, latent_seed=5)),
                "d": (PROMPTS["d"], greedy(5, max_loops=6))}
    eng = engine(path, max_num_loops=10, max_num_seqs=3, max_num_batched_tokens=8)
    outputs = run_arrivals(eng, requests, arrivals={"c": 3, "d": 11})
    assert_equal_plain(model, outputs, requests)
    depths = [d for o in outputs.values() for d in o.outputs[0].exit_depths[1:]]
    assert len(set(depths)) >= 3 and min(depths) < 6  # the rule fired at varied iterations


def test_convergence_exit_equals_the_oracle(tiny):
    path, model = tiny
    cfg, sd = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    prompt, n = [5, 9, 100, 3, 44, 7], 6 + 8
    init = model.initial_state(torch.zeros(n, model.config.hidden_size), torch.arange(n), torch.zeros(n, dtype=torch.long))
    tokens, depths, logprobs = reference_generate(sd, cfg, prompt, 8, max_steps=10, min_steps=2, threshold=0.05,
                                                  init_states=init)
    params = greedy(8, max_loops=10, min_loops=2, exit_threshold=0.05)
    c = run_arrivals(engine(path, max_num_loops=10), {"r": (prompt, params)})["r"].outputs[0]
    assert (c.token_ids, c.exit_depths) == (tokens, depths)
    assert min(depths[1:]) < 10
    assert torch.tensor(c.token_logprobs) == pytest.approx(torch.tensor(logprobs), abs=1e-4)


# ~3.5 s each, slow: tests/worker/test_huginn_stages.py::test_preemption_at_fixed_iterations preempts Huginn requests
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_preemption_under_a_tiny_pool_equals_a_roomy_run(tiny, mode):
    """Requests preempted (KV and slot state to CPU memory, the latent state, prelude output and log p with
    them) and resumed: outputs equal a run without pressure, and the plain path, token for token."""
    path, model = tiny
    requests = {f"r{i}": (list(range(10 + i, 16 + 3 * i)), greedy(7, max_loops=6, min_loops=2, exit_threshold=0.1,
                                                                   latent_seed=i)) for i in range(4)}
    eng = engine(path, scheduling_mode=mode, kv_allocation="incremental", enable_preemption=True,
                 num_kv_blocks=8 * 8, max_num_loops=6)
    tight = run_arrivals(eng, requests)
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.num_used_blocks == 0 and not eng.runner.pages.snapshots
    assert_equal_plain(model, tight, requests)


def test_prefix_cache_hits_equal_a_cold_run(tiny):
    """Later requests reuse the cached pages of a shared prefix (every plane: core, prelude, coda) and equal
    a cold engine's run token for token."""
    path, model = tiny
    shared = list(range(100, 124))
    requests = {f"p{i}": (shared + [i + 1, 2 * i + 3], greedy(4, exit_threshold=0.1)) for i in range(3)}
    warm = engine(path, enable_prefix_caching=True)
    outputs = run_arrivals(warm, requests, arrivals={"p1": 30, "p2": 60})
    assert warm.kv.prefix_cache.stats.hits > 0
    assert_equal_plain(model, outputs, requests)


def test_graph_buckets_equal_the_plain_path(tiny):
    """The CUDA-graph input path on the CPU (replay simulated by the eager capturer): decode and mixed
    steps in bucket-sized buffers with scratch padding rows and tokens, Huginn's own step buffers reserved
    before capture; outputs equal the plain path's."""
    from graph_testing import EagerCapturer

    path, model = tiny
    requests = {rid: (p, greedy(6, max_loops=6, min_loops=2, exit_threshold=0.1)) for rid, p in PROMPTS.items()}
    eng = engine(path, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=64)
    eng.runner.capture_graphs(48, 12, max_prefill_rows=2, capturer=EagerCapturer())
    outputs = run_arrivals(eng, requests, arrivals={"c": 5, "d": 9})
    assert_equal_plain(model, outputs, requests)
    assert eng.runner.graphs.replays["decode"] > 10 and eng.runner.graphs.replays["mixed"] > 2


def test_steps_larger_than_every_graph_leave_the_graphs_buffers(tiny):
    """Graphs captured for short sequences and small prompt chunks; a long prompt's chunks and sequences past the
    captured length run eagerly in buffers of their own, and every later graph replay still finds Huginn's step
    buffers where it captured them (a CUDA graph replays fixed addresses: on an H100 a run at concurrency 128
    read freed memory there); outputs equal the plain path's."""
    from graph_testing import AddressCheckingCapturer

    from loopline.worker.loop_stack import _STEP_BUFFERS

    path, model = tiny
    requests = {rid: (p, greedy(12, max_loops=4)) for rid, p in PROMPTS.items()}
    eng = engine(path, max_num_seqs=3, max_num_batched_tokens=24, max_model_len=64)
    stack = eng.runner.stack
    capturer = AddressCheckingCapturer(lambda: [getattr(stack, n) for n in _STEP_BUFFERS if not n.startswith("_")])
    eng.runner.capture_graphs(32, 8, max_prefill_rows=1, capturer=capturer)
    pinned = stack._tokens, stack._rows
    grew = []
    plan = stack.plan

    def watch(step_plan):  # (the sizes the previous step left: larger than pinned after an eager step grew them)
        grew.append((stack._tokens, stack._rows) != pinned)
        return plan(step_plan)

    stack.plan = watch
    outputs = run_arrivals(eng, requests, arrivals={"c": 5, "d": 9})
    assert_equal_plain(model, outputs, requests)
    assert any(grew) and capturer.replays_checked > 10, (eng.runner.graphs.replays, grew)


def test_cli_settings_line_and_serve_startup_line_name_huginn_fields(tiny):
    from types import SimpleNamespace

    from loopline.entrypoints.cli import loop_settings_line
    from loopline.entrypoints.openai.startup import kv_pool_summary

    path, model = tiny
    ns = SimpleNamespace(max_loops=None, min_loops=1, exit_threshold=None)
    line = loop_settings_line(ns, SimpleNamespace(model=str(path), exit_mode="threshold"), model.config)
    assert "at most 6 (mean_recurrence in" in line and "KL from the previous one is below 1.0 (huginn_raven's default)" in line
    eng = engine(path, max_num_loops=4)
    info = SimpleNamespace(config=eng.config, model_config=eng.model_config, kv_pages=eng.kv.pool.num_blocks,
                           kv_planes=eng.kv.layout.num_planes)
    kv = kv_pool_summary(info)
    assert kv["planes"] == 6 and kv["gib"] == pytest.approx(eng.kv.pool.num_blocks * eng.runner.k_cache[0, 0].numel() * 4 * 2 * 4 / 2**30)
