"""CUDA graphs for decode-only steps at bucketed row counts, and for steps with small prefill chunks.

A decode-only step (decode rows derived from the device decode state,
prelude for rows starting a token, one traversal, gate, exit rule, slot
state, exit copy and coda) is captured once per bucket size. The host sends
only the rows' slots and exit rules, in one persistent device buffer laid out
per bucket (:class:`_Layout`), so a replay needs at most one host-to-device
copy: the host fills a pinned image of the layout, scratch padding included,
and copies it in without waiting for the device. Padding rows use a scratch
slot and a scratch KV block that no request owns, so they never touch real
state. Sampling runs eagerly on the graph's logits (its work depends on which
features the batch uses).
"""
from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch
from torch import Tensor

from loopline.attention import PagedAttentionMetadata
from loopline.attention.base import build_work_tiles
from loopline.attention.paged import PagedAttention
from loopline.worker.decode_state import DecodeRows, DecodeTensors, SlotRows
from loopline.worker.staging import aligned, torch_dtype
from loopline.worker.step_inputs import PrefillInputs


def bucket_sizes(max_rows: int) -> list[int]:
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b = b * 2 if b < 8 else b + 8 if b < 64 else b + 32
    sizes.append(max_rows)
    return sorted(set(sizes))


class _Layout:
    """Where each input of one graph sits in the input buffer, and its padding image.

    ``fields``: name -> (dtype, shape, padding value)."""

    def __init__(self, fields: dict[str, tuple[np.dtype, tuple[int, ...], float | int]]) -> None:
        self.fields: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
        off = 0
        for name, (dtype, shape, _) in fields.items():
            self.fields[name] = (off, np.dtype(dtype), shape)
            off += aligned(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self.nbytes = off
        self.padding = np.zeros(off, dtype=np.uint8)
        for name, view in self.host_views(self.padding).items():
            view[...] = fields[name][2]

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        return {name: buf[off:off + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
                for name, (off, dt, shape) in self.fields.items()}

    def device_views(self, buf: Tensor) -> dict[str, Tensor]:
        return {name: buf[off:off + int(np.prod(shape)) * dt.itemsize].view(torch_dtype(dt)).view(shape)
                for name, (off, dt, shape) in self.fields.items()}


_DECODE_FIELDS = ("slots", "loops", "starts", "input_ids", "min_loops", "max_loops", "threshold", "plane_slots")


def _pinned_image(lay: _Layout, on_cuda: bool) -> tuple[Tensor, dict[str, np.ndarray]]:
    """A (pinned) host copy of ``lay``'s padding image and numpy views of its fields."""
    pinned = torch.empty(lay.nbytes, dtype=torch.uint8, pin_memory=on_cuda)
    image = pinned.numpy()
    image[:] = lay.padding
    return pinned, lay.host_views(image)


def _copy_decode_rows(v: dict[str, Tensor], rows: DecodeRows) -> None:
    """Copies decode rows derived on the device into a mixed graph's device views ``v``."""
    n = rows.slots.shape[0]
    for name in _DECODE_FIELDS:
        v[name][:n].copy_(getattr(rows.dec, name))
    v["positions"][:n].copy_(rows.positions)
    v["slot_mapping"][:n].copy_(rows.slot_mapping)
    v["seq_lens"][:n].copy_(rows.seq_lens)
    width = min(rows.block_tables.shape[1], v["block_tables"].shape[1])  # keys past max_seq_len are never read
    v["block_tables"][:n, :width].copy_(rows.block_tables[:, :width])


def _decode_fields(runner, b: int) -> dict:
    """Layout fields of ``b`` decode rows' ``DecodeTensors``, padded with scratch rows."""
    scratch_kv = runner.scratch_block * runner.block_size
    return {
        "slots": (np.int64, (b,), runner.scratch_slot), "loops": (np.int64, (b,), 1), "starts": (np.bool_, (b,), True),
        "input_ids": (np.int64, (b,), 0), "min_loops": (np.int64, (b,), 1), "max_loops": (np.int64, (b,), 1),
        "threshold": (np.float32, (b,), 1.0),
        "plane_slots": (np.int64, (b, runner.layout.num_planes), scratch_kv),
    }


class _GraphSet:
    """Graphs keyed by bucket over one device input buffer laid out per key (:class:`_Layout`).

    Subclasses give ``_forward(key)`` (the captured work, reading ``self.views[key]``) and
    ``_capture_order()`` (largest first, so one memory pool serves them all)."""

    def _init_inputs(self, layouts: dict, device: torch.device) -> None:
        self.layouts = layouts
        self.inputs = torch.zeros(max(lay.nbytes for lay in layouts.values()), dtype=torch.uint8, device=device)
        self.views = {k: lay.device_views(self.inputs) for k, lay in layouts.items()}
        self.padding = {k: torch.from_numpy(lay.padding).to(device) for k, lay in layouts.items()}
        self.graphs: dict = {}  # key -> torch.cuda.CUDAGraph
        self.outputs: dict = {}  # key -> the captured outputs
        self._uploaded: bytes | None = None  # the host image the device inputs hold, if one does

    def reset_inputs(self, key) -> None:
        """Fills graph ``key``'s inputs with scratch rows (on the device)."""
        self.inputs[:self.layouts[key].nbytes].copy_(self.padding[key])
        self._uploaded = None

    def _upload(self, pinned: Tensor) -> None:
        """Copies a host image of the inputs to the device, unless the device already holds it:
        decode steps of an unchanged batch send the same four arrays every step, and at one row each
        copy is a link of the step's chain (the graphs never write their inputs)."""
        image = pinned.numpy().tobytes()
        if image != self._uploaded:
            self.inputs[:pinned.shape[0]].copy_(pinned, non_blocking=True)
            self._uploaded = image

    def _forward(self, key) -> tuple:
        raise NotImplementedError

    def _capture_order(self) -> list:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, pool=None):
        """Captures every graph in one memory pool; returns the pool.

        Warm-up runs on the capture stream itself: per-stream resources (cuBLAS's
        workspace for that stream, its kernel choice given that workspace) then exist
        before capture, where creating them is not allowed."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for key in self._capture_order():
            with torch.cuda.stream(stream):
                self.reset_inputs(key)
                for _ in range(2):  # compile kernels, settle allocations
                    self._forward(key)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with _no_gc(), torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[key] = self._forward(key)
            except RuntimeError as e:  # name the bucket: the CUDA error alone does not say which shape failed
                raise RuntimeError(f"{type(self).__name__}: capturing the graph for bucket {key} failed "
                                   f"(enforce_eager=True runs without graphs): {e}") from e
            pool = graph.pool()
            self.graphs[key] = graph
        stream.synchronize()
        torch.cuda.current_stream().wait_stream(stream)
        return pool


@contextlib.contextmanager
def _no_gc():
    """Python's cyclic GC paused for one capture (``torch.cuda.graph`` collects once before it).

    A collection can start at any allocation and free objects whose teardown calls CUDA (pinned
    host buffers, events), which a stream capturing in torch's default global mode does not
    permit: the capture is invalidated. The suspected cause of a capture failure seen once on the
    H200 ("operation not permitted when stream is capturing", docs/benchmarks/h200-2026-11-30.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraphs(_GraphSet):
    """Decode-only steps, one graph per bucketed row count. The host sends slots and exit rules;
    the graph derives loops, positions, tokens and tables from the device decode state itself, and
    also returns the rows' :class:`SlotRows` for sampling and the state's advance."""

    def __init__(self, runner, max_rows: int, max_seq_len: int) -> None:
        self.runner = runner
        self.max_seq_len = max_seq_len
        self.sizes = bucket_sizes(max_rows)
        dev = runner.device
        self.max_blocks = -(-max_seq_len // runner.block_size)
        self._init_inputs({b: _Layout({
            "slots": (np.int64, (b,), runner.scratch_slot), "min_loops": (np.int64, (b,), 1),
            "max_loops": (np.int64, (b,), 1), "threshold": (np.float32, (b,), 1.0)}) for b in self.sizes}, dev)
        self.query_start_loc = torch.arange(self.sizes[-1] + 1, dtype=torch.int32, device=dev)

    def _bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _capture_order(self) -> list[int]:
        return list(reversed(self.sizes))

    # --- capture ----------------------------------------------------------------------
    def _forward(self, b: int) -> tuple:
        r, v = self.runner, self.views[b]
        rows = r.decode_rows(v["slots"], v["min_loops"], v["max_loops"], v["threshold"])
        meta = PagedAttentionMetadata(self.query_start_loc[:b + 1], rows.seq_lens, rows.block_tables,
                                      rows.slot_mapping, max_query_len=1, max_seq_len=self.max_seq_len)
        x = r.decode_inputs(rows.dec)
        h, gate = r.model.loop(x, rows.positions, PagedAttention(r.backend, r.k_cache, r.v_cache, meta, r.scale))
        ex, logits = r._decode_tail(h, gate, rows.dec)
        return r.exits_that_ran(ex, rows.run), logits, v["slots"], rows.loops, rows.run, rows.token_index

    # --- replay -----------------------------------------------------------------------
    def run_slots(self, slots: np.ndarray, min_loops: np.ndarray, max_loops: np.ndarray,
                  threshold: np.ndarray) -> tuple[Tensor, Tensor, SlotRows]:
        """Replays decode rows of ``slots``: one copy of four small arrays, the rest comes from the
        device state. Returns ``(exit, logits, SlotRows)``; only rows that ran can exit."""
        n = slots.shape[0]
        b = self._bucket(n)
        pinned, v = _pinned_image(self.layouts[b], self.inputs.is_cuda)
        v["slots"][:n], v["min_loops"][:n], v["max_loops"][:n], v["threshold"][:n] = slots, min_loops, max_loops, threshold
        self._upload(pinned)
        self.graphs[b].replay()
        ex, logits, *rows = (t[:n] for t in self.outputs[b])
        return ex, logits, SlotRows(*rows)


def mixed_buckets(max_decode: int, max_tokens: int) -> tuple[list[int], list[int]]:
    """Decode-row buckets (0 included) and prefill-token buckets of the mixed-step graphs."""
    decode = sorted({0, max_decode} | {b for b in (8, 16, 32, 64, 128, 256, 512, 1024) if b < max_decode})
    prefill = [p for p in (128, 256, 512, 1024, 2048) if p <= max_tokens] or [max_tokens]
    return decode, prefill


class MixedGraphs(_GraphSet):
    """CUDA graphs for steps with prefill chunks: up to ``D`` decode rows and ``P`` prefill tokens.

    Eagerly such a step launches ~300 kernels from Python, which costs more host
    time than the GPU needs for a few hundred prefill tokens; captured, it is
    one replay. Decode rows are padded to a bucket ``D`` as in
    :class:`DecodeGraphs`; prefill tokens to a bucket ``P`` (padding tokens
    belong to no row: nothing attends them, their K/V goes to the scratch slot),
    in at most ``max_prefill_rows`` rows. Attention runs over a fixed-size work
    list of (row, query tile) pairs, so the grid does not depend on the step.
    The prefill rows' inputs are copied into a persistent buffer before the
    replay and their outputs are booked after it, eagerly. Larger prefill steps
    run eagerly: their GPU time hides the launches.
    """

    def __init__(self, runner, max_decode: int, max_tokens: int, max_seq_len: int, max_prefill_rows: int = 16) -> None:
        self.runner = runner
        self.max_seq_len = max_seq_len
        self.max_prefill_rows = max_prefill_rows
        self.decode_sizes, self.prefill_sizes = mixed_buckets(max_decode, max_tokens)
        dev = runner.device
        self.max_blocks = -(-max_seq_len // runner.block_size)
        cfg = runner.model.config
        self.tile = runner.work_tile_tokens or 64  # a backend without work lists ignores them
        scratch_kv = runner.scratch_block * runner.block_size
        layouts: dict[tuple[int, int], _Layout] = {}
        for d in self.decode_sizes:
            for p in self.prefill_sizes:
                rows = d + max_prefill_rows
                lay = layouts[d, p] = _Layout({
                    **_decode_fields(runner, d),
                    "positions": (np.int64, (d + p,), 0), "slot_mapping": (np.int64, (d + p,), scratch_kv),
                    "query_start_loc": (np.int32, (rows + 1,), d), "seq_lens": (np.int32, (rows,), 1),
                    "block_tables": (np.int32, (rows, self.max_blocks), runner.scratch_block),
                    # decode rows get their own attention launch; the list holds the prompt tiles
                    "work_tiles": (np.int32, (2, max_prefill_rows + p // self.tile), -1),
                })
                v = lay.host_views(lay.padding)
                v["query_start_loc"][:d + 1] = np.arange(d + 1)  # padding decode rows: one query each
        self._init_inputs(layouts, dev)
        self.x_prefill = torch.zeros(self.prefill_sizes[-1], cfg.hidden_size, dtype=runner.dtype, device=dev)
        self.replays = 0

    def bucket(self, nd: int, prefill_tokens: int, prefill_rows: int, max_seq_len: int) -> tuple[int, int] | None:
        """The graph a step fits, or None (run it eagerly)."""
        if prefill_rows > self.max_prefill_rows or max_seq_len > self.max_seq_len:
            return None
        d = next((s for s in self.decode_sizes if s >= nd), None)
        p = next((s for s in self.prefill_sizes if s >= prefill_tokens), None)
        return None if d is None or p is None else (d, p)

    def _capture_order(self) -> list[tuple[int, int]]:
        return sorted(self.layouts, key=lambda k: (-k[1], -k[0]))

    # --- capture ----------------------------------------------------------------------
    def _forward(self, key: tuple[int, int]):
        r, v = self.runner, self.views[key]
        d, p = key
        meta = PagedAttentionMetadata(v["query_start_loc"], v["seq_lens"], v["block_tables"], v["slot_mapping"],
                                      max_query_len=p, max_seq_len=self.max_seq_len, work_tiles=v["work_tiles"],
                                      num_decode_rows=d)
        dec = None
        x = self.x_prefill[:p]
        if d:
            dec = DecodeTensors(**{k: v[k] for k in _DECODE_FIELDS})
            x = torch.cat([r.decode_inputs(dec), x])
        h, gate = r.model.loop(x, v["positions"], PagedAttention(r.backend, r.k_cache, r.v_cache, meta, r.scale))
        ex, logits = r._decode_tail(h[:d], gate[:d], dec) if d else (None, None)
        return ex, logits, h[d:], gate[d:]

    # --- replay -----------------------------------------------------------------------
    def run(self, key: tuple[int, int], prefill: PrefillInputs, x_prefill: list[Tensor],
            decode: DecodeRows | None = None):
        """Replays graph ``key``: prefill rows from host inputs, decode rows (if any) derived on the device.

        Returns the decode rows' ``(exit, logits)`` and the prefill tokens' ``(h, gate)``."""
        d, p = key
        lay = self.layouts[key]
        pinned, v = _pinned_image(lay, self.inputs.is_cuda)
        nd = decode.slots.shape[0] if decode is not None else 0
        n_rows, n_tok = len(prefill.rows), int(prefill.offsets[-1])
        v["positions"][d:d + n_tok] = prefill.positions
        v["slot_mapping"][d:d + n_tok] = prefill.slot_mapping
        v["query_start_loc"][d:] = d + prefill.offsets[-1]
        v["query_start_loc"][d:d + n_rows + 1] = d + prefill.offsets
        v["seq_lens"][d:d + n_rows] = prefill.seq_lens
        v["block_tables"][d:d + n_rows, :prefill.block_tables.shape[1]] = prefill.block_tables
        v["work_tiles"][:] = build_work_tiles(np.diff(prefill.offsets), self.tile, v["work_tiles"].shape[1], first_row=d)
        self.inputs[:lay.nbytes].copy_(pinned, non_blocking=True)
        if nd:
            _copy_decode_rows(self.views[key], decode)
        off = 0
        for part in x_prefill:
            self.x_prefill[off:off + part.shape[0]].copy_(part)
            off += part.shape[0]
        self.graphs[key].replay()
        self.replays += 1
        ex, logits, h, gate = self.outputs[key]
        return (ex[:nd] if d else None), (logits[:nd] if d else None), h[:n_tok], gate[:n_tok]
