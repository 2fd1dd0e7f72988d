"""GPU engine checks (skipped without CUDA): backends agree token for token."""
from __future__ import annotations

import math
import random

import pytest
import torch

from loopline import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(tiny, prompts, params, **kw):
    kw.setdefault("num_kv_blocks", 512)  # engines in one process must not each take 90% of the GPU
    llm = tiny.llm(device="cuda", skip_tokenizer_init=True, **kw)
    return [(o.outputs[0].token_ids, o.outputs[0].exit_depths) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("threshold", [1.0, 0.7])
def test_triton_equals_torch_backend_fp32(tiny_gqa, layout, threshold):
    prompts = [ids(n, seed=n) for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=threshold)
    kw = dict(kv_layout=layout, block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    torch_out = run(tiny_gqa, prompts, params, attention_backend="torch", **kw)
    triton_out = run(tiny_gqa, prompts, params, attention_backend="triton", **kw)
    assert triton_out == torch_out


def test_cuda_equals_cpu_fp32(tiny_gqa):
    prompts = [ids(n, seed=n) for n in (5, 21)]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True, exit_threshold=0.7)
    cuda = run(tiny_gqa, prompts, params)
    cpu_llm = tiny_gqa.llm(device="cpu", skip_tokenizer_init=True)
    cpu = [(o.outputs[0].token_ids, o.outputs[0].exit_depths) for o in
           cpu_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert cuda == cpu


def test_bf16_generation_runs(tiny_gqa):
    out = run(tiny_gqa, [ids(8)], SamplingParams(max_tokens=8, ignore_eos=True), dtype="bfloat16")
    assert len(out[0][0]) == 8


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_cuda_graphs_equal_eager(tiny_gqa, layout):
    prompts = [ids(n, seed=n) for n in (3, 17, 40, 9, 25)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    kw = dict(kv_layout=layout, block_size=8, max_num_seqs=8, attention_backend="triton", num_kv_blocks=512)
    graphs = tiny_gqa.llm(device="cuda", skip_tokenizer_init=True, **kw)
    assert graphs.llm_engine.runner.graphs is not None
    eager = run(tiny_gqa, prompts, params, enforce_eager=True, **kw)
    got = [(o.outputs[0].token_ids, o.outputs[0].exit_depths) for o in
           graphs.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == eager


def test_fused_kernels_equal_reference_kernels_fp32(tiny_gqa):
    prompts = [ids(n, seed=n) for n in (4, 19, 33)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    fused = run(tiny_gqa, prompts, params, kernel_backend="triton")
    reference = run(tiny_gqa, prompts, params, kernel_backend="torch")
    assert fused == reference


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_async_scheduling_equals_sync_on_gpu(tiny_gqa, layout, mode):
    prompts = [ids(n, seed=n) for n in (3, 17, 40, 9, 25)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    kw = dict(kv_layout=layout, scheduling_mode=mode, block_size=8, max_num_seqs=8)
    sync = run(tiny_gqa, prompts, params, **kw)
    assert run(tiny_gqa, prompts, params, async_scheduling=True, **kw) == sync  # CUDA graphs on
    assert run(tiny_gqa, prompts, params, async_scheduling=True, enforce_eager=True, **kw) == sync


def test_kv_pool_sized_after_a_profiling_pass(tiny_gqa):
    from loopline.attention import get_attention_backend
    from loopline.worker.memory_profile import peak_step_bytes

    llm = tiny_gqa.llm(device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.05, num_kv_blocks=None)
    engine = llm.llm_engine
    peak = peak_step_bytes(engine.model, get_attention_backend("auto", engine.config.device), 2048, 64, 16,
                           engine.config.dtype, engine.config.device)
    assert peak > 0 and engine.kv.pool.num_blocks > 0


def _staggered(tiny, **kw):
    """Requests arriving while others decode: steps mixing decode rows and small prefill chunks."""
    from loopline.config import EngineArgs
    from loopline.engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=str(tiny.path), device="cuda", dtype="float32", skip_tokenizer_init=True,
                                  block_size=8, max_num_seqs=8, num_kv_blocks=512, attention_backend="triton", **kw))
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    arrivals = {0: (3, 40, 9), 5: (25, 2), 11: (70,), 17: (6, 33)}
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for n in arrivals.get(step, ()):
            engine.add_request(f"r{step}-{n}", ids(n, seed=n), params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].exit_depths)
        step += 1
    return done, engine.runner.graphs


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_step_graphs_equal_eager(tiny_gqa, layout, async_scheduling):
    kw = dict(kv_layout=layout, async_scheduling=async_scheduling)
    graphed, graphs = _staggered(tiny_gqa, **kw)
    assert graphs is not None and graphs.replays["mixed"] > 5  # steps with prefill chunks really replayed a graph
    eager, _ = _staggered(tiny_gqa, enforce_eager=True, **kw)
    assert graphed == eager and len(graphed) == 8


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graphs_follow_weight_updates_sleep_and_wake_up(tiny_gqa, tiny_factory, async_scheduling):
    # In-place weight updates must reach the captured graphs (packed q/k/v and gate/up views);
    # sleep(level=2) re-lays the weights and the pool out at new addresses, so wake_up recaptures.
    prompts = [ids(n, seed=n) for n in (3, 17, 40, 9, 25)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    kw = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=64, attention_backend="triton",
              async_scheduling=async_scheduling)
    new = tiny_factory(3)
    want_old = run(tiny_gqa, prompts, params, enforce_eager=True, **kw)
    want_new = run(new, prompts, params, enforce_eager=True, **kw)
    assert want_new != want_old  # the update is visible in the outputs

    llm = tiny_gqa.llm(device="cuda", skip_tokenizer_init=True, num_kv_blocks=512, **kw)
    engine, runner = llm.llm_engine, llm.llm_engine.runner

    def generate():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].exit_depths) for o in outs]

    replays = runner.graphs.replays["mixed"]
    assert generate() == want_old and runner.graphs.replays["mixed"] > replays
    engine.start_weight_update(1)
    engine.update_weights(new.state_dict.items())
    engine.finish_weight_update()
    assert generate() == want_new  # same graphs, new weights in place

    engine.sleep(level=2)
    assert runner.graphs is None
    engine.wake_up(tags=["weights"])
    engine.start_weight_update(2)
    engine.update_weights(tiny_gqa.state_dict.items())
    engine.finish_weight_update()
    engine.wake_up(tags=["kv_cache"])
    assert runner.graphs is not None and runner.graphs.replays["mixed"] == 0  # recaptured: a fresh graph set
    replays = runner.graphs.replays["mixed"]
    assert generate() == want_old and runner.graphs.replays["mixed"] > replays


# --- FP8 KV cache on the GPU: the Triton kernels (CUDA graphs, fused decode, splits) vs the torch backend ---
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("threshold", [1.0, 0.7])
def test_fp8_kv_triton_paths_agree_and_match_the_torch_backend(tiny_gqa, layout, threshold):
    """Eager, CUDA graphs and one row at a time (split-KV, the fused decode kernel) give the same tokens.
    Against the torch backend only the first token's distribution is compared: an fp32 rotary that rounds
    one ulp apart can put a key one FP8 step apart, which may flip a later near-tie (seen on an H200)."""
    prompts = [ids(n, seed=n) for n in (3, 17, 40, 9, 77)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, exit_threshold=threshold, logprobs=3)
    kw = dict(kv_layout=layout, block_size=8, max_num_batched_tokens=32, max_num_seqs=8, kv_cache_dtype="fp8")

    def gen(prompts, **more):
        llm = tiny_gqa.llm(device="cuda", skip_tokenizer_init=True, num_kv_blocks=512, **kw, **more)
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    def tokens(outs):
        return [(o.token_ids, o.exit_depths) for o in outs]

    eager = gen(prompts, attention_backend="triton", enforce_eager=True)
    assert tokens(gen(prompts, attention_backend="triton")) == tokens(eager)  # CUDA graphs
    for p, want in zip(prompts, eager):
        assert tokens(gen([p], attention_backend="triton")) == tokens([want])
    for a, b in zip(eager, gen(prompts, attention_backend="torch")):
        first = a.token_ids[0]
        assert first in b.logprobs[0] and abs(a.logprobs[0][first].logprob - b.logprobs[0][first].logprob) < 1e-2


def test_fp8_kv_matches_the_reference_on_gpu(tiny_gqa):
    from reference import reference_generate

    prompts = [ids(n, seed=n) for n in (6, 33)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    llm = tiny_gqa.llm(device="cuda", skip_tokenizer_init=True, kv_cache_dtype="fp8", num_kv_blocks=512)
    scales = llm.llm_engine.runner.kv_scales
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        tokens, depths, _ = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, p, 10, exit_threshold=0.7,
                                               kv_scales=(scales.k.cpu(), scales.v.cpu()))
        assert (o.outputs[0].token_ids, o.outputs[0].exit_depths) == (tokens, depths)


def test_fp8_kv_with_a_bf16_model_runs(tiny_gqa):
    prompts = [ids(n, seed=n) for n in (12, 50)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = tiny_gqa.llm(device="cuda", skip_tokenizer_init=True, dtype="bfloat16", kv_cache_dtype="fp8",
                       num_kv_blocks=512)
    assert llm.llm_engine.runner.k_cache.dtype == torch.float8_e4m3fn
    for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        c = o.outputs[0]
        assert len(c.token_ids) == 16
        assert all(math.isfinite(step[t].logprob) for step, t in zip(c.logprobs, c.token_ids))


def test_startup_compiles_the_sampler(tiny_gqa, monkeypatch):
    """Greedy and sampled requests (top-p, top-k and min-p too) on a started engine compile no sampling kernel (the engine warmed
    them at start-up): Triton's in-memory cache misses during the first requests name none of the token-choice
    kernels."""
    import triton

    from loopline.kernels import sampling
    from loopline.worker import sampler

    monkeypatch.setattr(sampler, "_TRITON_ARGMAX_MIN_VOCAB", 0)  # (the tiny vocabulary would take torch's argmax)

    kernels = (sampling._chunk_argmax_kernel, sampling._pick_chunk_kernel, sampling._chunk_sample_kernel,
               sampling._cut_kernel)
    for kernel in kernels:  # (earlier tests in this process compiled them: forget that)
        kernel.device_caches.clear()
    llm = tiny_gqa.llm(device="cuda", skip_tokenizer_init=True, num_kv_blocks=512, attention_backend="triton")
    missed = []
    hook = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda *a, **kw: missed.append(getattr(kw.get("fn"), "name", "")) or False
    try:
        for params in (SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=4, temperature=0.8),
                       SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9),
                       SamplingParams(max_tokens=4, temperature=0.8, top_k=3, min_p=0.1)):
            llm.generate([{"prompt_token_ids": ids(9)}, {"prompt_token_ids": ids(5)}], params, use_tqdm=False)
    finally:
        triton.knobs.runtime.jit_cache_hook = hook
    assert not {k.fn.__name__ for k in kernels} & set(missed), missed
