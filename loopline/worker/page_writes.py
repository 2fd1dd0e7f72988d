"""Received KV pages written into the pool off the compute stream (prefill/decode disaggregation).

A decode worker writes each piece of a handed-off request's prompt pages into the pages it
reserved as the piece arrives (``KVPages.write_pages``). On CUDA the copies run on a stream of
their own so that they overlap the steps: each copy first waits for the steps already launched
(they may still write pages that were freed and reserved for this request), and the step that
first reads the pages -- or that may reuse them, once the request is dropped -- waits for the
request's last copy. On the CPU everything runs in order and a write is a plain copy.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from loopline.worker.staging import stage


class PageWriter:
    """Owns the copy stream and, per request, the event after its last write."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._events: dict[str, torch.cuda.Event] = {}

    def write(self, request_id: str, caches: tuple[Tensor, Tensor], dst: np.ndarray, src: np.ndarray,
              kv: Tensor) -> None:
        """``caches[i][:, dst[j]] = kv[i][:, src[j]]`` for k (i = 0) and v (i = 1)."""
        if self.device.type != "cuda":
            _copy(caches, kv.to(self.device), torch.from_numpy(dst), torch.from_numpy(src))
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            src_t, dst_t = stage(self.device, src, dst)
            kv = kv.to(self.device, non_blocking=True)
            _copy(caches, kv, dst_t, src_t)
        kv.record_stream(stream)  # the allocator must not hand the received tensor out before the copy ran
        event = torch.cuda.Event()
        event.record(stream)
        self._events[request_id] = event  # the stream runs in order: the last event covers every write

    def wait(self, request_id: str) -> None:
        """Steps launched from now on run after the request's writes (a no-op without any)."""
        event = self._events.pop(request_id, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def clear(self) -> None:
        self._events.clear()


def _copy(caches: tuple[Tensor, Tensor], kv: Tensor, dst: Tensor, src: Tensor) -> None:
    """``caches[i][:, dst[j]] = kv[i][:, src[j]]`` for k (i = 0) and v (i = 1), on the current stream."""
    for cache, part in zip(caches, kv):
        cache.index_copy_(1, dst, part.index_select(1, src))
