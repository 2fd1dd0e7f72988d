"""Engines as Ray actors (``--distributed-executor-backend ray``): data-parallel replicas, and
the prefill and decode workers of a disaggregated engine.

Each engine is an :class:`EngineActor`: the same :class:`EngineCore` loop that an
engine process runs, on a thread of a Ray actor (with a ``role``, the prefill or
decode loop, as ``run_engine_process`` takes one). :class:`ActorGroup` places the
actors with one placement group, one bundle per engine (``{"GPU": 1, "CPU": 1}``
on GPUs, ``{"CPU": 1}`` otherwise), so Ray decides the nodes and each actor sees
only its own GPU. Ray's actor calls are the transport: commands go down as
``submit`` calls (numbered, because a threaded actor may run calls out of order
and the engine loop must apply them in order), and a reader thread per engine
long-polls ``poll`` for the engine messages (pickled by the actor as an engine
process pickles them for its pipe). :class:`RayEngineClient` is the front-end
half; it routes the messages exactly as ``MPClient`` does, so ``dp.DPClient``
and ``pd.PDClient`` treat both alike. An actor that dies (killed, its node lost)
makes ``poll`` raise: that engine is dead and its requests fail.

Users: :func:`start_ray_replicas` (data parallelism) and :class:`RayWorkerPool`
(prefill/decode workers; the KV transport group meets at the rank-0 worker's
node, on a port free there).

``ray`` is an optional dependency (``pip install 'loopline[ray]'``), imported
only here and only when this backend is asked for. ``ray.init()`` joins the
cluster ``RAY_ADDRESS`` names (or ``ray start`` started on this host), else
starts a local one.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
import threading
from functools import partial
from typing import Any

import torch

from loopline.config import EngineArgs
from loopline.distributed.dp import DPClient, replica_args, start_in_parallel
from loopline.distributed.worker_pool import WorkerLink, WorkerPool, WorkerSpec, free_port
from loopline.engine import LLMEngine
from loopline.errors import EngineDeadError, InvalidRequestError
from loopline.runtime.client import EngineClient
from loopline.runtime.core import EngineCore, Inbox, dumps
from loopline.runtime.heap import freeze_startup_heap
from loopline.runtime.protocol import Command, EngineInfo, EngineMessage, EngineSnapshot, ShutdownCmd

logger = logging.getLogger("loopline.dp")

_POLL_S = 1.0  # how long one poll call waits for messages before it returns empty
_PLACEMENT_TIMEOUT_S = 120.0
_ACTOR_CONCURRENCY = 4  # submit and poll run at the same time (plus shutdown)


def import_ray() -> Any:
    """``ray``, or a clear error naming the option and the install command."""
    try:
        import ray
    except ImportError:
        raise InvalidRequestError("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                                  "pip install 'loopline[ray]'", param="distributed_executor_backend") from None
    return ray


class EngineActor:
    """One engine in a Ray actor: builds the engine, runs its loop on a thread, takes numbered
    commands and hands out the loop's messages (pickled bytes) to ``poll``. ``role``: a prefill or
    decode worker's (``pd_worker.WorkerRole``), which builds the engine and its loop instead."""

    def __init__(self, engine_args: EngineArgs, log_level: int, num_threads: int, role: Any = None) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("loopline").setLevel(log_level)
        torch.set_num_threads(num_threads)
        self._cond = threading.Condition()
        self._out: list[bytes] = []
        self._next_seq = 0
        self._early: dict[int, Command] = {}  # commands that arrived before an earlier-numbered one
        self._loop: threading.Thread | None = None
        try:
            engine = LLMEngine(engine_args) if role is None else role.build_engine(engine_args)
        except BaseException as e:  # the front end raises it (e.g. an invalid option)
            self._start = dumps(EngineMessage(dead=e))
            return
        self._start = pickle.dumps(EngineInfo.of(engine), pickle.HIGHEST_PROTOCOL)
        freeze_startup_heap()  # the actor's process lives for its engine, as the engine process does
        self._inbox = Inbox()
        core = EngineCore(engine, self._inbox, self._emit) if role is None else \
            role.make_core(engine, self._inbox, self._emit)
        self._loop = threading.Thread(target=core.run, name="loopline-engine", daemon=True)
        self._loop.start()

    def start(self) -> bytes:
        """The engine's :class:`EngineInfo`, or the message whose ``dead`` says why it could not be built."""
        return self._start

    def submit(self, seq: int, cmd: Command) -> None:
        with self._cond:
            self._early[seq] = cmd
            while self._next_seq in self._early:
                self._inbox.put(self._early.pop(self._next_seq))
                self._next_seq += 1

    def poll(self, timeout: float) -> list[bytes]:
        """The messages emitted since the last poll (waits up to ``timeout`` seconds for one)."""
        with self._cond:
            self._cond.wait_for(lambda: self._out, timeout)
            out, self._out = self._out, []
            return out

    def shutdown(self, timeout: float | None) -> None:
        if self._loop is not None:
            self._inbox.put(ShutdownCmd())
            self._loop.join(timeout)

    def _emit(self, msg: EngineMessage) -> None:
        data = dumps(msg)
        with self._cond:
            self._out.append(data)
            self._cond.notify_all()


class RayEngineClient(EngineClient):
    """The front-end half of one :class:`EngineActor` (routes its messages as ``MPClient`` does);
    ``what`` names the engine in errors ("replica 1", "decode worker 0")."""

    def __init__(self, actor: Any, index: int, what: str | None = None) -> None:
        super().__init__()
        self._ray = import_ray()
        self.actor, self.index = actor, index
        self._what = what or f"replica {index}"
        try:
            first = pickle.loads(self._ray.get(actor.start.remote()))
        except self._ray.exceptions.RayError as e:
            raise EngineDeadError(f"the Ray actor of {self._what} failed while starting ({type(e).__name__}: "
                                  f"{e})") from None
        if isinstance(first, EngineMessage):  # the engine could not be built: its error, unchanged
            raise first.dead
        self.info = first
        self.snapshot = EngineSnapshot(kv_total_blocks=first.kv_pages)
        self._seq = itertools.count()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"loopline-ray-reader-{self._what}", daemon=True)
        self._reader.start()

    def _send(self, cmd: Command) -> None:
        with self._send_lock:  # NOTE: numbers in the order the commands were queued
            self.actor.submit.remote(next(self._seq), cmd)  # a dead actor shows up in the reader's poll

    def _read(self) -> None:
        reason = "its actor stopped"
        try:
            while True:
                for data in self._ray.get(self.actor.poll.remote(_POLL_S)):
                    msg = pickle.loads(data)
                    self._on_message(msg)
                    if msg.dead is not None:
                        return
        except Exception as e:  # RayActorError (killed, node lost), or Ray shut down under us
            reason = f"its Ray actor died ({type(e).__name__})"
        self._die(EngineDeadError(f"the engine of {self._what} stopped unexpectedly: {reason}"))

    def is_alive(self) -> bool:
        return self._reader.is_alive()

    def shutdown(self, timeout: float | None) -> None:
        ray = self._ray
        if self._reader.is_alive():
            try:
                ray.get(self.actor.shutdown.remote(timeout), timeout=None if timeout is None else timeout + 5)
            except Exception:  # already dead, or a step that never returns: killed below
                logger.warning("%s did not stop cleanly; killing its actor", self._what, exc_info=True)
        self._reader.join(_POLL_S + 5)
        try:
            ray.kill(self.actor)
        except Exception:  # already gone
            pass


def _node_address() -> tuple[str, int]:
    """This node's IP, as Ray knows it, and a TCP port free on it now (a Ray task's body)."""
    return import_ray().util.get_node_ip_address(), free_port("")


class ActorGroup:
    """Engine actors in one placement group, one bundle per engine: what data-parallel replicas and
    prefill/decode workers share. ``param`` names the option that asked for the bundles in errors."""

    def __init__(self, count: int, device: str, param: str, placement_timeout: float = _PLACEMENT_TIMEOUT_S) -> None:
        ray = self._ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        if not ray.is_initialized():
            ray.init()
        #: GPU bundles: asked for (``cuda``), or ``auto`` on a cluster that has GPUs
        self.gpu = device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        bundle = {"GPU": 1, "CPU": 1} if self.gpu else {"CPU": 1}
        self.group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
        self.actors: list[Any] = []
        self._remove = remove_placement_group
        try:
            ray.get(self.group.ready(), timeout=placement_timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise InvalidRequestError(
                f"{param} {count}: the Ray cluster cannot place {count} bundle(s) of {bundle} within "
                f"{placement_timeout:.0f}s (it has {ray.available_resources()} free of {ray.cluster_resources()})",
                param=param) from None

    @property
    def device(self) -> str:
        """The engine device of an actor of this group (``cuda``: it sees only its own GPU)."""
        return "cuda" if self.gpu else "cpu"

    def _strategy(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)

    def start(self, bundle: int, engine_args: EngineArgs, role: Any = None) -> Any:
        """An :class:`EngineActor` in ``bundle`` (it builds its engine while this returns)."""
        actor_cls = self._ray.remote(EngineActor)
        level, threads = logging.getLogger("loopline").getEffectiveLevel(), torch.get_num_threads()
        actor = actor_cls.options(num_cpus=1, num_gpus=1 if self.gpu else 0, max_concurrency=_ACTOR_CONCURRENCY,
                                  scheduling_strategy=self._strategy(bundle)).remote(engine_args, level, threads, role)
        self.actors.append(actor)
        return actor

    def node_address(self, bundle: int) -> tuple[str, int]:
        """The IP of the node holding ``bundle`` and a port free there (reachable from the other nodes)."""
        task = self._ray.remote(num_cpus=0)(_node_address)
        return self._ray.get(task.options(scheduling_strategy=self._strategy(bundle)).remote(),
                             timeout=_PLACEMENT_TIMEOUT_S)

    def release(self) -> None:
        """Kills every actor (those already stopped are skipped) and frees the placement group (once)."""
        actors, self.actors = self.actors, []
        for actor in actors:
            try:
                self._ray.kill(actor)
            except Exception:  # already gone
                pass
        if self.group is not None:
            self._remove(self.group)
            self.group = None


def start_ray_replicas(args: EngineArgs, placement_timeout: float = _PLACEMENT_TIMEOUT_S) -> DPClient:
    """``args.data_parallel_size`` engine actors in one placement group, behind a :class:`DPClient`."""
    n = args.data_parallel_size
    group = ActorGroup(n, args.device, "data_parallel_size", placement_timeout)
    try:
        actors = [group.start(i, dataclasses.replace(replica_args(args, i, "ray"), device=group.device))
                  for i in range(n)]
        clients = start_in_parallel([partial(RayEngineClient, actor, i) for i, actor in enumerate(actors)])
    except BaseException:
        group.release()
        raise
    return DPClient(clients, on_shutdown=group.release)


class RayWorker(WorkerLink, RayEngineClient):
    """A prefill or decode worker's Ray actor, as ``pd.PDClient`` sees it."""

    def __init__(self, owner: Any, spec: WorkerSpec, actor: Any) -> None:
        self._link(owner, spec)
        RayEngineClient.__init__(self, actor, spec.index, what=self.name)


class RayWorkerPool(WorkerPool):
    """Prefill and decode workers as Ray actors, one placement-group bundle each (a GPU per bundle
    on CUDA). The KV transport group meets at the node of bundle 0 (the first prefill worker, rank
    0), on a port free there: the address Ray reports for that node, reachable from the others."""

    def __init__(self, args: EngineArgs, placement_timeout: float = _PLACEMENT_TIMEOUT_S) -> None:
        self._group = ActorGroup(args.prefill_workers + args.decode_workers, args.device, "prefill_workers",
                                 placement_timeout)
        # NOTE: the type only (the front end may have no GPU): each actor resolves its own device
        self.device = torch.device("cuda" if self._group.gpu else "cpu")
        self.devices_shared = False  # a GPU per bundle

    def rendezvous(self) -> str:
        host, port = self._group.node_address(0)
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def worker_args(self, args: EngineArgs, rank: int) -> dict[str, Any]:
        return dict(device=self._group.device)

    def start(self, owner: Any, specs: list[WorkerSpec]) -> list[WorkerLink]:
        # NOTE: every actor builds its engine at once; the clients then wait for each one's start
        actors = [self._group.start(spec.rank, spec.engine_args, spec.role) for spec in specs]
        return start_in_parallel([partial(RayWorker, owner, spec, actor) for spec, actor in zip(specs, actors)])

    def release(self) -> None:
        self._group.release()
