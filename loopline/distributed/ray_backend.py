"""Data-parallel replicas as Ray actors (``--distributed-executor-backend ray``).

Each replica is an :class:`EngineActor`: the same :class:`EngineCore` loop that an
engine process runs, on a thread of a Ray actor. The actors are placed with one
placement group, one bundle per replica (``{"GPU": 1, "CPU": 1}`` on GPUs,
``{"CPU": 1}`` otherwise), so Ray decides the nodes and each actor sees only its
own GPU. Ray's actor calls are the transport: commands go down as ``submit``
calls (numbered, because a threaded actor may run calls out of order and the
engine loop must apply them in order), and a reader thread per replica
long-polls ``poll`` for the engine messages (pickled by the actor as an engine
process pickles them for its pipe). :class:`RayReplicaClient` is the
front-end half; it routes the messages exactly as ``MPClient`` does, so
``dp.DPClient`` treats both alike. An actor that dies (killed, its node lost)
makes ``poll`` raise: the replica is dead and its requests fail.

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
from loopline.engine import LLMEngine
from loopline.entrypoints.core_client import EngineClient
from loopline.entrypoints.engine_core import (Command, EngineCore, EngineInfo, EngineMessage, EngineSnapshot, Inbox,
                                              ShutdownCmd, _dumps)
from loopline.errors import EngineDeadError, InvalidRequestError

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
    """One replica's engine in a Ray actor: builds the engine, runs its loop on a thread, takes
    numbered commands and hands out the loop's messages (pickled bytes) to ``poll``."""

    def __init__(self, engine_args: EngineArgs, log_level: int, num_threads: int) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("loopline").setLevel(log_level)
        torch.set_num_threads(num_threads)
        self._cond = threading.Condition()
        self._out: list[bytes] = []
        self._next_seq = 0
        self._early: dict[int, Command] = {}  # commands that arrived before an earlier-numbered one
        self._loop: threading.Thread | None = None
        try:
            engine = LLMEngine(engine_args)
        except BaseException as e:  # the front end raises it (e.g. an invalid option)
            self._start = _dumps(EngineMessage(dead=e))
            return
        self._start = pickle.dumps(EngineInfo.of(engine), pickle.HIGHEST_PROTOCOL)
        self._inbox = Inbox()
        self._loop = threading.Thread(target=EngineCore(engine, self._inbox, self._emit).run, name="loopline-engine",
                                      daemon=True)
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
        data = _dumps(msg)
        with self._cond:
            self._out.append(data)
            self._cond.notify_all()


class RayReplicaClient(EngineClient):
    """The front-end half of one :class:`EngineActor` (routes its messages as ``MPClient`` does)."""

    def __init__(self, actor: Any, index: int) -> None:
        super().__init__()
        self._ray = import_ray()
        self.actor, self.index = actor, index
        try:
            first = pickle.loads(self._ray.get(actor.start.remote()))
        except self._ray.exceptions.RayError as e:
            raise EngineDeadError(f"the Ray actor of replica {index} failed while starting ({type(e).__name__}: "
                                  f"{e})") from None
        if isinstance(first, EngineMessage):  # the engine could not be built: its error, unchanged
            raise first.dead
        self.info = first
        self.snapshot = EngineSnapshot(kv_total_blocks=first.kv_pages)
        self._seq = itertools.count()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"loopline-ray-reader-{index}", daemon=True)
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
        self._die(EngineDeadError(f"the engine of replica {self.index} stopped unexpectedly: {reason}"))

    def is_alive(self) -> bool:
        return self._reader.is_alive()

    def shutdown(self, timeout: float | None) -> None:
        ray = self._ray
        if self._reader.is_alive():
            try:
                ray.get(self.actor.shutdown.remote(timeout), timeout=None if timeout is None else timeout + 5)
            except Exception:  # already dead, or a step that never returns: killed below
                logger.warning("replica %d did not stop cleanly; killing its actor", self.index, exc_info=True)
        self._reader.join(_POLL_S + 5)
        try:
            ray.kill(self.actor)
        except Exception:  # already gone
            pass


def start_ray_replicas(args: EngineArgs, placement_timeout: float = _PLACEMENT_TIMEOUT_S) -> DPClient:
    """``args.data_parallel_size`` engine actors in one placement group, behind a :class:`DPClient`."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init()
    n = args.data_parallel_size
    gpu = args.device.startswith("cuda") or (args.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=placement_timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise InvalidRequestError(
            f"data_parallel_size {n}: the Ray cluster cannot place {n} bundle(s) of {bundle} within "
            f"{placement_timeout:.0f}s (it has {ray.available_resources()} free of {ray.cluster_resources()})",
            param="data_parallel_size") from None
    actor_cls = ray.remote(EngineActor)
    level, threads = logging.getLogger("loopline").getEffectiveLevel(), torch.get_num_threads()
    actors = []
    for i in range(n):
        replica = dataclasses.replace(replica_args(args, i, "ray"), device="cuda" if gpu else "cpu")
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
        actors.append(actor_cls.options(num_cpus=1, num_gpus=1 if gpu else 0, max_concurrency=_ACTOR_CONCURRENCY,
                                        scheduling_strategy=strategy).remote(replica, level, threads))

    def release() -> None:
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass
        remove_placement_group(group)

    try:
        clients = start_in_parallel([partial(RayReplicaClient, actor, i) for i, actor in enumerate(actors)])
    except BaseException:
        release()
        raise
    return DPClient(clients, on_shutdown=release)

