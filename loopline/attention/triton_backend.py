"""Paged attention in Triton: one launch for a whole step's rows.

The same contract as :class:`~loopline.attention.torch_backend.TorchAttentionBackend`
(the reference it is tested against); the kernels, and what each does, are in
:mod:`loopline.attention.triton_kernels`. This module picks and launches them:
the split-KV rule, the tile sizes, the work list of prefill steps, and which
decode-only steps take the fused decode kernel. FP8 caches take the same launches
(tile sizes by q's dtype, which the 1-byte tiles widen to) plus their per-head scales.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from loopline.attention.base import (
    AttentionBackend,
    PagedAttentionMetadata,
    check_kv_scales,
    is_fp8_kv,
    kv_bytes,
)
from loopline.attention.base import next_pow2 as _next_pow2
from loopline.attention.triton_kernels import (
    INTERPRET,
    copy_exited_kernel,
    decode_attention_kernel,
    merge_splits_kernel,
    mha_decode_kernel,
    paged_attention_kernel,
    rope_write_kv_kernel,
    triton,
)
from loopline.kernels import cuda_sm_count, pdl_options
from loopline.models.ops import Rope

_LOG2E = 1.4426950408889634
# The split counts kernels are compiled for (NUM_SPLITS is a compile-time constant, and a growing
# max_seq_len should not compile a kernel per value): a rule's count rounds down to one of them. (The full-wave
# counts of ``SplitRule`` depend on the rows and the SM count only: for Ouro's 16 heads on 132 SMs, 3 and 6.)
SPLIT_COUNTS = (1, 2, 4, 8, 12, 16, 20)


@dataclass(frozen=True)
class SplitRule:
    """How many programs split the key range of a launch (split-KV), and which decode-only steps take the fused
    decode kernel. The defaults are the measured rule; ``profile_step`` and tests build backends with others.

    The count aims for ``programs_per_sm`` programs per SM and gives each split at least
    ``min_keys_per_split`` keys, so tiny contexts are not split into pure overhead, at most ``max_splits``,
    rounded down to one of ``SPLIT_COUNTS``. ``exact_splits``: every launch the rule splits takes exactly this
    many splits instead (any count, not only ``SPLIT_COUNTS``: e.g. 24 at one row, 384 programs).
    """

    # One row of 16 KV heads (H200, 132 SMs) thus takes 20 splits, one 64-key tile each up to 1,280 keys: a
    # one-row step at 1,088 / 1,152 keys took 0.988 / 0.990 ms with 20 splits, 1.020 / 1.031 with 16 (where
    # one split reads a second tile after its grid-dependency wait) and 1.04-1.06 with 24 (384 programs do
    # not fit in one wave beside the previous kernel's).
    programs_per_sm: float = 2.5
    min_keys_per_split: int = 64  # bench_attention --sweep, H200: 16 splits of 64 keys beat 8 of 128 at one row
    max_splits: int = 20
    # Decode-only steps with at least this many splits take the fused decode kernel. Without splits (32 or 128
    # rows) the separate store + attention kernels measured faster on an H200: 7.82-8.13 vs 8.38 ms per step
    # at 128 rows, 3.031 vs 3.096 at 32 (profile_step --fused-decode-min-splits 1, 29ed633); with them (one
    # row) the fused kernel wins, 1.096 vs 1.187 ms. 1: every decode-only step takes it.
    fused_decode_min_splits: int = 2
    exact_splits: int | None = None
    # Unsplit decode-only launches over FP8 pages of an MHA cache with at least this many (row, head) programs
    # per SM (the CPU interpreter counts one SM) take mha_decode_kernel (``DecodeLaunch.cuda_cores`` None: this
    # rule): 11.6 is 1,536 programs on 132 SMs, 96 rows of Ouro's 16 heads. H100, Ouro-1.4B shapes, 1,088 keys,
    # step graph replayed alone (profile_step --kv-cache-dtype fp8 --decode-launch 16,1,1,0,1 against the
    # tensor-core kernel): 128 rows 6.867 vs 7.511 ms (mean steps), 96 rows 5.886 vs 6.006, 80 rows 5.515 vs
    # 5.290, 64 rows 5.078 vs 4.518; 32 rows 4.657 vs 3.109 a step (3.045 with 4 splits): one-warp programs
    # need a full grid.
    cuda_core_programs_per_sm: float = 11.6
    # Full waves: a fused decode launch over 16-bit pages with at least ``full_wave_programs_per_sm`` (row, KV
    # head) programs an SM takes the fewest splits from the rule's count to 1.5 times it whose grid fills its
    # waves (>= 95% of ``resident_programs_per_sm`` x SMs programs a wave); where none does, the rule's count.
    # The fused kernel over bf16 pages (64-key tiles) compiles to 160 registers a thread for sm_90 (Triton
    # 3.6, tools/attention_resources.py): 3 programs of 4 warps an SM. H100, Ouro-1.4B shapes, 1,088 keys
    # (profile_step --attn-num-splits S, mean steps): 16 rows 2.764 / 2.771 ms with 3 splits (768 programs,
    # two full waves) against 2.907 / 2.902 with the rule's 2 (512: 1.3 waves); 8 rows 2.105 with 3 (384)
    # against 2.133 with 2 and 2.177 with 4; 4 rows 1.914 with 6 (384) against 1.951 with 4; 12 rows best at
    # the rule's 2 (384). One and two rows (16 / 32 programs) keep the rule: there 24 and 12 splits would fill
    # a wave, and one row's 24 measured slower than its 20 (the previous kernel's programs still hold SMs).
    full_wave_programs_per_sm: float = 0.4
    resident_programs_per_sm: int = 3

    def __post_init__(self) -> None:
        for name in ("programs_per_sm", "cuda_core_programs_per_sm", "full_wave_programs_per_sm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_keys_per_split", "max_splits", "fused_decode_min_splits", "resident_programs_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.exact_splits is not None and not 1 <= self.exact_splits <= 64:
            raise ValueError(f"exact_splits must be in 1..64 or None, got {self.exact_splits}")

    @classmethod
    def parse(cls, text: str) -> SplitRule:
        """``"FIELD=VALUE[,FIELD=VALUE...]"`` over the defaults, as ``LOOPLINE_SPLIT_RULE`` spells a rule (e.g.
        ``full_wave_programs_per_sm=inf``: the rule before full waves); ``none`` clears ``exact_splits``."""
        kinds = {"exact_splits": int, **{f: type(getattr(cls, f)) for f in cls.__dataclass_fields__
                                         if f != "exact_splits"}}
        values = {}
        for item in filter(None, text.split(",")):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in kinds:
                raise ValueError(f"a split rule sets fields of {', '.join(kinds)}, got {item!r}")
            try:
                values[name] = None if value.strip() == "none" and name == "exact_splits" else kinds[name](value)
            except ValueError:
                raise ValueError(f"split rule field {name} takes a {kinds[name].__name__}, got {value!r}") from None
        return cls(**values)


def triton_available() -> bool:
    """True if triton can be imported (usable on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return triton is not None


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _key_block(head_dim: int, elem_bytes: int) -> int:
    """Keys per inner step: K and V tiles of BLOCK_N x D stay at ~16 KB each per pipeline stage."""
    return max(16, min(64, 16384 // (head_dim * elem_bytes)))


def _decode_block_m(group: int) -> int:
    """Q tile rows of a launch with one query per row: the G heads of one token, padded to 16."""
    return max(16, _next_pow2(group))


def _dot_precision(dot_dtype: torch.dtype) -> str:
    """The dots' input precision: ieee for fp32 operands (no TF32 rounding), else tf32 (ignored for 16 bits)."""
    return "ieee" if dot_dtype == torch.float32 else "tf32"


def _dot_dtype(q: Tensor, k_cache: Tensor) -> torch.dtype:
    """The dtype the kernels' dots run in: the cache's; for FP8 caches fp16 (fp32 with an fp32 q), which their
    tiles widen to (``triton_kernels._fp8_dot_operand``)."""
    if is_fp8_kv(k_cache):
        return torch.float32 if q.dtype == torch.float32 else torch.float16
    return k_cache.dtype


def _decode_key_block(head_dim: int, q: Tensor, k_cache: Tensor) -> int:
    """Keys per inner step of a decode launch without splits (one query per row): for FP8 caches the 1-byte
    tiles of ~16 KB, 128 keys at head_dim 128 (H200, Ouro-1.4B shapes, profile_step --kv-cache-dtype fp8: 32
    rows 2.641 ms per step against 3.099 with 64 keys and 2.901 for bf16; 128 rows 6.580 / 8.366 / 7.695);
    others as every launch (:func:`_key_block`)."""
    if is_fp8_kv(k_cache):
        return max(16, min(128, 16384 // head_dim))
    return _key_block(head_dim, _tile_elem_bytes(q, k_cache))


def _tile_elem_bytes(q: Tensor, k_cache: Tensor) -> int:
    """Bytes per K/V element that size the key tiles. FP8 tiles count as q's dtype, which they are widened to
    in registers before the dots: a bf16 model over an FP8 cache launches exactly as over a bf16 cache (the
    measured parameters; FP8 only halves the bytes each tile loads)."""
    return q.element_size() if is_fp8_kv(k_cache) else k_cache.element_size()


def _scale_args(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None
                ) -> tuple[Tensor, Tensor]:
    """The kernels' ``k_scale_ptr``/``v_scale_ptr``: the checked scales of FP8 caches, else the cache
    (a placeholder pointer, never read)."""
    if check_kv_scales(k_cache, v_cache, k_scale, v_scale):
        return k_scale.contiguous(), v_scale.contiguous()
    return k_cache, v_cache


def _heads_per_program(num_kv_heads: int, head_dim: int) -> int:
    """KV heads one copy program moves: about 2K elements, a power of two."""
    return min(_next_pow2(num_kv_heads), max(1, 2048 // head_dim))


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of decode-only steps (one query per row); ``None`` keeps the default rule."""

    block_n: int | None = None  # keys per inner step
    num_warps: int | None = None
    num_stages: int | None = None
    # Split launches of the fused decode kernel: the split of a (row, KV head) that finishes last merges the
    # partials, instead of a merge launch of its own (counters in a buffer the kernel rearms). None: off.
    last_split_merges: bool | None = None
    # MHA caches (one query head per KV head): decode rows on CUDA cores (``mha_decode_kernel``: a warp or two
    # per (row, head), tiles widened to fp32 in registers) instead of the tensor-core tile loop, in launches
    # that do not take the fused decode kernel: 1 one online softmax a program, 2 one a key lane (combined at
    # the end). 0: off. None: decode-only launches over FP8 pages take form 1 from
    # ``SplitRule.cuda_core_programs_per_sm`` programs an SM on (unsplit), mixed steps' decode rows the
    # tensor-core kernel.
    cuda_cores: int | None = None
    # A cap on registers per thread (Triton's ``maxnreg``; spills go to local memory): more programs an SM where
    # registers bound them (the FP8 unsplit launch compiles to 255 for sm_90 under Triton 3.6: two programs of
    # 4 warps an SM). None: the compiler's own count.
    max_registers: int | None = None

    def __post_init__(self) -> None:
        if self.cuda_cores not in (None, 0, 1, 2):
            raise ValueError(f"cuda_cores must be None, 0, 1 or 2, got {self.cuda_cores!r}")
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ValueError(f"max_registers must be in 24..255 or None, got {self.max_registers!r}")

    @property
    def register_cap(self) -> dict[str, int]:
        """The launch option that caps registers, if any."""
        return {} if self.max_registers is None else {"maxnreg": self.max_registers}

    @classmethod
    def parse(cls, text: str) -> DecodeLaunch:
        """``"BLOCK_N,WARPS,STAGES[,LAST_MERGES[,CUDA_CORES[,MAX_REGISTERS]]]"`` (0: the backend's own;
        CUDA_CORES 0 off, left out the rule), as the timing tools and ``LOOPLINE_DECODE_LAUNCH`` spell a launch."""
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise ValueError(f"a decode launch is up to 6 comma-separated integers, got {text!r}") from None
        if not 1 <= len(values) <= 6:
            raise ValueError(f"a decode launch is up to 6 comma-separated integers, got {text!r}")
        return cls(*(v or None for v in values[:4]), *values[4:5], *(v or None for v in values[5:]))


@dataclass(frozen=True)
class PrefillLaunch:
    """Launch parameters of steps with prefill chunks; ``None`` keeps the default rule."""

    block_m: int | None = None  # query rows per program (tokens x query heads of one KV head)
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; see the module docstring for the design.

    ``num_splits`` forces the split-KV factor of ``attend`` (tests); ``None``
    picks it by ``split_rule`` from the grid size and the SM count. ``decode_launch``
    overrides the launch parameters of decode-only steps, ``prefill_launch`` those
    of the others (``bench_attention --sweep``).
    """

    name = "triton"
    graph_steps = "all"

    def __init__(self, num_splits: int | None = None, decode_launch: DecodeLaunch | None = None,
                 prefill_launch: PrefillLaunch | None = None, split_rule: SplitRule | None = None) -> None:
        if triton is None:
            raise RuntimeError("TritonAttentionBackend needs the `triton` package (pip install loopline[triton])")
        if not torch.cuda.is_available() and not INTERPRET:
            raise RuntimeError(
                "TritonAttentionBackend needs CUDA, or TRITON_INTERPRET=1 set before loopline's triton "
                "backend is imported (CPU interpreter, for tests); use the 'torch' backend on CPU"
            )
        if num_splits is not None and not 1 <= num_splits <= 64:
            raise ValueError(f"num_splits must be in 1..64 or None, got {num_splits}")
        self.num_splits = num_splits
        # LOOPLINE_SPLIT_RULE / LOOPLINE_DECODE_LAUNCH: timing hooks (gpu_session.sh times the README command
        # under other split rules and launches)
        env = os.environ.get("LOOPLINE_SPLIT_RULE")
        self.split_rule = split_rule or (SplitRule.parse(env) if env else SplitRule())
        env = os.environ.get("LOOPLINE_DECODE_LAUNCH")
        self.decode_launch = decode_launch or (DecodeLaunch.parse(env) if env else DecodeLaunch())
        self.prefill_launch = prefill_launch or PrefillLaunch()
        self._arrivals: dict[torch.device, Tensor] = {}
        self._retired: list[Tensor] = []  # outgrown arrival buffers (``arrivals``)
        if self.prefill_launch.block_m is not None and not _is_pow2(self.prefill_launch.block_m):
            raise ValueError(f"prefill_launch.block_m must be a power of two, got {self.prefill_launch.block_m}")

    # ------------------------------------------------------------------ write_kv

    def write_kv(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, meta: PagedAttentionMetadata, *,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
        scales = _scale_args(k_cache, v_cache, k_scale, v_scale)
        n, kvh, d = k.shape
        if n == 0:
            return
        assert k_cache.dim() == 4 and k_cache.shape[2:] == (kvh, d) and v.shape == k.shape
        assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
        self._store_kv(k_cache, v_cache, k, v, meta, scales)

    # ------------------------------------------------------------------ rotate_and_write_kv

    def rotate_and_write_kv(self, k_cache: Tensor, v_cache: Tensor, q: Tensor, k: Tensor, v: Tensor, rope: Rope,
                            meta: PagedAttentionMetadata, *, k_scale: Tensor | None = None,
                            v_scale: Tensor | None = None) -> Tensor:
        """Rotary on q and k and the K/V store in one launch (the rotated k goes straight to the cache)."""
        n, heads, d = q.shape
        kvh = k.shape[1]
        if n == 0 or q.requires_grad or k.requires_grad:
            return super().rotate_and_write_kv(k_cache, v_cache, q, k, v, rope, meta, k_scale=k_scale,
                                               v_scale=v_scale)
        scales = _scale_args(k_cache, v_cache, k_scale, v_scale)
        assert k_cache.dim() == 4 and k_cache.shape[2:] == (kvh, d) and v.shape == k.shape
        assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and rope.cos.stride(-1) == rope.sin.stride(-1) == 1
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        q_out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
        self._store_kv(k_cache, v_cache, k, v, meta, scales, rotated=(q, q_out, rope))
        return q_out

    @staticmethod
    def _store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, meta: PagedAttentionMetadata,
                  scales: tuple[Tensor, Tensor], rotated: tuple[Tensor, Tensor, Rope] | None = None) -> None:
        """One launch of the store kernel; with ``rotated = (q, q_out, rope)`` rotary on q and k on the way.
        ``scales``: the kernel's scale pointers (``_scale_args``)."""
        n, kvh, d = k.shape
        q, q_out, cos, sin = (rotated[0], rotated[1], rotated[2].cos, rotated[2].sin) if rotated else (k, k, k, k)
        heads = q.shape[1]  # kvh without rotation (q is k then, and unread like q_out, cos and sin)
        block_h = min(_next_pow2(max(heads, kvh)), 16)
        rope_write_kv_kernel[(n, 3 if rotated else 2, triton.cdiv(max(heads, kvh), block_h))](
            q, k, v, q_out, k_cache, v_cache, cos, sin, meta.slot_mapping, *scales, heads, kvh,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1], HALF=d // 2, HALF_PAD=_next_pow2(d // 2), BLOCK_H=block_h,
            ROTATE=rotated is not None,
            **pdl_options(k.device),
        )  # fmt: skip

    # ------------------------------------------------------------------ copy_exited

    def copy_exited(self, k_cache: Tensor, v_cache: Tensor, plane_slots: Tensor, loops: Tensor, exits: Tensor,
                    scratch_slot: int) -> None:
        """The exit copy as one predicated kernel: rows that do not exit early cost a program that returns.

        ``scratch_slot`` is unused: nothing is copied for rows without an exit. FP8 caches move as bytes."""
        rows, num_planes = plane_slots.shape
        if rows == 0 or num_planes < 2:
            return
        k_cache, v_cache = kv_bytes(k_cache), kv_bytes(v_cache)  # the kernel only moves values: FP8 as bytes
        num_layers, _, block_size, kvh, d = k_cache.shape
        assert v_cache.shape == k_cache.shape and loops.shape == exits.shape == (rows,)
        assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and plane_slots.stride(1) == 1
        assert loops.is_contiguous() and exits.is_contiguous()  # the kernel indexes them by row
        block_h = _heads_per_program(kvh, _next_pow2(d))
        copy_exited_kernel[(rows, num_layers, triton.cdiv(kvh, block_h))](
            k_cache, v_cache, plane_slots, loops, exits.view(torch.int8), num_planes, kvh, plane_slots.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            BLOCK_SIZE=block_size, HEAD_DIM=d, D_PAD=_next_pow2(d), BLOCK_H=block_h, **pdl_options(k_cache.device),
        )  # fmt: skip

    # ------------------------------------------------------------------ rotate_store_attend

    def rotate_store_attend(self, k_cache: Tensor, v_cache: Tensor, q: Tensor, k: Tensor, v: Tensor, rope: Rope,
                            meta: PagedAttentionMetadata, scale: float, *, k_scale: Tensor | None = None,
                            v_scale: Tensor | None = None) -> Tensor:
        """Decode-only steps of small batches (split keys): rotary, the K/V store and attention as one
        kernel (``decode_attention_kernel``); other steps store, then attend."""
        n, heads, d = q.shape
        _, block_size, kvh, _ = k_cache.shape
        if (meta.max_query_len != 1 or meta.work_tiles is not None or n == 0 or n != meta.seq_lens.shape[0]
                or torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return super().rotate_store_attend(k_cache, v_cache, q, k, v, rope, meta, scale, k_scale=k_scale,
                                               v_scale=v_scale)
        launch = self.decode_launch
        block_n = launch.block_n or _decode_key_block(_next_pow2(d), q, k_cache)
        num_splits = self.pick_num_splits(q.device, n * kvh, 1, meta.max_seq_len, key_tile=block_n, full_waves=True)
        if num_splits < self.split_rule.fused_decode_min_splits:
            return super().rotate_store_attend(k_cache, v_cache, q, k, v, rope, meta, scale, k_scale=k_scale,
                                               v_scale=v_scale)
        scales = _scale_args(k_cache, v_cache, k_scale, v_scale)
        self._check_shapes(heads, kvh, d, block_size)
        assert k_cache.shape == v_cache.shape and k.shape == v.shape == (n, kvh, d)
        assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and rope.cos.stride() == rope.sin.stride()
        q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, rope.cos, rope.sin))
        group = heads // kvh
        block_m = _decode_block_m(group)
        out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
        part_out, part_lse = self.partials(num_splits, out)
        last_merges = bool(launch.last_split_merges) and num_splits > 1
        arrivals = self.arrivals(q.device, n * kvh) if last_merges else out
        decode_attention_kernel[(n, kvh, num_splits)](
            q, k, v, cos, sin, k_cache, v_cache, *scales, out, part_out, part_lse, arrivals,
            meta.seq_lens, meta.block_tables, meta.slot_mapping, scale * _LOG2E, n, heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1), meta.block_tables.stride(0),
            G=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size, HEAD_DIM=d, D_PAD=_next_pow2(d),
            NUM_SPLITS=num_splits, SPLITS_PAD=_next_pow2(num_splits),
            DOT_PRECISION=_dot_precision(_dot_dtype(q, k_cache)), **pdl_options(q.device),
            # With splits (small batches) the step is latency-bound and the grid fits in one wave at two
            # programs per SM; larger grids keep the pipelined loop's lower register count.
            PREFETCH=num_splits > 1, LAST_MERGES=last_merges,
            num_warps=launch.num_warps or 4,
            num_stages=launch.num_stages or self._decode_stages(num_splits), **launch.register_cap,
        )  # fmt: skip
        if not last_merges:
            self.merge(num_splits, part_out, part_lse, out)
        return out

    def arrivals(self, device: torch.device, count: int) -> Tensor:
        """The fused decode kernel's arrival counters (``DecodeLaunch.last_split_merges``): zeros, which each
        launch leaves zero again, so one buffer per device serves every launch and CUDA graph. Grown (rarely: at
        least 4,096 counters) outside the launches that use it."""
        buf = self._arrivals.get(device)
        if buf is None or buf.numel() < count:
            if buf is not None:  # graphs captured with it may still replay: it stays allocated
                self._retired.append(buf)
            buf = self._arrivals[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        return buf

    @staticmethod
    def _decode_stages(num_splits: int) -> int:
        """Pipeline stages of the fused decode kernel. Many splits (few rows) read one or two key tiles each at
        usual contexts, nothing for a pipeline to overlap: one stage (one row, 20 splits, 1,088 keys: 0.961 /
        0.962 ms against 0.970 / 0.970 with two). Fewer splits walk more tiles: two (2 rows, 8 splits: 1.466 ms
        against 1.474 with one; 4 rows 1.639 / 1.659; 8 rows, 2 splits of ~9 tiles: 1.835 against 1.973 with
        one and 1.896 with three; 16 rows: 2.412 / 2.744 / 2.498; H200, 1,024-token contexts, profile_step
        --decode-launch 64,4,S). By the split count, not the context: a
        CUDA graph compiles its launch at the captured length, longer than most rows it replays for."""
        return 1 if num_splits >= 16 else 2

    @staticmethod
    def _check_shapes(heads: int, kvh: int, d: int, block_size: int) -> None:
        if heads % kvh:
            raise ValueError(f"num_heads ({heads}) must be a multiple of num_kv_heads ({kvh})")
        if not (d % 2 == 0 and 16 <= d <= 256):  # tiles are d rounded up to a power of two, masked
            raise ValueError(f"head_dim must be an even number in 16..256, got {d}")
        if not _is_pow2(block_size):
            raise ValueError(f"block_size must be a power of two, got {block_size}")

    @staticmethod
    def partials(num_splits: int, out: Tensor) -> tuple[Tensor, Tensor]:
        """Split-KV workspaces ``[S, N, H, D]`` and ``[S, N, H]`` fp32 (``out`` itself, unread, without splits)."""
        if num_splits == 1:
            return out, out
        n, heads, d = out.shape
        return (torch.empty((num_splits, n, heads, d), dtype=torch.float32, device=out.device),
                torch.empty((num_splits, n, heads), dtype=torch.float32, device=out.device))

    @staticmethod
    def merge(num_splits: int, part_out: Tensor, part_lse: Tensor, out: Tensor) -> None:
        """Combines the ``partials`` of ``num_splits`` splits by their log-sum-exp into ``out`` (nothing for one)."""
        if num_splits == 1:
            return
        n, heads, d = out.shape
        merge_splits_kernel[(n, heads)](
            part_out, part_lse, out, n, heads, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=_next_pow2(num_splits), HEAD_DIM=d, D_PAD=_next_pow2(d),
            **pdl_options(out.device), num_warps=4 if d >= 128 else 2,
        )  # fmt: skip

    # ------------------------------------------------------------------ attend

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedAttentionMetadata, scale: float, *,
               k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
        scales = _scale_args(k_cache, v_cache, k_scale, v_scale)
        n, heads, d = q.shape
        num_rows = meta.seq_lens.shape[0]
        _, block_size, kvh, _ = k_cache.shape
        out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
        if n == 0 or num_rows == 0:
            return out
        self._check_shapes(heads, kvh, d, block_size)
        assert k_cache.shape == v_cache.shape and k_cache.shape[3] == d
        assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1

        group = heads // kvh
        # Q tile: 16 M rows for decode-only steps (the G heads of one token, padded),
        # growing to 64 with max_query_len (prefill chunks); never fewer rows than G.
        # Decode rows of a mixed step (meta.num_decode_rows) are not on the work list: they get
        # a decode launch below, since a 64-row tile would hold 1 query and 63 padding rows.
        work = meta.work_tiles
        if work is not None:  # one program per listed tile, at the tile size the list was built for
            block_m = self._work_block_m(group)
        else:
            widest = self.prefill_launch.block_m or 64
            block_m = max(16, min(widest, _next_pow2(meta.max_query_len * group)), _next_pow2(group))
        tile_t = block_m // group
        q_tiles = triton.cdiv(max(meta.max_query_len, 1), tile_t)
        d_pad = _next_pow2(d)  # the tiles' width
        block_n = _key_block(d_pad, _tile_elem_bytes(q, k_cache))
        if work is not None:
            num_splits, grid = 1, (work.shape[1], kvh, 1)
        else:
            num_splits = self.pick_num_splits(q.device, num_rows * kvh * q_tiles, q_tiles, meta.max_seq_len)
            grid = (num_rows, kvh, q_tiles * num_splits)
        num_warps = 8 if block_m * d_pad >= 64 * 256 else 4
        # 2 stages leave shared memory for more programs per SM (bench_attention --sweep, H200, bf16:
        # 8 x 1024-token prefill 0.192 vs 0.280 ms at 3 stages; decode 72.4 vs 74.3 us at 32 rows).
        num_stages = 2
        decode_only = meta.max_query_len == 1 and work is None
        tune = self.decode_launch if decode_only else self.prefill_launch
        if decode_only and num_splits == 1:
            block_n = _decode_key_block(d_pad, q, k_cache)
        block_n = tune.block_n or block_n
        num_warps = tune.num_warps or num_warps
        num_stages = tune.num_stages or num_stages
        precision = _dot_precision(_dot_dtype(q, k_cache))

        cuda_cores = self._cuda_core_form(q, k_cache, group, num_rows, num_splits, decode_only, work is not None)
        if cuda_cores:
            if decode_only:  # every row a decode row
                return self._cuda_core_decode(q, k_cache, v_cache, scales, out, meta, scale, num_rows, num_splits,
                                              cuda_cores)
            if meta.num_decode_rows:
                self._cuda_core_decode(q, k_cache, v_cache, scales, out, meta, scale, meta.num_decode_rows, 1,
                                       cuda_cores)
        elif work is not None and meta.num_decode_rows:
            # Decode rows of a mixed step: one query each, so 16-row tiles, not the work list's 64
            # (whose padding rows would multiply their softmax and MMA work by 64 / G).
            decode_m = _decode_block_m(group)
            self._launch(q, k_cache, v_cache, scales, out, out, out, meta, None, scale,
                         (meta.num_decode_rows, kvh, 1), group, decode_m // group, decode_m,
                         self.decode_launch.block_n or _decode_key_block(d_pad, q, k_cache), 1, precision,
                         self.decode_launch.num_warps or 4,
                         self.decode_launch.num_stages or num_stages, self.decode_launch.register_cap)
        part_out, part_lse = self.partials(num_splits, out)
        self._launch(q, k_cache, v_cache, scales, out, part_out, part_lse, meta, work, scale, grid, group, tile_t,
                     block_m, block_n, num_splits, precision, num_warps, num_stages,
                     self.decode_launch.register_cap if decode_only else {})
        self.merge(num_splits, part_out, part_lse, out)
        return out

    def _cuda_core_form(self, q: Tensor, k_cache: Tensor, group: int, num_rows: int, num_splits: int,
                        decode_only: bool, mixed: bool) -> int:
        """Which form of ``mha_decode_kernel`` runs this launch's decode rows (``DecodeLaunch.cuda_cores``),
        0 for the tensor-core kernel: MHA caches only, in decode-only launches and mixed steps' decode launches;
        unset, the rule of ``SplitRule.cuda_core_programs_per_sm`` (full unsplit grids over FP8 pages)."""
        form = self.decode_launch.cuda_cores
        if group != 1 or not (decode_only or mixed):
            return 0
        if form is None:
            sms = cuda_sm_count(q.device) if q.device.type == "cuda" else 1
            full = num_rows * q.shape[1] >= self.split_rule.cuda_core_programs_per_sm * sms
            return int(decode_only and num_splits == 1 and is_fp8_kv(k_cache) and full)
        return form

    def _cuda_core_decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scales: tuple[Tensor, Tensor],
                          out: Tensor, meta: PagedAttentionMetadata, scale: float, rows: int,
                          num_splits: int, form: int) -> Tensor:
        """The first ``rows`` rows of ``q`` (one query each) through ``mha_decode_kernel`` into ``out``;
        ``form``: ``DecodeLaunch.cuda_cores``'s 1 or 2."""
        launch = self.decode_launch
        part_out, part_lse = self.partials(num_splits, out)
        d = q.shape[2]
        mha_decode_kernel[(rows, q.shape[1], num_splits)](
            q, k_cache, v_cache, *scales, out, part_out, part_lse, meta.seq_lens, meta.block_tables,
            scale * _LOG2E, q.shape[0], q.shape[1], q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), out.stride(0), out.stride(1), meta.block_tables.stride(0),
            BLOCK_N=launch.block_n or k_cache.shape[1], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=d,
            D_PAD=_next_pow2(d), NUM_SPLITS=num_splits, LANES=form == 2, **pdl_options(q.device),
            num_warps=launch.num_warps or 1, num_stages=launch.num_stages or 1, **launch.register_cap)
        self.merge(num_splits, part_out, part_lse, out)
        return out

    @staticmethod
    def _launch(q, k_cache, v_cache, scales, out, part_out, part_lse, meta, work, scale, grid, group, tile_t, block_m,
                block_n, num_splits, precision, num_warps, num_stages, register_cap) -> None:
        paged_attention_kernel[grid](
            q, k_cache, v_cache, *scales, out, part_out, part_lse,
            meta.query_start_loc, meta.seq_lens, meta.block_tables,
            work if work is not None else meta.seq_lens, work.shape[1] if work is not None else 0,
            scale * _LOG2E, q.shape[0], q.shape[1],
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1),
            meta.block_tables.stride(0),
            G=group, TILE_T=tile_t, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1],
            HEAD_DIM=q.shape[2], D_PAD=_next_pow2(q.shape[2]), NUM_SPLITS=num_splits, DOT_PRECISION=precision,
            WORK_LIST=work is not None,
            **pdl_options(q.device), num_warps=num_warps, num_stages=num_stages, **register_cap,
        )  # fmt: skip

    def _work_block_m(self, group: int) -> int:
        return max(self.prefill_launch.block_m or 64, _next_pow2(group))

    def work_tile_tokens(self, group: int) -> int:
        """Prefill steps run one program per (row, 64-row query tile); see ``build_work_tiles``."""
        return self._work_block_m(group) // group

    def pick_num_splits(self, device: torch.device, programs: int, q_tiles: int, max_seq_len: int, *,
                        key_tile: int = 0, full_waves: bool = False) -> int:
        """The split-KV count of a launch of ``programs`` programs: ``split_rule`` splits the key range when
        the grid cannot fill the GPU (small decode batches).

        ``key_tile``: the launch's keys per inner step. Tiles of ``r`` times ``min_keys_per_split`` keys (FP8
        caches: 128-key tiles of the same 16 KB as bf16's 64) take ``ceil(splits / r)`` splits (at least 2
        where the rule splits), so that a split reads as many bytes as with the rule's tiles. One row, 1,024
        keys, FP8, H100: 10 splits of 128-key tiles 1.120 ms per step against 1.203 with the rule's 16 of 64
        keys, and 1.144 for bf16 (profile_step --kv-cache-dtype fp8 --decode-launch 128,4,1
        --attn-num-splits 10); with this rule 1 / 2 / 8 rows took 0.94x / 0.91x / 0.96x the 64-key launch's
        step time.

        ``full_waves``: the launch is the fused decode kernel's, whose residency ``SplitRule.resident_programs_per_sm``
        describes; over the rule's own key tiles it may take a count that fills whole waves (``SplitRule``).

        Uses host ints only. Prefill steps (more than one query tile per row)
        already have parallelism and are never split.
        """
        if self.num_splits is not None:
            return self.num_splits
        if q_tiles > 1 or device.type != "cuda":
            return 1
        rule = self.split_rule
        sms = cuda_sm_count(device)
        wanted = math.ceil(rule.programs_per_sm * sms / programs)
        most = min(max(1, max_seq_len // rule.min_keys_per_split), rule.max_splits)
        splits = max(1, min(wanted, most))
        if splits > 1 and rule.exact_splits is not None:
            return rule.exact_splits
        ratio = max(1, key_tile // rule.min_keys_per_split)
        if full_waves and splits > 1 and ratio == 1 and programs >= rule.full_wave_programs_per_sm * sms:
            wave = rule.resident_programs_per_sm * sms
            for count in range(splits, min(most, math.ceil(1.5 * splits)) + 1):
                if programs * count >= 0.95 * wave * math.ceil(programs * count / wave):
                    return count
        splits = max(c for c in SPLIT_COUNTS if c <= splits)
        return splits if splits == 1 else max(2, -(-splits // ratio))
