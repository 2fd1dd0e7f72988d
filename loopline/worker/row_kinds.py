"""Row kinds: what one kind of row puts into a step and takes out of its forward.

A step's rows are grouped by kind (``step_inputs.py``). Each kind says which
scheduled rows it takes, how the host fills their inputs (``plan`` then ``fill``,
numpy into the step's pinned image; ``write_inputs``, device inputs prepared
outside the forward), what the forward derives for them on the device
(``prepare``, inside a CUDA graph where one replays) and what it returns for them
after the layer loop (``finish``). The builder, the forward and the graph module
only iterate over kinds, so a new kind -- a speculative draft row, a verify row of
K+1 positions, a lookahead row -- is one more class here.

* :class:`DecodeKind`: one token per row in a persistent slot. The host names
  the slot and its exit rule; the device derives the loop, position, KV slots and
  block table from the slot state and runs the exit rule, the slot state update,
  the ``last_exited`` exit copy and the coda.
* :class:`PrefillKind`: a chunk of prompt tokens at one loop. The host computes
  positions, KV slots and tables from the block lists; the loop's input is the
  embedding (loop 1) or the previous loop's hidden state, and the forward returns
  the chunk's hidden states and gates for the runner to book.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from loopline.attention import AttentionBackend
from loopline.core.contracts import ScheduledRow
from loopline.models.ouro import OuroForCausalLM
from loopline.worker.decode_state import DecodeRows, DeviceDecodeState, RowsInto, SlotOps
from loopline.worker.lookahead_rule import NEVER, LookaheadRule
from loopline.worker.request_state import RequestState
from loopline.worker.step_inputs import HostImage, KindRows, Segment, StepInputs
from loopline.worker.trace_recorder import TraceRecorder

LOOKAHEAD = frozenset({"lookahead"})  # the step feature of the lookahead head's rule (StepShape.features)


@dataclass
class PrefillInputs:
    """A step's prefill rows as host arrays."""

    rows: list[ScheduledRow]
    positions: np.ndarray  # [N] int64
    slot_mapping: np.ndarray  # [N] int64, the K/V slot each token writes at this loop
    offsets: np.ndarray  # [B + 1] query_start_loc
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32, of the plane each row's loop reads
    max_query_len: int
    max_seq_len: int

    @property
    def token_offsets(self) -> list[int]:
        return self.offsets.tolist()


def exit_columns(rows: list[ScheduledRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows' exit rules as the host image's columns: ``min_loops``, ``max_loops`` (int64), ``threshold``
    (float32)."""
    n = len(rows)
    return (np.fromiter((r.exit.min_loops for r in rows), np.int64, n),
            np.fromiter((r.exit.max_loops for r in rows), np.int64, n),
            np.fromiter((r.exit.threshold for r in rows), np.float32, n))


def slot_of(blocks: np.ndarray, pos: np.ndarray | int, block_size: int) -> np.ndarray:
    return blocks[np.asarray(pos) // block_size].astype(np.int64) * block_size + np.asarray(pos) % block_size


def build_prefill_inputs(rows: list[ScheduledRow], block_arrays: Callable[[str], list[np.ndarray]],
                         block_size: int) -> PrefillInputs:
    """``rows``: prefill chunks; ``block_arrays(request_id) -> list[np.ndarray]`` (per plane)."""
    lens = np.fromiter((r.end - r.start for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    n_tok = int(offsets[-1])
    positions = np.empty(n_tok, dtype=np.int64)
    slot_mapping = np.empty(n_tok, dtype=np.int64)
    seq_lens = np.fromiter((r.end for r in rows), dtype=np.int32, count=len(rows))
    max_blocks = int(-(-seq_lens.max() // block_size))
    tables = np.zeros((len(rows), max_blocks), dtype=np.int32)
    for i, r in enumerate(rows):
        assert r.is_prefill
        blocks = block_arrays(r.request_id)[r.plane]
        nb = -(-r.end // block_size)
        tables[i, :nb] = blocks[:nb]
        lo, hi = offsets[i], offsets[i + 1]
        pos = np.arange(r.start, r.end)
        positions[lo:hi] = pos
        slot_mapping[lo:hi] = slot_of(blocks, pos, block_size)
    return PrefillInputs(rows, positions, slot_mapping, offsets, seq_lens, tables, int(lens.max()),
                         int(seq_lens.max()))


class RowKind(ABC):
    """One kind of row. Class attributes describe its place in a step:

    ``query_len``: queries per row (None: per row); kinds with 1 lead the step and are
    attended in the decode launch, off the work list. ``derives``: the forward writes the
    rows' positions, KV slots, lengths and tables on the device (such kinds come first).
    ``steady``: its host arrays repeat while the batch does (the upload may be skipped).
    ``num_outputs``: how many tensors ``finish`` returns."""

    query_len: int | None = None
    derives = False
    steady = False
    num_outputs = 0

    @abstractmethod
    def takes(self, row: ScheduledRow) -> bool:
        """Whether ``row`` is of this kind."""

    def host_fields(self, rows: int) -> dict[str, tuple[Any, tuple[int, ...], float | int]]:
        """The kind's own host arrays for ``rows`` rows: name -> (dtype, shape, padding value)."""
        return {}

    @abstractmethod
    def plan(self, rows: list[ScheduledRow]) -> KindRows:
        """The rows' counts, bounds and host arrays (the step's shape and the fill rule read them)."""

    def fill(self, part: KindRows, image: HostImage) -> None:
        """Writes the rows' host arrays into the step's image (padding is there already)."""

    def write_inputs(self, part: KindRows, x: Tensor, inp: StepInputs, seg: Segment) -> None:
        """Device-side inputs outside the forward: the rows' loop inputs ``x`` ``[tokens, H]`` (the kind's
        part of ``inp``, at ``seg``), if the forward does not derive them."""

    def prepare(self, inp: StepInputs, seg: Segment, own: dict[str, Tensor]) -> Any:
        """Inside the forward, before the layer loop: whatever the rows derive on the device."""
        return None

    @abstractmethod
    def finish(self, h: Tensor, gate: Tensor, prepared: Any, own: dict[str, Tensor]) -> tuple[Tensor | None, ...]:
        """Inside the forward, after the layer loop: the rows' outputs (``h``, ``gate``: their tokens')."""

    def trim(self, out: tuple[Tensor | None, ...], part: KindRows) -> Any:
        """The outputs cut to the step's rows (a graph's are bucket-sized)."""
        return out


class DecodeOut(NamedTuple):
    """What sampling and the state's advance need of a step's decode rows."""

    exit: Tensor  # [B] bool; only rows that ran exit
    logits: Tensor  # [B, V] fp32 (rows not exiting: unused, may be zeros)
    slots: Tensor  # [B] int64, as the host named them
    loops: Tensor  # [B] int64, the loop each row ran (1-based)
    run: Tensor  # [B] bool; False: a no_refill slot waiting for its cohort, run on scratch
    token_index: Tensor  # [B] int64, index in the completion of the token being computed
    # steps that run the lookahead rule: no logits (None) but what the coda reads, [B, H], and each row's fixed
    # exit after this step's decisions, [B] int64 (0: none); the runner's coda runs for the rows that may
    # exit only (worker/lookahead_plan.py)
    hidden: Tensor | None = None
    target: Tensor | None = None
    # with an exit-trace recorder installed: the rows' recorded columns, [B, width] fp32 (worker/trace_recorder.py)
    trace: Tensor | None = None


class DecodeKind(RowKind):
    """Decode tokens in persistent slots. ``no_refill``: a slot whose token exited waits for its
    cohort (its row runs on scratch); ``per_token_exits``: the exit rule comes from the recorded
    depths at the device's token index."""

    query_len = 1
    derives = steady = True
    num_outputs = 9
    # exit_mode="lookahead": the head's rule (worker/lookahead_rule.py), installed by the runner when the
    # model has a head; it runs in steps with a lookahead row (rows of other policies there carry its NEVER
    # threshold), and steps without one run the forward without it
    lookahead: LookaheadRule | None = None
    # EngineArgs.exit_trace: the recorder, installed by the runner before graphs are captured (None: nothing runs)
    trace: TraceRecorder | None = None

    def __init__(self, *, model: OuroForCausalLM, backend: AttentionBackend, kv: Callable[[], tuple[Tensor, Tensor]],
                 state: DeviceDecodeState, ops: SlotOps, slot_hidden: Tensor, slot_survival: Tensor,
                 requests: dict[str, RequestState], scratch_slot: int, copies_on_exit: bool, no_refill: bool,
                 per_token_exits: bool, stack: Any) -> None:
        """``stack``: the family's loop (``loop_stack.py``): the rows' inputs, what the head reads."""
        self.model, self.backend, self.kv, self.state, self.ops = model, backend, kv, state, ops
        self.slot_hidden, self.slot_survival, self.requests = slot_hidden, slot_survival, requests
        self.scratch_slot, self.copies_on_exit = scratch_slot, copies_on_exit
        self.no_refill, self.per_token_exits = no_refill, per_token_exits
        self.stack = stack
        # the exit copy fills the loops' planes only (a family's once-per-token planes come after them)
        layout = state.layout
        self.loop_planes = layout.num_loops if layout.num_planes > layout.num_loops else None
        self._tokens = (0, 0)  # the rows' token range in the step (prepare sets it for finish)
        self._rule: LookaheadRule | None = None  # the head's rule when the step runs it (prepare sets it for finish)

    def takes(self, row: ScheduledRow) -> bool:
        return not row.is_prefill and row.spec is None

    def host_fields(self, rows: int) -> dict:
        return {"slots": (np.int64, (rows,), self.scratch_slot), "min_loops": (np.int64, (rows,), 1),
                "max_loops": (np.int64, (rows,), 1), "threshold": (np.float32, (rows,), 1.0),
                "lookahead": (np.float32, (rows,), NEVER)}

    def plan(self, rows: list[ScheduledRow]) -> KindRows:
        """The host tells the device the rows' slots and exit rules; their lengths live on the device,
        so each request's longest sequence bounds them."""
        n = len(rows)
        host = (np.fromiter((r.slot for r in rows), np.int64, n), *exit_columns(rows),
                np.fromiter((NEVER if r.exit.lookahead is None else r.exit.lookahead for r in rows), np.float32, n))
        bound = max((self.requests[r.request_id].max_len for r in rows), default=0)
        # the head runs only in steps with a lookahead row (a graph variant of its own: StepShape.features)
        head = self.lookahead is not None and bool((host[4] < NEVER).any())
        return KindRows(rows, n, n, None, 1 if n else 0, bound, host, LOOKAHEAD if head else frozenset())

    def fill(self, part: KindRows, image: HostImage) -> None:
        n = part.num_rows
        for name, values in zip(("slots", "min_loops", "max_loops", "threshold", "lookahead"), part.host):
            image.own(name)[:n] = values

    def prepare(self, inp: StepInputs, seg: Segment, own: dict[str, Tensor]) -> DecodeRows | None:
        """The rows of slots ``own["slots"]`` derived from the device state, their attention inputs
        written into the step's views, and their loop inputs into ``inp.x``."""
        if not seg.rows:
            return None
        r, t, n = seg.row0, seg.tok0, seg.rows
        into = RowsInto(inp.positions[t:t + n], inp.slot_mapping[t:t + n], inp.seq_lens[r:r + n],
                        inp.block_tables[r:r + n])
        rows = self.ops.decode_rows(self.state, own["slots"], own["min_loops"], own["max_loops"], own["threshold"],
                                    self.no_refill, self.per_token_exits, self.scratch_slot, into=into)
        # prelude for rows starting a token, the slot's hidden state for the others
        self.stack.decode_inputs(rows, inp, seg)
        self._tokens = (t, t + n)
        self._rule = self.lookahead if LOOKAHEAD <= inp.shape.features else None
        if self._rule is not None:  # the projection of the rows' inputs: the head reads its change
            self._rule.before(inp.x[t:t + n])
        if self.trace is not None:
            self.trace.before(inp.x[t:t + n])
        return rows

    def finish(self, h: Tensor, gate: Tensor, rows: DecodeRows | None, own: dict[str, Tensor]) -> tuple:
        """Exit rule, slot state, the exit copy and the coda, without host syncs."""
        if rows is None:
            return (None,) * self.num_outputs
        d = rows.dec
        lo, hi = self._tokens
        ex = self.stack.decode_exit(h, gate, d, lo, hi)  # the family's exit rule; the slots' state kept
        target = None
        if self._rule is not None:  # exit_mode="lookahead" rows: exits fixed two loops ahead
            ex, target = self._rule.decode(h, gate, rows, own["lookahead"], self.slot_survival, ex)
        if self.copies_on_exit:  # last_exited: a token exiting at loop e fills its deeper planes
            k_cache, v_cache = self.kv()
            planes = d.plane_slots if self.loop_planes is None else d.plane_slots[:, :self.loop_planes]
            self.backend.copy_exited(k_cache, v_cache, planes, d.loops, ex,
                                     self.state.scratch_block * self.state.block_size)
        # rows not exiting: logits unused (may be zeros); with the rule, the runner's coda runs for the rows
        # that may exit (known on the host: worker/lookahead_plan.py)
        logits = self.stack.decode_logits(h, ex, lo, hi) if target is None else None
        hidden = self.stack.head_input(h, lo, hi) if target is not None else None
        # only rows that ran exit: a no_refill row waiting for its cohort does not (without no_refill every
        # row runs, and the mask would be a launch of its own)
        if self.no_refill:
            ex = ex & rows.run
        trace = self.trace.after(h, gate) if self.trace is not None else None
        return ex, logits, rows.slots, rows.loops, rows.run, rows.token_index, hidden, target, trace

    def trim(self, out: tuple, part: KindRows) -> DecodeOut | None:
        if out[0] is None or not part.num_rows:
            return None
        n = part.num_rows
        return DecodeOut(*(t if t is None or t.shape[0] == n else t[:n] for t in out))


class PrefillKind(RowKind):
    """Prompt chunks at one loop; the forward returns their tokens' ``(h, gate)``, and for a family that keeps
    its prelude output (Huginn) also what the head reads and that output (Ouro's head reads ``h``)."""

    def __init__(self, *, model: OuroForCausalLM, requests: dict[str, RequestState], block_size: int,
                 device: torch.device, stack: Any) -> None:
        self.model, self.requests, self.block_size, self.device = model, requests, block_size, device
        self.stack = stack
        self.num_outputs = 4 if stack.keeps_injected else 2
        self._tokens = (0, 0)

    def takes(self, row: ScheduledRow) -> bool:
        return row.is_prefill

    def _block_arrays(self, request_id: str) -> list[np.ndarray]:
        return self.requests[request_id].block_arrays

    def plan(self, rows: list[ScheduledRow]) -> KindRows:
        if not rows:
            return KindRows(rows, 0, 0, np.zeros(0, dtype=np.int64), 0, 0)
        p = build_prefill_inputs(rows, self._block_arrays, self.block_size)
        return KindRows(rows, len(rows), int(p.offsets[-1]), np.diff(p.offsets), p.max_query_len, p.max_seq_len, p)

    def fill(self, part: KindRows, image: HostImage) -> None:
        p = part.host
        image.shared("positions")[:part.num_tokens] = p.positions
        image.shared("slot_mapping")[:part.num_tokens] = p.slot_mapping
        image.shared("seq_lens")[:part.num_rows] = p.seq_lens
        image.shared("block_tables")[:part.num_rows, :p.block_tables.shape[1]] = p.block_tables

    def write_inputs(self, part: KindRows, x: Tensor, inp: StepInputs, seg: Segment) -> None:
        """Each row's input (the family's loop says which: ``loop_stack.py``)."""
        self.stack.prefill_inputs(part.rows, x, inp, seg)

    def prepare(self, inp: StepInputs, seg: Segment, own: dict[str, Tensor]) -> Any:
        self._tokens = (seg.tok0, seg.tok0 + seg.tokens)
        return None

    def finish(self, h: Tensor, gate: Tensor, prepared: Any, own: dict[str, Tensor]) -> tuple:
        if self.num_outputs == 2:
            return h, gate
        lo, hi = self._tokens
        return h, gate, self.stack.head_input(h, lo, hi), self.stack.injected(lo, hi)

    def trim(self, out: tuple, part: KindRows) -> tuple | None:
        if not part.num_rows:
            return None
        t = part.num_tokens
        return tuple(o[:t] for o in out)
