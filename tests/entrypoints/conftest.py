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


@pytest.fixture(scope="module")
def async_llm(make_engine_args):
    from loopline import AsyncLLM

    llm = AsyncLLM(make_engine_args())
    yield llm
    llm.shutdown()


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
