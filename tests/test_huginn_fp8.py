"""FP8 KV cache for Huginn (``kv_cache_dtype="fp8"``).

A Huginn cache layer ``i`` holds layer ``i`` of the prelude, of every core iteration and of the coda, each in
its own planes, with one scale per (cache layer, KV head) calibrated over all of them. What must hold: the
engine equals the independent Huginn oracle (tests/huginn_reference.py) when the oracle stores every K/V as
FP8 E4M3 with the engine's scales (tokens and exit iterations exactly, logprobs within FP8's own error and
nearer the FP8 oracle than the full-precision one), at
fixed iterations and with the convergence exit, batched and chunked; the scales cover the K/V of every stage
and iteration the oracle computes for the calibration prompt; the pool holds twice the pages; preempted and
prefix-cached runs equal a roomy FP8 run.
"""
from __future__ import annotations

import json

import pytest
import torch
from engine_testing import run_arrivals  # tests/ is on pythonpath (pyproject.toml)
from huginn_reference import HuginnReference, _Layer, reference_generate
from matching import closer_to_fp8
from safetensors.torch import load_file

from loopline.attention.base import FP8_KV_DTYPE
from loopline.config import EngineArgs
from loopline.engine.llm_engine import LLMEngine
from loopline.kv.quant import calibration_token_ids, kv_amax
from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopline.models.loader import load_looped_model
from loopline.sampling_params import SamplingParams
from loopline.worker.memory_profile import num_kv_blocks

PROMPTS = {"a": [5, 9, 100, 3], "b": list(range(7, 26)), "c": [300, 2, 41, 41, 8, 90, 17]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn_fp8"), seed=0)
    return path, load_looped_model(path)


def engine(path, **kw) -> LLMEngine:
    kw = {"skip_tokenizer_init": True, "device": "cpu", "max_num_seqs": 4, "block_size": 4, "kv_cache_dtype": "fp8",
          **kw}
    return LLMEngine(EngineArgs(model=str(path), **kw))


def greedy(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, **kw)


def scales(eng: LLMEngine) -> tuple[torch.Tensor, torch.Tensor]:
    s = eng.runner.kv_scales
    return s.k.cpu(), s.v.cpu()


def oracle(path, model, prompt: list[int], params: SamplingParams, kv_scales) -> tuple[list, list, list]:
    cfg, sd = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    n = len(prompt) + params.max_tokens
    init = model.initial_state(torch.zeros(n, model.config.hidden_size), torch.arange(n), torch.zeros(n, dtype=torch.long))
    return reference_generate(sd, cfg, prompt, params.max_tokens, max_steps=params.max_loops,
                              min_steps=params.min_loops or 1, threshold=params.exit_threshold or 1.0,
                              init_states=init, kv_scales=kv_scales)


@pytest.mark.parametrize("params", [greedy(max_loops=6), greedy(8, max_loops=10, min_loops=2, exit_threshold=0.05)],
                         ids=["fixed", "convergence"])
def test_fp8_engine_equals_the_oracle_storing_fp8(tiny, params):
    path, model = tiny
    eng = engine(path, max_num_loops=params.max_loops, max_num_batched_tokens=6, max_num_seqs=3)
    assert eng.runner.k_cache.dtype == FP8_KV_DTYPE
    out = run_arrivals(eng, {rid: (p, params) for rid, p in PROMPTS.items()}, arrivals={"c": 4})
    kv_scales, depths = scales(eng), set()
    for rid, prompt in PROMPTS.items():
        tokens, exit_depths, logprobs = oracle(path, model, prompt, params, kv_scales)
        c = out[rid].outputs[0]
        assert (c.token_ids, c.exit_depths) == (tokens, exit_depths), rid
        closer_to_fp8(c.token_logprobs, logprobs, oracle(path, model, prompt, params, None)[2], rid)
        depths |= set(exit_depths[1:])
    if params.exit_threshold is not None:
        assert len(depths) > 1  # the convergence exit fired at varied iterations


def test_calibration_covers_every_stage_and_iteration(tiny, monkeypatch):
    """The calibration pass's largest |K| and |V| per cache layer and head equal the oracle's over the
    calibration prompt (the engine's, cut to max_model_len) through the prelude, every core iteration and the
    coda, and the engine's scales are their powers of two with 2x to 4x headroom."""
    path, model = tiny
    loops, max_len = 8, 64
    eng = engine(path, max_num_loops=loops, max_model_len=max_len)
    k_scale, v_scale = scales(eng)
    ids = calibration_token_ids(model.config.vocab_size)[:max_len]
    cfg, sd = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    amax: dict[tuple[str, int], torch.Tensor] = {}
    qkv = _Layer.qkv

    def recording(self, x, positions):
        q, k, v = qkv(self, x, positions)
        key = self.stage
        pair = torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))])  # [2, kv_heads]
        amax[key] = pair if key not in amax else torch.maximum(amax[key], pair)
        return q, k, v

    monkeypatch.setattr(_Layer, "qkv", recording)
    ref = HuginnReference(sd, cfg)
    for stage, layers in (("prelude", ref.prelude), ("core", ref.core), ("coda", ref.coda_layers)):
        for i, layer in enumerate(layers):
            layer.stage = (stage, i)
    n = len(ids)
    e = ref.embed(ids)
    s = model.initial_state(e, torch.arange(n), torch.zeros(n, dtype=torch.long)).to(e.dtype)
    kv: dict = {}
    for r in range(1, loops + 1):
        s = ref.iterate(s, e, r, [None] * n, kv)
    ref.logits(s)
    expected = torch.zeros(2, *k_scale.shape)
    for (_, i), pair in amax.items():
        expected[:, i] = torch.maximum(expected[:, i], pair)
    k_amax, v_amax = kv_amax(model, ids, loops)
    assert torch.stack([k_amax, v_amax]) == pytest.approx(expected, rel=1e-4)
    for found, scale in ((k_amax, k_scale), (v_amax, v_scale)):
        assert bool((found * 2.0 / scale <= 448.0).all()) and bool((found * 2.0 / scale > 224.0).all())


def test_an_fp8_pool_holds_twice_the_pages(tiny):
    path, _ = tiny
    full, fp8 = engine(path, kv_cache_dtype="auto", kv_cache_memory_gb=0.01), engine(path, kv_cache_memory_gb=0.01)
    nb, nf = (num_kv_blocks(e.config, e.model, e.runner.backend, e.kv.layout) for e in (full, fp8))
    # (the tiny model is fp32: a 1-byte page is a quarter of a 4-byte one)
    assert nf in (4 * nb, 4 * nb + 1, 4 * nb + 2, 4 * nb + 3) and fp8.kv.pool.num_blocks == nf
    assert full.runner.kv_scales is None


def test_preemption_and_prefix_caching_equal_a_roomy_fp8_run(tiny):
    """Pages and snapshots move as FP8 bytes: requests preempted under a tiny pool, and requests whose prompts
    start from cached pages (every plane: core, prelude, coda), equal a roomy FP8 run token for token."""
    path, _ = tiny
    reqs = {f"r{i}": (list(range(10 + i, 16 + 3 * i)), greedy(7, max_loops=6, min_loops=2, exit_threshold=0.1,
                                                             latent_seed=i)) for i in range(4)}
    roomy = run_arrivals(engine(path, max_num_loops=6), reqs)
    tight = engine(path, max_num_loops=6, kv_allocation="incremental", enable_preemption=True, num_kv_blocks=8 * 8)
    assert {k: v.outputs[0].token_ids for k, v in run_arrivals(tight, reqs).items()} == \
        {k: v.outputs[0].token_ids for k, v in roomy.items()}
    assert tight.scheduler.num_preemptions > 0
    shared = list(range(100, 116))
    reqs = {f"p{i}": (shared + [i + 1, 2 * i + 3], greedy(4, max_loops=6, exit_threshold=0.1)) for i in range(3)}
    roomy = run_arrivals(engine(path, max_num_loops=6), reqs)
    cached = engine(path, max_num_loops=6, enable_prefix_caching=True)
    warm = run_arrivals(cached, reqs, arrivals={"p1": 30, "p2": 60})
    assert cached.kv.prefix_cache.stats.hits > 0
    for rid, out in warm.items():
        assert (out.outputs[0].token_ids, out.outputs[0].exit_depths) == \
            (roomy[rid].outputs[0].token_ids, roomy[rid].outputs[0].exit_depths)
