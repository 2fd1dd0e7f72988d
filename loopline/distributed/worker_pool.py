"""Where a :class:`~loopline.distributed.pd.PDClient`'s workers run, and how it reaches each one.

:class:`WorkerPool` starts the workers a :class:`WorkerSpec` each describes: engine processes on
this host (:class:`ProcessWorkerPool`) or Ray actors (``ray_backend.RayWorkerPool``);
``launch.make_worker_pool`` picks one. Each worker's client carries :class:`WorkerLink`, which
routes its messages to the front end.
"""
from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from loopline.distributed.pd_worker import WorkerRole
from loopline.runtime.client import MPClient
from loopline.runtime.protocol import EngineMessage


class WorkerOwner(Protocol):
    """The front end a worker's messages go to (``pd.PDClient``)."""

    def _on_worker_message(self, worker: "WorkerLink", msg: EngineMessage) -> None: ...


@dataclass
class WorkerSpec:
    """One worker a :class:`WorkerPool` starts: its kind, index among its kind, rank in the
    transport group, engine arguments and role."""

    kind: str
    index: int
    rank: int
    engine_args: Any
    role: WorkerRole


class WorkerLink:
    """What :class:`PDClient` needs of a worker's client, whatever runs the worker (a mixin over an
    engine client: an engine process's, a Ray actor's): its place in the pool, and its messages
    going to the ``PDClient``."""

    owner: WorkerOwner
    kind: str
    index: int
    rank: int
    alive: bool

    def _link(self, owner: WorkerOwner, spec: WorkerSpec) -> None:
        # NOTE: before the engine client starts: its reader may deliver a message at once
        self.owner, self.kind, self.index, self.rank = owner, spec.kind, spec.index, spec.rank
        self.alive = True

    @property
    def name(self) -> str:
        return f"{self.kind} worker {self.index}"

    @property
    def label(self) -> str:
        return f"{self.kind}-{self.index}"

    def is_alive(self) -> bool:
        return self.alive and super().is_alive()

    def _on_message(self, msg: EngineMessage) -> None:
        self.owner._on_worker_message(self, msg)


class _Worker(WorkerLink, MPClient):
    """One worker process; its messages go to the :class:`PDClient`."""

    def __init__(self, owner: WorkerOwner, spec: WorkerSpec) -> None:
        self._link(owner, spec)
        MPClient.__init__(self, spec.engine_args, spec.role)


class WorkerPool(ABC):
    """Where a :class:`PDClient`'s workers run: engine processes on this host
    (:class:`ProcessWorkerPool`) or Ray actors in a placement group (``ray_backend.RayWorkerPool``)."""

    #: what the workers compute on (its type picks the KV transport) and whether they all share one GPU
    device: torch.device
    devices_shared: bool

    @abstractmethod
    def rendezvous(self) -> str:
        """The ``tcp://host:port`` where the KV transport group meets (rank 0 listens there)."""

    @abstractmethod
    def worker_args(self, args: Any, rank: int) -> dict[str, Any]:
        """The engine arguments worker ``rank``'s engine gets instead of the front end's (its device...)."""

    @abstractmethod
    def start(self, owner: WorkerOwner, specs: list[WorkerSpec]) -> list[WorkerLink]:
        """Starts every worker and returns their clients, in order; if one fails, the started ones
        are stopped and its error is raised."""

    def release(self) -> None:
        """Frees what the pool holds once every worker stopped (nothing for processes)."""


class ProcessWorkerPool(WorkerPool):
    """Workers as engine processes on this host: one GPU each where there are enough, else all on
    the front end's device (and the transport group on the loopback interface)."""

    def __init__(self, args: Any) -> None:
        from loopline.config import resolve_device
        self.device = resolve_device(args.device)
        self.devices = _worker_devices(self.device, args.prefill_workers + args.decode_workers)
        self.devices_shared = len(set(self.devices)) == 1

    def rendezvous(self) -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    def worker_args(self, args: Any, rank: int) -> dict[str, Any]:
        dev, util = self.devices[rank], args.gpu_memory_utilization
        if dev.type == "cuda":  # NOTE: workers start one after another on a shared device: each
            # one's pool is sized from what the earlier ones left (cumulative fractions)
            util *= self.devices[:rank + 1].count(dev) / self.devices.count(dev)
        return dict(device=str(dev), gpu_memory_utilization=util)

    def start(self, owner: WorkerOwner, specs: list[WorkerSpec]) -> list[WorkerLink]:
        workers: list[WorkerLink] = []
        try:
            for spec in specs:  # one after another: see worker_args
                workers.append(_Worker(owner, spec))
        except BaseException:
            for w in workers:
                w.stopping = True
                w.shutdown(5)
            raise
        return workers


def _worker_devices(device: torch.device, count: int) -> list[torch.device]:
    """One device per worker where there are enough GPUs, else every worker on ``device``."""
    if device.type == "cuda" and torch.cuda.device_count() >= count and device.index in (None, 0):
        return [torch.device("cuda", i) for i in range(count)]
    return [device] * count


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host``'s interface ("": every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
