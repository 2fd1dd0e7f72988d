"""What moves from a prefill worker's engine to a decode worker's engine (prefill/decode
disaggregation, ``loopline.distributed.pd``), besides the KV pages.

A prefill worker runs a request's prompt at full depth and samples its first token exactly
where a single engine does (the step in which the last prompt chunk finishes its last loop:
only that worker holds the last position's hidden state at the depth the exit rule picked).
The request then leaves it as a :class:`Handoff` -- the request as the scheduler knew it, the
runner's slot state and the output state the stream continues from -- and the decode worker,
whose pool already holds its prompt pages (reserved when the first of them arrived, written
as they came), resumes it as it would resume a preempted request.

:class:`HandoffPort` is an engine's side of it (``LLMEngine.handoff``): on a prefill worker it says
which prompt pages are final (:meth:`~HandoffPort.final_prompt_pages`), copies them out and takes
ready requests out (:meth:`~HandoffPort.take`); on a decode worker it reserves, writes and releases
the pages of requests on their way and adopts them. The engine's step knows nothing of it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loopline.core.contracts import SampledToken
from loopline.core.request import Request, RequestStatus
from loopline.core.scheduler import Scheduler
from loopline.engine.control import EngineControl
from loopline.engine.input_processor import InputProcessor, parent_request_id
from loopline.engine.output_processor import OutputProcessor
from loopline.errors import CapacityError, EngineStateError, InvalidRequestError
from loopline.kv.manager import KVCacheManager
from loopline.outputs import RequestMetrics
from loopline.sampling_params import SamplingParams
from loopline.worker.kv_pages import KVPages
from loopline.worker.swap import HandoffState


@dataclass
class Handoff:
    """One request (one completion) between its first token and its second. Plain CPU data."""

    request_id: str  # the parent id given to add_request
    child_id: str  # the scheduler's id
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # effective (seed, max_tokens and loop bounds resolved)
    seed: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    first: SampledToken  # the first generated token, already reported by the prefill worker
    weight_version: Any
    metrics: RequestMetrics
    runner: HandoffState  # (its KV pages travel on their own, into pages the decode worker reserved)


class HandoffPort:
    """An engine's end of prefill/decode disaggregation (see the module docstring). It works on the
    engine's scheduler, KV manager, KV pages and output state; the engine's step never calls it."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, pages: KVPages, inputs: InputProcessor,
                 outputs: OutputProcessor, control: EngineControl, num_loops: int,
                 check_alive: Callable[[], None]) -> None:
        self.scheduler, self.kv, self.pages = scheduler, kv, pages
        self.inputs, self.outputs, self.control = inputs, outputs, control
        self.num_loops = num_loops
        self._check_alive = check_alive
        self._reserved: set[str] = set()  # requests on their way here: prompt pages reserved, not adopted yet

    # --- prefill side -------------------------------------------------------------------
    def ready(self) -> list[str]:
        """Requests (scheduler ids) of a prefill-only engine whose first token was booked and did
        not end them: they wait for :meth:`take`."""
        return [r.request_id for r in self.scheduler.running if r.status == RequestStatus.HANDOFF and r.output]

    def final_prompt_pages(self) -> dict[str, int]:
        """Per prefilling request (scheduler id): how many of its prompt pages (per plane) hold final
        KV -- every position in them ran its last loop in a step already launched -- so a prefill
        worker can send them while the next chunks compute (:meth:`export_pages`)."""
        bs = self.kv.block_size
        out = {}
        for req in self.scheduler.running:
            if req.status == RequestStatus.HANDOFF:
                out[req.request_id] = -(-req.prompt_len // bs)
            elif req.status == RequestStatus.PREFILL:
                done = 0
                depth = req.prefill_loops or self.num_loops  # (a family may run a prompt fewer loops: Huginn)
                for chunk in req.chunks:  # in position order; a chunk finishes its last loop after the one before
                    if chunk.loops_done < depth:
                        break
                    done = chunk.end
                out[req.request_id] = done // bs
        return out

    def export_pages(self, child_id: str, first: int, last: int) -> torch.Tensor:
        """A copy of a prefilling request's prompt pages ``[first, last)`` of every plane."""
        return self.pages.export_pages(child_id, first, last)

    def take(self, child_id: str, first_page: int = 0) -> tuple[Handoff, torch.Tensor]:
        """Takes a ready request out of this engine for a decode worker: its :class:`Handoff` and a
        copy of its prompt's KV pages from ``first_page`` on (see ``KVPages.export_request``);
        its pages, slot and output state here are freed at once and it reports nothing more."""
        req = self.scheduler.requests[child_id]
        assert req.status == RequestStatus.HANDOFF and len(req.output) == 1, child_id
        rid = parent_request_id(child_id)
        state, kv = self.pages.export_request(child_id, first_page)
        handoff = Handoff(rid, child_id, self.outputs.prompt(rid), req.prompt_token_ids, req.params, req.seed,
                          req.max_tokens, req.eos_token_ids, req.output[0], self.control.weight_version,
                          self.outputs.metrics(rid), state)
        self.scheduler.finish_request(child_id, "handoff")
        self.outputs.forget(rid)
        return handoff, kv

    # --- decode side --------------------------------------------------------------------
    def reserve(self, child_id: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> None:
        """Reserves, in this engine's KV pool, the prompt pages (every plane the layout keeps) of a
        request a prefill worker is about to hand off, so that its pages are written straight into
        them as they arrive (:meth:`write_pages`) and :meth:`adopt` copies nothing. Prompt pages this
        engine's prefix cache holds under the request's ``cache_salt`` are shared, not written. Raises (changing nothing)
        ``CapacityError`` if the pool can never hold them, ``EngineStateError`` if it cannot now
        (admission credits should prevent that); :meth:`release` undoes it."""
        self._check_alive()
        if child_id in self._reserved or child_id in self.scheduler.requests:
            raise InvalidRequestError(f"request_id {parent_request_id(child_id)!r} is already in use",
                                      param="request_id")
        need = self.kv.blocks_needed(len(prompt_token_ids))
        if not self.kv.fits_ever(len(prompt_token_ids)):
            raise CapacityError(f"the prompt needs {need} KV blocks but this decode worker's pool has "
                                f"{self.kv.pool.num_blocks}", param="prompt")
        if self.kv.allocate(child_id, len(prompt_token_ids), prompt_token_ids,
                            self.scheduler.prefix_salt(cache_salt)) is None:
            raise EngineStateError(f"the prompt needs up to {need} KV blocks but this decode worker has "
                                   f"{self.kv.num_free_blocks} free of {self.kv.pool.num_blocks}: no room to "
                                   "receive the request's pages")
        self._reserved.add(child_id)

    def write_pages(self, child_id: str, first_page: int, kv: torch.Tensor) -> None:
        """Writes received prompt pages ``[first_page, first_page + n)`` of every plane (``kv``, as
        :meth:`export_pages` gave them, on any device) into the pages :meth:`reserve` reserved."""
        if child_id not in self._reserved:
            raise EngineStateError(f"no prompt pages are reserved for request {parent_request_id(child_id)!r}")
        alloc = self.kv.get(child_id)
        self.pages.write_pages(child_id, alloc.block_tables, first_page, kv,
                               skip=alloc.num_cached_tokens // self.kv.block_size)

    def release(self, child_id: str) -> None:
        """Frees the pages reserved for a request that will not be adopted (aborted, dropped or
        failed before its handoff); unknown ids are ignored."""
        if child_id in self._reserved:
            self._reserved.discard(child_id)
            self.pages.release_pages(child_id)
            self.kv.free(child_id)

    @property
    def num_reserved(self) -> int:
        """Requests whose prompt pages are reserved here and that were not adopted yet."""
        return len(self._reserved)

    def adopt(self, handoff: Handoff) -> str:
        """Takes over a request a prefill worker handed off, whose prompt pages were reserved
        (:meth:`reserve`) and written (:meth:`write_pages`): it resumes at its second token exactly
        as in the engine that produced its first, and its outputs continue the prefill worker's.
        Returns the text the prefill worker reported (where this engine's text deltas start). On an
        error the reservation stays (the caller releases it)."""
        self._check_alive()
        self.control.check_may_generate()
        if self.outputs.has(handoff.request_id):
            raise InvalidRequestError(f"request_id {handoff.request_id!r} is already in use", param="request_id")
        if handoff.child_id not in self._reserved:
            raise EngineStateError(f"no prompt pages are reserved for request {handoff.request_id!r}")
        total = len(handoff.prompt_token_ids) + handoff.max_tokens
        if not self.kv.fits_ever(total):
            raise CapacityError(f"request needs {self.kv.blocks_needed(total)} KV blocks but this decode worker's "
                                f"pool has {self.kv.pool.num_blocks}", param="max_tokens")
        req = Request(handoff.child_id, list(handoff.prompt_token_ids), handoff.params, handoff.seed,
                      handoff.max_tokens, handoff.eos_token_ids, self.inputs.next_arrival_seq(),
                      status=RequestStatus.PREEMPTED, output=[handoff.first], handed_off=True)
        req.resume_status = RequestStatus.DECODE
        self.pages.adopt_request(handoff.child_id, handoff.runner)
        try:
            text = self.outputs.adopt(req, handoff.prompt, handoff.metrics, handoff.weight_version)
        except Exception:  # e.g. the detokenizer on the first token: nothing of it stays but the reservation
            self.pages.snapshots.pop(handoff.child_id, None)
            self.outputs.forget(handoff.request_id)
            raise
        self._reserved.discard(handoff.child_id)  # the scheduler owns its pages from now on
        self.scheduler.adopt(req)
        return text
