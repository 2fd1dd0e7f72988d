"""loopline.entrypoints.rollout_server: the framework-free core of the verl plug-in (no verl, no Ray)."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from loopline.errors import InvalidRequestError, WeightUpdateError
from loopline.models.loader import load_model
from loopline.rl import replay_logprobs
from loopline.entrypoints.rollout_server import (RequestRejected, RolloutLimits, RolloutServer, engine_options,
                                        sampling_from_dict)

LIMITS = RolloutLimits(prompt_length=16, response_length=8, max_model_len=24)


# --- sampling dict -----------------------------------------------------------------------------
def test_sampling_dict_keys_and_length_budget():
    p = sampling_from_dict({"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0,
                            "logprobs": True, "unknown_key": 3}, prompt_len=10, limits=LIMITS)
    assert (p.temperature, p.top_p, p.top_k, p.logprobs, p.max_tokens, p.seed) == (0.7, 0.9, -1, 0, 8, None)
    assert sampling_from_dict({"logprobs": False}, 10, LIMITS).logprobs is None
    # min(response_length, prompt_length + response_length - len(prompt)), clamped to [1, max_model_len - len]
    assert sampling_from_dict({}, 20, LIMITS).max_tokens == 4
    assert sampling_from_dict({}, 23, LIMITS).max_tokens == 1
    assert sampling_from_dict({"max_new_tokens": 3}, 5, LIMITS).max_tokens == 3
    assert sampling_from_dict({"max_tokens": 5, "max_new_tokens": 3}, 5, LIMITS).max_tokens == 5
    p = sampling_from_dict({"seed": 7, "ignore_eos": True, "exit_threshold": 0.5}, 5, LIMITS,
                           loop_defaults={"min_loops": 2, "exit_threshold": 0.9})
    assert (p.seed, p.ignore_eos, p.min_loops, p.exit_threshold) == (7, True, 2, 0.5)  # the request's wins


@pytest.mark.parametrize("params,field", [({"logprobs": "yes"}, "logprobs"), ({"temperature": -1}, "temperature"),
                                          ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                                          ({"temperature": "hot"}, "temperature"), ({"top_p": None}, "top_p"),
                                          ({"repetition_penalty": [1]}, "repetition_penalty"),
                                          ({"ignore_eos": "false"}, "ignore_eos"), ({"temperature": True}, "temperature")])
def test_sampling_dict_bad_values_name_the_key(params, field):
    with pytest.raises(InvalidRequestError) as e:
        sampling_from_dict(params, 4, LIMITS)
    assert e.value.param == field


def _options(path, **extra):
    return engine_options(str(path), dtype="float32", logprobs_mode="processed_logprobs", prompt_length=16,
                          response_length=8, max_model_len=None, max_num_seqs=8, max_num_batched_tokens=8192,
                          gpu_memory_utilization=0.5, enforce_eager=True, enable_prefix_caching=True, seed=3,
                          extra={"device": "cpu", "num_kv_blocks": 256, "block_size": 4, **extra})


def test_engine_options(tiny_gqa):
    o = _options(tiny_gqa.path, exit_threshold=0.5, min_loops=1, bucket_bytes=1024)
    a = o.engine_args
    assert (a.max_model_len, a.logprobs_mode, a.seed, a.enable_prefix_caching, a.num_kv_blocks) == \
        (24, "processed_logprobs", 3, True, 256)
    assert o.loop_defaults == {"exit_threshold": 0.5, "min_loops": 1} and not o.engine_process
    assert o.limits == RolloutLimits(16, 8, 24)
    assert not _options(tiny_gqa.path, kv_layout="shared").engine_args.enable_prefix_caching  # last_exited only
    with pytest.raises(InvalidRequestError) as e:
        _options(tiny_gqa.path, no_such_option=1)
    assert e.value.param == "no_such_option"


# --- the server ----------------------------------------------------------------------------------
def _server(tiny, **extra) -> RolloutServer:
    o = _options(tiny.path, **extra)
    return RolloutServer(o.build(), o.limits, o.loop_defaults)


def _wait_for_tokens(server: RolloutServer, n: int, timeout: float = 60.0) -> None:
    """Until some request in the engine has produced ``n`` tokens (read-only peek at the in-thread engine)."""
    engine = server.llm.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.num_output_tokens >= n for r in list(engine.scheduler.requests.values())):
            return
        time.sleep(0.005)
    raise AssertionError("no request produced tokens in time")


def test_generate_matches_replay_with_adaptive_exits(tiny_gqa, ids):
    async def main():
        server = _server(tiny_gqa, exit_threshold=0.5, min_loops=1)
        try:
            prompt = ids(6, seed=1)
            results = await asyncio.gather(*[server.generate(prompt, {"temperature": 1.0, "logprobs": True}, "same")
                                             for _ in range(4)])  # one caller id, reused: the server keeps them apart
            return results, prompt
        finally:
            server.llm.shutdown()

    results, prompt = asyncio.run(main())
    model = load_model(tiny_gqa.path, torch.float32)
    assert len({tuple(r.token_ids) for r in results}) > 1  # no seed: each request draws its own
    depths = {d for r in results for d in r.exit_depths}
    assert len(depths) > 1 and max(depths) <= tiny_gqa.cfg["total_ut_steps"]  # adaptive exits happened
    for r in results:
        assert r.stop_reason == "completed" and r.weight_version == 0 and r.global_steps is None
        assert len(r.token_ids) == len(r.log_probs) == len(r.exit_depths) == 8  # the default budget
        with torch.no_grad():
            lp = replay_logprobs(model, prompt, r.token_ids, r.exit_depths, temperature=1.0)
        assert (lp - torch.tensor(r.log_probs)).abs().max().item() <= 1e-5


def test_abort_keeps_tokens_holds_later_requests_and_resume_runs_them(tiny_gqa, ids):
    async def main():
        server = _server(tiny_gqa, max_model_len=1100, num_kv_blocks=1200)
        try:
            long = asyncio.create_task(server.generate(ids(4), {"max_tokens": 1000, "ignore_eos": True,
                                                                "logprobs": True}, "long"))
            await asyncio.to_thread(_wait_for_tokens, server, 2)
            await server.abort_all_requests()
            aborted = await asyncio.wait_for(long, 30)
            held = asyncio.create_task(server.generate(ids(4), {"max_tokens": 2, "temperature": 0}, "held"))
            await asyncio.sleep(0.3)
            was_held = not held.done()
            await server.release_kv_cache()  # held requests wait across a KV release ...
            await server.resume_kv_cache()
            still_held = not held.done()
            await server.resume_generation()  # ... and run at resume
            done = await asyncio.wait_for(held, 30)
            return aborted, was_held, still_held, done
        finally:
            server.llm.shutdown()

    aborted, was_held, still_held, done = asyncio.run(main())
    assert aborted.stop_reason == "aborted" and aborted.finish_reason == "abort"
    assert 2 <= len(aborted.token_ids) < 1000 and len(aborted.log_probs) == len(aborted.token_ids)
    assert was_held and still_held
    assert done.stop_reason == "completed" and len(done.token_ids) == 2


def test_reject_request_refuses_until_resume(tiny_gqa, ids):
    async def main():
        server = _server(tiny_gqa)
        try:
            await server.abort_all_requests(reject_request=True)
            with pytest.raises(RequestRejected):
                await server.generate(ids(4), {"max_tokens": 2}, "r")
            await server.resume_generation()
            return await server.generate(ids(4), {"max_tokens": 2}, "r")
        finally:
            server.llm.shutdown()

    assert asyncio.run(main()).stop_reason == "completed"


def test_weight_update_in_both_orders(tiny_gqa, tiny_factory, ids):
    other = tiny_factory(7)  # same shapes, other weights

    async def greedy(server):
        return await server.generate(ids(5, seed=3), {"temperature": 0, "max_tokens": 4, "logprobs": True}, "g")

    async def publish(server, state, steps):
        await server.start_weight_update()
        names = list(state)
        for part in (names[:3], names[3:]):
            await server.update_weights([(n, state[n]) for n in part])
        return await server.finish_weight_update(global_steps=steps)

    async def main():
        server = _server(tiny_gqa)
        try:
            await server.wake_up()  # verl may wake an awake server: a no-op
            await server.clear_kv_cache()
            first = await greedy(server)
            # hybrid: everything freed, weights back, update, KV back
            await server.sleep()
            await server.wake_up(["weights"])
            v1 = await publish(server, other.state_dict, 1)
            await server.wake_up(["kv_cache"])
            second = await greedy(server)
            # disaggregated: held by an abort, KV released, update, KV back, resume
            await server.abort_all_requests()
            pending = asyncio.create_task(greedy(server))
            await server.release_kv_cache()
            v2 = await publish(server, tiny_gqa.state_dict, 2)
            await server.resume_kv_cache()
            await server.resume_generation()
            third = await asyncio.wait_for(pending, 30)
            # a refused bucket aborts the update; the old weights keep serving
            await server.start_weight_update()
            with pytest.raises(WeightUpdateError):
                await server.update_weights([("model.no_such.weight", torch.zeros(1))])
            fourth = await greedy(server)
            return first, second, third, fourth, v1, v2, await server.get_weight_version()
        finally:
            server.llm.shutdown()

    first, second, third, fourth, v1, v2, version = asyncio.run(main())
    assert (v1, v2, version) == (1, 2, 2)
    assert (first.weight_version, first.global_steps) == (0, None)
    assert (second.weight_version, second.global_steps) == (1, 1)
    assert (third.weight_version, third.global_steps) == (2, 2)
    assert (fourth.weight_version, fourth.global_steps) == (2, 2)
    assert third.token_ids == first.token_ids == fourth.token_ids  # the first weights again
    assert max(abs(a - b) for a, b in zip(third.log_probs, first.log_probs)) <= 1e-5
    assert second.log_probs != first.log_probs  # other weights served in between


def test_inference_and_rl_code_import_neither_verl_nor_ray():
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import sys, loopline, loopline.rl, loopline.entrypoints.rollout_server, loopline.entrypoints.cli, "
             "loopline.entrypoints.openai.api_server; print(sorted(m for m in ('verl', 'ray') if m in sys.modules))")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
