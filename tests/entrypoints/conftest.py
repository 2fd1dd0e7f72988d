"""Real uvicorn servers on free loopback ports, in background threads, over the tiny GQA checkpoint."""
from __future__ import annotations

import socket
import threading
import time

import pytest

API_KEY = "test-key"
MODEL = "tiny-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """An ASGI app served by uvicorn in a thread; ``stop()`` asks it to exit and joins."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def free_port():
    return _free_port


@pytest.fixture(scope="session")
def make_engine_args(tiny_gqa):
    """EngineArgs for the tiny GQA checkpoint: float32 on CPU, 4 slots, 256-token context."""
    from loopline import EngineArgs

    def make(**overrides):
        kwargs = dict(model=str(tiny_gqa.path), dtype="float32", device="cpu", max_num_seqs=4,
                      max_num_batched_tokens=256, max_model_len=256)
        return EngineArgs(**{**kwargs, **overrides})

    return make


def _as_new(llm, wait_s: float = 10.0) -> bool:
    """Whether ``llm`` serves as a new engine would: running, idle (requests a module's last test aborted may
    still be ending: waited for), not paused or sleeping, the weights it started with (version 0, committed),
    and every counter of its gauges still zero (no preemptions so far: test_metrics reads the engine's own)."""
    from dataclasses import replace

    from loopline.runtime.protocol import EngineSnapshot

    deadline = time.monotonic() + wait_s
    while llm.is_running and (llm.snapshot.num_unfinished or llm.snapshot.kv_used_blocks):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    if not llm.is_running or replace(llm.snapshot, kv_total_blocks=0) != EngineSnapshot():
        return False
    import asyncio

    async def state():
        return await llm.is_sleeping(), await llm.get_weight_version()

    return asyncio.run(state()) == (False, 0)


@pytest.fixture(scope="session")
def _shared_async_llm():
    """The default engine process, shared by this worker's modules (each start is ~4 s of a 2-core CI box,
    and a dozen modules use it); ``async_llm`` replaces it when a module left it other than new."""
    held = {}
    yield held
    if "llm" in held:
        held["llm"].shutdown()


@pytest.fixture(scope="module")
def async_llm(make_engine_args, _shared_async_llm):
    """The default AsyncLLM (an engine process over the tiny GQA checkpoint), as a new one would serve: the
    worker's shared engine when it is in that state, else a new one (modules that shut down, pause, sleep or
    update an engine, or need other arguments, build their own)."""
    from loopline import AsyncLLM

    llm = _shared_async_llm.get("llm")
    if llm is None or not _as_new(llm):
        if llm is not None:
            llm.shutdown()
        llm = _shared_async_llm["llm"] = AsyncLLM(make_engine_args())
    return llm


@pytest.fixture(scope="module")
def serve_app():
    """``serve_app(app) -> RunningServer``; every server started is stopped when the module ends."""
    servers = []

    def serve(app) -> RunningServer:
        servers.append(RunningServer(app))
        return servers[-1]

    yield serve
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="module")
def server(async_llm, serve_app):
    """The main test server: served name ``tiny-test``, API key ``test-key``, 16 requests in flight at most, RL API on."""
    from loopline.entrypoints.openai.api_server import build_app

    return serve_app(build_app(async_llm, MODEL, api_key=API_KEY, max_concurrent_requests=16, shutdown_engine=False,
                               enable_rl_api=True))
