"""An engine process stopped from outside (issue #43): SIGTERM makes it abort its requests on its way out,
which nobody asked for, so their streams fail with the engine's error (a 5xx over HTTP) as after SIGKILL,
never end as a normal output with finish_reason "abort"; a shutdown the client asks for still ends them
with "abort"."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from loopline import AsyncLLM, EngineArgs, SamplingParams
from loopline.errors import EngineDeadError

PARAMS = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def engine_args(tiny) -> EngineArgs:
    return EngineArgs(model=str(tiny.path), dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256,
                      skip_tokenizer_init=True)


async def generating(llm: AsyncLLM, rid: str) -> asyncio.Future:
    """A request that is producing tokens when this returns."""
    stream = llm.generate({"prompt_token_ids": [5, 9, 23, 7]}, PARAMS, rid)
    await asyncio.wait_for(stream.__anext__(), 30)

    async def rest():
        async for out in stream:
            pass
        return out

    return asyncio.ensure_future(rest())


def test_sigterm_to_the_engine_process_fails_its_requests(tiny_gqa):
    llm = AsyncLLM(engine_args(tiny_gqa))
    try:
        async def main():
            doomed = await generating(llm, "doomed")
            os.kill(llm.client.process.pid, signal.SIGTERM)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="shut down"):
                await asyncio.wait_for(doomed, 10)
            return time.monotonic() - t0

        assert asyncio.run(main()) < 5
        assert llm.health_problem() is not None  # one engine: the server is unhealthy now
    finally:
        llm.shutdown()


def test_a_shutdown_the_client_asks_for_still_ends_requests_with_abort(tiny_gqa):
    llm = AsyncLLM(engine_args(tiny_gqa))

    async def main():
        running = await generating(llm, "running")
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        return await asyncio.wait_for(running, 10)

    out = asyncio.run(main())
    assert out.outputs[0].finish_reason == "abort" and 0 < len(out.outputs[0].token_ids) < 200
