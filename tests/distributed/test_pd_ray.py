"""Prefill/decode disaggregation over Ray (``--distributed-executor-backend ray``) on the CPU: each
worker a Ray actor in one placement group (a CPU bundle each), KV pages over gloo in a group that
meets at the rank-0 worker's node address. 1P1D gives exactly the single engine's outputs; killed
worker actors (prefill, decode) fail only their requests and the rest keeps serving; bad combinations are refused.
Skipped when ``ray`` is not installed (``pip install 'loopline[ray]'``)."""
from __future__ import annotations

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")

from matching import approx_floats  # noqa: E402
from distributed.test_pd import BASE, generate_all, ids, result, single_engine, wait_idle, workload  # noqa: E402
from loopline import AsyncLLM, EngineArgs, SamplingParams  # noqa: E402
from loopline.errors import EngineDeadError, InvalidRequestError  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, object_store_memory=100 * 2**20)
    yield
    ray.shutdown()


def live_groups() -> list[dict]:
    from ray.util import placement_group_table
    return [g for g in placement_group_table().values() if g["state"] == "CREATED"]


def pd_args(tiny, **kw) -> EngineArgs:
    return EngineArgs(model=str(tiny.path), distributed_executor_backend="ray", **{**BASE, **kw})


def test_1p1d_over_ray_gives_the_single_engines_tokens_and_exit_depths(cluster, tiny_gqa):
    llm = AsyncLLM(pd_args(tiny_gqa, prefill_workers=1, decode_workers=1))
    try:
        client = llm.client
        assert client.transport == "gloo"
        assert [list(g["bundles"].values()) for g in live_groups()] == [[{"CPU": 1.0}, {"CPU": 1.0}]]
        # the group meets where Ray says the rank-0 worker's node is, not on the loopback interface
        assert client.init_method.startswith(f"tcp://{ray.util.get_node_ip_address()}:")
        assert [type(w).__name__ for w in client.workers] == ["RayWorker", "RayWorker"]
        outs = asyncio.run(generate_all(llm, workload()))
        ref = single_engine(tiny_gqa, "last_exited")
        assert approx_floats({k: result(v) for k, v in outs.items()}) == {k: result(v) for k, v in ref.items()}
        assert len({d for o in ref.values() for d in o.outputs[0].exit_depths}) > 1  # adaptive exits vary
        assert client.num_handoffs == 4 and client.num_pieces > client.num_handoffs  # pages left chunk by chunk
        assert all(s.kv_used_blocks == 0 for s in wait_idle(llm))
    finally:
        llm.shutdown(10)
    assert not live_groups()  # the placement group was released


@pytest.mark.timeout(300)
def test_killed_worker_actors_fail_only_their_requests(cluster, tiny_gqa, serve_app):
    """2P2D: the single engine's outputs; a prefill worker's actor killed mid-chunk, then a decode worker's mid-stream: each fails
    only its requests, the others finish, no KV page leaks, the server keeps serving (/health 200,
    as with worker processes); once no decode worker is left, /health is 503 and requests are refused."""
    import httpx
    from loopline.entrypoints.openai.api_server import build_app

    llm = AsyncLLM(pd_args(tiny_gqa, prefill_workers=2, decode_workers=2, kv_transfer_timeout=20))
    srv = serve_app(build_app(llm, "t", shutdown_engine=False))
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    client = llm.client

    async def prefill_death():
        short = params.clone(max_tokens=8)
        doomed = asyncio.create_task(llm.generate_tokens(ids(200, seed=40), short, "doomed"))  # ~40 chunks
        while (placed := client.placement("doomed")) is None:
            await asyncio.sleep(0.001)
        victim = placed.prefill
        other = asyncio.create_task(llm.generate_tokens(ids(12, seed=41), short, "other"))
        while (placed := client.placement("other")) is None:
            await asyncio.sleep(0.001)
        assert placed.prefill is not victim  # least-loaded prefill worker
        ray.kill(victim.actor)
        with pytest.raises(EngineDeadError, match="prefill worker"):
            await doomed
        return await other, victim

    async def main():
        seen, other = [], None
        with pytest.raises(EngineDeadError, match="decode worker"):
            async for out in llm.generate({"prompt_token_ids": ids(10, seed=50)}, params, "streaming"):
                seen.append(len(out.outputs[0].token_ids))
                placed = client.placement("streaming")
                if other is None:
                    other = asyncio.create_task(llm.generate_tokens(ids(11, seed=51), params.clone(max_tokens=30),
                                                                    "survivor"))
                if placed is not None and placed.on_decode and out.outputs[0].token_ids[1:] and \
                        (survivor := client.placement("survivor")) is not None:
                    victim = placed.decode
                    assert survivor.decode is not victim  # the other had more credit
                    ray.kill(victim.actor)
        return seen, await other, victim

    try:
        # the outputs of one engine across 4 actors; the transport group forms meanwhile (NOTE: before it has
        # formed, killing rank 0, which holds its store, stalls the others' join up to JOIN_TIMEOUT_S)
        outs = asyncio.run(generate_all(llm, workload()))
        ref = single_engine(tiny_gqa, "last_exited")
        assert approx_floats({k: result(v) for k, v in outs.items()}) == {k: result(v) for k, v in ref.items()}
        assert {client.placement(k) for k in outs} == {None}  # released
        wait_idle(llm)
        other, dead_prefill = asyncio.run(prefill_death())
        assert len(other.outputs[0].token_ids) == 8 and not dead_prefill.alive and llm.health_problem() is None
        wait_idle(llm)
        seen, survivor, victim = asyncio.run(main())
        assert max(seen) < 120 and len(survivor.outputs[0].token_ids) == 30
        assert not victim.alive and llm.health_problem() is None  # degraded, still serving
        wait_idle(llm)
        again = asyncio.run(llm.generate_tokens(ids(7, seed=52), params.clone(max_tokens=5), "after-death"))
        assert len(again.outputs[0].token_ids) == 5
        last = client.decode[1 - victim.index]
        assert last.alive and client.prefill[1 - dead_prefill.index].alive
        assert httpx.get(srv.base_url + "/health").status_code == 200
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "t", "prompt": [5, 6, 7], "max_tokens": 3,
                                                               "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        ray.kill(last.actor)  # no decode worker left: the engine is dead
        deadline = time.monotonic() + 30
        while llm.health_problem() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "no decode worker is left" in llm.health_problem()
        assert httpx.get(srv.base_url + "/health").status_code == 503
        with pytest.raises(EngineDeadError):
            asyncio.run(llm.generate_tokens([5, 6], params.clone(max_tokens=2), "refused"))
    finally:
        llm.shutdown(10)
    assert not live_groups()


def test_bad_combinations_are_refused(cluster, tiny_gqa):
    # no worker starts for these: refused by validation
    for kw, param, match in [
        (dict(kv_transport="cuda_ipc"), "kv_transport", "one GPU"),
        (dict(data_parallel_size=2), "prefill_workers", "data_parallel_size must be 1"),
    ]:
        with pytest.raises(InvalidRequestError, match=match) as e:
            pd_args(tiny_gqa, prefill_workers=1, decode_workers=1, **kw).validate()
        assert e.value.param == param
    # CPU bundles cannot carry nccl: refused before any actor starts, the placement group freed
    with pytest.raises(InvalidRequestError, match="needs the workers on CUDA devices") as e:
        AsyncLLM(pd_args(tiny_gqa, prefill_workers=1, decode_workers=1, kv_transport="nccl"))
    assert e.value.param == "kv_transport" and not live_groups()
    # more bundles than the cluster has: a clear error naming the option
    from loopline.distributed.ray_backend import RayWorkerPool
    with pytest.raises(InvalidRequestError, match="cannot place 5 bundle") as e:
        RayWorkerPool(pd_args(tiny_gqa, prefill_workers=2, decode_workers=3), placement_timeout=2)
    assert e.value.param == "prefill_workers" and not live_groups()
