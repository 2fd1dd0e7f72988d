"""``SamplingParams.output_kind`` through AsyncLLM and the HTTP server, and the client's cost per delta:
the client hands each engine delta on as it came (no copy of a request's history per message)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from loopline import AsyncLLM, SamplingParams
from loopline.engine import LLMEngine
from loopline.engine.deltas import CompletionDelta, OutputDelta
from loopline.entrypoints.async_llm import OutputStream
from loopline.runtime.client import EngineClient
from loopline.runtime.protocol import AddCmd, EngineMessage, Reply
from loopline.sampling_params import RequestOutputKind as Kind

PROMPT = "The river town woke slowly."
PARAMS = SamplingParams(max_tokens=12, temperature=0.9, seed=4, n=2, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_engine_args):
    llm = AsyncLLM(engine=LLMEngine(make_engine_args()))
    yield llm
    llm.shutdown()


async def _all(llm, params, rid):
    return [out async for out in llm.generate(PROMPT, params, rid)]


def test_async_generate_yields_each_output_kind(llm):
    async def main():  # one at a time: alone in its batches, each request gets the same logprobs
        return [await _all(llm, PARAMS.clone(output_kind=k), k.name) for k in Kind]

    cumulative, delta, final = asyncio.run(main())
    whole = cumulative[-1]
    assert whole.finished and all(len(c.token_ids) == 12 for c in whole.outputs)
    assert [(c.text, c.token_ids) for c in cumulative[0].outputs] != [(c.text, c.token_ids) for c in whole.outputs]
    assert len(final) == 1 and final[0].finished  # FINAL_ONLY: one output, the whole completion
    key = lambda o: [(c.index, c.text, c.token_ids, c.logprobs, c.exit_depths, c.cumulative_logprob, c.finish_reason)
                     for c in o.outputs]  # noqa: E731
    assert key(final[0]) == key(whole)
    assert delta[-1].finished
    for c in whole.outputs:  # DELTA: the outputs add up to the whole completion
        parts = [p for out in delta for p in out.outputs if p.index == c.index]
        assert "".join(p.text for p in parts) == c.text
        assert [t for p in parts for t in p.token_ids] == c.token_ids
        assert [e for p in parts for e in p.logprobs] == c.logprobs
        assert [d for p in parts for d in p.exit_depths] == c.exit_depths
        assert parts[-1].finish_reason == c.finish_reason and parts[-1].cumulative_logprob == c.cumulative_logprob
    assert SamplingParams().output_kind is Kind.CUMULATIVE


def test_the_server_asks_for_deltas_when_streaming_and_the_final_output_otherwise(llm, monkeypatch):
    from loopline.entrypoints.openai.api_server import build_app

    kinds = []
    real = AsyncLLM.add_requests

    async def add_requests(self, requests, **kw):
        kinds.extend(p.output_kind for _, _, p in requests)
        return await real(self, requests, **kw)

    monkeypatch.setattr(AsyncLLM, "add_requests", add_requests)
    app = build_app(llm, "m", shutdown_engine=False, enable_rl_api=True)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            for stream in (True, False):
                body = {"model": "m", "max_tokens": 4, "stream": stream}
                for route, extra in (("/v1/completions", {"prompt": "Hi"}),
                                     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
                    assert (await c.post(route, json={**body, **extra})).status_code == 200
                r = await c.post("/generate", json={"text": "Hi", "stream": stream, "sampling_params": {"max_new_tokens": 4}})
                assert r.status_code == 200

    asyncio.run(main())
    # /generate streams whole objects (SGLang's shape): cumulative outputs are what it formats
    assert kinds == [Kind.DELTA, Kind.DELTA, Kind.CUMULATIVE] + [Kind.FINAL_ONLY] * 3


class _Loopback(EngineClient):
    """An engine client without an engine: the test plays the engine's messages."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = []

    def _send(self, cmd) -> None:
        self.sent.append(cmd)

    def play(self, msg) -> None:
        """Delivers a message as a transport's receiving thread does."""
        self._on_message(msg)


def test_the_client_hands_each_delta_on_as_it_came():
    """Structural, not timed: the 4,000th message of a DELTA stream costs what the first did. The output a
    reader gets holds the very lists the engine's message brought; nothing of the history is copied or kept."""
    params = SamplingParams(n=1, logprobs=0, output_kind=Kind.DELTA)

    async def main():
        client, stream = _Loopback(), OutputStream()
        ack = asyncio.get_running_loop().create_future()
        client.add([("r", {"prompt_token_ids": [1, 2]}, params)], False, stream, ack)
        add_id = client.sent[-1].add_id
        assert isinstance(client.sent[-1], AddCmd)
        client.play(EngineMessage(replies=[Reply(add_id)]))
        await ack
        for i in range(4000):
            comp = CompletionDelta(0, "ab", 2 * i, [i], [3], [0], [{}], -1.0, None, None, 0)
            delta = OutputDelta("r", [comp], i == 3999, 0, None, (None, [1, 2], params) if i == 0 else None)
            client.play(EngineMessage(outputs=[delta]))
            (out,) = await stream.get()
            c = out.outputs[0]
            assert c.token_ids is comp.token_ids and c.logprobs is comp.logprobs and c.exit_depths is comp.exit_depths
            assert c.text == "ab" and out.prompt_token_ids == [1, 2]
        assert out.finished and not client.has_stream("r") and not stream.num_requests

    asyncio.run(main())
