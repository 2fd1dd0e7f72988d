"""A request's KV pages in and out of the pool: preemption snapshots and the PD handoff.

Both move the same thing -- every plane's pages of one request plus its slot's
device state -- so they live together, off the model runner: a preempted
request goes to CPU memory and comes back unchanged (``snapshot`` /
``restore``, never recomputed: replay would change its exit history); a
prefill worker exports a finished prompt (``export_pages`` while it computes,
``export_request`` at the end) and a decode worker writes the pages into the
ones it reserved as they arrive (``write_pages``, off the compute stream) and
holds the request as a snapshot whose pages are in the pool already
(``adopt_request``), which the scheduler resumes like a preempted one.

The runner owns the KV tensors and the request table; :class:`KVPages` reads
the pool through a callable each time, because sleep releases and
re-allocates it at new addresses.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from loopline.attention.base import kv_bytes
from loopline.core.contracts import ResumedRequestData
from loopline.errors import EngineStateError
from loopline.kv.quant import KVScales, stored_dtype
from loopline.worker.decode_state import DeviceDecodeState
from loopline.worker.page_writes import PageWriter
from loopline.worker.request_state import RequestState
from loopline.worker.staging import stage
from loopline.worker.swap import HandoffState, Snapshot


class KVPages:
    """Owns the CPU snapshots of preempted (or adopted) requests and the writer of received pages.

    ``kv()`` returns the current ``(k_cache, v_cache)``; ``requests`` is the runner's table of
    running requests (shared, not copied); ``slot_hidden`` / ``slot_survival`` / ``decode_state``
    are the runner's per-slot device state."""

    def __init__(self, kv: Callable[[], tuple[Tensor, Tensor]], requests: dict[str, RequestState],
                 slot_hidden: Tensor, slot_survival: Tensor, decode_state: DeviceDecodeState, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, *,
                 kv_dtype: torch.dtype | None = None, kv_scales: KVScales | None = None) -> None:
        """``dtype``: the slot state's (the model's); ``kv_dtype``: the pool's (default ``dtype``). Pages of an
        FP8 pool move as raw bytes (``uint8``, :func:`loopline.kv.quant.raw`): the scales are per layer and
        head, the same for every page."""
        self._kv, self._requests = kv, requests
        self._slot_hidden, self._slot_survival, self._decode_state = slot_hidden, slot_survival, decode_state
        self.block_size, self.hidden_size, self.dtype, self.device = block_size, hidden_size, dtype, device
        self.page_dtype = stored_dtype(kv_dtype or dtype)  # what exported and received pages hold
        self.kv_scales = kv_scales.to(torch.device("cpu")) if kv_scales is not None else None
        self.snapshots: dict[str, Snapshot] = {}
        self.writer = PageWriter(device)  # handed-off pages, written as they arrive

    def _pool(self) -> tuple[Tensor, Tensor]:
        """The pool's K and V as the dtype pages move in (bytes for FP8)."""
        k_cache, v_cache = self._kv()
        return kv_bytes(k_cache), kv_bytes(v_cache)

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.k.nbytes + s.v.nbytes for s in self.snapshots.values() if s.k is not None)

    def forget(self, request_id: str) -> None:
        """A finished request: its snapshot goes, and steps launched from now on (which may write its
        freed pages) wait for any writes of its received pages."""
        self.snapshots.pop(request_id, None)
        self.writer.wait(request_id)

    def clear(self) -> None:
        """Drops every snapshot and pending write record (the pool is being released)."""
        self.snapshots.clear()
        self.writer.clear()

    # --- preemption -------------------------------------------------------------------
    def _blocks_index(self, tables: list[np.ndarray]) -> Tensor:
        """Physical blocks of every plane, plane-major (staged: a pageable copy would wait for the steps in flight)."""
        return stage(self.device, (np.concatenate(tables), np.int64))[0]

    def snapshot(self, request_id: str) -> None:
        """Moves a preempted request to CPU memory: KV of every plane, slot state, request state."""
        st = self._requests.pop(request_id)
        idx = self._blocks_index(st.block_arrays)
        pin = self.device.type == "cuda"

        def to_host(t: Tensor) -> Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return host

        k_cache, v_cache = self._pool()
        slot = st.slot
        self.snapshots[request_id] = Snapshot(
            k=to_host(k_cache[:, idx]), v=to_host(v_cache[:, idx]),
            slot_hidden=to_host(self._slot_hidden[slot]), slot_survival=to_host(self._slot_survival[slot]),
            state=st.to(torch.device("cpu")), blocks_per_plane=len(st.block_arrays[0]),
            decode_state=self._decode_state.save(slot, to_host))

    def restore(self, resumed: ResumedRequestData) -> None:
        """Puts a snapshot back: its pages into the request's new tables, its slot state into its new slot."""
        snap = self.snapshots.pop(resumed.request_id)
        st = snap.state.to(self.device)
        st.block_arrays = [np.asarray(t, dtype=np.int32) for t in resumed.block_tables]
        # The new tables may be longer (room for the next position); the snapshot fills their heads,
        # except pages the prefix cache gave it (shared with other requests: never written).
        if snap.k is None:  # a handed-off request: its pages were written in place as they arrived
            self.writer.wait(resumed.request_id)
        else:
            self._restore_pages(snap, st.block_arrays, resumed.num_cached_pages)
        # A preemption snapshot's buffers are pinned on CUDA, so these copies queue behind the steps in
        # flight; a handoff's come from another process in pageable memory and copy synchronously.
        self._slot_hidden[resumed.slot].copy_(snap.slot_hidden, non_blocking=True)
        self._slot_survival[resumed.slot].copy_(snap.slot_survival, non_blocking=True)
        st.slot = resumed.slot
        self._decode_state.load(resumed.slot, snap.decode_state, resumed.block_tables)
        self._requests[resumed.request_id] = st

    def _restore_pages(self, snap: Snapshot, tables: list[np.ndarray], cached: int) -> None:
        bpp = snap.blocks_per_plane
        idx = self._blocks_index([t[cached:bpp] for t in tables])
        k, v = snap.k, snap.v
        if cached:
            keep = torch.cat([torch.arange(p * bpp + cached, (p + 1) * bpp) for p in range(len(tables))])
            k, v = k[:, keep.to(k.device)], v[:, keep.to(v.device)]
        k_cache, v_cache = self._pool()
        k_cache[:, idx] = k.to(self.device, non_blocking=True)
        v_cache[:, idx] = v.to(self.device, non_blocking=True)

    # --- prefill/decode disaggregation ----------------------------------------------------
    def export_pages(self, request_id: str, first: int, last: int) -> Tensor:
        """A copy of a running request's pages ``[first, last)`` of every plane (plane-major),
        ``[2 (k, v), layers, planes * (last - first), block_size, kv_heads, D]`` on this device, queued
        after the steps already launched (so it holds what they wrote)."""
        st = self._requests[request_id]
        k_cache, v_cache = self._pool()
        # (staged through pinned memory: a pageable copy would wait for the steps in flight)
        idx = stage(self.device, (np.concatenate([a[first:last] for a in st.block_arrays]), np.int64))[0]
        kv = torch.empty((2, k_cache.shape[0], idx.numel(), *k_cache.shape[2:]), dtype=self.page_dtype,
                         device=self.device)
        torch.index_select(k_cache, 1, idx, out=kv[0])
        torch.index_select(v_cache, 1, idx, out=kv[1])
        return kv

    def prompt_pages(self, request_id: str) -> int:
        """Pages per plane that hold the request's prompt."""
        return -(-self._requests[request_id].prompt.numel() // self.block_size)

    def export_request(self, request_id: str, first_page: int = 0) -> tuple[HandoffState, Tensor]:
        """Takes a request whose prompt finished (its first token fed to its slot) off this runner:
        its slot state on the CPU and a copy of its prompt's pages from ``first_page`` on (the
        earlier ones were exported already, ``export_pages``); the pool's pages may be reused at
        once. With the earlier pages, exactly what a preemption snapshot holds, without the prefill
        buffers a decode worker never reads."""
        blocks = self.prompt_pages(request_id)
        kv = self.export_pages(request_id, first_page, blocks)
        st = self._requests.pop(request_id)
        cpu = torch.device("cpu")
        slot = st.slot
        state = HandoffState(
            params=st.params, seed=st.seed, prompt_token_ids=st.prompt.tolist(), prompt_exit=st.prompt_exit,
            max_len=st.max_len, blocks_per_plane=blocks, slot_hidden=self._slot_hidden[slot].to(cpu),
            slot_survival=self._slot_survival[slot].to(cpu),
            decode_state=self._decode_state.save(slot, lambda t: t.to(cpu)), kv_scales=self.kv_scales)
        return state, kv

    def write_pages(self, request_id: str, block_tables: list[list[int]], first: int, kv: Tensor,
                    skip: int = 0) -> None:
        """Writes received pages into the pool: ``kv`` is ``[2, layers, planes * n, block_size, kv_heads,
        D]`` (pages ``[first, first + n)`` of every plane, plane-major, as ``export_pages`` gives them),
        page ``i`` of plane ``p`` goes to ``block_tables[p][i]``; pages below ``skip`` are left alone
        (the prefix cache gave them: shared, never written). On CUDA the copy runs on a stream of its
        own, after the steps already launched (they may still write pages freed to this request) and
        before the step that resumes the request (``restore`` waits for it)."""
        k_cache, v_cache = self._pool()
        planes = len(block_tables)
        n = kv.shape[2] // planes if kv.dim() == 6 else 0
        expected = (2, k_cache.shape[0], planes * n, *k_cache.shape[2:])
        if tuple(kv.shape) != expected or kv.dtype != self.page_dtype:
            raise ValueError(f"KV pages of shape {tuple(kv.shape)} {kv.dtype}, expected {expected} {self.page_dtype} "
                             "(prefill and decode workers must run the same kv_cache_dtype)")
        if first < 0 or first + n > len(block_tables[0]):
            raise ValueError(f"pages [{first}, {first + n}) outside the {len(block_tables[0])} reserved per plane")
        pages = np.arange(max(first, skip), first + n)
        if not len(pages):
            return
        src = np.concatenate([p * n + pages - first for p in range(planes)])
        dst = np.concatenate([np.asarray(t, dtype=np.int64)[pages] for t in block_tables])
        self.writer.write(request_id, (k_cache, v_cache), dst, src, kv)

    def release_pages(self, request_id: str) -> None:
        """Forgets a request whose pages were written but will not be resumed (aborted, dropped,
        failed): steps launched from now on, which may reuse its pages, wait for the writes."""
        self.writer.wait(request_id)

    def adopt_request(self, request_id: str, state: HandoffState) -> None:
        """Holds a request exported by another runner (``export_request``) as a preemption snapshot
        whose pages are in the pool already (``write_pages``): the scheduler resumes it like a
        preempted request (``ResumedRequestData``) and no page is copied then."""
        mine, theirs = self.kv_scales, state.kv_scales
        if (mine is None) != (theirs is None) or (mine is not None and not mine.same_as(theirs)):
            raise EngineStateError(f"request {request_id!r}: its KV pages were written with other FP8 scales "
                             f"({theirs.source if theirs else 'none'}) than this worker's "
                             f"({mine.source if mine else 'none'}); prefill and decode workers must load the same "
                             "checkpoint with the same kv_cache_dtype")
        h, cpu = self.hidden_size, torch.device("cpu")
        st = RequestState(params=state.params, seed=state.seed,
                          prompt=torch.tensor(state.prompt_token_ids, dtype=torch.long), block_arrays=[],
                          prompt_exit=state.prompt_exit, hidden=torch.empty(0, h, dtype=self.dtype, device=cpu),
                          survival=torch.empty(0, device=cpu), sel_hidden=torch.empty(0, h, dtype=self.dtype, device=cpu),
                          sel_depth=torch.empty(0, dtype=torch.long, device=cpu), max_len=state.max_len)
        self.snapshots[request_id] = Snapshot(k=None, v=None, slot_hidden=state.slot_hidden,
                                              slot_survival=state.slot_survival, state=st,
                                              blocks_per_plane=state.blocks_per_plane, decode_state=state.decode_state)
