"""KV page transports between prefill and decode workers, behind one interface.

A prefill worker ``send``s the tensor of a request's KV pages (``[2, layers, pages, block_size,
kv_heads, head_dim]``, see ``ModelRunner.export_request``) to a decode worker and gets back a
*payload*: whatever the receiver needs besides the tensor's shape (nothing for two-sided
transports, an IPC handle for one-sided ones). The payload travels with the request's handoff
through the front end; the decode worker ``recv``s with it. Both calls return futures and never
block the engine loop: the bytes move on the transport's own threads while the next step computes.

* :class:`TorchDistributedTransport`: ``torch.distributed`` point-to-point ``isend`` / ``irecv``
  in one process group of every prefill and decode worker -- ``gloo`` (CPU tensors: tests, CPU
  serving) or ``nccl`` (GPU to GPU, its own communicator stream).
* :class:`CudaIpcTransport`: two processes on one GPU. The payload is the pages tensor pickled
  with torch's CUDA sharing reductions (an IPC handle plus an event the receiver's stream waits
  on); the decode worker copies the pages device to device. torch's IPC reference counting keeps
  the sender's copy alive until the receiver released it.
* :class:`NixlTransport`: NIXL one-sided reads, only when the ``nixl`` package is importable;
  asking for it without the package is an error, never a fallback.

Every operation has a timeout; a failed or timed-out transfer fails its future (the decode worker
then fails that request alone).
"""
from __future__ import annotations

import concurrent.futures
import datetime
import io
import logging
import threading
import urllib.parse
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from loopline.errors import InvalidRequestError

logger = logging.getLogger("loopline.pd")

TRANSPORTS = ("gloo", "nccl", "cuda_ipc", "nixl")
#: How long a worker waits for the others to join the group (and a first transfer for the group to
#: form): the workers of a pool start one after another, and on a GPU host each takes seconds (spawn,
#: imports, engine), more than one transfer may take.
JOIN_TIMEOUT_S = 600.0


class KVTransferError(RuntimeError):
    """A KV transfer failed or timed out (the request it carried fails; the worker goes on)."""


class KVTransport(ABC):
    """Moves one request's KV pages tensor from a prefill worker to a decode worker."""

    name: str

    # NOTE: NCCL point-to-point operations between two ranks must be issued in the same order on
    # both: one thread each (a decode worker receives in the order the front end forwards, which
    # is the order its prefill worker sent in). gloo matches by tag, so it may run several at once.
    threads = 4

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.threads,
                                                           thread_name_prefix=f"loopline-kv-{self.name}")

    def start(self, rank: int, world_size: int, init_method: str, device: torch.device) -> None:
        """Joins the workers' group (``rank`` of ``world_size``); returns at once, joining goes on
        in the background (every worker must have started before any transfer completes)."""
        self.device = device

    @abstractmethod
    def send(self, kv: Tensor, peer: int, tag: int) -> tuple[Any, concurrent.futures.Future]:
        """Starts sending ``kv`` to rank ``peer``; returns ``(payload, done)``. ``kv`` must not be
        written until ``done`` completed."""

    @abstractmethod
    def recv(self, payload: Any, shape: tuple[int, ...], dtype: torch.dtype, peer: int,
             tag: int) -> concurrent.futures.Future:
        """Starts receiving what rank ``peer`` sent with ``tag``; the future gets the tensor
        (on this worker's device, or the CPU for ``gloo``)."""

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TorchDistributedTransport(KVTransport):
    """``torch.distributed`` point-to-point send / recv (``gloo`` or ``nccl``)."""

    def __init__(self, backend: str, timeout_s: float, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        self.name = backend
        self.threads = 1 if backend == "nccl" else 4
        super().__init__(timeout_s)
        # Joining waits for the whole pool (see JOIN_TIMEOUT_S); a transfer's own timeout starts after.
        self.join_timeout_s = max(timeout_s, join_timeout_s)
        self._joined = threading.Event()
        self._join_error: BaseException | None = None

    def start(self, rank: int, world_size: int, init_method: str, device: torch.device) -> None:
        super().start(rank, world_size, init_method, device)
        check_transport_device(self.name, device)

        def join() -> None:
            import torch.distributed as dist
            try:
                kwargs = {"device_id": device} if self.name == "nccl" else {}
                url = urllib.parse.urlparse(init_method)
                store = dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0,
                                      timeout=datetime.timedelta(seconds=self.join_timeout_s))
                dist.init_process_group(self.name, store=store, rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=self.timeout_s), **kwargs)
            except BaseException as e:  # every transfer reports it
                self._join_error = e
                logger.exception("KV transport %s: joining the worker group failed", self.name)
            finally:
                self._joined.set()

        threading.Thread(target=join, name="loopline-kv-join", daemon=True).start()

    def _wait_joined(self) -> None:
        # NOTE: a worker reports its start before it joins, so the first transfers may wait for the
        # last worker's join: that is the pool's start, bounded by the join timeout, not a transfer's.
        if not self._joined.wait(self.join_timeout_s):
            raise KVTransferError(f"the KV transport group did not form within {self.join_timeout_s}s")
        if self._join_error is not None:
            raise KVTransferError(f"the KV transport group failed to form: {self._join_error}")

    def _staging_device(self) -> torch.device:
        return self.device if self.name == "nccl" else torch.device("cpu")

    def send(self, kv: Tensor, peer: int, tag: int) -> tuple[Any, concurrent.futures.Future]:
        def run() -> None:
            import torch.distributed as dist
            self._wait_joined()
            t = kv.to(self._staging_device()).contiguous()
            try:
                dist.isend(t, dst=peer, tag=tag).wait(datetime.timedelta(seconds=self.timeout_s))
            except Exception as e:
                raise KVTransferError(f"sending KV pages to worker {peer} failed: {e}") from e

        return None, self._pool.submit(run)

    def recv(self, payload: Any, shape: tuple[int, ...], dtype: torch.dtype, peer: int,
             tag: int) -> concurrent.futures.Future:
        def run() -> Tensor:
            import torch.distributed as dist
            self._wait_joined()
            t = torch.empty(shape, dtype=dtype, device=self._staging_device())
            try:
                dist.irecv(t, src=peer, tag=tag).wait(datetime.timedelta(seconds=self.timeout_s))
            except Exception as e:
                raise KVTransferError(f"receiving KV pages from worker {peer} failed: {e}") from e
            return t

        return self._pool.submit(run)

    def close(self) -> None:
        super().close()
        # NOTE: no destroy_process_group: a peer that died makes it hang; the process is ending.


class CudaIpcTransport(KVTransport):
    """Two processes on one GPU: the payload is a CUDA IPC handle of the sender's pages copy."""

    name = "cuda_ipc"
    _stream: Any = None
    _sends = 0

    def start(self, rank: int, world_size: int, init_method: str, device: torch.device) -> None:
        super().start(rank, world_size, init_method, device)
        check_transport_device("cuda_ipc", device)

    def send(self, kv: Tensor, peer: int, tag: int) -> tuple[Any, concurrent.futures.Future]:
        from multiprocessing.reduction import ForkingPickler
        import torch.multiprocessing  # noqa: F401  (registers the CUDA sharing reductions)

        self._sends += 1
        if self._sends % 64 == 0:  # frees the copies every receiver has released
            torch.cuda.ipc_collect()
        buf = io.BytesIO()
        ForkingPickler(buf).dump(kv)  # an IPC handle + an event recorded on the current stream
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)  # NOTE: torch keeps the storage alive until the receiver released it
        return buf.getvalue(), done

    def recv(self, payload: Any, shape: tuple[int, ...], dtype: torch.dtype, peer: int,
             tag: int) -> concurrent.futures.Future:
        def run() -> Tensor:
            import pickle
            import torch.multiprocessing  # noqa: F401
            torch.cuda.set_device(self.device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            try:
                # NOTE: a stream of its own, so the copy overlaps the engine's steps on the default stream
                with torch.cuda.stream(self._stream):
                    shared = pickle.loads(payload)  # this stream waits for the sender's copy (its IPC event)
                    if tuple(shared.shape) != tuple(shape) or shared.dtype != dtype:
                        raise KVTransferError(f"KV pages of shape {tuple(shared.shape)} {shared.dtype}, "
                                              f"expected {tuple(shape)} {dtype}")
                    out = shared.clone()  # our own copy: the sender's memory is released at once
                    self._stream.synchronize()
                # the engine reads it on its stream; the allocator must not reuse it before that
                out.record_stream(torch.cuda.default_stream(self.device))
                del shared
                return out
            except KVTransferError:
                raise
            except Exception as e:  # e.g. the sender died and its memory is gone
                raise KVTransferError(f"opening the CUDA IPC pages of worker {peer} failed: {e}") from e

        return self._pool.submit(run)


class NixlTransport(KVTransport):
    """NIXL one-sided reads (UCX and other NIXL backends): only with the ``nixl`` package."""

    name = "nixl"

    def __init__(self, timeout_s: float) -> None:
        try:
            from nixl._api import nixl_agent  # noqa: F401
        except ImportError as e:
            raise InvalidRequestError("kv_transport 'nixl' needs the nixl package (pip install nixl), which is "
                                      "not importable here; choose gloo, nccl or cuda_ipc", param="kv_transport") from e
        super().__init__(timeout_s)
        self._held: dict[int, tuple[Tensor, Any]] = {}
        self._lock = threading.Lock()

    def start(self, rank: int, world_size: int, init_method: str, device: torch.device) -> None:
        super().start(rank, world_size, init_method, device)
        from nixl._api import nixl_agent, nixl_agent_config
        self._agent = nixl_agent(f"loopline-{rank}", nixl_agent_config(backends=["UCX"]))

    def send(self, kv: Tensor, peer: int, tag: int) -> tuple[Any, concurrent.futures.Future]:
        kv = kv.contiguous()
        reg = self._agent.register_memory(kv)
        with self._lock:
            self._held[tag] = (kv, reg)
        descs = self._agent.get_serialized_descs(self._agent.get_xfer_descs(kv))
        done: concurrent.futures.Future = concurrent.futures.Future()

        def release() -> None:  # the receiver's notification says it read the pages
            import time
            deadline = time.monotonic() + self.timeout_s
            key = str(tag).encode()
            while time.monotonic() < deadline:
                for msgs in self._agent.get_new_notifs().values():
                    if key in msgs:
                        with self._lock:
                            t, r = self._held.pop(tag)
                        self._agent.deregister_memory(r)
                        done.set_result(None)
                        return
                time.sleep(0.001)
            done.set_exception(KVTransferError(f"worker {peer} did not read the KV pages within {self.timeout_s}s"))

        self._pool.submit(release)
        return (self._agent.get_agent_metadata(), descs), done

    def recv(self, payload: Any, shape: tuple[int, ...], dtype: torch.dtype, peer: int,
             tag: int) -> concurrent.futures.Future:
        def run() -> Tensor:
            import time
            meta, descs = payload
            remote = self._agent.add_remote_agent(meta)
            out = torch.empty(shape, dtype=dtype, device=self.device)
            reg = self._agent.register_memory(out)
            try:
                handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(out),
                                                     self._agent.deserialize_descs(descs), remote, str(tag).encode())
                self._agent.transfer(handle)
                deadline = time.monotonic() + self.timeout_s
                while (state := self._agent.check_xfer_state(handle)) == "PROC":
                    if time.monotonic() > deadline:
                        raise KVTransferError(f"reading KV pages of worker {peer} timed out after {self.timeout_s}s")
                    time.sleep(0.0005)
                if state != "DONE":
                    raise KVTransferError(f"reading KV pages of worker {peer} failed (NIXL state {state})")
                self._agent.release_xfer_handle(handle)
                return out
            finally:
                self._agent.deregister_memory(reg)

        return self._pool.submit(run)


#: Transports that move pages between CUDA devices only.
CUDA_TRANSPORTS = ("nccl", "cuda_ipc")


def check_transport_device(name: str, device: torch.device) -> None:
    """Refuses a CUDA-only transport for workers on another kind of device (the front end, before it starts
    workers, and each worker's transport at start)."""
    if name in CUDA_TRANSPORTS and device.type != "cuda":
        raise InvalidRequestError(f"kv_transport {name!r} needs the workers on CUDA devices; they run on "
                                  f"{device.type} (use 'gloo' or 'auto')", param="kv_transport")


def resolve_transport(name: str, device: torch.device, devices_shared: bool) -> str:
    """``"auto"``: ``gloo`` on the CPU, ``cuda_ipc`` when every worker shares one GPU, else ``nccl``."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "gloo"
    return "cuda_ipc" if devices_shared else "nccl"


def make_transport(name: str, timeout_s: float, join_timeout_s: float = JOIN_TIMEOUT_S) -> KVTransport:
    """The transport ``name``; transfers time out after ``timeout_s``, joining the group after
    ``join_timeout_s`` (torch.distributed transports)."""
    if name in ("gloo", "nccl"):
        return TorchDistributedTransport(name, timeout_s, join_timeout_s)
    if name == "cuda_ipc":
        return CudaIpcTransport(timeout_s)
    if name == "nixl":
        return NixlTransport(timeout_s)
    raise InvalidRequestError(f"kv_transport must be one of {['auto', *TRANSPORTS]}, got {name!r}",
                              param="kv_transport")
