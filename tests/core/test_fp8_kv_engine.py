"""FP8 KV cache (``kv_cache_dtype="fp8"``) through the engine.

The independent reference stores every K/V as FP8 E4M3 with the engine's scales (``reference_forward``'s
``kv_scales``) and must give the engine's greedy tokens and exit depths exactly and its logprobs to fp32
tolerance; batched, chunked, preempted, prefix-cached and handed-off runs must equal a plain FP8 run.
Scales come from a deterministic calibration pass or from the checkpoint; the pool holds twice the pages.
"""
from __future__ import annotations

import random

import pytest
import torch
from matching import approx_floats, closer_to_fp8
from reference import reference_generate
from safetensors.torch import load_file, save_file

from loopline import SamplingParams
from loopline.attention.base import FP8_KV_DTYPE
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.errors import EngineStateError, InvalidRequestError
from loopline.kv.quant import (
    KVScales,
    calibrate_kv_scales,
    calibration_token_ids,
    power_of_two_scales,
    resolve_kv_cache_dtype,
)
from loopline.models.loader import CheckpointError, load_model
from loopline.worker.memory_profile import num_kv_blocks


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def engine_for(tiny, prefill_only=False, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_dtype", "fp8")
    return LLMEngine(EngineArgs(model=str(tiny.path), **kw), prefill_only=prefill_only)


def drain(engine, requests, arrivals=None):
    arrivals = arrivals or {}
    done, step, pending = {}, 0, dict(requests)
    while pending or engine.has_unfinished_requests():
        for rid in [r for r in pending if arrivals.get(r, 0) <= step]:
            prompt, params = pending.pop(rid)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
        assert step < 20_000
    return done


def result(out):
    return [(c.token_ids, c.exit_depths) for c in out.outputs]


def scales_of(engine) -> tuple[torch.Tensor, torch.Tensor]:
    s = engine.runner.kv_scales
    return s.k.cpu(), s.v.cpu()


ADAPTIVE = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.7, logprobs=1)
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, exit_threshold=0.7)


# --- the option -------------------------------------------------------------------------------------------
def test_kv_cache_dtype_names_and_errors():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == FP8_KV_DTYPE
    with pytest.raises(InvalidRequestError, match="E4M3") as e5m2:
        EngineArgs(kv_cache_dtype="fp8_e5m2").validate()
    assert e5m2.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidRequestError, match=r"kv_cache_dtype must be one of .*'fp8'"):
        EngineArgs(kv_cache_dtype="int8").validate()


def test_cli_flag_reaches_the_engine_args():
    import argparse

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--kv-cache-dtype", "fp8"])
    assert EngineArgs.from_cli_args(ns).kv_cache_dtype == "fp8"


def test_an_fp8_pool_holds_twice_the_pages(tiny_gqa):
    bf16, fp8 = engine_for(tiny_gqa, kv_cache_dtype="bfloat16", kv_cache_memory_gb=0.01), \
        engine_for(tiny_gqa, kv_cache_memory_gb=0.01)
    nb, nf = (num_kv_blocks(e.config, e.model, e.runner.backend, e.kv.layout) for e in (bf16, fp8))
    assert nf in (2 * nb, 2 * nb + 1) and fp8.kv.pool.num_blocks == nf  # (the budget's rounding)
    assert fp8.runner.k_cache.dtype == FP8_KV_DTYPE and fp8.runner.k_cache.element_size() == 1
    assert bf16.runner.k_cache.dtype == torch.bfloat16 and bf16.runner.kv_scales is None


# --- scales -----------------------------------------------------------------------------------------------
def test_power_of_two_scales_keep_the_calibrated_maximum_in_range():
    amax = torch.tensor([0.0, 1e-3, 1.0, 7.3, 223.9, 5000.0])
    s = power_of_two_scales(amax)
    assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))  # powers of two
    assert s[0] == 1.0
    assert bool((amax * 2.0 / s <= 448.0).all())  # at least 2x headroom...
    assert bool((amax[1:] * 2.0 / s[1:] > 224.0).all())  # ...and at most 4x (the smallest such power)


def test_calibration_is_deterministic_and_covers_every_loop(tiny_gqa):
    model = load_model(tiny_gqa.path, dtype=torch.float32)
    tokens = calibration_token_ids(model.config.vocab_size)
    assert torch.equal(tokens, calibration_token_ids(model.config.vocab_size))
    a, b = calibrate_kv_scales(model, tokens, 64), calibrate_kv_scales(model, tokens, 64)
    assert a.same_as(b) and a.k.shape == (tiny_gqa.cfg["num_hidden_layers"], tiny_gqa.cfg["num_key_value_heads"])
    # The scales cover the K/V of every loop: nothing the reference stores for the calibration prompt saturates.
    engine = engine_for(tiny_gqa)
    k, v = scales_of(engine)
    assert bool((k > 0).all()) and bool((v > 0).all())


def test_checkpoint_scales_are_used_and_validated(tiny_gqa, tmp_path):
    import shutil

    layers, heads = tiny_gqa.cfg["num_hidden_layers"], tiny_gqa.cfg["num_key_value_heads"]
    weights = load_file(str(tiny_gqa.path / "model.safetensors"))
    for i in range(layers):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.full((heads,), 0.125)
    shutil.copytree(tiny_gqa.path, tmp_path / "m")
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    engine = LLMEngine(EngineArgs(model=str(tmp_path / "m"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  kv_cache_dtype="fp8"))
    assert engine.runner.kv_scales.source.startswith("checkpoint")
    k, v = scales_of(engine)
    assert bool((k == 0.25).all()) and bool((v == 0.125).all())
    # a bf16 engine loads the same checkpoint and ignores the scales
    assert LLMEngine(EngineArgs(model=str(tmp_path / "m"), dtype="float32", device="cpu", skip_tokenizer_init=True)
                     ).runner.kv_scales is None

    del weights["model.layers.1.self_attn.v_scale"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.v_scale"):
        load_model(tmp_path / "m")
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([0.5] * (heads - 1) + [-1.0])
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="positive and finite"):
        load_model(tmp_path / "m")


# --- exactness against the reference ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_fp8_engine_matches_the_reference_storing_fp8(tiny_gqa, layout):
    prompts = [ids(5, seed=1), ids(14, seed=2), ids(9, seed=3)]
    engine = engine_for(tiny_gqa, kv_layout=layout, max_num_batched_tokens=8, max_num_seqs=3)
    outs = drain(engine, {f"r{i}": (p, ADAPTIVE) for i, p in enumerate(prompts)}, arrivals={"r1": 2, "r2": 5})
    scales = scales_of(engine)
    depths = set()
    for i, p in enumerate(prompts):
        tokens, exit_depths, logprobs = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, p, 8, exit_threshold=0.7,
                                                           layout=layout, kv_scales=scales)
        out = outs[f"r{i}"].outputs[0]
        assert (out.token_ids, out.exit_depths) == (tokens, exit_depths)
        # ...and FP8 really changes the numbers: the logprobs are nearer the reference storing FP8 than the
        # one without (tests/test_huginn_fp8.py says why the tolerance is FP8's own error, not fp32's)
        _, _, full = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, p, 8, exit_threshold=0.7, layout=layout)
        closer_to_fp8([lps[tid].logprob for tid, lps in zip(out.token_ids, out.logprobs)], logprobs, full, f"r{i}")
        depths |= set(exit_depths)
    assert len(depths) > 1


def test_fp8_batched_chunked_equals_serial(tiny_gqa):
    reqs = {f"r{i}": (ids(4 + 5 * i, seed=30 + i), (ADAPTIVE if i % 2 else SAMPLED)) for i in range(4)}
    batched = drain(engine_for(tiny_gqa, max_num_batched_tokens=6, max_num_seqs=4), reqs)
    for rid, req in reqs.items():
        serial = drain(engine_for(tiny_gqa, block_size=8), {rid: req})
        assert result(serial[rid]) == result(batched[rid])


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_fp8_preemption_and_prefix_caching_leave_outputs_unchanged(tiny_gqa, layout):
    system = ids(13, seed=99)
    reqs = {f"r{i}": (system + ids(3 + 2 * i, seed=20 + i), (ADAPTIVE if i % 2 else SAMPLED).clone(max_tokens=14))
            for i in range(4)}
    roomy = drain(engine_for(tiny_gqa, kv_layout=layout), reqs)
    planes = 4 if layout == "last_exited" else 1
    tight = engine_for(tiny_gqa, kv_layout=layout, kv_allocation="incremental", enable_preemption=True,
                       num_kv_blocks=planes * 14)
    assert {k: result(v) for k, v in drain(tight, reqs).items()} == {k: result(v) for k, v in roomy.items()}
    assert tight.scheduler.num_preemptions > 0
    assert all(s.k is None or s.k.dtype == torch.uint8 for s in tight.runner.pages.snapshots.values())
    if layout == "last_exited":
        cached = engine_for(tiny_gqa, enable_prefix_caching=True)
        assert {k: result(v) for k, v in drain(cached, reqs, arrivals={"r1": 6, "r2": 9, "r3": 12}).items()} == \
            {k: result(v) for k, v in roomy.items()}
        assert cached.kv.prefix_cache.stats.hits > 0


def test_fp8_handoff_moves_bytes_and_scales(tiny_gqa):
    """Prefill/decode disaggregation in one process: pages leave as FP8 bytes with their scales; a decode
    engine with other scales refuses the request instead of reading its pages wrongly."""
    from loopline.engine.input_processor import child_request_id

    reqs = {"a": (ids(11, seed=1), ADAPTIVE), "b": (ids(19, seed=2), SAMPLED)}
    single = drain(engine_for(tiny_gqa, max_num_seqs=4), reqs)
    prefill, decode = engine_for(tiny_gqa, prefill_only=True, max_num_seqs=4), engine_for(tiny_gqa, max_num_seqs=4)
    for rid, (prompt, params) in reqs.items():
        prefill.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        prefill.step()
        for child in prefill.handoff.ready():
            handoff, kv = prefill.handoff.take(child, 0)
            assert kv.dtype == torch.uint8  # FP8 pages travel as their bytes
            assert handoff.runner.kv_scales.same_as(prefill.runner.kv_scales)
            decode.handoff.reserve(child, handoff.prompt_token_ids)
            decode.handoff.write_pages(child, 0, kv)
            decode.handoff.adopt(handoff)
        done.update((o.request_id, o) for o in decode.step() if o.finished)
    assert approx_floats({k: result(v) for k, v in done.items()}) == {k: result(v) for k, v in single.items()}

    # a decode engine whose scales differ (here: a bf16 engine has none) refuses the adoption cleanly
    other = engine_for(tiny_gqa, kv_cache_dtype="auto")
    prefill.add_request("c", {"prompt_token_ids": ids(6, seed=3)}, ADAPTIVE)
    while not prefill.handoff.ready():
        prefill.step()
    child = child_request_id("c", 0)
    handoff, kv = prefill.handoff.take(child, 0)
    other.handoff.reserve(child, handoff.prompt_token_ids)
    with pytest.raises((EngineStateError, ValueError)):
        other.handoff.write_pages(child, 0, kv)
        other.handoff.adopt(handoff)
    other.handoff.release(child)
    assert other.kv.num_used_blocks == 0


def test_mismatched_scales_are_refused(tiny_gqa):
    from loopline.engine.input_processor import child_request_id

    prefill, decode = engine_for(tiny_gqa, prefill_only=True), engine_for(tiny_gqa)
    k, v = scales_of(decode)
    decode.runner.pages.kv_scales = KVScales(k * 2, v, "other")
    prefill.add_request("c", {"prompt_token_ids": ids(6, seed=3)}, ADAPTIVE)
    while not prefill.handoff.ready():
        prefill.step()
    child = child_request_id("c", 0)
    handoff, kv = prefill.handoff.take(child, 0)
    decode.handoff.reserve(child, handoff.prompt_token_ids)
    decode.handoff.write_pages(child, 0, kv)
    with pytest.raises(EngineStateError, match="other FP8 scales"):
        decode.handoff.adopt(handoff)
    decode.handoff.release(child)
    assert decode.kv.num_used_blocks == 0 and not decode.runner.pages.snapshots
