"""Which engine client serves a set of :class:`EngineArgs`: the one place that picks the transport.

``AsyncLLM`` (and so ``loopline serve``) calls :func:`make_client`; each client it can return has
the interface of one engine (``EngineClient``), so nothing above it knows how many engines run.
"""
from __future__ import annotations

from functools import partial

from loopline.config import EngineArgs
from loopline.distributed.dp import DPClient, replica_args, start_in_parallel
from loopline.distributed.worker_pool import ProcessWorkerPool, WorkerPool
from loopline.runtime.client import EngineClient, MPClient


def make_client(args: EngineArgs) -> EngineClient:
    """The engine client for ``args``: one engine process, prefill and decode workers behind a
    ``PDClient`` (``prefill_workers``), or ``data_parallel_size`` replicas (engine processes or Ray
    actors) behind a :class:`DPClient`."""
    if args.prefill_workers:
        from loopline.distributed.pd import PDClient

        return PDClient(args, make_worker_pool(args))
    if args.data_parallel_size == 1 and args.distributed_executor_backend == "mp":
        return MPClient(args)
    args.validate()
    if args.distributed_executor_backend == "ray":
        from loopline.distributed.ray_backend import start_ray_replicas  # NOTE: imports ray; only when asked for

        return start_ray_replicas(args)
    return DPClient(start_in_parallel([partial(MPClient, replica_args(args, i, "mp"))
                                       for i in range(args.data_parallel_size)]))


def make_worker_pool(args: EngineArgs) -> WorkerPool:
    """The pool of prefill/decode workers ``args.distributed_executor_backend`` asks for (``ray``
    imports Ray, only then)."""
    if args.distributed_executor_backend == "ray":
        from loopline.distributed.ray_backend import RayWorkerPool
        return RayWorkerPool(args)
    return ProcessWorkerPool(args)
