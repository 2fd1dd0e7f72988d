"""CUDA graphs for decode-only steps at bucketed row counts.

A decode-only step (prelude for rows starting a token, one traversal, gate,
exit rule, slot state, exit copy and coda) is captured once per bucket size.
Its inputs live in one persistent device buffer laid out per bucket
(:class:`_Layout`), so a replay needs exactly one host-to-device copy: the
host fills a pinned image of the layout, scratch padding included, and copies
it in without waiting for the device. Padding rows use a scratch slot and a
scratch KV block that no request owns, so they never touch real state.
Sampling runs eagerly on the graph's logits (its work depends on which
features the batch uses).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from loopline.attention import PagedAttentionMetadata
from loopline.attention.paged import PagedAttention
from loopline.worker.staging import _ALIGN, _TORCH_DTYPES
from loopline.worker.step_inputs import StepInputs


def bucket_sizes(max_rows: int) -> list[int]:
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b = b * 2 if b < 8 else b + 8 if b < 64 else b + 32
    sizes.append(max_rows)
    return sorted(set(sizes))


class _Layout:
    """Where each input of a ``rows``-row graph sits in the input buffer, and its padding image."""

    def __init__(self, rows: int, fields: dict[str, tuple[np.dtype, tuple[int, ...], float | int]]) -> None:
        self.rows = rows
        self.fields: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
        off = 0
        for name, (dtype, tail, _) in fields.items():
            shape = (rows, *tail)
            self.fields[name] = (off, np.dtype(dtype), shape)
            off += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        self.nbytes = off
        self.padding = np.zeros(off, dtype=np.uint8)
        for name, view in self.host_views(self.padding).items():
            view[...] = fields[name][2]

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        return {name: buf[off:off + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
                for name, (off, dt, shape) in self.fields.items()}

    def device_views(self, buf: Tensor) -> dict[str, Tensor]:
        return {name: buf[off:off + int(np.prod(shape)) * dt.itemsize].view(_TORCH_DTYPES[dt]).view(shape)
                for name, (off, dt, shape) in self.fields.items()}


class DecodeGraphs:
    def __init__(self, runner, max_rows: int, max_seq_len: int) -> None:
        self.runner = runner
        self.max_seq_len = max_seq_len
        self.sizes = bucket_sizes(max_rows)
        dev = runner.device
        self.max_blocks = -(-max_seq_len // runner.block_size)
        scratch_kv = runner.scratch_block * runner.block_size
        planes = runner.layout.num_planes
        # name: (dtype, shape after the row axis, padding value); DecodeTensors' fields first
        fields = {
            "slots": (np.int64, (), runner.scratch_slot), "loops": (np.int64, (), 1), "starts": (np.bool_, (), True),
            "input_ids": (np.int64, (), 0), "min_loops": (np.int64, (), 1), "max_loops": (np.int64, (), 1),
            "threshold": (np.float32, (), 1.0), "plane_slots": (np.int64, (planes,), scratch_kv),
            "positions": (np.int64, (), 0), "slot_mapping": (np.int64, (), scratch_kv), "seq_lens": (np.int32, (), 1),
            "block_tables": (np.int32, (self.max_blocks,), runner.scratch_block),
        }
        self.layouts = {b: _Layout(b, fields) for b in self.sizes}
        self.inputs = torch.zeros(max(lay.nbytes for lay in self.layouts.values()), dtype=torch.uint8, device=dev)
        self.views = {b: lay.device_views(self.inputs) for b, lay in self.layouts.items()}
        self.padding = {b: torch.from_numpy(lay.padding).to(dev) for b, lay in self.layouts.items()}
        self.query_start_loc = torch.arange(self.sizes[-1] + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}

    def fits(self, inp: StepInputs) -> bool:
        return inp.decode.n <= self.sizes[-1] and inp.max_seq_len <= self.max_seq_len

    def _bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def reset_inputs(self, b: int) -> None:
        """Fills bucket ``b``'s inputs with scratch rows (on the device)."""
        self.inputs[:self.layouts[b].nbytes].copy_(self.padding[b])

    # --- capture ----------------------------------------------------------------------
    def _forward(self, b: int) -> tuple[Tensor, Tensor]:
        from loopline.worker.model_runner import DecodeTensors  # cycle-free at call time

        r, v = self.runner, self.views[b]
        d = DecodeTensors(**{k: v[k] for k in ("slots", "loops", "starts", "input_ids", "min_loops", "max_loops",
                                               "threshold", "plane_slots")})
        meta = PagedAttentionMetadata(self.query_start_loc[:b + 1], v["seq_lens"], v["block_tables"],
                                      v["slot_mapping"], max_query_len=1, max_seq_len=self.max_seq_len)
        x = r.decode_inputs(d)
        h, gate = r.model.loop(x, v["positions"], PagedAttention(r.backend, r.k_cache, r.v_cache, meta, r.scale))
        return r._decode_tail(h, gate, d)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):
            self.reset_inputs(b)
            for _ in range(2):  # compile kernels, settle allocations
                self._forward(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    # --- replay -----------------------------------------------------------------------
    def run(self, inp: StepInputs) -> tuple[Tensor, Tensor]:
        """Replays with host inputs: one pinned image of the bucket's layout, one copy."""
        n, d = inp.decode.n, inp.decode
        lay = self.layouts[self._bucket(n)]
        pinned = torch.empty(lay.nbytes, dtype=torch.uint8, pin_memory=self.inputs.is_cuda)
        image = pinned.numpy()
        image[:] = lay.padding
        v = lay.host_views(image)
        for name in ("slots", "loops", "starts", "input_ids", "min_loops", "max_loops", "threshold", "plane_slots"):
            v[name][:n] = getattr(d, name)
        v["positions"][:n] = inp.positions
        v["slot_mapping"][:n] = inp.slot_mapping
        v["seq_lens"][:n] = inp.seq_lens
        v["block_tables"][:n, :inp.block_tables.shape[1]] = inp.block_tables
        self.inputs[:lay.nbytes].copy_(pinned, non_blocking=True)
        return self._replay(n)

    def run_tensors(self, d, positions: Tensor, slot_mapping: Tensor, seq_lens: Tensor,
                    block_tables: Tensor) -> tuple[Tensor, Tensor]:
        """Replays with inputs already on the device (async scheduling); no host sync."""
        n = d.slots.shape[0]
        b = self._bucket(n)
        self.reset_inputs(b)
        v = self.views[b]
        for name, t in vars(d).items():
            v[name][:n].copy_(t)
        v["positions"][:n].copy_(positions)
        v["slot_mapping"][:n].copy_(slot_mapping)
        v["seq_lens"][:n].copy_(seq_lens)
        width = min(block_tables.shape[1], self.max_blocks)  # keys past max_seq_len are never read
        v["block_tables"][:n, :width].copy_(block_tables[:, :width])
        return self._replay(n)

    def _replay(self, n: int) -> tuple[Tensor, Tensor]:
        b = self._bucket(n)
        self.graphs[b].replay()
        ex, logits = self.outputs[b]
        return ex[:n], logits[:n]
