"""Model runner: owns every device tensor and runs one forward per step.

One step (docs/design.md, 'Scheduling'): prelude for rows that start a token, one traversal of
the shared stack + final norm + gate for all rows (each attending its own
plane), exit decisions, the ``last_exited`` exit copy, and coda + sampling for
rows whose token exits -- all queued by ``launch`` without waiting for the
device. ``launch`` prepares the step's inputs (``step_inputs.py``, one builder
for every step), runs the one forward (``forward.py``) -- a captured CUDA graph
of it where one fits the step, else eagerly on exact-size views -- then samples
and advances the decode state. Decode slots' loops, positions and tokens live on
the device (``decode_state.py``); the host reads a step's results through the
handle ``launch`` returns, at once (synchronous engine) or after it launched the
next step (overlapped engine). There is no other execution path.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from loopline.attention import AttentionBackend
from loopline.core.contracts import (
    ExitParams,
    NewRequestData,
    RunnerOutput,
    SampledToken,
    ScheduledRow,
    SchedulerOutput,
)
from loopline.core.exit_trace import ExitTraceConfig
from loopline.kv.layout import KVLayout
from loopline.kv.quant import KVScales, is_fp8
from loopline.models.family import family_of
from loopline.models.lookahead_head import HeadConfig, LookaheadHead
from loopline.models.ouro import OuroForCausalLM
from loopline.sampling_params import BAD_WORD_MAX_TOKENS, SamplingParams
from loopline.spec.config import SpeculativeConfig
from loopline.worker.both_rounds import BothRounds
from loopline.worker.cuda_graphs import (
    GraphCapturer,
    StepGraphs,
    bucket_sizes,
    mixed_buckets,
    spec_buckets,
)
from loopline.worker.decode_state import DeviceDecodeState, SlotOps
from loopline.worker.draft_head import DraftHead
from loopline.worker.exit_rule import exit_decision
from loopline.worker.forward import StepForward
from loopline.worker.kv_pages import KVPages
from loopline.worker.lookahead_plan import LookaheadPlan
from loopline.worker.lookahead_rule import LookaheadRule, PromptChunk
from loopline.worker.loop_stack import loop_stack
from loopline.worker.pipe_rows import LaneRing, PipeKind, PipeRounds
from loopline.worker.request_state import RequestState
from loopline.worker.row_kinds import LOOKAHEAD, DecodeKind, DecodeOut, PrefillKind
from loopline.worker.sampler import Sampler, SamplerOutput
from loopline.worker.sampling_inputs import (
    FieldsStager,
    HostSample,
    ParamsStager,
    SampleBatch,
    bad_words_history,
    build_sampling_tensors,
    has_penalties,
)
from loopline.worker.spec_rows import SpecKind, SpecRounds, SpecRoundState, VerifyPart
from loopline.worker.staging import concat, stage
from loopline.worker.step_inputs import StepBuilder, StepShape
from loopline.worker.trace_recorder import TraceRecorder

_SEED_MASK = 2**63 - 1
# (logits of the sampled rows, their request ids) -> None: masks constrained rows in place
TokenMask = Callable[[Tensor, list[str]], None]


class RowFailure(Exception):
    """Raised by ``launch`` before it changed anything: these requests cannot run (their inputs do not
    fit the device's types). The step may be launched again without them."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class StepHandle:
    """A launched step: ``get()`` waits for its results and returns them (once)."""

    def __init__(self, read: Callable[[], RunnerOutput]) -> None:
        self._read: Callable[[], RunnerOutput] | None = read

    @classmethod
    def ready(cls, output: RunnerOutput) -> StepHandle:
        return cls(lambda: output)

    def get(self) -> RunnerOutput:
        assert self._read is not None, "a step's results are read once"
        read, self._read = self._read, None
        return read()


@dataclass
class _Booked:
    """Prefill rows' results gathered while a step is launched."""

    exited: list[bool]  # per step row: the prompt finished (decode rows: filled at readback)
    hidden: list[Tensor] = field(default_factory=list)  # last prompt position's hidden, per finished prompt
    meta: list[tuple[int, Tensor]] = field(default_factory=list)  # (step row, exit depth [1]) per finished prompt
    prompt_logprobs: dict = field(default_factory=dict)


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zeroed KV pool. On the CPU its pages come from an anonymous mapping, which the OS zero-fills when
    first touched: ``torch.zeros`` writes every page up front (0.4 s and 1 GiB of resident memory for the
    default CPU pool, whatever the requests use); here only the blocks written cost memory. Zeros, not
    ``empty``: a masked position's weight is 0, and 0 times a stale NaN is still NaN."""
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping alive


class ModelRunner:
    """Runs steps on the device. ``no_refill``: a decode slot whose token exited idles until every
    slot's token has exited (the cohort baseline); ``per_token_exits``: the exit rule depends on the
    token index (``exit_mode="trace"``), which only the device knows, so recorded depths live there."""

    def __init__(self, model: OuroForCausalLM, layout: KVLayout, backend: AttentionBackend, num_blocks: int,
                 block_size: int, max_num_seqs: int, max_model_len: int, sampler: Sampler, device: torch.device,
                 dtype: torch.dtype, *, slot_ops: SlotOps | None = None, no_refill: bool = False,
                 per_token_exits: bool = False, kv_dtype: torch.dtype | None = None,
                 kv_scales: KVScales | None = None, speculative: SpeculativeConfig | None = None,
                 lookahead: tuple[LookaheadHead, HeadConfig] | None = None,
                 exit_trace: ExitTraceConfig | None = None) -> None:
        """``kv_dtype``: the pool's stored dtype (default ``dtype``); an FP8 pool needs ``kv_scales``.
        ``speculative``: loop self-speculation's config (docs/speculation.md). ``lookahead``: the head
        beside the weights (``load_head``), which ``exit_mode="lookahead"`` rows use (docs/lookahead.md).
        ``exit_trace``: record every executed loop's exit features to disk (docs/lookahead.md, 'Engine traces')."""
        cfg = model.config
        self.kv_dtype = kv_dtype or dtype
        if is_fp8(self.kv_dtype) and kv_scales is None:
            raise ValueError("an FP8 KV pool needs kv_scales (loopline.kv.quant.kv_scales_for)")
        self.kv_scales = kv_scales.to(device) if kv_scales is not None and is_fp8(self.kv_dtype) else None
        self.model, self.layout, self.backend, self.sampler = model, layout, backend, sampler
        self.device, self.dtype, self.block_size = device, dtype, block_size
        family = family_of(model)
        self.family = family
        self.vocab_size = family.logits_size(cfg)
        # One scratch block and one scratch slot beyond what the scheduler hands out:
        # padding rows of a CUDA graph write there and nowhere else.
        self.scratch_block, self.scratch_slot = num_blocks, max_num_seqs
        shape = (family.kv_layers(cfg), num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = kv_zeros(shape, self.kv_dtype, device)
        self.v_cache = kv_zeros(shape, self.kv_dtype, device)
        # Per-slot decode state stays on the device between steps.
        self.slot_hidden = torch.zeros(max_num_seqs + 1, cfg.hidden_size, dtype=dtype, device=device)
        self.slot_survival = torch.ones(max_num_seqs + 1, dtype=torch.float32, device=device)
        self.slot_ops = slot_ops or SlotOps()  # the decode state's step ops (worker/backends.py picks them)
        self.max_num_seqs = max_num_seqs
        # a speculating request may write KV past its reservation (SpeculativeConfig.kv_lookahead)
        self.lookahead = 0 if speculative is None else speculative.kv_lookahead(cfg.total_ut_steps)
        max_blocks = -(-(max_model_len + 1 + self.lookahead) // block_size)
        self.decode_state = DeviceDecodeState(max_num_seqs + 1, layout, block_size, max_blocks, self.scratch_block,
                                              device, self.slot_ops)
        if per_token_exits:
            self.decode_state.allocate_trace()
        self.work_tile_tokens = backend.work_tile_tokens(cfg.num_attention_heads // cfg.num_key_value_heads)
        self.graphs: StepGraphs | None = None
        self._sampling_params = ParamsStager()  # the sampled rows' parameters, on the device while unchanged
        self._sampling_fields = FieldsStager()  # their logits fields (logit_bias, min_tokens, ...), likewise
        # the tokens of decode rows that do not exit in a step (never read, never written: no fill a step)
        self._unread_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device)
        self._graph_args: tuple | None = None  # graphs to recapture after a sleep
        self._kv_shape = shape
        self.requests: dict[str, RequestState] = {}
        # The step's rows by kind, decode rows first (the scheduler's order); one builder and one
        # forward serve eager steps and graph captures alike.
        kv = self._kv_cache  # (read at each call: the pool moves on sleep / wake)
        # the family's loop over a step's rows (loopline.worker.loop_stack)
        self.stack = loop_stack(model, ops=self.slot_ops, state=self.decode_state, slot_hidden=self.slot_hidden,
                                slot_survival=self.slot_survival, requests=self.requests,
                                planes=family.once_planes(cfg, layout.num_loops), dtype=dtype, no_refill=no_refill,
                                per_token_exits=per_token_exits, tile_tokens=self.work_tile_tokens)
        self.decode = DecodeKind(model=model, backend=backend, kv=kv, state=self.decode_state, ops=self.slot_ops,
                                 slot_hidden=self.slot_hidden, slot_survival=self.slot_survival,
                                 requests=self.requests, scratch_slot=self.scratch_slot,
                                 copies_on_exit=len(layout.exit_copy_planes(1)) > 0, no_refill=no_refill,
                                 per_token_exits=per_token_exits, stack=self.stack)
        # the lookahead exit rule, evaluated on the device after every loop (worker/lookahead_rule.py)
        self.lookahead_rule = None if lookahead is None else LookaheadRule(*lookahead, cfg.hidden_size, self.decode_state,
                                                                            device)
        self.decode.lookahead = self.lookahead_rule
        self.trace = None if exit_trace is None else TraceRecorder(exit_trace, model, device)
        self.decode.trace = self.trace
        # what the host knows a step ahead of the rule's exits: the coda runs only for rows that may exit
        self.lookahead_plan = None if lookahead is None else LookaheadPlan(max_num_seqs + 1, lookahead[1].loops, device,
                                                                           counts_runs=not no_refill)
        spec_kinds: list = []
        rounds: list[SpecRounds | PipeRounds] = []  # speculating requests' drafts and acceptance, per scheme
        self.lanes: LaneRing | None = None  # the pipeline's lane ring (scheme 2)
        # requests that may speculate at once: new requests stop speculating from disable_by_batch_size running on
        self.max_speculating = min(max_num_seqs, (speculative and speculative.disable_by_batch_size) or max_num_seqs)
        if speculative is not None:
            head = DraftHead(model, speculative.draft_loops, speculative.draft_adapter)
            if speculative.scheme != "pipeline":  # draft-then-verify rounds (scheme 1; with "auto", beside lanes)
                state = SpecRoundState(max_num_seqs + 1, speculative.num_speculative_tokens, cfg.hidden_size, dtype,
                                       device)
                spec_kinds.append(SpecKind(model=model, backend=backend, kv=kv, state=self.decode_state, rounds=state,
                                           requests=self.requests, scratch_slot=self.scratch_slot,
                                           copies_on_exit=len(layout.exit_copy_planes(1)) > 0))
                rounds.append(SpecRounds(model, self.decode_state, state, self.requests, sampler, device, head))
            if speculative.pipelines:
                self.lanes = LaneRing(max_num_seqs + 1, speculative.lanes(cfg.total_ut_steps), cfg.hidden_size, dtype,
                                      device)
                spec_kinds.append(PipeKind(model=model, backend=backend, kv=kv, state=self.decode_state, ring=self.lanes,
                                           requests=self.requests, scratch_slot=self.scratch_slot,
                                           max_loops=cfg.total_ut_steps))
                rounds.append(PipeRounds(model, self.decode_state, self.lanes, self.requests, sampler, device, head,
                                         redraft=speculative.redraft))
        self.spec: SpecRounds | PipeRounds | BothRounds | None = (
            None if not rounds else rounds[0] if len(rounds) == 1 else BothRounds(*rounds))
        kinds = (self.decode, *spec_kinds,
                 PrefillKind(model=model, requests=self.requests, block_size=block_size, device=device, stack=self.stack))
        self.builder = StepBuilder(kinds, cfg.hidden_size, dtype, device, block_size, self.scratch_block,
                                   self.work_tile_tokens)
        self.forward = StepForward(model, backend, kv, kinds, self.kv_scales, self.stack)
        # preemption snapshots and the PD handoff's page export/import
        self.pages = KVPages(kv, self.requests, self.slot_hidden,
                             self.slot_survival, self.decode_state, block_size, cfg.hidden_size, dtype, device,
                             kv_dtype=self.kv_dtype, kv_scales=self.kv_scales)

    def _kv_cache(self) -> tuple[Tensor, Tensor]:
        return self.k_cache, self.v_cache

    def capture_graphs(self, max_seq_len: int, max_num_batched_tokens: int | None = None, *,
                       max_prefill_rows: int = 16, capturer: GraphCapturer | None = None) -> None:
        """Captures decode-only steps, and steps with up to ``max_prefill_rows`` small prefill chunks
        (given the token budget), as CUDA graphs (CUDA only; a backend whose ``graph_steps`` is "decode" gets
        the families whose rows all have one query, the rest run eagerly); under
        loop self-speculation also steps of speculating rows beside decode rows (:meth:`_spec_shapes`); with a
        lookahead head the decode and mixed steps twice, with and without its rule (only steps with a
        lookahead row run it). ``capturer``: how graphs are captured and replayed (default: CUDA graphs)."""
        self._graph_args = (max_seq_len, max_num_batched_tokens, max_prefill_rows, capturer)
        max_seq_len += self.lookahead  # (requests' bounds count a round's lookahead; 0 without speculation)
        width = self.builder.width(max_seq_len)
        idle = ((0, 0),) * (len(self.builder.kinds) - 2)  # the speculative kind's part: its own family holds it
        decode = [StepShape(((b, b), *idle, (0, 0)), width, 0, 1, max_seq_len) for b in bucket_sizes(self.max_num_seqs)]
        mixed, chunks = [], []
        if max_num_batched_tokens is not None:
            # Decode rows get their own attention launch; a fixed-size work list holds the prompt tiles, so
            # the grid does not depend on the step (a backend without work lists ignores it).
            decode_sizes, prefill_sizes = mixed_buckets(self.max_num_seqs, max_num_batched_tokens)
            chunks = [(max_prefill_rows, p) for p in prefill_sizes]
            mixed = [StepShape(((d, d), *idle, chunk), width, self._work(*chunk), chunk[1], max_seq_len)
                     for d in decode_sizes for chunk in chunks]
        # the family's loop may skip work a step does not need: decode graphs per variant, leanest first (the
        # last runs everything, as mixed steps' graphs do)
        variants = self.stack.graph_variants
        families = {f"decode{suffix}": [dataclasses.replace(s, features=s.features | f) for s in decode]
                    for suffix, f in variants}
        families["mixed"] = [dataclasses.replace(s, features=s.features | variants[-1][1]) for s in mixed]
        if self.spec is not None:
            families |= self._spec_shapes(width, max_seq_len, chunks)
        if self.lookahead_rule is not None:  # the same steps with the head's rule: steps with a lookahead row
            families |= {f"{name}_lookahead": [dataclasses.replace(s, features=LOOKAHEAD) for s in families[name]]
                         for name in ("decode", "mixed")}
        if self.backend.graph_steps == "decode":  # steps with prompt chunks or verify rows run eagerly
            families = {name: shapes for name, shapes in families.items()
                        if all(s.max_query_len == 1 for s in shapes)}
        self.graphs = StepGraphs(self.forward, self.builder, families)
        shapes = [shape for family in families.values() for shape in family]
        # the family's own step buffers at their largest before any graph captures views of them
        self.stack.reserve(max(s.tokens for s in shapes), max(s.rows for s in shapes), width, pin=True)
        self.graphs.capture(capturer)

    def _work(self, rows: int, tokens: int) -> int:
        """Work-list entries of a graph's prompt part: ``rows`` prompts' ``tokens`` tokens in query tiles."""
        return rows + tokens // (self.work_tile_tokens or 64)

    def _spec_shapes(self, width: int, max_seq_len: int,
                     chunks: Sequence[tuple[int, int]] = ()) -> dict[str, list[StepShape]]:
        """The families of steps with speculating rows at the :func:`spec_buckets` pairs. The pipeline's
        (``pipe``): ``s`` pipelining requests are ``s * L`` one-query lane rows, beside ``d`` decode rows, like a
        plain decode step of as many rows; ``pipe_mixed``: their lanes beside a prompt's chunk of one of the
        mixed graphs' ``chunks`` (rows, tokens) and no decode rows, the step a closed loop's next request
        makes (eagerly ~14 ms each on an H100, an estimate: docs/speculation.md); draft then verify's
        ``spec_mixed`` likewise holds a chunk beside rounds' rows. Other steps with prefill chunks and
        speculating rows run eagerly. Draft then verify's
        (``spec_draft``, then ``spec``): A ``spec`` bucket of ``s`` rows holds ``s * (K + 1)`` query tokens, so one graph
        serves verify rows (K+1 queries), draft rows (1) and any mix of them (requests in different phases
        of their rounds). Steps whose rows all have one query (every speculating request drafting) take the
        ``draft`` family first: one token a row, no work list, the decode attention and the one-row GEMVs,
        as a plain decode step of as many rows. In the verify-sized graph such a step ran K+1 tokens a
        row through the GEMMs and the work-list attention: on an H200 (Ouro-1.4B shapes, C = 1, every
        draft accepted) K=3, d=1 gave 1.08x plain decoding at 1.79 steps per token against 4.01."""
        pairs = spec_buckets(self.max_num_seqs, self.max_num_seqs)
        counts = self._kind_counts
        families: dict[str, list[StepShape]] = {}
        for kind in self.builder.kinds:
            if isinstance(kind, PipeKind):
                lanes = kind.ring.lanes
                families["pipe"] = [StepShape(counts(kind, d, s * lanes, s * lanes), width, 0, 1, max_seq_len)
                                    for d, s in pairs]
                # a prompt's chunk beside pipelining requests (the next request arriving): their lanes and the
                # chunk, no plain decode rows, at most as many pipelining requests as may pipeline at once (a
                # step of more runs eagerly). The lanes' one-query rows are attended off the work list unless a
                # kind of several queries comes before theirs (scheme auto's rounds): then a tile each.
                kinds = self.builder.kinds
                listed = any(k.query_len != 1 for k in kinds[1:kinds.index(kind)])
                families["pipe_mixed"] = [
                    StepShape(counts(kind, 0, s * lanes, s * lanes)[:-1] + (chunk,), width,
                              (s * lanes if listed else 0) + self._work(*chunk), chunk[1], max_seq_len)
                    for d, s in pairs if d == 0 and s <= self.max_speculating for chunk in chunks]
            elif isinstance(kind, SpecKind):
                k1 = kind.rounds.k + 1
                tiles = -(-k1 // (self.work_tile_tokens or 64))
                families["spec_draft"] = [StepShape(counts(kind, d, s, s), width, 0, 1, max_seq_len)
                                          for d, s in pairs]
                families["spec"] = [StepShape(counts(kind, d, s, s * k1), width, s * tiles, k1, max_seq_len)
                                    for d, s in pairs]
                # a prompt's chunk beside speculating requests and no plain decode rows (the next request of a
                # closed loop arriving), as pipe_mixed: their rows (drafting or verifying) on the work list
                # beside the chunk's tiles
                families["spec_mixed"] = [
                    StepShape(counts(kind, 0, s, s * k1)[:-1] + (chunk,), width, s * tiles + self._work(*chunk),
                              max(k1, chunk[1]), max_seq_len)
                    for d, s in pairs if d == 0 and s <= self.max_speculating for chunk in chunks]
        # (scheme "auto": a step with rounds' rows and lanes both runs eagerly)
        return families

    def _kind_counts(self, kind: object, decode: int, rows: int, tokens: int) -> tuple[tuple[int, int], ...]:
        """A step's (rows, tokens) per row kind: ``decode`` decode rows and ``rows`` rows of ``kind`` holding
        ``tokens`` queries."""
        return tuple((decode, decode) if k is self.decode else (rows, tokens) if k is kind else (0, 0)
                     for k in self.builder.kinds)

    # --- sleep (colocated training) ---------------------------------------------------
    def release_kv_cache(self) -> None:
        """Frees the KV pool. No request may be in flight: leftover request state is dropped.

        CUDA graphs captured on the pool's addresses are dropped too; :meth:`restore_graphs`
        recaptures them once the pool (and the weights) are back.
        """
        self.requests.clear()
        self.pages.clear()
        self.graphs = None  # (capture_graphs kept its arguments for restore_graphs)
        self.k_cache = self.v_cache = torch.empty(0, dtype=self.kv_dtype, device=self.device)
        if self.device.type == "cuda":
            gc.collect()  # what the graphs held in reference cycles goes before the cache is emptied
            torch.cuda.empty_cache()

    def allocate_kv_cache(self) -> None:
        """Re-allocates the KV pool released by :meth:`release_kv_cache` (zeroed, new addresses)."""
        self.k_cache = kv_zeros(self._kv_shape, self.kv_dtype, self.device)
        self.v_cache = kv_zeros(self._kv_shape, self.kv_dtype, self.device)

    def restore_graphs(self) -> None:
        """Recaptures the CUDA graphs dropped by :meth:`release_kv_cache` (a no-op if there were none)."""
        if self.graphs is None and self._graph_args is not None:
            max_seq_len, max_tokens, max_prefill_rows, capturer = self._graph_args
            self.capture_graphs(max_seq_len, max_tokens, max_prefill_rows=max_prefill_rows, capturer=capturer)

    # --- request bookkeeping ----------------------------------------------------------
    def _add(self, new: NewRequestData) -> None:
        t, h = len(new.prompt_token_ids), self.model.config.hidden_size
        dev = self.device
        self.requests[new.request_id] = RequestState(
            params=new.params, seed=new.seed & _SEED_MASK,
            prompt=stage(dev, (new.prompt_token_ids, np.int64))[0],
            block_arrays=[np.asarray(bt, dtype=np.int32) for bt in new.block_tables],
            prompt_exit=self._prompt_exit(new),
            hidden=torch.empty(t, h, dtype=self.dtype, device=dev),
            survival=torch.ones(t, dtype=torch.float32, device=dev),
            sel_hidden=torch.empty(t, h, dtype=self.dtype, device=dev),
            sel_depth=torch.zeros(t, dtype=torch.long, device=dev),
            exit_target=torch.zeros(t, dtype=torch.long, device=dev) if new.prompt_exit.lookahead is not None else None,
            max_len=t + new.params.max_tokens + 1 + self.lookahead, slot=new.slot,  # effective params: max_tokens resolved
            prefill_loops=self.family.prefill_loops(self.model.config, new.params.max_loops),
            injected=torch.empty(t, h, dtype=self.dtype, device=dev) if self.stack.keeps_injected else None,
        )
        self._init_decode_slot(self.requests[new.request_id], new.block_tables)

    def _prompt_exit(self, new: NewRequestData) -> ExitParams:
        """The exit rule of the request's prompt positions: a family whose prompts never exit early (Huginn)
        runs them all to its prefill depth."""
        if self.family.exit_criterion.exits_in_prefill:
            return new.prompt_exit
        depth = self.family.prefill_loops(self.model.config, new.params.max_loops)
        return dataclasses.replace(new.prompt_exit, min_loops=depth, max_loops=depth, threshold=1.0)

    @staticmethod
    def _fits_device(new: NewRequestData) -> bool:
        """Whether a new request's values convert to the dtypes its tensors use (entry points validate
        ranges; this is the last line, checked before anything is mutated)."""
        p = new.params
        ints = [p.top_k, new.seed & _SEED_MASK]  # (prompt ids are range-checked at entry)
        floats = [p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
        try:
            np.asarray(ints, dtype=np.int64)
            with np.errstate(over="raise", invalid="raise"):
                np.asarray(floats, dtype=np.float32)
        except (OverflowError, ValueError, TypeError, FloatingPointError):
            return False
        return all(np.isfinite(floats))

    def _init_decode_slot(self, st: RequestState, block_tables: list) -> None:
        """A request's per-slot device state before its first token."""
        ds = self.decode_state
        ds.set_tables(st.slot, block_tables)
        if self.lanes is not None:
            self.lanes.clear(st.slot, st.params.max_tokens, st.params._stop_ids)
        self.stack.set_slot(st.slot, st.params.latent_seed)
        if has_penalties(st.params):
            ds.track_penalties(st.slot, st.prompt, self.vocab_size)
        if bad_words_history(st.params):  # multi-token bad words compare the slot's last tokens
            ds.track_recent(BAD_WORD_MAX_TOKENS - 1)
        if self.decode.per_token_exits:
            ds.set_trace(st.slot, st.params.exit_depths)
        if self.lookahead_rule is not None:  # (a predictor that replays depths keys on the slot)
            self.lookahead_rule.start_slot(st.slot, st.params)
            self.lookahead_plan.forget(st.slot)

    # --- one step: launch now, read when asked ---------------------------------------
    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, token_mask: TokenMask | None = None) -> StepHandle:
        """Queues one step on the device and returns the handle that reads its results.

        ``token_mask``: called as ``token_mask(logits, request_ids)`` on the sampled rows' logits (one
        request id a row) before the sampler; it masks, in place, the rows it constrains (structured
        outputs). ``None``: no row is constrained, nothing is paid.

        Decode rows' loops, positions and tokens come from the device state
        (``DeviceDecodeState``), so the host never waits inside or between steps:
        a synchronous caller calls ``handle.get()`` at once, the overlapped engine
        launches the next step first.
        """
        bad = [new.request_id for new in sched.new_requests if not self._fits_device(new)]
        if bad:  # before any state changes: the engine fails these and launches the rest again
            raise RowFailure("request inputs do not fit the device's integer or float types", bad)
        self._apply_lifecycle(sched)
        rows = sched.rows
        if not rows:
            return StepHandle.ready(RunnerOutput([], []))
        # prepare: the rows into persistent buffers (a captured graph's views where one fits the step)
        plan = self.builder.plan(rows)
        self.stack.plan(plan)  # (the stages of the family's loop the rows need: step features)
        if self.lookahead_plan is not None:  # (the depths the rule fixed: which decode rows may exit)
            self.lookahead_plan.launch(plan.kinds[0])
        graph = self.graphs.find(plan) if self.graphs is not None else None
        inputs = graph.inputs if graph is not None else self.builder.inputs(self.stack.eager(self.builder.exact_shape(plan)))
        self.builder.fill(plan, inputs)
        # run: the one forward, replayed or eager
        out = graph.replay() if graph is not None else self.forward(inputs)
        parts = self.builder.split(out, plan)
        dec, prefill = parts[0], parts[-1]
        nd = plan.kinds[0].num_rows
        if self.trace is not None and nd:
            self.trace.decode(rows[:nd], dec, self.requests)
        ns = nd + sum(p.num_rows for p in plan.kinds[1:-1])  # speculative rows come between
        booked = _Booked([False] * len(rows))
        if prefill is not None:
            h, gate, *kept = prefill  # (h, gate[, head input, prelude output]: the family's loop keeps them)
            head_in, injected = kept or (h, None)
            self._book_prefill_rows(rows, ns, h, gate, head_in, injected, plan.kinds[-1].host.token_offsets, booked)
        verify = None
        if ns > nd:  # speculative rows: drafts, and the target rows of rounds that end here
            self.spec.draft(rows[nd:ns])
            verify = self.spec.verify_part(rows[nd:ns], nd)
        # sample, then advance the decode state, for the decode rows that may exit: a step that ran the lookahead
        # rule computed no logits, its coda runs here (worker/lookahead_plan.py); the family's loop names its own
        # (Huginn at fixed iterations: loop_stack.py)
        coda = self.stack.compact(dec) if dec is None or dec.target is None else \
            self.lookahead_plan.compact(dec, self.model.head)
        ne = coda.dec.exit.shape[0] if coda.dec is not None else 0  # decode rows sampled
        batch = self.sample(rows, ne, booked, coda.dec, token_mask, verify, coda.rows)
        ds = self.decode_state
        if nd:
            # Without finished prompts the decode rows are every sampled row: the advance packs their
            # results for the readback as it applies them, instead of a stack of its own.
            whole = batch is not None and not (booked.meta or verify or coda.rows is not None)
            record = torch.empty((3, nd), dtype=torch.int64, device=self.device) if whole else None
            sampled = batch.out.token_ids[:ne] if batch is not None else None
            tokens = LookaheadPlan.tokens(coda, sampled, self._unread_tokens[:nd])
            ds.advance(dec.slots, dec.loops, dec.run, dec.exit, tokens, record)
            if whole:
                batch.packed = record
        if batch is None:  # nothing sampled: prefill rows only, none finished its prompt (or no decode row exits)
            return StepHandle.ready(RunnerOutput(booked.exited, [None] * len(rows), booked.prompt_logprobs))
        if booked.meta:  # prompts that finished: their first token is fed next, at position prompt_len
            done = [rows[i] for i, _ in booked.meta]
            slots, ends = stage(self.device, ([r.slot for r in done], np.int64), ([r.end for r in done], np.int64))
            ds.start(slots, batch.out.token_ids[ne:ne + len(done)], ends)
        wait = batch.to_host_async()
        return StepHandle(lambda: self._collect(rows, batch, wait(), booked))

    def _apply_lifecycle(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
            if self.trace is not None:  # (a request ended without the engine's count: a handoff, an abort-all)
                self.trace.finish(rid)
            self.stack.forget(rid)
            self.pages.forget(rid)  # its pages (freed) may be written by this step
        # Snapshots before any freed block is written, and before a new request resets the
        # device state of a slot a victim just gave up (the scheduler never preempts a request
        # it started or resumed in the same step, nor resumes one it preempted).
        for rid in sched.preempted_request_ids:
            self.pages.snapshot(rid)
        for new in sched.new_requests:
            self._add(new)
        for resumed in sched.resumed_requests:
            self.pages.restore(resumed)
            if self.lanes is not None:  # lanes in flight at the preemption were dropped: it resumes from its commits
                params = self.requests[resumed.request_id].params
                self.lanes.clear(resumed.slot, params.max_tokens, params._stop_ids)
            if self.lookahead_plan is not None:  # (a slot with a new owner)
                self.lookahead_plan.forget(resumed.slot)
        for rid, added in sched.block_updates.items():
            st = self.requests[rid]
            for plane, blocks in enumerate(added):
                st.block_arrays[plane] = np.concatenate([st.block_arrays[plane], np.asarray(blocks, dtype=np.int32)])
            self.decode_state.set_tables(st.slot, st.block_arrays)

    def _book_prefill_rows(self, rows, first: int, h: Tensor, gate: Tensor, head_in: Tensor, injected: Tensor | None,
                           offsets, booked: _Booked) -> None:
        """Books prefill rows ``rows[first:]``; the j-th one's tokens are ``h[offsets[j]:offsets[j + 1]]``
        (``head_in``: what the head reads of them; ``injected``: the family's kept prelude output, or None)."""
        chunks = rows[first:]
        traced = self.trace is not None and self.trace.config.prompts
        # the loop's input, for those that read it (before st.hidden takes this loop's state)
        xs = [self._loop_input(row) if traced or self.requests[row.request_id].prompt_exit.lookahead is not None
              else None for row in chunks]
        newly = self._lookahead_prefill(chunks, xs, h, gate, offsets)
        for j, (i, row) in enumerate(zip(range(first, len(rows)), chunks)):
            lo, hi = offsets[j], offsets[j + 1]
            if injected is not None and row.loop == 1:
                self.requests[row.request_id].injected[row.start:row.end] = injected[lo:hi]
            if traced:
                self.trace.prefill(row.request_id, self.requests[row.request_id].prompt.numel(), row.loop, row.start,
                                   xs[j], head_in[lo:hi], gate[lo:hi])
            self._finish_prefill_row(i, row, h[lo:hi], gate[lo:hi], booked, head_in[lo:hi], newly.get(j))

    def _loop_input(self, row: ScheduledRow) -> Tensor:
        """A prompt chunk's loop input: the embedding at loop 1, else the previous loop's kept hidden state."""
        st = self.requests[row.request_id]
        return self.model.embed(st.prompt[row.start:row.end]) if row.loop == 1 else st.hidden[row.start:row.end]

    def _lookahead_prefill(self, chunks, xs: list, h: Tensor, gate: Tensor, offsets) -> dict[int, Tensor]:
        """The lookahead rule for the step's chunks of lookahead requests, in one batch (one evaluation per
        step, not ~40 small ops per chunk): each such chunk's positions that exit at this loop and had not
        exited before, by its index in ``chunks``."""
        picked = [j for j, row in enumerate(chunks) if self.requests[row.request_id].prompt_exit.lookahead is not None]
        if not picked:
            return {}
        if len(picked) == len(chunks):  # (the common case: the step's outputs are the batch as they are)
            h_in, gate_in = h[offsets[0]:offsets[-1]], gate[offsets[0]:offsets[-1]]
        else:
            h_in = torch.cat([h[offsets[j]:offsets[j + 1]] for j in picked])
            gate_in = torch.cat([gate[offsets[j]:offsets[j + 1]] for j in picked])
        exit = self.lookahead_rule.prefill(
            [PromptChunk(self.requests[chunks[j].request_id], chunks[j].loop, chunks[j].start, chunks[j].end, xs[j])
             for j in picked], h_in, gate_in)
        depth = [self.requests[chunks[j].request_id].sel_depth[chunks[j].start:chunks[j].end] for j in picked]
        newly = exit & (concat(depth) == 0)  # (exits here first)
        out, a = {}, 0
        for j in picked:
            b = a + chunks[j].end - chunks[j].start
            out[j], a = newly[a:b], b
        return out

    def _finish_prefill_row(self, i: int, row: ScheduledRow, h: Tensor, gate: Tensor, booked: _Booked,
                            head_in: Tensor, lookahead_newly: Tensor | None = None) -> None:
        """One chunk's exits, kept state and (after its last loop) results. ``lookahead_newly``: a lookahead
        request's positions that exit here first (the rule ran for the step's chunks at once)."""
        st = self.requests[row.request_id]
        lo, hi = row.start, row.end
        ep = st.prompt_exit
        # NOTE: the gate's rule for a chunk is one (loop, min, max, threshold) for all its positions, so it
        # goes in as scalars; each op here is a launch per prefill row, which bounds steps that carry many
        # rows (the lookahead rule's ~40 ops run once per step instead: _lookahead_prefill).
        if ep.threshold < 1.0 or ep.lookahead is not None:  # the gate (or the head) decides, position by position
            if ep.lookahead is not None:
                newly = lookahead_newly
            else:
                survival = st.survival[lo:hi] if row.loop > 1 else 1.0
                ex, survival = exit_decision(row.loop, survival, gate, ep.min_loops, ep.max_loops, ep.threshold)
                st.survival[lo:hi] = survival
                newly = ex & (st.sel_depth[lo:hi] == 0)
            # in place (one launch each, not a where and a copy); a mask, not a mask index: that would sync
            sel_hidden = st.sel_hidden[lo:hi]
            torch.where(newly[:, None], head_in, sel_hidden, out=sel_hidden)
            st.sel_depth[lo:hi].masked_fill_(newly, row.loop)
        elif row.loop == ep.max_loops:  # no early exit: every position exits exactly at max_loops
            st.sel_hidden[lo:hi] = head_in
            st.sel_depth[lo:hi] = row.loop
        if row.loop < st.prefill_loops:
            st.hidden[lo:hi] = h
            return
        # The chunk finished its last loop: prompt logprobs, and the first token if last chunk.
        if st.params.prompt_logprobs is not None:
            booked.prompt_logprobs.setdefault(row.request_id, []).extend(self._prompt_logprobs(st, lo, hi))
        if row.is_last_chunk:
            booked.exited[i] = True
            last = st.prompt.numel() - 1
            booked.hidden.append(st.sel_hidden[last])
            booked.meta.append((i, st.sel_depth[last:last + 1]))

    def _prompt_logprobs(self, st: RequestState, lo: int, hi: int) -> list:
        """Position p predicts prompt token p+1 from its hidden at the depth the rule picked (returned too)."""
        hi = min(hi, st.prompt.numel() - 1)
        if hi <= lo:
            return []
        logp = torch.log_softmax(self.model.head(st.sel_hidden[lo:hi]), dim=-1)
        nxt = st.prompt[lo + 1:hi + 1]
        chosen = logp.gather(1, nxt[:, None]).squeeze(1)
        ranks = (logp > chosen[:, None]).sum(1) + 1
        k = st.params.prompt_logprobs
        top_v, top_i = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        rows = zip(chosen.tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist(), st.sel_depth[lo:hi].tolist())
        return [(lo + j, c, rk, list(zip(ti, tv)), depth) for j, (c, rk, tv, ti, depth) in enumerate(rows)]

    # --- coda + sampling --------------------------------------------------------------
    def sample(self, rows, nd: int, booked: _Booked, dec: DecodeOut | None,
               token_mask: TokenMask | None = None, verify: VerifyPart | None = None,
               dec_rows: list[int] | None = None) -> SampleBatch | None:
        """Coda + sampling for ``nd`` decode rows (logits given; their loops, token indices and slots
        from the device state ``dec``; ``dec_rows``: their step rows, default ``[:nd]``), for prompts that finished, and for the target rows of speculative
        rounds that end in this step (``verify``), on the device: the last phase of :meth:`launch` (after
        prepare and run), which calls it; public as that phase, for profilers (``tools/step_phases.py``).
        ``None``: nothing to sample (prefill rows only, no prompt finished, no round ended)."""
        logits = dec.logits if dec is not None else None
        parts = [logits] if logits is not None else []
        if booked.hidden:
            parts.append(self.model.head(torch.stack(booked.hidden)))
        if verify is not None:
            parts.append(verify.logits)
        if not parts:
            return None
        all_logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        row_idx = (list(range(nd)) if dec_rows is None else dec_rows) + [i for i, _ in booked.meta] + (
            verify.row_idx if verify else [])
        states = [self.requests[rows[i].request_id] for i in row_idx]
        n_done = len(booked.meta)
        # A finished prompt samples token 0. (No tensor or cat of a single part on the decode path: at one
        # decode row each op is a sizeable part of the step.)
        if n_done or verify is not None:
            index = torch.cat(([dec.token_index] if nd else [])
                              + ([torch.zeros(n_done, dtype=torch.long, device=self.device)] if n_done else [])
                              + ([verify.token_index] if verify is not None else []))
        else:
            index = dec.token_index
        tensors = build_sampling_tensors(states, index, self.sampler.logprobs_mode, self.device,
                                         params=self._sampling_params, fields=self._sampling_fields)
        ds = self.decode_state
        history = tensors.any_bad_words and ds.recent is not None
        if tensors.any_penalties or history:  # the device counts every slot's tokens (and keeps its last ones)
            done = stage(self.device, ([rows[i].slot for i in row_idx[nd:nd + n_done]], np.int64))[0]
            row_slots = torch.cat([dec.slots, done]) if nd else done
            if tensors.any_penalties:  # (each only where a row's penalty reads it: a [B, V] gather each)
                if tensors.any_count_penalties:
                    tensors.output_counts = ds.counts[row_slots]
                if tensors.any_repetition:
                    tensors.seen_mask = ds.seen[row_slots]
            if history:
                tensors.recent = ds.recent[row_slots][:, -tensors.bad_prefix.shape[1]:]
            if verify is not None:  # a round's targets read the drafts before their position too: after the rest
                self.spec.target_history(tensors, verify)
        if token_mask is not None:  # structured outputs: disallowed tokens of constrained rows to -inf
            token_mask(all_logits, [rows[i].request_id for i in row_idx])
        if tensors.any_filters:
            # the filters search only the rows whose token is read: a decode row's where it exits (one step of
            # its token's R at fixed depth), every finished prompt's and round target's
            tensors.active = dec.exit if len(row_idx) == nd else torch.cat(
                ([dec.exit] if nd else []) + [torch.ones(len(row_idx) - nd, dtype=torch.bool, device=self.device)])
        out: SamplerOutput = self.sampler(all_logits, tensors)
        depths = ([dec.loops] if nd else []) + [depth for _, depth in booked.meta]
        flags = ([dec.exit] if nd else []) + ([torch.ones(n_done, dtype=torch.bool, device=self.device)] if n_done else [])
        verdicts = None
        if verify is not None:  # a round's target rows: the committed ones are read back, in order
            flags.append(self.spec.accept(verify, out.token_ids[nd + n_done:]))
            depths.append(verify.depth)
            if verify.verdicts is not None:  # (pipelining lanes: zeros for the rows before them)
                verdicts = torch.cat([verify.verdicts.new_zeros(nd + n_done), verify.verdicts])
        return SampleBatch(row_idx, states, out, *(concat(t) for t in (flags, depths)),
                           verdicts=verdicts)

    def _collect(self, rows, batch: SampleBatch, host: HostSample, booked: _Booked) -> RunnerOutput:
        exited = booked.exited
        sampled: list[SampledToken | None] = [None] * len(rows)
        more: dict[int, list[SampledToken]] = {}  # a speculative round's tokens after its first
        failed: dict[str, Exception] = {}
        verdicts: dict[int, tuple[int, int]] = {}
        for j, row_i in enumerate(batch.row_idx):
            if host.verdicts is not None and host.verdicts[j]:
                judged, accepted = verdicts.get(row_i, (0, 0))
                verdicts[row_i] = (judged + 1, accepted + (host.verdicts[j] == 2))
            if not host.exit[j]:
                continue
            exited[row_i] = True
            try:
                token = self._sampled_token(host, j, batch.states[j].params)
            except Exception as e:  # one row's readback: only its request fails (the engine fails it)
                failed[rows[row_i].request_id] = e
                continue
            if sampled[row_i] is None:
                sampled[row_i] = token
            else:
                more.setdefault(row_i, []).append(token)
        return RunnerOutput(exited, sampled, booked.prompt_logprobs, failed, more, verdicts)

    @staticmethod
    def _sampled_token(host: HostSample, j: int, params: SamplingParams) -> SampledToken:
        k = params.logprobs
        top = None
        if k is not None and k > 0 and host.top_ids is not None:
            top = list(zip(host.top_ids[j][:k], host.top_lps[j][:k]))
        return SampledToken(token_id=host.ids[j], exit_depth=host.depth[j],
                            logprob=host.lps[j] if host.lps is not None else None,
                            rank=host.ranks[j] if host.ranks is not None else None, top=top)
