"""Prefill/decode disaggregation end to end on the CPU (gloo): AsyncLLM over prefill and decode
worker processes gives exactly what one engine gives; aborts and dead workers fail only their
requests, leak no KV page on either side, and the rest keeps serving."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from matching import approx_floats

from loopline import AsyncLLM, EngineArgs, SamplingParams
from loopline.engine import LLMEngine
from loopline.errors import EngineDeadError, InvalidRequestError

# Small chunks (chunked prefill), adaptive exits, prefix caching: what the single engine is run with too.
BASE = dict(dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=8, max_model_len=256,
            block_size=4, enable_prefix_caching=True, skip_tokenizer_init=True)


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def workload():
    system = ids(13, seed=99)  # a shared prefix: the prefill side's prefix cache serves it
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.6)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, exit_threshold=0.6)
    return {
        "g0": (system + ids(9, seed=1), greedy),
        "g1": (system + ids(30, seed=2), greedy.clone(logprobs=2)),
        "s0": (system + ids(6, seed=3), sampled),
        "s1": (ids(21, seed=4), sampled.clone(seed=11, repetition_penalty=1.3)),
        "one": (ids(5, seed=5), greedy.clone(max_tokens=1)),  # ends with its first token, on the prefill side
    }


def single_engine(tiny, layout, requests=None):
    engine = LLMEngine(EngineArgs(model=str(tiny.path), kv_layout=layout, **BASE))
    done = {}
    for rid, (prompt, params) in (requests or workload()).items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def result(out):
    c = out.outputs[0]
    return c.token_ids, c.exit_depths, c.finish_reason, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)] \
        if c.logprobs else None


async def generate_all(llm, requests):
    async def one(rid, prompt, params):
        return await llm.generate_tokens(prompt, params, rid)
    outs = await asyncio.gather(*(one(rid, p, sp) for rid, (p, sp) in requests.items()))
    return {o.request_id: o for o in outs}


def wait_idle(llm, timeout=20.0):
    """Until every live worker reports no request and no KV page in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snaps = [w.snapshot for w in llm.client.workers if w.alive]
        if all(s.kv_used_blocks == 0 and s.num_unfinished == 0 for s in snaps):
            return snaps
        time.sleep(0.05)
    raise AssertionError(f"workers not idle: {llm.client.worker_snapshots}")


# Each layout once and each decode pool size once (2P2D below covers several prefill and decode workers): every
# pairing would add two fixtures of two and three engine processes each to the CPU run for no new path. The default
# run has last_exited over one decode worker (two processes); the shared layout's three are slow (~12 s on 2 cores):
# test_handoff.py hands off both layouts' pages in one process.
@pytest.fixture(scope="module", params=[("last_exited", 1), pytest.param(("shared", 2), marks=pytest.mark.slow)],
                ids=["last_exited-1P1D", "shared-1P2D"])
def pd(request, tiny_gqa):
    layout, decode = request.param
    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), kv_layout=layout, prefill_workers=1, decode_workers=decode, **BASE))
    yield layout, llm
    llm.shutdown()


def test_pd_gives_the_single_engines_tokens_and_exit_depths(pd, tiny_gqa):
    layout, llm = pd
    assert llm.client.transport == "gloo"
    # seed=None: one prefill worker draws the seeds one engine draws (requests arrive in the same order)
    fresh = SamplingParams(max_tokens=10, temperature=1.0, seed=None, ignore_eos=True, exit_threshold=0.6)
    requests = {**workload(), "fresh": (ids(8, seed=6), fresh)}
    outs = asyncio.run(generate_all(llm, requests))
    ref = single_engine(tiny_gqa, layout, requests)
    assert approx_floats({k: result(v) for k, v in outs.items()}) == {k: result(v) for k, v in ref.items()}
    assert len({d for o in ref.values() for d in o.outputs[0].exit_depths}) > 1  # adaptive exits vary
    client = llm.client
    assert client.num_handoffs == 5 and client.num_pieces > client.num_handoffs  # pages left chunk by chunk
    snaps = wait_idle(llm)
    assert all(s.kv_used_blocks == 0 for s in snaps)
    # a later request finds the shared prefix in the prefill worker's cache (shared caches nothing: docs)
    system = workload()["g0"][0][:13]
    late = {"late": (system + ids(4, seed=9), workload()["g0"][1])}
    out = asyncio.run(generate_all(llm, late))
    assert approx_floats(result(out["late"])) == result(single_engine(tiny_gqa, layout, late)["late"])
    wait_idle(llm)
    assert llm.client.prefill[0].snapshot.prefix_cache_hits == (12 if layout == "last_exited" else 0)
    # decode workers share the pages of a prefix they received before (shared caches nothing)
    decode_hits = sum(w.snapshot.prefix_cache_hits for w in llm.client.decode)
    assert decode_hits > 0 if layout == "last_exited" else decode_hits == 0
    # the front end's counters (/metrics) count each prompt once: the prefill workers' lookups
    total = llm.client.aggregate()
    assert (total.prefix_cache_hits, total.prefix_cache_queries) == (
        llm.client.prefill[0].snapshot.prefix_cache_hits, llm.client.prefill[0].snapshot.prefix_cache_queries)


def test_streamed_outputs_continue_across_the_handoff(pd):
    _, llm = pd
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)

    async def main():
        return [o async for o in llm.generate({"prompt_token_ids": ids(17, seed=8)}, params, "stream")]

    outs = asyncio.run(main())
    assert outs[0].outputs[0].token_ids and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
    assert outs[-1].prompt_token_ids == ids(17, seed=8)
    for a, b in zip(outs, outs[1:]):  # each output extends the one before, from both workers
        assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
    assert len(outs[-1].outputs[0].logprobs) == 6
    wait_idle(llm)


def test_n_above_one_is_refused(pd):
    _, llm = pd
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(llm.generate_tokens([5, 6, 7], SamplingParams(n=2, max_tokens=2), "n2"))
    assert e.value.param == "n"


def test_control_calls_go_to_every_worker_or_are_refused(pd):
    from loopline.errors import EngineStateError
    _, llm = pd

    async def main():
        await llm.reset_prefix_cache()
        assert await llm.get_weight_version() == 0 and await llm.is_paused() is False
        assert await llm.abort_all() == []
        with pytest.raises(EngineStateError, match="not supported"):
            await llm.pause_generation("wait")
        with pytest.raises(EngineStateError, match="not supported"):
            await llm.start_weight_update(1)

    asyncio.run(main())
    assert llm.health_problem() is None


def test_flags_are_validated():
    for kw, param in [(dict(prefill_workers=1), "decode_workers"), (dict(prefill_workers=2, decode_workers=-1), "decode_workers"),
                      (dict(prefill_workers=1, decode_workers=1, kv_transport="tcp"), "kv_transport"),
                      (dict(prefill_workers=1, decode_workers=1, kv_transfer_timeout=0), "kv_transfer_timeout"),
                      (dict(prefill_workers=1, decode_workers=1, data_parallel_size=2, device="cpu"), "prefill_workers"),
                      (dict(prefill_workers=1, decode_workers=1, distributed_executor_backend="ray",
                            kv_transport="cuda_ipc"), "kv_transport")]:
        with pytest.raises(InvalidRequestError) as e:
            EngineArgs(**kw).validate()
        assert e.value.param == param


def test_serve_flags_reach_engine_args():
    from loopline.entrypoints.cli import build_parser
    ns = build_parser().parse_args(["serve", "--prefill-workers", "2", "--decode-workers", "3", "--kv-transport", "gloo",
                                    "--kv-transfer-timeout", "5"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.prefill_workers, args.decode_workers, args.kv_transport, args.kv_transfer_timeout) == (2, 3, "gloo", 5.0)
    with pytest.raises(SystemExit):  # argparse refuses a transport it does not know
        build_parser().parse_args(["serve", "--kv-transport", "rdma"])


def test_missing_nixl_is_a_clear_error():
    pytest.importorskip("torch")
    try:
        import nixl  # noqa: F401
        pytest.skip("nixl is installed here")
    except ImportError:
        pass
    from loopline.distributed.kv_transfer import make_transport
    with pytest.raises(InvalidRequestError, match="nixl package") as e:
        make_transport("nixl", 5.0)
    assert e.value.param == "kv_transport"


# --- failures: 2 prefill + 2 decode workers; the tests run in this order ----------------------
@pytest.fixture(scope="module")
def faults(tiny_gqa):
    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), prefill_workers=2, decode_workers=2, kv_transfer_timeout=20,
                              **BASE))
    yield llm
    llm.shutdown()


def test_2p2d_gives_the_single_engines_outputs(faults, tiny_gqa):
    outs = asyncio.run(generate_all(faults, workload()))
    ref = single_engine(tiny_gqa, "last_exited")
    assert approx_floats({k: result(v) for k, v in outs.items()}) == {k: result(v) for k, v in ref.items()}
    wait_idle(faults)


def test_health_and_metrics_name_each_worker(faults, serve_app):
    """/metrics' engine-side series carry one ``replica`` label per worker (prefill-0, prefill-1, decode-0,
    decode-1), each worker's steps counted under its own; /health is a plain 200 while all serve."""
    import re

    import httpx

    from loopline.entrypoints.openai.api_server import build_app

    srv = serve_app(build_app(faults, "t", shutdown_engine=False))
    body = {"model": "t", "prompt": [ids(12, seed=70), ids(9, seed=71)], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0}
    assert httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    wait_idle(faults)
    time.sleep(0.2)  # the last steps' records
    names = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert [r.name for r in faults.replicas()] == names and all(r.problem is None for r in faults.replicas())
    health = httpx.get(srv.base_url + "/health")
    assert health.status_code == 200 and not health.content
    text = httpx.get(srv.base_url + "/metrics").text
    for name in ("loopline:kv_cache_usage_perc", "loopline:replica_healthy", "loopline:engine_steps_total"):
        for worker in names:
            assert re.search(rf'^{name}{{model_name="t",replica="{worker}"}} ', text, re.M), (name, worker)
    steps = {w: float(v) for w, v in re.findall(r'^loopline:engine_steps_total{model_name="t",replica="(\S+?)"} (\S+)',
                                                 text, re.M)}
    # both prompts were prefilled on some prefill worker and decoded on some decode worker, under their names
    assert sum(steps[w] for w in names[:2]) > 0 and sum(steps[w] for w in names[2:]) > 0, steps


def test_abort_mid_transfer_leaks_nothing(faults):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def main():
        finals = []
        for i in range(3):
            rid = f"abort-{i}"
            async for out in faults.generate({"prompt_token_ids": ids(40, seed=20 + i)}, params, rid):
                # the first token came from the prefill worker: its pages are on their way now
                assert len(out.outputs[0].token_ids) >= 1
                await faults.abort(rid)
                finals.append(out)
                break
        return finals

    asyncio.run(main())
    wait_idle(faults)  # both sides: no page in use, no request left

    async def mid_prefill():  # aborted while its first pages are on their way, before its handoff
        client = faults.client
        task = asyncio.create_task(faults.generate_tokens(ids(200, seed=23), params, "abort-prefill"))
        while not ((placed := client.placement("abort-prefill")) and placed.pieces):
            await asyncio.sleep(0.001)
        await faults.abort("abort-prefill")
        return await task

    out = asyncio.run(mid_prefill())
    assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
    wait_idle(faults)
    after = asyncio.run(faults.generate_tokens(ids(9, seed=30), SamplingParams(max_tokens=4, ignore_eos=True), "after-abort"))
    assert len(after.outputs[0].token_ids) == 4


def test_decode_worker_holds_the_pages_before_the_handoff(faults):
    """A decode worker reserves a request's prompt pages (every plane) in its own pool when the first
    piece arrives: its KV gauge counts them while the prefill still runs; an abort then frees them."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    client = faults.client
    pages = client.info.kv_planes * 200 // BASE["block_size"]

    async def main():
        task = asyncio.create_task(faults.generate_tokens(ids(200, seed=24), params, "reserved"))
        deadline = time.monotonic() + 20
        while not ((placed := client.placement("reserved")) and placed.pieces):
            await asyncio.sleep(0.001)
        while placed.decode.snapshot.kv_used_blocks < pages and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        held = placed.decode.snapshot.kv_used_blocks
        prefilling = not client.placement("reserved").on_decode  # (read after the gauge: the pages were held before the handoff)
        await faults.abort("reserved")
        return held, prefilling, await task

    held, prefilling, out = asyncio.run(main())
    assert held == pages and prefilling
    assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
    wait_idle(faults)


def test_prefill_worker_killed_mid_chunk(faults):
    long_prompt = ids(200, seed=40)  # ~40 chunks of 5 tokens x 4 loops: still prefilling when killed
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main():
        doomed = asyncio.create_task(faults.generate_tokens(long_prompt, params, "doomed"))
        while (placed := faults.client.placement("doomed")) is None:
            await asyncio.sleep(0.001)
        victim = placed.prefill
        other = asyncio.create_task(faults.generate_tokens(ids(12, seed=41), params, "other"))
        while (placed := faults.client.placement("other")) is None:
            await asyncio.sleep(0.001)
        assert placed.prefill is not victim  # least-loaded prefill worker
        victim.process.kill()
        with pytest.raises(EngineDeadError):
            await doomed
        return await other, victim

    other, victim = asyncio.run(main())
    assert len(other.outputs[0].token_ids) == 8 and not victim.alive
    assert faults.health_problem() is None
    wait_idle(faults)
    again = asyncio.run(faults.generate_tokens(ids(15, seed=42), params, "after-prefill-death"))
    assert len(again.outputs[0].token_ids) == 8


def test_decode_worker_killed_mid_stream(faults):
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)

    async def main():
        seen = []
        stream = faults.generate({"prompt_token_ids": ids(10, seed=50)}, params, "streaming")
        other = None
        with pytest.raises(EngineDeadError):
            async for out in stream:
                seen.append(len(out.outputs[0].token_ids))
                placed = faults.client.placement("streaming")
                if len(seen) == 1:
                    other = asyncio.create_task(faults.generate_tokens(ids(11, seed=51), params.clone(max_tokens=30),
                                                                       "survivor"))
                if placed is not None and placed.on_decode and out.outputs[0].token_ids[1:] and \
                        (survivor := faults.client.placement("survivor")) is not None and not killed:
                    victim = placed.decode
                    assert survivor.decode is not victim  # the other had more credit
                    victim.process.kill()
                    killed.append(victim.label)
        return seen, await other

    killed = []
    seen, survivor = asyncio.run(main())
    victim_name, = killed
    assert max(seen) < 120 and len(survivor.outputs[0].token_ids) == 30
    assert faults.health_problem() is None
    down = [r.name for r in faults.replicas() if r.problem is not None]  # /health's "unhealthy_replicas"
    assert [n for n in down if n.startswith("decode-")] == [victim_name], down  # (a prefill worker may be down too)
    wait_idle(faults)
    again = asyncio.run(faults.generate_tokens(ids(7, seed=52), params.clone(max_tokens=5), "after-decode-death"))
    assert len(again.outputs[0].token_ids) == 5


# --- admission credits -------------------------------------------------------------------------
@pytest.mark.slow  # its own two worker processes (~8 s on 2 cores); default run: the credit accounting
# runs for every request of the clusters above (test_decode_worker_holds_the_pages_before_the_handoff)
def test_decode_credit_holds_requests_back(tiny_gqa):
    """A decode pool that holds one request at a time: the others wait in the front end (not on the
    prefill worker) and all finish with the single engine's outputs; a request the pool can never
    hold is refused."""
    planes, pages = 4, -(-(20 + 10) // 4)
    kw = {**BASE, "num_kv_blocks": planes * pages}
    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), prefill_workers=1, decode_workers=1, **kw))
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.6)
        reqs = {f"c{i}": (ids(20, seed=60 + i), params) for i in range(3)}

        async def main():
            tasks = [asyncio.create_task(llm.generate_tokens(p, sp, rid)) for rid, (p, sp) in reqs.items()]
            await asyncio.sleep(0)
            queued = llm.client.num_queued
            credits = []
            while not all(t.done() for t in tasks):
                credits.append(min(llm.client.decode_credit.values()))
                await asyncio.sleep(0.002)
            return queued, credits, {t.result().request_id: t.result() for t in tasks}

        queued, credits, outs = asyncio.run(main())
        assert queued == 2 and min(credits) >= 0
        engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), kv_layout="last_exited", **BASE))
        for rid, (prompt, p) in reqs.items():
            engine.add_request(rid, {"prompt_token_ids": prompt}, p)
        ref = {}
        while engine.has_unfinished_requests():
            ref.update((o.request_id, o) for o in engine.step() if o.finished)
        assert approx_floats({k: result(v) for k, v in outs.items()}) == {k: result(v) for k, v in ref.items()}
        with pytest.raises(InvalidRequestError) as e:
            asyncio.run(llm.generate_tokens(ids(20, seed=1), params.clone(max_tokens=100), "too-big"))
        assert e.value.param == "max_tokens"
        wait_idle(llm)
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_1p1d_over_cuda_ipc_on_one_gpu(tiny_gqa):
    """Two workers on one GPU, pages over CUDA IPC: the single engine's outputs, requests one at a
    time (the same step shapes on both sides, so the same kernels)."""
    kw = {**BASE, "device": "cuda", "gpu_memory_utilization": 0.3}
    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), prefill_workers=1, decode_workers=1, **kw))
    try:
        assert llm.client.transport == "cuda_ipc"
        outs = {rid: asyncio.run(generate_all(llm, {rid: req}))[rid] for rid, req in workload().items()}
        # a pool of its own size: the two workers already hold the utilization share
        engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), **{**kw, "num_kv_blocks": 512}))
        ref = {}
        for rid, (prompt, params) in workload().items():
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            while engine.has_unfinished_requests():
                ref.update((o.request_id, o) for o in engine.step() if o.finished)
        assert {k: result(v)[:3] for k, v in outs.items()} == {k: result(v)[:3] for k, v in ref.items()}
        assert llm.client.num_pieces >= llm.client.num_handoffs == 4
        wait_idle(llm)
    finally:
        llm.shutdown()
