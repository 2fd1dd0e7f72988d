"""AsyncLLM: one engine thread shared by many asyncio callers."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loopline import AsyncLLM, SamplingParams
from loopline.errors import EngineDeadError
from loopline.errors import CapacityError, InvalidRequestError


def in_thread(args) -> AsyncLLM:
    """An AsyncLLM whose engine loop runs on a thread of this process (the test reads ``llm.engine``)."""
    from loopline.engine import LLMEngine

    return AsyncLLM(engine=LLMEngine(args))


PROMPT = "The river town woke slowly."


def run(coro):
    return asyncio.run(coro)


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, rid: str):
    outs = [out async for out in llm.generate(prompt, params, rid)]
    return outs


async def wait_until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_generate_streams_cumulative_outputs_matching_llm(async_llm, tiny_gqa):
    params = SamplingParams(max_tokens=6, seed=3, ignore_eos=True)
    outs = run(collect(async_llm, PROMPT, params, "a-1"))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    final = outs[-1].outputs[0]
    assert len(final.exit_depths) == 6 and final.finish_reason == "length"
    offline = tiny_gqa.llm(max_num_seqs=4, max_model_len=256).generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert final.token_ids == offline.token_ids and final.text == offline.text


def test_concurrent_generates_share_the_engine(async_llm):
    async def main():
        params = [SamplingParams(max_tokens=4 + i, seed=i, ignore_eos=True) for i in range(4)]
        return await asyncio.gather(*(collect(async_llm, PROMPT, p, f"c-{i}") for i, p in enumerate(params)))

    results = run(main())
    assert [len(r[-1].outputs[0].token_ids) for r in results] == [4, 5, 6, 7]
    assert async_llm.snapshot.kv_used_blocks == 0


@pytest.mark.parametrize("prompt,params,error,param", [
    ("", SamplingParams(max_tokens=2), InvalidRequestError, "prompt"),
    ([10**9], SamplingParams(max_tokens=2), InvalidRequestError, "prompt_token_ids"),
    ("word " * 400, SamplingParams(max_tokens=2), CapacityError, "prompt"),
    (PROMPT, SamplingParams(max_tokens=2, max_loops=9), InvalidRequestError, "max_loops"),
])
def test_validation_errors_reach_the_caller_unchanged(async_llm, prompt, params, error, param):
    with pytest.raises(error) as info:
        run(collect(async_llm, prompt, params, "bad"))
    assert info.value.param == param
    # the engine keeps serving, and the failed id is free again
    outs = run(collect(async_llm, PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), "bad"))
    assert outs[-1].finished


def test_duplicate_request_id_is_rejected(async_llm):
    async def main():
        gen = async_llm.generate(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await gen.__anext__()
        try:
            with pytest.raises(InvalidRequestError):
                await collect(async_llm, PROMPT, SamplingParams(max_tokens=2), "dup")
        finally:
            await gen.aclose()

    run(main())


def test_stopping_early_aborts_and_frees_kv(async_llm):
    async def main():
        gen = async_llm.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), "early")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()
        await wait_until(lambda: async_llm.snapshot.kv_used_blocks == 0 and async_llm.snapshot.num_running == 0)

    run(main())
    assert async_llm.snapshot.kv_used_blocks == 0


def test_abort_finishes_the_stream_with_abort(async_llm):
    async def main():
        outs = []
        async for out in async_llm.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), "ab"):
            outs.append(out)
            if len(outs) == 2:
                await async_llm.abort("ab")
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200


def test_cancelled_consumer_aborts(async_llm):
    async def main():
        async def consume():
            async for _ in async_llm.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), "cancel"):
                pass

        task = asyncio.ensure_future(consume())
        await wait_until(lambda: async_llm.snapshot.num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: async_llm.snapshot.kv_used_blocks == 0 and async_llm.snapshot.num_running == 0)

    run(main())


def test_shutdown_aborts_in_flight_and_refuses_new_work(make_engine_args):
    llm = in_thread(make_engine_args())

    async def main():
        outs = []
        async for out in llm.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), "s"):
            outs.append(out)
            if len(outs) == 1:
                await asyncio.to_thread(llm.shutdown)
        assert outs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await collect(llm, PROMPT, SamplingParams(max_tokens=2), "after")

    run(main())
    assert not llm.is_running and llm.engine.kv.num_used_blocks == 0


def _inject_step_failures(llm, failures, when=None, delay_s: float = 0.0):
    """Makes ``llm.engine.step_deltas`` (the engine loop's step) raise ``failures.pop(0)`` while the list
    is not empty, in steps where ``when()`` holds (default: every step; the loop may also step an empty
    engine, where a failure reaches no request). Until then each step waits ``delay_s`` first, so a request cannot finish
    before the condition comes true on a fast machine."""
    real = llm.engine.step_deltas
    when = when or (lambda: True)

    def step():
        if failures and when():
            raise failures.pop(0)
        if failures and delay_s:
            time.sleep(delay_s)
        return real()

    llm.engine.step_deltas = step


def test_an_unattributable_step_error_fails_the_requests_in_flight_and_the_engine_keeps_serving(make_engine_args):
    from loopline.errors import EngineInternalError

    llm = in_thread(make_engine_args())
    try:
        async def main():
            ok = await collect(llm, PROMPT, SamplingParams(max_tokens=2), "warm")
            assert ok[-1].finished
            _inject_step_failures(llm, [RuntimeError("secret internal detail")])
            with pytest.raises(EngineInternalError) as info:
                await collect(llm, PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), "x")
            assert "secret" not in str(info.value) and info.value.error_id in str(info.value)
            after = await collect(llm, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), "y")
            assert len(after[-1].outputs[0].token_ids) == 3

        run(main())
        assert llm.is_running and llm.health_problem() is None and llm.engine.kv.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_an_attributed_step_error_fails_only_the_named_request(make_engine_args):
    from loopline.errors import EngineInternalError, RequestFailedError

    llm = in_thread(make_engine_args())
    try:
        async def main():
            bad = asyncio.ensure_future(collect(llm, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), "bad"))
            good = asyncio.ensure_future(collect(llm, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), "good"))
            while llm.snapshot.num_running < 2:
                await asyncio.sleep(0.001)
            _inject_step_failures(llm, [RequestFailedError("staging failed for request bad", ["bad"])])
            with pytest.raises(EngineInternalError):
                await bad
            outs = await good
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40

        run(main())
        assert llm.is_running and llm.engine.kv.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_a_step_that_keeps_failing_stops_the_engine_and_health_says_so(make_engine_args, serve_app):
    llm = in_thread(make_engine_args())
    # only steps with a request fail: the engine loop's steps of an empty engine in between must not
    # reset the count of failures in a row
    _inject_step_failures(llm, [RuntimeError("boom")] * 100, when=llm.engine.has_runnable_requests)
    for i in range(3):  # each request fails; the third consecutive failure is an engine fault
        with pytest.raises(Exception):
            run(collect(llm, PROMPT, SamplingParams(max_tokens=2), f"x{i}"))
    deadline = time.monotonic() + 10
    while llm.is_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.errored and not llm.is_running and "error id" in llm.health_problem()
    with pytest.raises(EngineDeadError):  # later callers get an error at once, never hang
        run(collect(llm, PROMPT, SamplingParams(max_tokens=2), "y"))
    from loopline.entrypoints.openai.api_server import build_app

    srv = serve_app(build_app(llm, "m"))
    health = httpx.get(srv.base_url + "/health")
    assert health.status_code == 503 and "error id" in health.json()["error"]["message"]
    assert "boom" not in health.text
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"


def test_a_device_fault_stops_the_engine_at_once(make_engine_args):
    llm = in_thread(make_engine_args())
    _inject_step_failures(llm, [RuntimeError("CUDA error: an illegal memory access was encountered")])
    with pytest.raises(EngineDeadError):
        run(collect(llm, PROMPT, SamplingParams(max_tokens=2), "x"))
    assert llm.errored and "stopped" in llm.health_problem()


def test_a_user_id_never_collides_with_a_choice_id(make_engine_args):
    """The engine names every choice ``id#i`` (n = 1 too), so ``x`` with n=2 and a request named ``x#0``
    are different requests and run side by side."""
    llm = in_thread(make_engine_args())
    try:
        async def main():
            two = await llm.add_request("x", PROMPT, SamplingParams(n=2, max_tokens=30, ignore_eos=True))
            one = await collect(llm, PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), "x#0")
            assert len(one[-1].outputs[0].token_ids) == 2
            while not (outs := await two.get())[-1].finished:
                pass
            assert [len(c.token_ids) for c in outs[-1].outputs] == [30, 30]

        run(main())
        assert llm.is_running and llm.engine.kv.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_async_scheduling_engine_behind_asyncllm(make_engine_args, tiny_gqa):
    llm = in_thread(make_engine_args(async_scheduling=True))
    try:
        async def main():
            params = [SamplingParams(max_tokens=5 + i, seed=i, ignore_eos=True, exit_threshold=0.7) for i in range(3)]
            return await asyncio.gather(*(collect(llm, PROMPT, p, f"as-{i}") for i, p in enumerate(params)))

        results = run(main())
        offline = tiny_gqa.llm(max_num_seqs=4, max_model_len=256).generate(
            [PROMPT] * 3, [SamplingParams(max_tokens=5 + i, seed=i, ignore_eos=True, exit_threshold=0.7)
                           for i in range(3)], use_tqdm=False)
        for res, off in zip(results, offline):
            got = res[-1].outputs[0]
            assert res[-1].finished and (got.token_ids, got.exit_depths) == (off.outputs[0].token_ids,
                                                                             off.outputs[0].exit_depths)
        assert llm.engine.kv.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_http_a_failed_step_is_a_500_with_an_id_and_the_server_keeps_serving(make_engine_args, serve_app):
    from loopline.entrypoints.openai.api_server import build_app

    llm = in_thread(make_engine_args())
    try:
        srv = serve_app(build_app(llm, "m", shutdown_engine=False))
        runnable = llm.engine.has_runnable_requests  # a failure must reach the request, not an empty step
        _inject_step_failures(llm, [RuntimeError("secret internal detail")], when=runnable)
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        err = r.json()["error"]
        assert r.status_code == 500 and err["code"] == "internal_error" and "error id" in err["message"]
        assert "secret" not in r.text
        _inject_step_failures(llm, [RuntimeError("secret internal detail")], when=runnable)
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and '"internal_error"' in events[-2] and "secret" not in r.text
        assert httpx.get(srv.base_url + "/health").status_code == 200
        ok = httpx.post(srv.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        llm.shutdown()


def test_a_step_error_spares_the_requests_a_pause_holds_back(make_engine_args):
    from loopline.errors import EngineInternalError

    llm = in_thread(make_engine_args())
    try:
        async def main():
            # the step fails once a request is held, and runs slowly until then: "running" is still
            # in flight when it fails, however fast the machine
            _inject_step_failures(llm, [RuntimeError("boom")], when=lambda: bool(llm.engine.control.held),
                                  delay_s=0.005)
            running = await llm.add_request("running", PROMPT, SamplingParams(max_tokens=60, ignore_eos=True))
            pause = asyncio.ensure_future(llm.pause_generation("wait"))
            while not llm.engine.is_paused:
                await asyncio.sleep(0.001)
            held = asyncio.ensure_future(collect(llm, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), "held"))
            with pytest.raises(EngineInternalError):
                while True:
                    await running.get()
            await pause  # nothing left in flight: the pause is in force
            await llm.resume_generation()
            outs = await held
            assert len(outs[-1].outputs[0].token_ids) == 3

        run(main())
    finally:
        llm.shutdown()


def test_add_requests_is_all_or_none_and_a_cancelled_add_aborts_every_prompt(make_engine_args):
    llm = in_thread(make_engine_args())
    try:
        async def main():
            params = SamplingParams(max_tokens=50, ignore_eos=True)
            batch = [(f"b{i}", [5, 6, 7], params) for i in range(200)]
            with pytest.raises(InvalidRequestError):  # one bad prompt: none of them is accepted
                await llm.add_requests(batch + [("bad", [10**9], params)])
            assert llm.engine.get_num_unfinished_requests() == 0
            real_add = llm.engine.add_request

            def slow_add(*args, **kwargs):  # 2,000 adds take ~2 s: the caller leaves half way
                time.sleep(0.001)
                return real_add(*args, **kwargs)

            llm.engine.add_request = slow_add
            task = asyncio.ensure_future(llm.add_requests([(f"c{i}", PROMPT, params) for i in range(2000)]))
            while llm.engine.get_num_unfinished_requests() < 10:  # the engine thread is adding them
                await asyncio.sleep(0.001)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 10
            while llm.engine.get_num_unfinished_requests() or llm.engine.kv.num_used_blocks:
                assert time.monotonic() < deadline, llm.engine.get_num_unfinished_requests()
                await asyncio.sleep(0.01)

        run(main())
        assert llm.is_running
    finally:
        llm.shutdown()


def _fail_one_request(monkeypatch, max_tokens: int, at_token: int = 5) -> None:
    """An engine bug for the requests with this ``max_tokens``: booking their ``at_token``-th token raises
    (in the output processor: detokenization and stop strings)."""
    from loopline.engine.output_processor import OutputProcessor

    real = OutputProcessor.on_token

    def on_token(self, req, weight_version=None, check_stop=True):
        if req.params.max_tokens == max_tokens and req.num_output_tokens == at_token:
            raise RuntimeError("secret internal detail")
        return real(self, req, weight_version, check_stop)

    monkeypatch.setattr(OutputProcessor, "on_token", on_token)


def _wait_for_no_kv(llm: AsyncLLM) -> None:
    deadline = time.monotonic() + 10
    while llm.engine.kv.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.engine.kv.num_used_blocks == 0


def test_an_engine_bug_in_one_request_fails_it_alone(make_engine_args, tiny_gqa, monkeypatch):
    """The failing request raises EngineInternalError (an id, no internals); the requests sharing its
    steps finish exactly as each does alone; no KV is left in use and the engine serves on."""
    from loopline.errors import EngineInternalError

    _fail_one_request(monkeypatch, max_tokens=61)
    good = [SamplingParams(max_tokens=30 + 4 * i, seed=i, ignore_eos=True, exit_threshold=0.7) for i in range(3)]
    llm = in_thread(make_engine_args())  # the fault is patched into this process's engine
    try:
        async def main():
            bad = asyncio.ensure_future(collect(llm, PROMPT, SamplingParams(max_tokens=61, ignore_eos=True), "bad"))
            goods = [asyncio.ensure_future(collect(llm, PROMPT, p, f"good-{i}")) for i, p in enumerate(good)]
            with pytest.raises(EngineInternalError) as info:
                await bad
            assert "secret" not in str(info.value) and info.value.error_id in str(info.value)
            return [(await g)[-1] for g in goods]

        results = run(main())
        _wait_for_no_kv(llm)
        assert llm.is_running and llm.health_problem() is None and llm.engine.stats.failed_requests == 1
    finally:
        llm.shutdown()
    serial = tiny_gqa.llm(max_num_seqs=4, max_model_len=256)
    for out, p in zip(results, good):
        alone = serial.generate(PROMPT, p, use_tqdm=False)[0].outputs[0]
        got = out.outputs[0]
        assert out.finished and (got.token_ids, got.exit_depths, got.text, got.finish_reason) == \
            (alone.token_ids, alone.exit_depths, alone.text, "length")


@pytest.mark.slow  # an engine process and a server (~5 s on 2 cores); default run:
# test_an_engine_bug_in_one_request_fails_it_alone, and over HTTP
# test_http_a_failed_step_is_a_500_with_an_id_and_the_server_keeps_serving
def test_http_an_engine_bug_in_one_request_is_its_500_and_the_others_finish(make_engine_args, serve_app, monkeypatch):
    """Over HTTP, concurrently: the failing request gets a 500 (non-streamed) or an in-band error then
    [DONE] (streamed), naming only an error id; the others answer exactly as each does alone."""
    import concurrent.futures

    from loopline.entrypoints.openai.api_server import build_app

    _fail_one_request(monkeypatch, max_tokens=61)
    llm = in_thread(make_engine_args())  # the fault is patched into this process's engine
    try:
        srv = serve_app(build_app(llm, "m", shutdown_engine=False))
        url = srv.base_url + "/v1/completions"
        good = [{"prompt": PROMPT, "max_tokens": 30 + 4 * i, "seed": i, "ignore_eos": True, "return_token_ids": True}
                for i in range(3)]
        bad = {"prompt": PROMPT, "max_tokens": 61, "ignore_eos": True}

        def post(body):
            return httpx.post(url, json=body, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(post, b) for b in [bad, {**bad, "stream": True}, *good]]
            answers = [f.result() for f in futures]
        r = answers[0]
        err = r.json()["error"]
        assert r.status_code == 500 and err["code"] == "internal_error" and "error id" in err["message"]
        events = [e for e in answers[1].text.split("\n\n") if e]
        assert answers[1].status_code == 200 and events[-1] == "data: [DONE]" and '"internal_error"' in events[-2]
        assert "secret" not in r.text + answers[1].text
        for body, r in zip(good, answers[2:]):
            alone = post(body)  # serially, on the same server
            assert r.status_code == 200 == alone.status_code
            got, want = r.json()["choices"][0], alone.json()["choices"][0]
            assert (got["text"], got["token_ids"], got["finish_reason"]) == \
                (want["text"], want["token_ids"], "length")
        _wait_for_no_kv(llm)
        assert llm.is_running and httpx.get(srv.base_url + "/health").status_code == 200
    finally:
        llm.shutdown()
