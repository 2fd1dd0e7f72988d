"""A real uvicorn server on a free loopback port, in a background thread, over the tiny GQA checkpoint."""
from __future__ import annotations

import socket
import threading
import time

import pytest

API_KEY = "test-key"
MODEL = "tiny-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """``build_app(...)`` served by uvicorn in a thread; ``stop()`` asks it to exit and joins."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
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


def engine_args(path, **overrides):
    from loopline import EngineArgs

    kwargs = dict(model=str(path), dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=256,
                  max_model_len=256)
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


@pytest.fixture(scope="module")
def async_llm(tiny_gqa):
    from loopline import AsyncLLM

    llm = AsyncLLM(engine_args(tiny_gqa.path))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(async_llm):
    from loopline.entrypoints.openai.api_server import build_app

    srv = RunningServer(build_app(async_llm, MODEL, api_key=API_KEY, max_concurrent_requests=16, shutdown_engine=False))
    yield srv
    srv.stop()
