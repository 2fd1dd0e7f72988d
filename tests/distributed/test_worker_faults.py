"""Process faults (issue #43): a KV transfer whose peer died never holds a worker's exit for the
transfer timeout."""
from __future__ import annotations

import multiprocessing
import time

import torch

from loopline.distributed.kv_transfer import make_transport
from loopline.distributed.worker_pool import free_port

SHAPE = (2, 3)


def _join_and_idle(init_method: str, conn) -> None:
    """Rank 0: joins the group, then never sends (the test kills it: a prefill worker that died)."""
    t = make_transport("gloo", 30.0)
    t.start(0, 2, init_method, torch.device("cpu"))
    t._wait_joined()
    conn.send("joined")
    time.sleep(600)


def _receive_then_close(init_method: str, conn) -> None:
    """Rank 1: a decode worker waiting for pages rank 0 will never send; says how the wait ended, then exits."""
    t = make_transport("gloo", 30.0)
    t.start(1, 2, init_method, torch.device("cpu"))
    pending = t.recv(None, SHAPE, torch.float32, 0, 7)
    conn.send("posted")
    conn.recv()  # the sender was killed
    error = pending.exception(timeout=5)  # (a TimeoutError here, not an answer, if it still waits)
    conn.send(f"{type(error).__name__}: {error}")
    t.close()


def test_a_worker_exits_promptly_while_a_receive_from_a_dead_peer_is_pending():
    ctx = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    (c0, w0), (c1, w1) = ctx.Pipe(), ctx.Pipe()
    sender = ctx.Process(target=_join_and_idle, args=(init_method, w0), daemon=True)
    receiver = ctx.Process(target=_receive_then_close, args=(init_method, w1), daemon=True)
    sender.start(), receiver.start()
    try:
        assert c0.poll(60) and c0.recv() == "joined"
        assert c1.poll(60) and c1.recv() == "posted"
        sender.kill()
        sender.join(10)
        t0 = time.monotonic()
        c1.send("killed")
        assert c1.poll(10)
        assert c1.recv().startswith("KVTransferError: receiving KV pages from worker 0 failed")
        receiver.join(20)
        took = time.monotonic() - t0
        assert receiver.exitcode == 0 and took < 5, f"exit took {took:.1f}s (exit code {receiver.exitcode})"
    finally:
        for p in (sender, receiver):
            if p.is_alive():
                p.kill()


def test_a_killed_prefill_worker_fails_its_request_and_shutdown_promptly(tiny_gqa):
    """1 prefill + 1 decode worker; the prefill worker is killed mid-prompt: the request fails with an
    error naming the worker well within the transfer timeout, and shutting down takes seconds."""
    import asyncio
    import os
    import signal

    import pytest

    from loopline import SamplingParams
    from loopline.config import EngineArgs
    from loopline.entrypoints.async_llm import AsyncLLM
    from loopline.errors import EngineDeadError

    llm = AsyncLLM(EngineArgs(model=str(tiny_gqa.path), prefill_workers=1, decode_workers=1, kv_transfer_timeout=60,
                              dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=8,
                              max_model_len=256, block_size=4, skip_tokenizer_init=True))
    try:
        async def main() -> float:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            doomed = asyncio.create_task(llm.generate_tokens(list(range(3, 203)), params, "doomed"))
            while (placed := llm.client.placement("doomed")) is None:
                await asyncio.sleep(0.001)
            os.kill(placed.prefill.process.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="prefill worker 0"):
                await asyncio.wait_for(doomed, 30)
            return time.monotonic() - t0

        assert asyncio.run(main()) < 5
    finally:
        t0 = time.monotonic()
        llm.shutdown()
        took = time.monotonic() - t0
    assert took < 5, f"shutdown took {took:.1f}s"
