"""The prefill and decode workers' engine loops (see ``distributed/pd.py`` for a request's life).

:class:`WorkerRole` tells ``run_engine_process`` (or a Ray actor) which loop to build:
:class:`PrefillCore` sends a request's final prompt pages to its decode worker while the next
chunks compute and hands the request off after its first token; :class:`DecodeCore` reserves the
pages, writes pieces as they arrive and adopts the request once all are in.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from loopline.core.request import RequestStatus
from loopline.engine import LLMEngine
from loopline.engine.input_processor import parent_request_id
from loopline.errors import EngineInternalError, EngineStateError, LooplineError, new_error_id
from loopline.distributed.kv_transfer import KVTransport, make_transport
from loopline.runtime.core import EngineCore, Inbox
from loopline.runtime.protocol import (AbortCmd, AcceptCmd, Command, DropCmd, HandoffMsg, PageReservation, PieceCmd,
                                       PieceDoneCmd, PieceMsg, PrefillCmd)

logger = logging.getLogger("loopline.pd")


@dataclass
class WorkerRole:
    """How ``run_engine_process`` builds a prefill or decode worker (picklable: it crosses ``spawn``)."""

    kind: str  # "prefill" | "decode"
    rank: int  # in the transport group: prefill workers first, then decode workers
    world_size: int
    init_method: str
    transport: str
    timeout_s: float

    def build_engine(self, engine_args: Any) -> LLMEngine:
        # NOTE: the transport is made here, before the engine reports that it started, so that
        # a transport that cannot work (nixl missing) is the start's error, not a dead worker.
        self._transport = make_transport(self.transport, self.timeout_s)
        return LLMEngine(engine_args, prefill_only=self.kind == "prefill")

    def make_core(self, engine: LLMEngine, inbox: Inbox, emit) -> EngineCore:
        self._transport.start(self.rank, self.world_size, self.init_method, engine.config.device)
        cls = PrefillCore if self.kind == "prefill" else DecodeCore
        return cls(engine, inbox, emit, self._transport)


class PrefillCore(EngineCore):
    """The loop of a prefill worker: after every step, the prompt pages that became final are sent
    to the request's decode worker (``PieceMsg``) while the next chunks compute; a request leaves
    after its first token with the rest (``HandoffMsg``)."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, emit, transport: KVTransport) -> None:
        super().__init__(engine, inbox, emit)
        self.transport = transport
        self._targets: dict[str, tuple[int, int]] = {}  # request id -> (decode rank, first tag)
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (pages sent, pieces sent)

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, PrefillCmd):
            self._targets.update(cmd.targets)
        super()._apply(cmd)

    def _step(self) -> bool:
        progressed = super()._step()
        for child, pages in self.engine.handoff.final_prompt_pages().items():
            rid = parent_request_id(child)
            if rid not in self._targets:
                continue
            try:
                sent, _ = self._sent.get(rid, (0, 0))
                req = self.engine.scheduler.requests[child]
                if pages > sent and req.status == RequestStatus.PREFILL:
                    self._send_piece(rid, PageReservation(child, req.prompt_token_ids, req.params._cache_salt),
                                     self.engine.handoff.export_pages(child, sent, pages), sent, pages)
            except Exception as e:  # this request fails; the others go on
                self._fail(rid, e)
        for child in self.engine.handoff.ready():
            progressed = True
            self._hand_off(child)
        if len(self._targets) > len(self._live):  # requests that finished or failed here
            self._targets = {rid: t for rid, t in self._targets.items() if rid in self._live}
            self._sent = {rid: t for rid, t in self._sent.items() if rid in self._live}
        return progressed

    def _send_piece(self, rid: str, reservation: PageReservation, kv: torch.Tensor, first: int, end: int) -> None:
        rank, tag0 = self._targets[rid]
        _, count = self._sent.get(rid, (0, 0))
        tag = tag0 + count
        payload, sent = self.transport.send(kv, rank, tag)
        sent.add_done_callback(lambda f: f.exception() is not None and logger.error(
            "request %s: sending KV pages to worker %d failed: %s", rid, rank, f.exception()))
        self._sent[rid] = (end, count + 1)
        self._msg.handoffs.append(PieceMsg(rid, tag, payload, tuple(kv.shape), kv.dtype, first,
                                           reservation if count == 0 else None))

    def _hand_off(self, child: str) -> None:
        rid = parent_request_id(child)
        try:
            sent, _ = self._sent.get(rid, (0, 0))
            handoff, rest = self.engine.handoff.take(child, sent)
            if rest.shape[2]:
                reservation = PageReservation(child, handoff.prompt_token_ids, handoff.params._cache_salt)
                self._send_piece(rid, reservation, rest, sent,
                                 sent + rest.shape[2] // self.engine.kv.layout.num_planes)
            self._msg.handoffs.append(HandoffMsg(handoff, self._sent.get(rid, (0, 0))[1]))
        except Exception as e:
            self._fail(rid, e)
        self._targets.pop(rid, None)
        self._sent.pop(rid, None)
        self._live.discard(rid)

    def _fail(self, rid: str, error: Exception) -> None:
        error_id = new_error_id()
        logger.error("request %s: handing it to a decode worker failed (error id %s)", rid, error_id, exc_info=error)
        self.engine.abort_request(rid)
        self._live.discard(rid)
        self._targets.pop(rid, None)
        self._sent.pop(rid, None)
        self._msg.failures.append((rid, EngineInternalError(
            f"internal error while handing the request to a decode worker (error id {error_id})", error_id)))


@dataclass
class _Incoming:
    """A decode worker's view of a request on its way: its reserved pages, its pieces and, once sent,
    its handoff."""

    child_id: str | None = None  # set once its pages are reserved in the engine
    outstanding: int = 0  # receives not finished
    received: int = 0
    accept: AcceptCmd | None = None
    error: BaseException | None = None
    aborted: bool = False
    dropped: bool = False


class DecodeCore(EngineCore):
    """The loop of a decode worker: a request's prompt pages are reserved in the engine's KV pool when
    its first piece arrives (``PieceCmd``); the pieces are received on the transport's threads while
    the loop steps, and each is written straight into its reserved pages; the request resumes once its
    handoff (``AcceptCmd``) and all its pieces are in, with nothing left to copy."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, emit, transport: KVTransport) -> None:
        super().__init__(engine, inbox, emit)
        self.transport = transport
        self._incoming: dict[str, _Incoming] = {}

    @property
    def incoming(self) -> Mapping[str, _Incoming]:
        """The requests on their way here (id -> reserved pages, pieces, handoff, abort and drop marks),
        until adopted or forgotten: a read-only view."""
        return MappingProxyType(self._incoming)

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, PieceCmd):
            self._receive(cmd)
        elif isinstance(cmd, PieceDoneCmd):
            self._piece_done(cmd)
        elif isinstance(cmd, AcceptCmd):
            inc = self._incoming.setdefault(cmd.handoff.request_id, _Incoming())
            inc.accept, inc.aborted = cmd, inc.aborted or cmd.aborted
            self._maybe_adopt(cmd.handoff.request_id)
        elif isinstance(cmd, DropCmd):
            if cmd.request_id in self._incoming:
                inc = self._incoming[cmd.request_id]
                inc.dropped = True
                self._release(inc)  # at once: receives still on their way (a dead sender's) write nothing
                self._maybe_adopt(cmd.request_id)
        else:
            if isinstance(cmd, AbortCmd):
                for rid in cmd.request_ids:
                    if rid in self._incoming:
                        self._incoming[rid].aborted = True
            super()._apply(cmd)

    def _receive(self, cmd: PieceCmd) -> None:
        piece = cmd.piece
        inc = self._incoming.setdefault(piece.request_id, _Incoming())
        if piece.reservation is not None and inc.child_id is None and inc.error is None:
            try:
                self.engine.handoff.reserve(piece.reservation.child_id, piece.reservation.prompt_token_ids,
                                            piece.reservation.cache_salt)
                inc.child_id = piece.reservation.child_id
            except Exception as e:  # the request fails at its handoff; its pieces are still received
                inc.error = e  # (so that the sender's transfers complete), and dropped
        inc.outstanding += 1
        future = self.transport.recv(piece.payload, piece.shape, piece.dtype, cmd.src_rank, piece.tag)
        future.add_done_callback(lambda f, rid=piece.request_id, first=piece.first_page:
                                 self.inbox.put(PieceDoneCmd(rid, f, first)))

    def _piece_done(self, cmd: PieceDoneCmd) -> None:
        inc = self._incoming.get(cmd.request_id)
        if inc is None:
            return
        inc.outstanding -= 1
        try:
            kv = cmd.future.result()
            if inc.error is None and not (inc.dropped or inc.aborted):  # (else its pages are not read)
                if inc.child_id is None:
                    raise EngineStateError(f"pages of request {cmd.request_id!r} arrived before its reservation")
                self.engine.handoff.write_pages(inc.child_id, cmd.first_page, kv)
            inc.received += 1
        except Exception as e:
            inc.error = inc.error or e
            self._release(inc)  # it will fail at its handoff: its pages go now
        self._maybe_adopt(cmd.request_id)

    def _maybe_adopt(self, rid: str) -> None:
        """Adopts (or fails, or forgets) a request once nothing of it is still on its way; whatever
        does not end adopted frees its reserved pages."""
        inc = self._incoming[rid]
        if inc.outstanding:
            return
        if inc.dropped:
            self._forget(rid)
            return
        accept = inc.accept
        if accept is None:
            return  # more pieces, and the handoff, are coming
        if inc.error is None and inc.received < accept.num_pieces:
            return
        try:
            if inc.error is not None:
                raise inc.error
            self.engine.handoff.adopt(accept.handoff)
            del self._incoming[rid]
        except Exception as e:  # a failed transfer (or a refusal): this request fails alone
            self._forget(rid)
            if isinstance(e, LooplineError):
                failure: Exception = e
            else:
                error_id = new_error_id()
                logger.error("request %s: receiving it from worker %d failed (error id %s): %s", rid, accept.src_rank,
                             error_id, e)
                failure = EngineInternalError(f"the KV transfer of the request failed (error id {error_id}); "
                                              "it was aborted", error_id)
            self._msg.failures.append((rid, failure))
            return
        self._live.add(rid)  # (its deltas continue the prefill worker's: the engine's adopt saw to that)
        if inc.aborted:
            self.engine.abort_request(rid)

    def _forget(self, rid: str) -> None:
        self._release(self._incoming.pop(rid))

    def _release(self, inc: _Incoming) -> None:
        """Frees a request's reserved pages (it will not be adopted); later pieces are not written."""
        if inc.child_id is not None:
            self.engine.handoff.release(inc.child_id)
            inc.child_id = None
