"""Data-parallel replicas (two engine processes) behind one AsyncLLM: each request gets exactly what
one engine gives it, aborts reach the owning replica, control calls fan out, /metrics carries the
replica label, and a killed replica fails only its own requests."""
from __future__ import annotations

import asyncio
import concurrent.futures
import re
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from loopline import AsyncLLM, SamplingParams
from loopline.distributed.dp import DPClient
from loopline.engine import LLMEngine
from loopline.runtime.client import EngineClient
from loopline.errors import EngineDeadError, EngineStateError, InvalidRequestError, WeightUpdateError
from loopline.outputs import RequestOutput

CASES = {
    "greedy": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, logprobs=0),
    "n3-logprobs": SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=3, logprobs=3, ignore_eos=True),
    "stop": SamplingParams(max_tokens=40, temperature=1.0, seed=5, stop=["e", "th"], ignore_eos=True),
    "prompt-logprobs": SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, logprobs=0, ignore_eos=True),
    "adaptive-exit": SamplingParams(max_tokens=10, temperature=0.0, exit_threshold=0.5, ignore_eos=True),
}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def one(make_engine_args):
    """The reference: one engine (on a thread of this process)."""
    llm = AsyncLLM(engine=LLMEngine(make_engine_args()))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp(make_engine_args):
    """Two replicas (engine processes); ``dp.picks`` records the replica chosen for every request."""
    llm = AsyncLLM(make_engine_args(data_parallel_size=2))
    client = llm.client
    assert isinstance(client, DPClient) and len(llm.replicas()) == 2
    llm.picks = []
    choose = client.router.choose
    client.router.choose = lambda ids, loads: llm.picks.append(choose(ids, loads)) or llm.picks[-1]
    yield llm
    llm.shutdown()


def fields(out: RequestOutput, seeded: bool) -> tuple:
    """Everything a request gets back, but the seed drawn for an unseeded request (replica i draws
    from engine seed + i, so that replicas never hand out the same seeds)."""
    comps = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason,
              c.exit_depths, c.seed if seeded else None, c.weight_versions, c.error_id) for c in out.outputs]
    return (out.request_id, out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.prompt_exit_depths, comps,
            out.finished, out.weight_version)


async def final(llm: AsyncLLM, prompt, params: SamplingParams, rid: str) -> RequestOutput:
    outs = [out async for out in llm.generate(prompt, params, rid)]
    return outs[-1]


def test_each_request_gets_exactly_what_one_engine_gives_it(dp, one):
    """One request at a time (so each engine runs the same batches): every field equal, and the
    requests alternate between the replicas."""
    picks = len(dp.picks)
    for k, (case, params) in enumerate(CASES.items()):
        prompt = f"The river town {k} woke slowly."
        got, want = run(final(dp, prompt, params, case)), run(final(one, prompt, params, case))
        assert fields(got, params.seed is not None) == fields(want, params.seed is not None), case
    assert set(dp.picks[picks:]) == {0, 1}


def test_concurrent_requests_spread_over_replicas_with_the_same_tokens(dp, one):
    params = [SamplingParams(max_tokens=6 + i, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True, logprobs=1)
              for i in range(8)]

    async def main(llm):
        return await asyncio.gather(*(llm.generate_tokens([5 + i] * (3 + i), p, f"c-{i}") for i, p in enumerate(params)))

    picks = len(dp.picks)
    got, want = run(main(dp)), run(main(one))
    assert sorted(dp.picks[picks:]).count(0) == 4  # 8 requests on an idle pool: 4 each
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].exit_depths == w.outputs[0].exit_depths
        # other requests share the batch: the same tokens, logprobs equal to float32 rounding
        assert g.outputs[0].token_logprobs == pytest.approx(w.outputs[0].token_logprobs, abs=1e-4)
    assert dp.snapshot.kv_used_blocks == 0 and dp.snapshot.num_unfinished == 0


def test_prefix_affinity_sends_a_shared_prefix_to_one_replica(dp):
    prefix = list(range(20, 52))  # two full pages of 16 tokens
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def main():
        for i in range(4):
            await dp.generate_tokens(prefix + [60 + i], params, f"aff-{i}")

    picks = len(dp.picks)
    run(main())
    assert len(set(dp.picks[picks:])) == 1


def test_abort_reaches_the_replica_that_owns_the_request(dp):
    async def main():
        outs = []
        async for out in dp.generate([7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True), "ab"):
            outs.append(out)
            if len(out.outputs[0].token_ids) >= 2 and not out.finished:
                assert dp.client.owner("ab") in (0, 1)
                await dp.abort("ab")
        with pytest.raises(InvalidRequestError) as info:  # validation errors cross unchanged
            await dp.add_request("bad", [1, 2], SamplingParams(max_tokens=-1))
        return outs, info.value

    outs, error = run(main())
    final_out = outs[-1].outputs[0]
    assert outs[-1].finished and final_out.finish_reason == "abort" and 2 <= len(final_out.token_ids) < 200
    assert error.param == "max_tokens"
    assert dp.client.owner("ab") is None
    assert all(r.snapshot.kv_used_blocks == 0 for r in dp.replicas())


def test_a_multi_prompt_add_is_all_or_none_across_replicas(dp):
    good, bad = SamplingParams(max_tokens=50, ignore_eos=True), SamplingParams(max_tokens=10_000)

    async def main():
        with pytest.raises(InvalidRequestError):  # the second one is longer than the context
            await dp.add_requests([("m-0", [3, 4, 5], good), ("m-1", [6, 7, 8], bad)])
        await asyncio.sleep(0.2)  # the abort of m-0, if it was accepted, reaches its replica

    run(main())
    assert dp.client.owner("m-0") is None and dp.client.owner("m-1") is None
    assert all(r.snapshot.num_unfinished == 0 and r.snapshot.kv_used_blocks == 0 for r in dp.replicas())


def test_control_calls_fan_out_to_every_replica(dp, one, tiny_factory, tiny_gqa):
    new, old = tiny_factory(3), tiny_gqa
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)

    async def publish(llm, state, version):
        await llm.pause_generation("abort")
        assert await llm.is_paused() is True
        await llm.start_weight_update(version)
        assert await llm.update_weights(state) == len(state)
        assert await llm.finish_weight_update() == version
        await llm.resume_generation()

    async def main(llm):
        await publish(llm, new.state_dict, 1)
        after = [await llm.generate_tokens([5, 17, 42, 99 + i], params) for i in range(2)]
        version = await llm.get_weight_version()
        await publish(llm, old.state_dict, 2)  # the module's other tests keep the original weights
        return after, version

    (got, v_dp), (want, _) = run(main(dp)), run(main(one))
    assert v_dp == 1 and [o.weight_version for o in got] == [1, 1]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(r.snapshot.weights_state == "committed" and not r.snapshot.is_paused for r in dp.replicas())

    async def rejected():
        await dp.start_weight_update(3)
        try:
            with pytest.raises(WeightUpdateError) as info:
                await dp.update_weights({"model.no_such.weight": old.state_dict["lm_head.weight"]})
        finally:
            await dp.abort_weight_update()
        return info.value, await dp.get_weight_version()

    error, version = run(rejected())
    assert re.match(r"data-parallel replica [01]: ", str(error)) and version == 2
    assert dp.health_problem() is None


def test_an_update_from_disk_reaches_every_replica_beside_the_requests_in_flight(dp, tiny_factory, tiny_gqa):
    """Each replica reads the checkpoint while its request generates and swaps once it finished: the requests
    in flight keep the old version throughout, the next one has the new version on whichever replica."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def main():
        v = await dp.get_weight_version()
        busy = [asyncio.ensure_future(dp.generate_tokens([5, 17, 42, 99 + i], params)) for i in range(2)]
        deadline = time.monotonic() + 30
        while sum(r.snapshot.num_running for r in dp.replicas()) < 2:  # both are generating when the call comes
            assert time.monotonic() < deadline
            await asyncio.sleep(0.002)
        version = await dp.update_weights_from_disk(str(tiny_factory(3).path), v + 1)
        outs = await asyncio.gather(*busy)
        after = [await dp.generate_tokens([7, 8, 9 + i], params.clone(max_tokens=2)) for i in range(2)]
        await dp.update_weights_from_disk(str(tiny_gqa.path), v + 2)  # the module's other tests keep the original weights
        return v, version, outs, after

    v, version, outs, after = run(main())
    assert version == v + 1 and all(set(o.outputs[0].weight_versions) == {v} for o in outs)
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs) and [o.weight_version for o in after] == [v + 1] * 2
    assert all(r.snapshot.weights_state == "committed" for r in dp.replicas()) and dp.health_problem() is None


class _Fake(EngineClient):
    """A replica that answers control calls with a fixed result or error."""

    def __init__(self, result=None, error=None) -> None:
        super().__init__()
        self.info = SimpleNamespace(config=SimpleNamespace(block_size=16))
        self.result, self.error = result, error

    def call(self, name, args=(), until_drained=False) -> concurrent.futures.Future:
        f = concurrent.futures.Future()
        f.set_exception(self.error) if self.error is not None else f.set_result(self.result)
        return f

    def is_alive(self) -> bool:
        return self.dead is None

    def add(self, requests, chat_stop, stream, ack) -> None:
        """Accepts; a replica built with ``die_on_add`` dies instead, before taking anything."""
        self.added = getattr(self, "added", []) + [rid for rid, _, _ in requests]
        if self.result == "die_on_add":
            self.dead = EngineDeadError("the engine process exited unexpectedly")
            ack.get_loop().call_soon(ack.set_exception, self.dead)
        else:
            ack.get_loop().call_soon(ack.set_result, None)


def test_a_share_whose_replica_died_before_taking_it_goes_to_a_live_one():
    dying, live = _Fake("die_on_add"), _Fake()
    dp = DPClient([dying, live])

    async def main(rid):
        ack = asyncio.get_running_loop().create_future()
        dp.add([(rid, [1, 2, 3], SamplingParams())], False, object(), ack)
        await ack

    run(main("x"))
    assert dying.added == ["x"] and live.added == ["x"] and dp.owner("x") == 1
    with pytest.raises(EngineDeadError, match="every data-parallel replica stopped"):  # the last one dies too
        live.result = "die_on_add"
        run(main("y"))
    assert dp.owner("y") is None and dp.dead is not None


def test_fan_out_results_agree_concatenate_or_fail():
    assert DPClient([_Fake(3), _Fake(3)]).call("get_weight_version").result() == 3
    assert DPClient([_Fake(["a"]), _Fake(["b"])]).call("abort_all").result() == ["a", "b"]
    with pytest.raises(EngineStateError, match="disagree on get_weight_version: replica 0: 3, replica 1: 4"):
        DPClient([_Fake(3), _Fake(4)]).call("get_weight_version").result()
    with pytest.raises(EngineStateError, match="^data-parallel replica 1: busy$"):
        DPClient([_Fake(None), _Fake(error=EngineStateError("busy"))]).call("resume_generation").result()


def test_dp_over_http_completions_stream_and_replica_metrics(dp, serve_app):
    from loopline.entrypoints.openai.api_server import build_app

    srv = serve_app(build_app(dp, "tiny", shutdown_engine=False))
    body = {"model": "tiny", "prompt": ["Once upon", "A cat"], "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    with httpx.stream("POST", srv.base_url + "/v1/completions", json={**body, "prompt": "Once upon", "stream": True},
                      timeout=60) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert httpx.get(srv.base_url + "/health").status_code == 200
    text = httpx.get(srv.base_url + "/metrics").text
    for name in ("loopline:num_requests_running", "loopline:kv_cache_usage_perc", "loopline:replica_healthy",
                 "loopline:prefix_cache_queries_total", "loopline:engine_steps_total"):
        for replica in ("0", "1"):
            assert re.search(rf'^{name}{{model_name="tiny",replica="{replica}"}} ', text, re.M), (name, replica)
    steps = [float(v) for v in re.findall(r'^loopline:engine_steps_total{.*replica="[01]"} (\S+)', text, re.M)]
    assert len(steps) == 2 and all(v > 0 for v in steps)  # both replicas ran steps
    # a client that disconnects mid-stream: the abort reaches the replica that runs the request
    def rows() -> float:
        text = httpx.get(srv.base_url + "/metrics").text
        return sum(float(v) for v in re.findall(r'^loopline:engine_rows_total{.*} (\S+)', text, re.M))

    rows0 = rows()
    with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                      json={**body, "prompt": "Once upon", "stream": True, "max_tokens": 200}) as s:
        next(line for line in s.iter_lines() if line.startswith("data: {"))
    deadline = time.monotonic() + 10
    while any(r.snapshot.num_unfinished or r.snapshot.kv_used_blocks for r in dp.replicas()):
        assert time.monotonic() < deadline, [r.snapshot for r in dp.replicas()]
        time.sleep(0.05)
    time.sleep(0.2)  # the last step records
    assert rows() - rows0 < 400  # 200 tokens at 4 loops would run 800 rows: it was stopped early


@pytest.mark.slow  # ~10 s on 2 cores. Default run: a killed engine process (tests/entrypoints/test_core_client.py)
# and killed PD workers (test_pd.py) fail only their requests, health names them
def test_killed_replica_fails_only_its_requests(make_engine_args, one, serve_app):
    """Replica A's process is killed mid-stream: A's request fails with a clean EngineDeadError naming
    it; B's request finishes exactly as one engine runs it; new requests go to B; /health and
    /metrics name the dead replica."""
    from loopline.entrypoints.openai.api_server import build_app

    llm = AsyncLLM(make_engine_args(data_parallel_size=2))
    srv = serve_app(build_app(llm, "t", shutdown_engine=False))
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, ignore_eos=True, logprobs=0)
    try:
        async def main():
            gens = {rid: llm.generate([11 + i, 12, 13], params, rid) for i, rid in enumerate(("a", "b"))}
            firsts = {rid: await g.__anext__() for rid, g in gens.items()}
            owners = {rid: llm.client.owner(rid) for rid in gens}
            assert sorted(owners.values()) == [0, 1]
            victim = owners["a"]
            llm.client.replicas()[victim].process.kill()
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match=rf"^data-parallel replica {victim}: "):
                async for _ in gens["a"]:
                    pass
            assert time.monotonic() - t0 < 30
            outs = [firsts["b"]] + [out async for out in gens["b"]]
            after = await llm.generate_tokens([30, 31, 32], SamplingParams(max_tokens=3, ignore_eos=True), "after")
            return victim, outs[-1], after

        victim, survivor, after = run(main())
        want = run(final(one, [12, 12, 13], params, "b"))
        # (the reference's weights were republished as version 2 by an earlier test: same tensors, another version)
        assert survivor.finished and [(c.token_ids, c.logprobs, c.exit_depths, c.finish_reason) for c in survivor.outputs] \
            == [(c.token_ids, c.logprobs, c.exit_depths, c.finish_reason) for c in want.outputs]
        assert after.finished and len(after.outputs[0].token_ids) == 3
        assert llm.is_running and llm.health_problem() is None
        problems = {r.index: r.problem for r in llm.replicas()}
        assert problems[1 - victim] is None and "exited unexpectedly" in problems[victim]
        r = httpx.get(srv.base_url + "/health")
        assert r.status_code == 200 and list(r.json()["unhealthy_replicas"]) == [str(victim)]
        text = httpx.get(srv.base_url + "/metrics").text
        assert re.search(rf'^loopline:replica_healthy{{model_name="t",replica="{victim}"}} 0\.0$', text, re.M)
        assert re.search(rf'^loopline:replica_healthy{{model_name="t",replica="{1 - victim}"}} 1\.0$', text, re.M)
        # its last snapshot still holds its request's pages; the gauges say it holds nothing now (#43)
        assert llm.client.replicas()[victim].snapshot.kv_used_blocks > 0
        assert re.search(rf'^loopline:kv_cache_used_blocks{{model_name="t",replica="{victim}"}} 0\.0$', text, re.M)
        assert re.search(rf'^vllm:num_requests_running{{engine="{victim}",model_name="t"}} 0\.0$', text, re.M)
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "t", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        assert llm.replicas()[1 - victim].snapshot.kv_used_blocks == 0
    finally:
        llm.shutdown(5)


def test_ray_backend_without_ray_is_a_clear_error(monkeypatch):
    from loopline.distributed.ray_backend import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what an absent package looks like to import
    with pytest.raises(InvalidRequestError, match=r"pip install 'loopline\[ray\]'") as info:
        import_ray()
    assert info.value.param == "distributed_executor_backend"


def test_flags_and_their_validation():
    import argparse

    from loopline.config import EngineArgs
    from loopline.entrypoints import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    ns = parser.parse_args(["serve", "--data-parallel-size", "3", "--distributed-executor-backend", "ray"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.data_parallel_size, args.distributed_executor_backend) == (3, "ray")
    for kwargs, param in ((dict(data_parallel_size=0), "data_parallel_size"),
                          (dict(data_parallel_size=2, device="cuda:1"), "device"),
                          (dict(distributed_executor_backend="slurm"), "distributed_executor_backend")):
        with pytest.raises(InvalidRequestError) as info:
            EngineArgs(**kwargs).validate()
        assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:  # one engine never silently ignores the option
        LLMEngine(EngineArgs(data_parallel_size=2, device="cpu"))
    assert info.value.param == "data_parallel_size"
