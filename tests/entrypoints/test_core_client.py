"""The engine process client (MPClient) against the in-thread one: same outputs, aborts, weight
updates through the process boundary, and a dead engine process failing everything cleanly."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loopline import AsyncLLM, SamplingParams
from loopline.engine import LLMEngine
from loopline.runtime.client import InProcClient, MPClient
from loopline.engine.deltas import CompletionDelta, OutputBuilder, OutputDelta
from loopline.errors import EngineDeadError, InvalidRequestError
from loopline.outputs import CompletionOutput, RequestOutput
from loopline.sampling_params import SamplingParams as Params

PROMPT = "The river town woke slowly."
CASES = {
    "greedy": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True),
    "n3-logprobs": SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=3, logprobs=3, ignore_eos=True),
    "stop": SamplingParams(max_tokens=40, temperature=1.0, seed=5, stop=["e", "th"], ignore_eos=True),
    "prompt-logprobs": SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, logprobs=0, ignore_eos=True),
}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def pair(make_engine_args):
    """(process client, thread client) over the same checkpoint and arguments."""
    mp = AsyncLLM(make_engine_args())
    th = AsyncLLM(engine=LLMEngine(make_engine_args()))
    assert isinstance(mp.client, MPClient) and isinstance(th.client, InProcClient)
    yield mp, th
    mp.shutdown()
    th.shutdown()


async def stream(llm: AsyncLLM, prompt, params: SamplingParams, rid: str) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params, rid)]


def fields(out: RequestOutput) -> tuple:
    comps = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason,
              c.exit_depths, c.seed, c.weight_versions, c.error_id) for c in out.outputs]
    return (out.request_id, out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.prompt_exit_depths, comps,
            out.finished, out.weight_version)


@pytest.mark.parametrize("case", list(CASES))
def test_process_client_outputs_equal_the_thread_clients(pair, case):
    mp, th = pair
    params = CASES[case]

    async def main():
        return await asyncio.gather(stream(mp, PROMPT, params, case), stream(th, PROMPT, params, case))

    outs_mp, outs_th = run(main())
    assert fields(outs_mp[-1]) == fields(outs_th[-1])
    assert outs_mp[-1].sampling_params == outs_th[-1].sampling_params
    for outs in (outs_mp, outs_th):  # each streamed output extends the one before
        for a, b in zip(outs, outs[1:]):
            for ca, cb in zip(a.outputs, b.outputs):
                assert cb.token_ids[:len(ca.token_ids)] == ca.token_ids and cb.text.startswith(ca.text)
    if case == "stop":
        assert outs_mp[-1].outputs[0].finish_reason == "stop"


def test_several_requests_at_once_match(pair):
    mp, th = pair
    params = [SamplingParams(max_tokens=5 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]

    async def main(llm):
        return await asyncio.gather(*(llm.generate_tokens([5 + i, 6, 7, 8], p, f"m-{i}") for i, p in enumerate(params)))

    assert [fields(o) for o in run(main(mp))] == [fields(o) for o in run(main(th))]
    assert mp.snapshot.kv_used_blocks == 0 and mp.snapshot.num_unfinished == 0


def test_abort_mid_stream_and_errors_cross_the_boundary(pair):
    mp, _ = pair

    async def main():
        outs = []
        async for out in mp.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), "ab"):
            outs.append(out)
            if len(out.outputs[0].token_ids) >= 2:
                await mp.abort("ab")
        with pytest.raises(InvalidRequestError) as info:
            await mp.add_request("bad", PROMPT, SamplingParams(max_tokens=-1))
        return outs, info.value

    outs, error = run(main())
    final = outs[-1].outputs[0]
    assert outs[-1].finished and final.finish_reason == "abort" and 2 <= len(final.token_ids) < 200
    assert error.param == "max_tokens"  # the typed error, with its field, through the pipe
    assert mp.snapshot.kv_used_blocks == 0 and mp.is_running and mp.health_problem() is None


def test_weight_update_through_the_process_boundary_matches_the_thread_path(pair, tiny_factory, tiny_gqa):
    mp, th = pair
    new, old = tiny_factory(3), tiny_gqa
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)

    async def publish(llm, state, version):
        await llm.pause_generation("abort")
        await llm.start_weight_update(version)
        names = sorted(state)
        assert await llm.update_weights({n: state[n] for n in names[::2]}) == len(names[::2])
        assert await llm.update_weights([(n, state[n]) for n in names[1::2]]) == len(names[1::2])
        assert await llm.finish_weight_update() == version
        await llm.resume_generation()

    async def main(llm):
        before = await llm.generate_tokens([5, 17, 42, 99], params)
        await publish(llm, new.state_dict, 1)
        after = await llm.generate_tokens([5, 17, 42, 99], params)
        assert mp.weights_state() == "committed"
        await publish(llm, old.state_dict, 2)  # the module's other tests keep the original weights
        return before, after

    (b_mp, a_mp), (b_th, a_th) = run(main(mp)), run(main(th))
    assert b_mp.outputs[0].token_ids == b_th.outputs[0].token_ids
    assert a_mp.outputs[0].token_ids != b_mp.outputs[0].token_ids and a_mp.weight_version == 1
    assert a_mp.outputs[0].token_ids == a_th.outputs[0].token_ids
    assert a_mp.outputs[0].token_logprobs == a_th.outputs[0].token_logprobs


def test_killed_engine_process_fails_every_waiter_and_health(make_engine_args, serve_app):
    from loopline.entrypoints.openai.api_server import build_app

    llm = AsyncLLM(make_engine_args())
    srv = serve_app(build_app(llm, "t", shutdown_engine=False))
    try:
        assert httpx.get(srv.base_url + "/health").status_code == 200

        async def main():
            gen = llm.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), "long")
            await gen.__anext__()
            llm.client.process.kill()
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            assert time.monotonic() - t0 < 30
            with pytest.raises(EngineDeadError):
                await llm.add_request("after", PROMPT, SamplingParams(max_tokens=2))
            with pytest.raises(EngineDeadError):
                await llm.get_weight_version()

        run(main())
        assert llm.errored and not llm.is_running
        r = httpx.get(srv.base_url + "/health")
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"]
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "t", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
    finally:
        llm.shutdown(5)


def test_deltas_rebuild_cumulative_outputs_even_when_text_changes():
    def out(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
        comp = CompletionOutput(0, text, ids, None, None, "stop" if finished else None, exit_depths=[4] * len(ids),
                                weight_versions=[0] * len(ids))
        return RequestOutput("r", "p", [1, 2], None, [comp], finished, 0)

    def encode(prev: RequestOutput | None, cur: RequestOutput) -> OutputDelta:
        """What the engine reports between two cumulative outputs (an oracle of the output processor's deltas)."""
        c, old = cur.outputs[0], prev.outputs[0] if prev else CompletionOutput(0, "", [], None, None)
        n = len(old.token_ids)
        start = len(old.text) if c.text.startswith(old.text) else 0
        comp = CompletionDelta(c.index, c.text[start:], start, c.token_ids[n:], c.exit_depths[n:], c.weight_versions[n:],
                               None, None, c.finish_reason, c.stop_reason, c.seed, c.error_id)
        head = None if prev else (cur.prompt, cur.prompt_token_ids, Params())
        return OutputDelta(cur.request_id, [comp], cur.finished, cur.weight_version, cur.metrics, head)

    asm = OutputBuilder()
    steps = [out("ab", [1]), out("abcd", [1, 2]), out("abX", [1, 2, 3]), out("abXyz", [1, 2, 3, 4], True)]
    for prev, cumulative in zip([None] + steps, steps):
        delta = encode(prev, cumulative)
        assert len(delta.outputs[0].token_ids) <= 1  # never the whole history
        rebuilt = asm.build([delta])[0]
        assert fields(rebuilt) == fields(cumulative)
    assert not len(asm)  # a finished request leaves no state


@pytest.mark.gpu
def test_cuda_weight_update_through_the_engine_process(make_engine_args, tiny_factory, tiny_gqa):
    """A trainer's CUDA tensors cross the pipe as CUDA IPC handles: the engine process on the same
    GPU reads them in place, and the new weights give what a fresh engine on them gives."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    new = tiny_factory(3)
    cuda_args = dict(device="cuda", dtype="float32", enforce_eager=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = AsyncLLM(make_engine_args(**cuda_args))
    fresh = LLMEngine(make_engine_args(model=str(new.path), **cuda_args))
    try:
        state = {n: t.to("cuda") for n, t in new.state_dict.items()}

        async def main():
            await llm.pause_generation("abort")
            await llm.start_weight_update(1)
            assert await llm.update_weights(list(state.items())) == len(state)
            assert await llm.finish_weight_update() == 1
            await llm.resume_generation()
            return await llm.generate_tokens([5, 17, 42, 99], params)

        out = run(main())
        assert isinstance(llm.client, MPClient) and out.weight_version == 1
        fresh.add_request("f", {"prompt_token_ids": [5, 17, 42, 99]}, params)
        ref = None
        while fresh.has_unfinished_requests():
            for o in fresh.step():
                ref = o
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].token_logprobs == pytest.approx(ref.outputs[0].token_logprobs, abs=1e-5)
    finally:
        llm.shutdown()
