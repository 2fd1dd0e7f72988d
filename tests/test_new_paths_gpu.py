"""This session's new engine paths on a real GPU (marked gpu: skipped without CUDA): Huginn through the
Triton attention, eagerly and in CUDA graphs, against the plain path; the lookahead exit policy in CUDA
graphs against the same engine eagerly; Huginn's FP8 KV against its oracle. ``LOOPLINE_TEST_DEVICE=cpu`` runs the same checks on the CPU
(the torch backend, no graphs) to check the tests themselves."""
from __future__ import annotations

import json
import os

import pytest
import torch
from engine_testing import run_arrivals

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.sampling_params import SamplingParams

DEVICE = os.environ.get("LOOPLINE_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = {"a": [5, 9, 100, 3], "b": list(range(7, 26)), "c": [300, 2, 41, 41, 8, 90, 17], "d": [11] * 12}


def engine(path, eager: bool, **kw) -> LLMEngine:
    # a fixed small pool: several engines live in one process
    return LLMEngine(EngineArgs(model=str(path), skip_tokenizer_init=True, device=DEVICE, dtype="float32",
                                max_num_seqs=4, block_size=16, kv_cache_memory_gb=0.25, enforce_eager=eager, **kw))


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("exit_kw", [{"exit_threshold": 1.0}, {"exit_threshold": 0.5, "max_loops": 6}],
                         ids=["fixed", "convergence"])
def test_huginn_on_the_gpu_equals_the_plain_path(tmp_path, eager, exit_kw):
    check_huginn(tmp_path, eager, exit_kw)


def test_huginn_head_size_not_a_power_of_two_on_the_gpu(tmp_path):
    # Huginn-0125's heads are 96 wide: the Triton kernels run 128-wide tiles, masked (here 48 in 64)
    check_huginn(tmp_path, False, {"exit_threshold": 0.5, "max_loops": 6}, hidden_size=96, num_attention_heads=2,
                 num_key_value_heads=2)


def test_huginn_fp8_kv_on_the_gpu_equals_the_oracle(tmp_path):
    """FP8 pages through the Triton kernels in CUDA graphs, 96-wide heads as Huginn-0125's: tokens and exit
    iterations equal the independent oracle storing every K/V as FP8 with the engine's scales."""
    from huginn_reference import reference_generate
    from safetensors.torch import load_file
    from matching import closer_to_fp8

    from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopline.models.loader import load_looped_model

    path = make_tiny_huginn_checkpoint(tmp_path / "h", seed=0, hidden_size=96, num_attention_heads=2,
                                       num_key_value_heads=2)
    model = load_looped_model(path)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True, exit_threshold=0.05,
                            max_loops=6, min_loops=2)
    eng = engine(path, False, kv_cache_dtype="fp8")
    outs = run_arrivals(eng, {rid: (p, params) for rid, p in PROMPTS.items()}, {"d": 3})
    scales = (eng.runner.kv_scales.k.cpu(), eng.runner.kv_scales.v.cpu())
    cfg, sd = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    for rid, prompt in PROMPTS.items():
        n = len(prompt) + params.max_tokens
        init = model.initial_state(torch.zeros(n, 96), torch.arange(n), torch.zeros(n, dtype=torch.long))
        tokens, depths, logprobs = reference_generate(sd, cfg, prompt, 8, max_steps=6, min_steps=2, threshold=0.05,
                                                      init_states=init, kv_scales=scales)
        full = reference_generate(sd, cfg, prompt, 8, max_steps=6, min_steps=2, threshold=0.05, init_states=init)[2]
        got = outs[rid].outputs[0]
        assert (got.token_ids, got.exit_depths) == (tokens, depths), rid
        closer_to_fp8(got.token_logprobs, logprobs, full, rid)


def check_huginn(tmp_path, eager, exit_kw, **config):
    from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopline.models.loader import load_looped_model
    from loopline.models.plain import plain_generate

    path = make_tiny_huginn_checkpoint(tmp_path / "h", seed=0, **config)
    model = load_looped_model(path)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True, **exit_kw)
    eng = engine(path, eager)
    if DEVICE == "cuda":
        assert (eng.runner.graphs is None) == eager
    outs = run_arrivals(eng, {rid: (p, params) for rid, p in PROMPTS.items()}, {"d": 3})
    for rid, prompt in PROMPTS.items():
        ref = plain_generate(model, prompt, params.max_tokens, max_loops=params.max_loops, min_loops=params.min_loops,
                             exit_threshold=params.exit_threshold, seed=params.latent_seed)
        got = outs[rid].outputs[0]
        assert (got.token_ids, got.exit_depths) == (ref.tokens, ref.exit_loops), rid
        assert got.token_logprobs == pytest.approx(ref.logprobs, abs=1e-3), rid


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_huginn_stage_variants_in_graphs_equal_eager(tmp_path, mode):
    """Huginn at fixed iterations (up to 8, requests at different depths and phases): decode steps where no row
    starts a token or exits replay the graph variants without the prelude, the coda or both; tokens, exit
    iterations and logprobs equal the same engine run eagerly (whose steps gather each stage's rows)."""
    from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint

    path = make_tiny_huginn_checkpoint(tmp_path / "h", seed=0, mean_recurrence=8)
    reqs = {rid: (p, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True, max_loops=8 - 2 * i))
            for i, (rid, p) in enumerate(PROMPTS.items())}
    outs = {}
    for eager in (True, False):
        eng = engine(path, eager, scheduling_mode=mode)
        outs[eager] = run_arrivals(eng, reqs, {"c": 2, "d": 5})
        if DEVICE == "cuda" and not eager:
            replays = eng.runner.graphs.replays
            assert replays["decode_core"] > 0 and replays["decode_prelude"] + replays["decode_coda"] > 0, replays
    for rid in reqs:
        a, b = outs[True][rid].outputs[0], outs[False][rid].outputs[0]
        assert (a.token_ids, a.exit_depths) == (b.token_ids, b.exit_depths), rid
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-3), rid


def test_lookahead_in_graphs_equals_eager(tmp_path):
    from worker.test_lookahead_engine import random_head

    from loopline.models.lookahead_head import save_head
    from loopline.models.tiny import default_checkpoint

    src, d = default_checkpoint(), tmp_path / "demo_head"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    save_head(*random_head(cfg["total_ut_steps"], cfg["hidden_size"]), d)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True, exit_mode="lookahead")
    reqs = {f"r{i}": ([3 + (i * 37 + j * 11) % 250 for j in range(5 + 3 * i)], params) for i in range(6)}
    outs = {eager: run_arrivals(engine(d, eager), reqs) for eager in (True, False)}
    for rid in reqs:
        a, b = outs[True][rid].outputs[0], outs[False][rid].outputs[0]
        assert (a.token_ids, a.exit_depths) == (b.token_ids, b.exit_depths), rid
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-3), rid


def test_exit_traces_in_graphs_equal_eager(tmp_path):
    """The exit-trace recorder inside captured decode graphs (its projections and labels are graph outputs, read
    back by a copy queued on the step's stream): the same rows and values as the same engine run eagerly."""
    from loopline.core.exit_trace import load_exit_traces
    from loopline.models.tiny import default_checkpoint

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    reqs = {f"r{i}": ([3 + (i * 37 + j * 11) % 250 for j in range(5 + 3 * i)], params) for i in range(6)}
    cols = {}
    for eager in (True, False):
        trace = {"dir": str(tmp_path / f"t{eager}"), "labels": True, "shard_rows": 64}
        eng = engine(default_checkpoint(), eager, exit_trace=trace)
        if DEVICE == "cuda":
            assert (eng.runner.graphs is None) == eager
        run_arrivals(eng, reqs, {"r4": 3, "r5": 7})
        _, c = load_exit_traces(trace["dir"])
        order = sorted(range(len(c["loop"])), key=lambda i: (c["request_ids"][i], int(c["position"][i]), int(c["loop"][i])))
        cols[eager] = {k: v[order] for k, v in c.items() if k not in ("request_ids", "request")} | {
            "ids": [c["request_ids"][i] for i in order]}
    a, b = cols[True], cols[False]
    assert a["ids"] == b["ids"]
    for name in ("position", "loop", "generated", "exited", "greedy"):
        assert torch.equal(a[name], b[name]), name
    for name in ("gate_logit", "input_proj", "hidden_proj", "greedy_logprob"):
        torch.testing.assert_close(a[name], b[name], atol=1e-3, rtol=1e-3, msg=name)
