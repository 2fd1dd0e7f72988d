"""CUDA graphs for decode-only steps at bucketed row counts.

A decode-only step (prelude for rows starting a token, one traversal, gate,
exit rule, slot state, exit copy and coda) is captured once per bucket size
with persistent input buffers. Replaying pads the step to the next bucket
with scratch rows: they use a scratch slot and a scratch KV block that no
request owns, so they never touch real state. Sampling runs eagerly on the
graph's logits (its work depends on which features the batch uses).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from loopline.attention import PagedAttentionMetadata
from loopline.attention.paged import PagedAttention
from loopline.worker.step_inputs import StepInputs


def bucket_sizes(max_rows: int) -> list[int]:
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b = b * 2 if b < 8 else b + 8 if b < 64 else b + 32
    sizes.append(max_rows)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner, max_rows: int, max_seq_len: int) -> None:
        from loopline.worker.model_runner import DecodeTensors  # cycle-free at call time

        self.runner = runner
        self.max_seq_len = max_seq_len
        self.sizes = bucket_sizes(max_rows)
        dev, m = runner.device, self.sizes[-1]
        planes = runner.layout.num_planes
        self.max_blocks = -(-max_seq_len // runner.block_size)
        self.scratch_slot = runner.scratch_slot
        self.scratch_kv = runner.scratch_block * runner.block_size
        i64 = dict(dtype=torch.long, device=dev)
        self.buf = DecodeTensors(
            slots=torch.zeros(m, **i64), loops=torch.ones(m, **i64), starts=torch.ones(m, dtype=torch.bool, device=dev),
            input_ids=torch.zeros(m, **i64), min_loops=torch.ones(m, **i64), max_loops=torch.ones(m, **i64),
            threshold=torch.ones(m, dtype=torch.float32, device=dev), plane_slots=torch.zeros(m, planes, **i64))
        self.positions = torch.zeros(m, **i64)
        self.slot_mapping = torch.zeros(m, **i64)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(m, self.max_blocks, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self._fill_padding(0, m)

    def fits(self, inp: StepInputs) -> bool:
        return inp.decode.n <= self.sizes[-1] and inp.max_seq_len <= self.max_seq_len

    # --- capture ----------------------------------------------------------------------
    def _forward(self, b: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        d = type(self.buf)(**{k: v[:b] for k, v in vars(self.buf).items()})
        meta = PagedAttentionMetadata(self.query_start_loc[:b + 1], self.seq_lens[:b], self.block_tables[:b],
                                      self.slot_mapping[:b], max_query_len=1, max_seq_len=self.max_seq_len)
        x = r.decode_inputs(d)
        h, gate = r.model.loop(x, self.positions[:b], PagedAttention(r.backend, r.k_cache, r.v_cache, meta, r.scale))
        return r._decode_tail(h, gate, d)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):
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
    def _fill_padding(self, lo: int, hi: int) -> None:
        self.buf.slots[lo:hi] = self.scratch_slot
        self.buf.loops[lo:hi] = 1
        self.buf.starts[lo:hi] = True
        self.buf.input_ids[lo:hi] = 0
        self.buf.min_loops[lo:hi] = 1
        self.buf.max_loops[lo:hi] = 1
        self.buf.threshold[lo:hi] = 1.0
        self.buf.plane_slots[lo:hi] = self.scratch_kv
        self.positions[lo:hi] = 0
        self.slot_mapping[lo:hi] = self.scratch_kv
        self.seq_lens[lo:hi] = 1
        self.block_tables[lo:hi] = self.runner.scratch_block

    def run_tensors(self, d, positions: Tensor, slot_mapping: Tensor, seq_lens: Tensor,
                    block_tables: Tensor) -> tuple[Tensor, Tensor]:
        """Replays with inputs already on the device (async scheduling); no host sync."""
        n = d.slots.shape[0]
        for name, buf in vars(self.buf).items():
            buf[:n].copy_(getattr(d, name))
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.seq_lens[:n].copy_(seq_lens)
        width = min(block_tables.shape[1], self.max_blocks)  # keys past max_seq_len are never read
        self.block_tables[:n, :width].copy_(block_tables[:, :width])
        return self._replay(n)

    def run(self, inp: StepInputs) -> tuple[Tensor, Tensor]:
        n = inp.decode.n
        d = inp.decode

        def put(dst: Tensor, src: np.ndarray) -> None:
            dst[:n].copy_(torch.from_numpy(src), non_blocking=True)

        put(self.buf.slots, d.slots)
        put(self.buf.loops, d.loops)
        put(self.buf.starts, d.starts)
        put(self.buf.input_ids, d.input_ids)
        put(self.buf.min_loops, d.min_loops)
        put(self.buf.max_loops, d.max_loops)
        put(self.buf.threshold, d.threshold)
        put(self.buf.plane_slots, d.plane_slots)
        put(self.positions, inp.positions)
        put(self.slot_mapping, inp.slot_mapping)
        put(self.seq_lens, inp.seq_lens)
        width = inp.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(torch.from_numpy(inp.block_tables), non_blocking=True)
        return self._replay(n)

    def _replay(self, n: int) -> tuple[Tensor, Tensor]:
        """Pads rows ``n..bucket`` with scratch rows and replays the bucket's graph (inputs for ``:n`` set)."""
        b = next(s for s in self.sizes if s >= n)
        if n < b:
            self._fill_padding(n, b)
        self.graphs[b].replay()
        ex, logits = self.outputs[b]
        return ex[:n], logits[:n]
