"""Data-parallel replicas behind one front end: :class:`DPClient`, the engine client ``AsyncLLM`` takes.

Each replica is a whole engine with a client of its own: an engine process
(:class:`~loopline.runtime.client.MPClient`, ``--distributed-executor-backend mp``)
or a Ray actor (``ray_backend.RayEngineClient``). :class:`DPClient` has the
interface of one engine client, so ``AsyncLLM``, the HTTP server and the RL
routes run unchanged over N replicas:

* **adds** go request by request to the replica its :class:`~loopline.distributed.router.Router`
  picks (load and prefix affinity); a multi-prompt add is split by replica and
  stays all-or-none (a refusal on one replica aborts what the others accepted).
  Outputs stream from the replica's client straight into the caller's stream.
* **aborts** go to the replica that owns the request (the front end remembers
  which one until the request finishes).
* **control calls** (the verbs of ``engine/verbs.py``: pause / resume, weight
  updates, prefix cache, sleep / wake, abort-all) fan out to every live replica
  and answer once (``runtime.fanout``), combined by the verb's rule: the ids
  ``abort_all`` aborted are merged, most other answers must agree on every
  replica (the weight version, say) or the call fails with ``EngineStateError``;
  a replica's error is raised with the replica named.
* **a replica that dies** fails only the requests it held (``EngineDeadError``
  naming the replica); the router skips it from then on, ``replicas()`` reports
  it to the health route and the metrics, and the others keep serving. The
  client as a whole is dead only when every replica is.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from loopline.config import EngineArgs, resolve_device
from loopline.engine import LLMEngine, PromptType
from loopline.engine.verbs import VERBS
from loopline.distributed.router import LoadAffinityRouter, ReplicaLoad, Router
from loopline.errors import EngineDeadError, InvalidRequestError, LooplineError
from loopline.runtime.client import EngineClient, call_soon, set_exception, set_result
from loopline.runtime.fanout import fan_out
from loopline.runtime.protocol import EngineSnapshot, OutputDelta, StepRecord
from loopline.sampling_params import SamplingParams

logger = logging.getLogger("loopline.dp")


def replica_args(args: EngineArgs, index: int, backend: str) -> EngineArgs:
    """Replica ``index``'s own engine arguments: one engine, on its own device (``cuda:index`` for
    engine processes on CUDA; a Ray actor sees only its own GPU, as ``cuda``), drawing the seeds
    of unseeded requests from ``seed + index`` so replicas never hand out the same ones."""
    device = args.device
    if resolve_device(args.device).type == "cuda":
        device = f"cuda:{index}" if backend == "mp" else "cuda"
    return dataclasses.replace(args, data_parallel_size=1, distributed_executor_backend="mp", device=device,
                               seed=args.seed + index)


def start_in_parallel(starts: Sequence[Callable[[], EngineClient]]) -> list[EngineClient]:
    """Builds every replica's client at once (each loads a model); if one fails, the others are shut
    down and its error is raised."""
    with concurrent.futures.ThreadPoolExecutor(len(starts), thread_name_prefix="loopline-dp-start") as pool:
        futures = [pool.submit(start) for start in starts]
        concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().shutdown(5)
        raise errors[0]
    return [f.result() for f in futures]


class DPClient(EngineClient):
    """One engine client's interface over several replicas' clients (see the module docstring)."""

    # NOTE: EngineClient.__init__ is not called: the per-message state (streams, acks, the
    # output assembler) lives in each replica's client; this one only routes.
    def __init__(self, replicas: list[EngineClient], router: Router | None = None,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        """``router``: default :class:`LoadAffinityRouter` over the engine's KV pages; ``on_shutdown``:
        runs after every replica stopped (the Ray backend frees its placement group there)."""
        if not replicas:
            raise InvalidRequestError("a data-parallel client needs at least one replica", param="replicas")
        self._replicas = list(replicas)
        self.info = replicas[0].info
        self.router = router or LoadAffinityRouter(page_size=self.info.config.block_size)
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}  # request id -> its replica, until it finished or failed
        self._in_flight = [0] * len(replicas)
        self._dead_seen: set[int] = set()
        self._stopping = False
        self._on_shutdown = on_shutdown

    # --- the client's state, from its replicas ----------------------------------------------
    def replicas(self) -> list[EngineClient]:
        return list(self._replicas)

    @property
    def size(self) -> int:
        return len(self._replicas)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = value
        for client in self._replicas:
            client.stopping = value

    @property
    def dead(self) -> BaseException | None:
        """``None`` while a replica serves; once all stopped, an error that names why each did."""
        if any(_serves(c) for c in self._replicas):
            return None
        why = "; ".join(f"replica {i}: {c.dead or 'stopped'}" for i, c in enumerate(self._replicas))
        return EngineDeadError(f"every data-parallel replica stopped ({why})")

    @property
    def snapshot(self) -> EngineSnapshot:
        """The live replicas' gauges added up (paused: all of them are; weights: the worst state)."""
        return EngineSnapshot.total([c.snapshot for c in self._replicas if _serves(c)] or [self._replicas[0].snapshot])

    def is_alive(self) -> bool:
        return any(_serves(c) for c in self._replicas)

    @property
    def engine(self) -> LLMEngine:
        raise AttributeError("data-parallel replicas run their engines in other processes")

    def shutdown(self, timeout: float | None) -> None:
        threads = [threading.Thread(target=c.shutdown, args=(timeout,), name=f"loopline-dp-stop-{i}")
                   for i, c in enumerate(self._replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._on_shutdown is not None:
            self._on_shutdown()

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        for i, client in enumerate(self._replicas):
            client.add_step_listener(partial(_tag_step, fn, i))

    def has_stream(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._owner

    def owner(self, request_id: str) -> int | None:
        """The replica serving ``request_id`` (``None``: finished, failed or unknown)."""
        with self._lock:
            return self._owner.get(request_id)

    # --- requests ---------------------------------------------------------------------------
    def _loads_locked(self) -> list[ReplicaLoad]:
        """What the router sees now, one entry per replica (under ``_lock``: it notes replicas that died)."""
        loads = []
        for i, client in enumerate(self._replicas):
            alive = _serves(client)
            if not alive and i not in self._dead_seen:
                self._dead_seen.add(i)
                self.router.replica_died(i)
                logger.warning("data-parallel replica %d stopped (%s); routing to the others", i,
                               client.dead or "its engine is gone")
            snap = client.snapshot
            loads.append(ReplicaLoad(alive, self._in_flight[i], snap.num_waiting, snap.kv_used_blocks,
                                     snap.kv_total_blocks))
        return loads

    def add(self, requests: list[tuple[str, PromptType, SamplingParams]], chat_stop: bool, stream: Any,
            ack: asyncio.Future) -> None:
        """Routes each request to a replica and sends each replica its share; ``ack`` resolves once
        every share was accepted (or with the first refusal, after the accepted shares were aborted)."""
        try:
            groups = self._route(requests)
        except LooplineError as e:
            call_soon(ack.get_loop(), set_exception, ack, e)
            return
        join = _AddJoin(self, ack, chat_stop, stream)
        for i, group in groups.items():
            join.send(i, group)

    def _route(self, requests: list[tuple[str, PromptType, SamplingParams]]) -> dict[int, list]:
        """Picks each request's replica and records it as the owner (all or none: on an error nothing is kept)."""
        groups: dict[int, list[tuple[str, PromptType, SamplingParams]]] = {}
        with self._lock:
            try:
                error = self._refusal()
                if error is not None:
                    raise error
                for request in requests:
                    rid = request[0]
                    if rid in self._owner:
                        raise InvalidRequestError(f"request_id {rid!r} is already in use", param="request_id")
                    i = self.router.choose(_prompt_ids(request[1]), self._loads_locked())
                    groups.setdefault(i, []).append(request)
                    self._owner[rid] = i
                    self._in_flight[i] += 1
            except LooplineError:
                for i, group in groups.items():
                    self._release_locked([rid for rid, _, _ in group], i)
                raise
        return groups

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                i = self._owner.get(rid)
                if i is not None:  # else finished, failed or unknown: nothing to abort
                    by_replica.setdefault(i, []).append(rid)
        for i, ids in by_replica.items():
            self._replicas[i].abort(ids)

    def _release(self, request_ids: list[str], index: int) -> None:
        with self._lock:
            self._release_locked(request_ids, index)

    def _release_locked(self, request_ids: list[str], index: int) -> None:
        for rid in request_ids:
            if self._owner.get(rid) == index:
                del self._owner[rid]
                self._in_flight[index] -= 1

    # --- control calls ----------------------------------------------------------------------
    def call(self, name: str, args: tuple = (), until_drained: bool = False) -> concurrent.futures.Future:
        """The verb ``name`` on every live replica; one answer (see the module docstring)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            verb = VERBS.lookup(name)
        except LooplineError as e:
            future.set_exception(e)
            return future
        error = self._refusal()
        if error is not None:
            future.set_exception(error)
            return future
        live = [(i, c) for i, c in enumerate(self._replicas) if _serves(c)]
        return fan_out(verb, args, until_drained, live, engines="data-parallel replicas", label=lambda i: f"replica {i}",
                       name_error=lambda i, e: _naming_replica(e, i, self.size))


class _AddJoin:
    """One add split over replicas: resolves the caller's ack once every share settled (on its loop).
    A share whose replica died before taking it (nothing started there) is routed again."""

    _REROUTED = object()

    def __init__(self, dp: DPClient, ack: asyncio.Future, chat_stop: bool, stream: Any) -> None:
        self.dp, self.ack, self.chat_stop, self.stream = dp, ack, chat_stop, stream
        self.shares: list[tuple[int, list]] = []  # (replica, its requests)
        self.outcomes: dict[int, Any] = {}  # share -> None (accepted), its error, or _REROUTED
        self.pending = 0

    def send(self, index: int, group: list) -> None:
        k = len(self.shares)
        self.shares.append((index, group))
        self.pending += 1
        share = self.ack.get_loop().create_future()
        share.add_done_callback(partial(self.settled, k))
        self.dp._replicas[index].add(group, self.chat_stop,
                                     _ReplicaStream(self.dp, index, self.stream, [r for r, _, _ in group]), share)

    def settled(self, k: int, share: asyncio.Future) -> None:
        self.pending -= 1
        index, group = self.shares[k]
        error = share.exception()
        if isinstance(error, EngineDeadError) and not _serves(self.dp._replicas[index]):
            self.dp._release([rid for rid, _, _ in group], index)
            try:
                groups = self.dp._route(group)
            except LooplineError as e:  # no replica is left (or the client is stopping)
                error = e
            else:
                error = self._REROUTED
                for i, g in groups.items():
                    self.send(i, g)
        self.outcomes[k] = error
        if self.pending:
            return
        failed = [(self.shares[j][0], e) for j, e in self.outcomes.items() if e is not None and e is not self._REROUTED]
        if not failed:
            set_result(self.ack, None)
            return
        accepted = [(self.shares[j][0], [rid for rid, _, _ in self.shares[j][1]])
                    for j, e in self.outcomes.items() if e is None]
        self.dp.abort([rid for _, ids in accepted for rid in ids])  # all or none, as on one engine
        for i, ids in accepted:
            self.dp._release(ids, i)
        for j, e in self.outcomes.items():
            if e is not None and e is not self._REROUTED:
                self.dp._release([rid for rid, _, _ in self.shares[j][1]], self.shares[j][0])
        i, error = failed[0]
        set_exception(self.ack, _naming_replica(error, i, self.dp.size) if isinstance(error, EngineDeadError) else error)


class _ReplicaStream:
    """What a replica's client fills for one add: the caller's stream (each request's deltas pass
    through as they came), plus the owner bookkeeping."""

    def __init__(self, dp: DPClient, index: int, stream: Any, request_ids: list[str]) -> None:
        self.dp, self.index, self.stream, self.request_ids = dp, index, stream, request_ids

    def _put(self, delta: OutputDelta) -> None:
        if delta.finished:
            self.dp._release([delta.request_id], self.index)
        self.stream._put(delta)

    def _fail(self, error: BaseException) -> None:
        replica = self.dp._replicas[self.index]
        self.dp._release([rid for rid in self.request_ids if not replica.has_stream(rid)], self.index)
        self.stream._fail(_naming_replica(error, self.index, self.dp.size) if isinstance(error, EngineDeadError)
                          else error)


def _serves(client: EngineClient) -> bool:
    return client.dead is None and client.is_alive()


def _tag_step(fn: Callable[[StepRecord], None], index: int, record: StepRecord) -> None:
    fn(dataclasses.replace(record, replica=index))


def _prompt_ids(prompt: PromptType) -> list[int] | None:
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids")
    return prompt if isinstance(prompt, list) else None


def _naming_replica(error: BaseException, index: int, size: int) -> BaseException:
    """The same error (type and fields) with the replica named in its message (loopline's own errors only)."""
    if size == 1 or not isinstance(error, LooplineError) or not error.args:
        return error
    named = copy.copy(error)
    named.args = (f"data-parallel replica {index}: {error.args[0]}", *error.args[1:])
    return named
