"""The KV transports between two processes: pages arrive bit for bit, in any order of tags, and a
transfer nobody answers fails with a clear error after its timeout (gloo on CPU; CUDA IPC on a GPU)."""
from __future__ import annotations

import multiprocessing
import re
import time

import pytest
import torch

from loopline.distributed.kv_transfer import KVTransferError, check_transport_device, make_transport
from loopline.errors import InvalidRequestError
from loopline.distributed.worker_pool import free_port

SHAPE = (2, 3, 8, 4, 2, 16)  # [k/v, layers, planes * pages, block_size, kv_heads, head_dim]


def _pieces(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=g).to(device) for _ in range(3)]


def _peer(transport: str, init_method: str, device: str, conn, timeout_s: float, delay_s: float) -> None:
    """The receiving side (rank 1): receives three pieces in the reverse order of their tags."""
    torch.set_num_threads(1)
    time.sleep(delay_s)  # a worker that starts late (workers of a pool start one after another)
    t = make_transport(transport, timeout_s)
    t.start(1, 2, init_method, torch.device(device))
    conn.send("started")  # as a worker reports its start to the front end
    payloads = conn.recv()
    futures = [t.recv(payloads[i], SHAPE, torch.float32, 0, 10 + i) for i in (2, 1, 0)]
    got = [f.result().cpu() for f in futures][::-1]
    conn.send([bool(torch.equal(a, b.cpu())) for a, b in zip(got, _pieces(device))])
    conn.recv()  # the sender is done with its copies
    t.close()


def _exchange(transport: str, device: str, timeout_s: float = 30.0, peer_delay_s: float = 0.0) -> list[bool]:
    ctx = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(transport, init_method, device, child, timeout_s, peer_delay_s), daemon=True)
    proc.start()
    t = make_transport(transport, timeout_s)
    t.start(0, 2, init_method, torch.device(device))
    assert conn.recv() == "started"  # transfers begin once every worker started, as in a pool
    pieces = _pieces(device)
    sent = [t.send(p, 1, 10 + i) for i, p in enumerate(pieces)]
    conn.send([payload for payload, _ in sent])
    for _, done in sent:
        done.result(timeout=30)
    equal = conn.recv()
    conn.send(None)
    proc.join(30)
    t.close()
    return equal


def _exchange_then_unanswered_receive(conn) -> None:
    equal = _exchange("gloo", "cpu")
    # a receive nobody sends to: a clear error once the timeout passes (here: the group never forms)
    t = make_transport("gloo", 0.5, join_timeout_s=0.5)
    t.start(0, 2, f"tcp://127.0.0.1:{free_port()}", torch.device("cpu"))
    try:
        t.recv(None, SHAPE, torch.float32, 1, 1).result(timeout=30)
        error = None
    except KVTransferError as e:  # any other error ends the process, and the test with it
        error = str(e)
    conn.send((equal, error))


@pytest.mark.slow  # two processes (~8 s on 2 cores). Default run: test_pd.py's workers move every page over gloo
# (outputs equal one engine's), test_handoff.py::test_a_failed_transfer_fails_its_request_alone
def test_gloo_moves_pages_exactly_and_times_out():
    # In a process of its own: rank 0 joins the default process group, which outlives the test (a transport
    # never destroys it: a dead peer would hang that), and would be the pytest worker's for its later tests.
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_exchange_then_unanswered_receive, args=(child,))
    proc.start()
    assert conn.poll(90), "the exchange process did not report"
    equal, error = conn.recv()
    proc.join(30)
    assert equal == [True, True, True]
    assert error is not None and re.search("did not form|failed to form", error), error


def _late_exchange(conn) -> None:
    conn.send(_exchange("gloo", "cpu", timeout_s=1.0, peer_delay_s=2.5))


@pytest.mark.slow  # two processes and a 2.5 s late start (~11 s on 2 cores); default run: the exchange and the
# timeout in test_gloo_moves_pages_exactly_and_times_out, and test_pd.py's worker pools form their groups
def test_a_worker_joining_after_a_transfer_timeout_still_forms_the_group():
    """A pool starts its workers one after another (seconds each on a GPU host): the group waits for
    the last one longer than one transfer's timeout. (In a process of its own: a process joins once.)"""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_late_exchange, args=(child,))
    proc.start()
    assert conn.poll(60) and conn.recv() == [True, True, True]
    proc.join(30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_moves_pages_exactly():
    assert _exchange("cuda_ipc", "cuda:0") == [True, True, True]


@pytest.mark.parametrize("name", ["nccl", "cuda_ipc"])
def test_a_cuda_transport_refuses_cpu_workers_at_start(name):
    """The front end and each worker's transport run the same check: the error names the field."""
    cpu = torch.device("cpu")
    with pytest.raises(InvalidRequestError, match=f"kv_transport '{name}' needs the workers on CUDA") as e:
        check_transport_device(name, cpu)
    assert e.value.param == "kv_transport"
    transport = make_transport(name, timeout_s=1.0)
    try:
        with pytest.raises(InvalidRequestError, match="needs the workers on CUDA"):
            transport.start(0, 1, f"tcp://127.0.0.1:{free_port()}", cpu)
    finally:
        transport.close()
    check_transport_device("gloo", cpu)  # no error
