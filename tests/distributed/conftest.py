"""Engine arguments over the tiny GQA checkpoint, and real uvicorn servers (as in tests/entrypoints)."""
from __future__ import annotations

import pytest

from entrypoints.conftest import RunningServer


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
def serve_app():
    """``serve_app(app) -> RunningServer``; every server started is stopped when the module ends."""
    servers = []

    def serve(app) -> RunningServer:
        servers.append(RunningServer(app))
        return servers[-1]

    yield serve
    for srv in servers:
        srv.stop()
