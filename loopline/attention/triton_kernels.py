"""The Triton kernels of paged attention (:mod:`loopline.attention.triton_backend` launches them).

* ``paged_attention_kernel`` serves decode rows and prefill chunks together.
  Grid ``(row, kv_head, q_tile * num_splits)``. The M dimension of a program's
  Q tile packs ``TILE_T`` query tokens x the ``G = heads // kv_heads`` query
  heads of one KV head (row ``m`` is token ``m // G``, head ``m % G``), so a
  KV page is loaded once per GQA group, and a decode row fills ``G`` of the
  16 M rows instead of one of 64. Keys are walked ``BLOCK_N`` positions at a
  time through the row's block table with an online softmax in fp32.
  With few programs (small decode batches) the key range is split across
  ``num_splits`` programs (flash-decoding) whose partial results
  ``merge_splits_kernel`` combines by their log-sum-exp.
* ``decode_attention_kernel`` serves decode-only steps (one query per row):
  rotary on q and on the row's own key, its K/V store, and attention over the
  row's history in one launch. With splits (small batches), each program loads
  its first key tile before its grid-dependency wait, while the kernels before
  it still run (the history was written by earlier steps).
* ``mha_decode_kernel`` serves decode rows of MHA caches on CUDA cores instead
  (``DecodeLaunch.cuda_cores``): one (row, head) per program of a warp or two, no tensor-core tiles.
* ``rope_write_kv_kernel`` stores a step's new K/V at ``slot_mapping`` (slot < 0:
  skip) and applies rotary to q and k on the way (what the engine runs: the
  rotated k never makes a round trip through memory); with ``ROTATE=False`` it
  is the plain store of ``write_kv``.
* ``copy_exited_kernel`` is the ``last_exited`` exit copy: rows whose token exits
  before the last loop copy their K/V into the deeper planes, in every layer; the
  other rows' programs return at once.

FP8 (E4M3, ``tl.float8e4nv``) caches, told apart by the cache pointer's element type (no
extra constexpr): the stores divide by the KV head's fp32 scale, saturate to +-448 and round
to nearest even (``_to_fp8``, what ``loopline.attention.base.quantize_fp8`` computes). The
attention kernels load 1-byte K/V tiles and widen them to q's dtype (exact for bf16 and fp32),
so the dots run in the model's dtype; q and the probabilities are never quantized. Each
program serves one KV head, so its ``k_scale`` folds into the score scale and its ``v_scale``
multiplies the normalized output once. The fused decode kernel attends the row's own key and
value as stored (quantized, then widened), so it matches reading them back from the cache.
The exit copy moves bytes (the backend passes ``uint8`` views). Other caches take the code
paths and dtypes they always did.

Head sizes that are not a power of two (Huginn-0125's 96) run tiles of the next power of two
(``D_PAD``), masked past ``HEAD_DIM`` on every load and store (``_head_cols``, ``_load_cols``); at power-of-two
sizes those branches compile away and the kernels are what they were.

Without CUDA the kernels run only under ``TRITON_INTERPRET=1`` (slow, for tests). The module imports
without triton (the kernels are then plain functions nobody calls).
"""
from __future__ import annotations  # NOTE: keeps `tl.constexpr` annotations lazy, so this imports without triton

import os

from loopline.kernels import grid_dependency_wait

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # the backend is unusable, but the module still imports for triton_available()
    triton = None
    tl = None

    def _jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)


def _jit_step_sizes(*names: str):
    """``triton.jit`` that does not specialize the named integer arguments on their values.

    Triton compiles a variant per (== 1, divisible by 16) pattern of every integer argument.
    Token counts, work-list lengths and block-table widths change from step to step, so each
    new pattern compiled a variant in the middle of serving: the first C = 128 run in a
    process spent ~1.4 s more in its prefill steps than the runs after it."""
    return _jit(do_not_specialize=names)


# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when this
# module is imported; what counts is the value at that moment.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
# The interpreter's float -> fp8 conversion (Triton 3.8) does not round to nearest even: it rounds ties up and
# drops a carry out of the mantissa (124.9 -> 64, not 128). Under it _to_fp8 rounds on the bits instead.
_SOFT_FP8 = tl.constexpr(INTERPRET) if tl is not None else INTERPRET


@_jit
def _fp8_bits_rtne(y):
    """The FP8 E4M3 bits (``uint8``) of fp32 ``y`` (``|y| <= 448``), rounded to nearest even with integer ops."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal results (|y| >= 2**-6): drop 20 of the 23 mantissa bits, ties to even; a carry runs into the
    # exponent. Then rebias the exponent from 127 to 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal results are multiples of 2**-9: adding 2**14 (whose ulp is 2**-9) rounds to one, to nearest even.
    sub = (tl.abs(y) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    return (tl.where(mag >= 0x3C800000, normal, sub) | sign).to(tl.uint8)


@_jit
def _to_fp8(x, scale):
    """``x`` (fp32) / ``scale`` (IEEE division), saturated to +-448 (the largest finite E4M3, as
    ``quantize_fp8`` clamps) and rounded to nearest even into FP8 E4M3."""
    y = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
    if _SOFT_FP8:
        out = _fp8_bits_rtne(y).to(tl.float8e4nv, bitcast=True)
    else:
        out = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return out


@_jit
def _fp8_dot_operand(x):
    """q of a 16-bit model over an FP8 cache as the dots take it: fp16, to which E4M3 tiles widen in one
    conversion (to bf16 they take three: e4m3 -> f16 -> f32 -> bf16, which made FP8 steps slower than bf16
    ones on an H200); fp16 also keeps 3 more mantissa bits of q and of the probabilities. Saturated at fp16's
    largest value (a normed model's q is far below it). fp32 (tests) stays fp32."""
    if x.dtype == tl.float32:
        out = x
    else:
        out = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return out


@_jit
def _kv_value(x, dtype: tl.constexpr, scale_ptrs, mask):
    """``x`` as a cache of ``dtype`` stores it: cast, or for FP8 quantized by the scales at ``scale_ptrs``
    (broadcast against ``x``; read under ``mask``)."""
    if dtype == tl.float8e4nv:
        out = _to_fp8(x.to(tl.float32), tl.load(scale_ptrs, mask=mask, other=1.0))
    else:
        out = x.to(dtype)
    return out


@_jit
def _head_cols(mask, offs_d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """``mask`` (``[X, 1]`` or ``[X, D_PAD]``) limited to a head's ``HEAD_DIM`` real columns of the
    ``D_PAD``-wide tiles (a head size that is not a power of two, e.g. Huginn's 96); unchanged otherwise."""
    if HEAD_DIM == D_PAD:
        out = mask
    else:
        out = mask & (offs_d < HEAD_DIM)[None, :]
    return out


@_jit
def _load_cols(ptrs, offs, N: tl.constexpr, N_PAD: tl.constexpr):
    """``tl.load(ptrs)`` of a vector (or row) indexed by ``offs`` in ``0 .. N_PAD``, zeros from ``N`` on."""
    if N == N_PAD:
        out = tl.load(ptrs)
    else:
        out = tl.load(ptrs, mask=offs < N, other=0.0)
    return out


@_jit
def _store_cols(ptrs, x, offs, N: tl.constexpr, N_PAD: tl.constexpr):
    """``tl.store(ptrs, x)`` of a vector indexed by ``offs`` in ``0 .. N_PAD``, nothing from ``N`` on."""
    if N == N_PAD:
        tl.store(ptrs, x)
    else:
        tl.store(ptrs, x, mask=offs < N)


@_jit
def _load_kv_tile(start, kv_hi, table, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  MASKED: tl.constexpr, EVICT: tl.constexpr):
    """Keys ``[D_PAD, BLOCK_N]`` and values ``[BLOCK_N, D_PAD]`` of positions ``start .. start + BLOCK_N``
    through the row's block table; MASKED: positions from ``kv_hi`` on read as zeros; columns past
    ``HEAD_DIM`` (``D_PAD``: the next power of two) read as zeros. EVICT: the loads' L2 eviction policy (the
    fused decode kernel marks what it reads before its wait, which tests/kernels/test_pdl.py checks)."""
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_d = tl.arange(0, D_PAD)
    if MASKED:
        n_valid = pos < kv_hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_valid, other=0, eviction_policy=EVICT)
    else:
        block = tl.load(table + pos // BLOCK_SIZE, eviction_policy=EVICT)
    # NOTE: int64 before multiplying: block id * block stride exceeds 2**31 in big pools.
    block = block.to(tl.int64)
    in_block = (pos % BLOCK_SIZE).to(tl.int64)
    k_ptrs = k_head + (block * stride_kb + in_block * stride_ks)[None, :] + offs_d[:, None]  # [D, BLOCK_N]
    v_ptrs = v_head + (block * stride_vb + in_block * stride_vs)[:, None] + offs_d[None, :]  # [BLOCK_N, D]
    if HEAD_DIM != D_PAD:
        d_ok = offs_d < HEAD_DIM
        if MASKED:
            k = tl.load(k_ptrs, mask=n_valid[None, :] & d_ok[:, None], other=0.0, eviction_policy=EVICT)
            v = tl.load(v_ptrs, mask=n_valid[:, None] & d_ok[None, :], other=0.0, eviction_policy=EVICT)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0, eviction_policy=EVICT)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0, eviction_policy=EVICT)
    elif MASKED:
        k = tl.load(k_ptrs, mask=n_valid[None, :], other=0.0, eviction_policy=EVICT)
        v = tl.load(v_ptrs, mask=n_valid[:, None], other=0.0, eviction_policy=EVICT)
    else:
        k = tl.load(k_ptrs, eviction_policy=EVICT)
        v = tl.load(v_ptrs, eviction_policy=EVICT)
    return k, v


@_jit
def _split_keys(kv_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split ``split``'s keys ``kv_lo .. kv_hi`` of ``kv_len``: key steps ceil(s * steps / S) .. ceil((s + 1) *
    steps / S) of ``BLOCK_N`` keys, so sizes differ by at most one step and split 0 is never empty."""
    steps = tl.cdiv(kv_len, BLOCK_N)
    kv_lo = tl.cdiv(split * steps, NUM_SPLITS) * BLOCK_N
    kv_hi = tl.minimum(kv_len, tl.cdiv((split + 1) * steps, NUM_SPLITS) * BLOCK_N)
    return kv_lo, kv_hi


@_jit
def softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step of queries ``q`` ``[BLOCK_M, D]`` over a key tile; MASKED: only ``visible``
    ``[BLOCK_M, BLOCK_N]`` scores count. Public: experimental kernels (tools/decode_kernel_probe.py) build on it.

    K/V tiles of another dtype than q's (FP8 caches) are widened to it; the caller folds their scales in."""
    k = k.to(q.dtype)  # no-op unless FP8
    v = v.to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@_jit
def _attend_keys(q, m_i, l_i, acc, start, kv_hi, q_pos, table, k_head, v_head, qk_scale,
                 stride_kb, stride_ks, stride_vb, stride_vs,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over keys ``start .. start + BLOCK_N``; MASKED: apply causality and ``kv_hi``."""
    k, v = _load_kv_tile(start, kv_hi, table, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                         BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, MASKED, "")
    pos = start + tl.arange(0, BLOCK_N)
    visible = (pos < kv_hi)[None, :] & (pos[None, :] <= q_pos[:, None])
    return softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION, MASKED)


@_jit_step_sizes("num_work_tiles", "num_tokens", "stride_bt")
def paged_attention_kernel(
    q_ptr,  # [N, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    k_scale_ptr,  # [KVH] fp32, FP8 caches only (unread otherwise)
    v_scale_ptr,
    out_ptr,  # [N, H, D] (NUM_SPLITS == 1)
    part_out_ptr,  # [NUM_SPLITS, N, H, D] fp32, contiguous (NUM_SPLITS > 1)
    part_lse_ptr,  # [NUM_SPLITS, N, H] fp32, contiguous (NUM_SPLITS > 1)
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    work_tiles_ptr,  # [2, T] int32 (row, q_tile) per program (WORK_LIST), row < 0 = padding
    num_work_tiles,  # T, the stride between the two halves of the work list
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    num_tokens,  # N, for the workspace layout
    num_heads,  # H, for the workspace layout
    stride_qn,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_on,
    stride_oh,
    stride_bt,
    G: tl.constexpr,  # query heads per KV head
    TILE_T: tl.constexpr,  # query tokens per program; TILE_T * G <= BLOCK_M
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_SIZE: tl.constexpr,  # page size of the cache
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two: the tiles' width
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 dots (no TF32 rounding), else "tf32" (ignored for 16-bit)
    WORK_LIST: tl.constexpr,  # grid (T, kv_head, 1) over the work list instead of (row, kv_head, q_tile * splits)
    PDL: tl.constexpr,
):
    kv_head = tl.program_id(1)
    FP8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.float8e4nv
    if FP8:  # the scales are fixed for the engine's life: read before the wait, under the kernels before
        k_scale = tl.load(k_scale_ptr + kv_head, eviction_policy="evict_last")
        v_scale = tl.load(v_scale_ptr + kv_head, eviction_policy="evict_last")
    grid_dependency_wait(PDL)
    if WORK_LIST:
        row = tl.load(work_tiles_ptr + tl.program_id(0))
        q_tile = tl.load(work_tiles_ptr + num_work_tiles + tl.program_id(0))
        split = 0
        if row < 0:
            return
    else:
        row = tl.program_id(0)
        q_tile = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    tile_start = q_tile * TILE_T
    # The grid is sized by max_query_len; shorter rows (decode) have spare tiles.
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    ctx_len = seq_len - q_len  # the row's queries sit at positions ctx_len .. seq_len-1

    # M rows: (token, head-in-group) pairs, token-major.
    offs_m = tl.arange(0, BLOCK_M)
    tok = tile_start + offs_m // G  # [BLOCK_M] query index within the row
    head = kv_head * G + offs_m % G  # [BLOCK_M] query head
    m_valid = (offs_m < TILE_T * G) & (tok < q_len)
    q_pos = ctx_len + tok  # [BLOCK_M] absolute position of each query
    offs_d = tl.arange(0, D_PAD)
    md_valid = _head_cols(m_valid[:, None], offs_d, HEAD_DIM, D_PAD)  # [BLOCK_M, 1 or D_PAD]

    q_row = (q_start + tok).to(tl.int64)
    q_off = q_row * stride_qn + head.to(tl.int64) * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=md_valid, other=0.0)  # [BLOCK_M, D_PAD]
    if FP8:  # q as the dots take it (the tiles widen to it); the head's key scale joins the score scale
        q = _fp8_dot_operand(q)
        qk_scale = qk_scale * k_scale
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # Causal: no query of this tile sees past its last query's position.
    kv_len = tl.minimum(seq_len, ctx_len + tile_start + TILE_T)
    kv_lo, kv_hi = _split_keys(kv_len, split, NUM_SPLITS, BLOCK_N)

    # NOTE: m_i starts finite (not -inf) so a row that has seen only masked keys
    # gets exp2(-inf - m) = 0 and alpha = 1 instead of NaN from (-inf) - (-inf).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    table = block_tables_ptr + row.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    # Whole key blocks that every query of the tile sees (positions <= its first query's)
    # need no mask; only the blocks from there to kv_hi (the diagonal, a ragged end) do.
    full_hi = tl.maximum(kv_lo, tl.minimum(kv_hi, ctx_len + tile_start + 1) // BLOCK_N * BLOCK_N)
    for start in range(kv_lo, full_hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, start, kv_hi, q_pos, table, k_head, v_head, qk_scale,
                                     stride_kb, stride_ks, stride_vb, stride_vs,
                                     BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, DOT_PRECISION, False)
    for start in range(full_hi, kv_hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, start, kv_hi, q_pos, table, k_head, v_head, qk_scale,
                                     stride_kb, stride_ks, stride_vb, stride_vs,
                                     BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, DOT_PRECISION, True)

    # Only padding M rows (and, with splits, rows whose split saw no visible key) have l_i == 0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_M, D]
    if FP8:
        o = o * v_scale
    if NUM_SPLITS == 1:
        o_off = q_row * stride_on + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=md_valid)
    else:
        # Normalized partial output + its log2-sum-exp; an empty split has lse = -inf (weight 0).
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        p_idx = (split * num_tokens + q_row) * num_heads + head  # [BLOCK_M] into [S, N, H]
        tl.store(part_lse_ptr + p_idx, lse, mask=m_valid)
        tl.store(part_out_ptr + p_idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=md_valid)


@_jit_step_sizes("num_tokens", "stride_bt")
def mha_decode_kernel(
    q_ptr,  # [N, H, D], rotated; row n is decode row n (one query)
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, H, D]: one KV head per query head (MHA)
    v_cache_ptr,
    k_scale_ptr,  # [H] fp32, FP8 caches only (unread otherwise)
    v_scale_ptr,
    out_ptr,  # [N, H, D] (NUM_SPLITS == 1)
    part_out_ptr,  # [NUM_SPLITS, N, H, D] fp32, contiguous (NUM_SPLITS > 1)
    part_lse_ptr,  # [NUM_SPLITS, N, H] fp32, contiguous (NUM_SPLITS > 1)
    seq_lens_ptr,  # [N] int32: keys 0 .. seq_len - 1, the row's own included
    block_tables_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_tokens,
    num_heads,
    stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_on, stride_oh,
    stride_bt,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    LANES: tl.constexpr,  # an online softmax per key lane, combined once at the end (no per-tile key reductions)
    PDL: tl.constexpr,
):
    """Decode rows of an MHA cache on CUDA cores (``DecodeLaunch.cuda_cores``): grid ``(row, head, split)``,
    one query against ``[BLOCK_N, D]`` key and value tiles that widen to fp32 in registers, scores and
    output as elementwise products and sums. A query of one head fills 1 of a tensor-core tile's 16 rows;
    here no tile passes through shared memory, which over FP8 pages the widened tiles of the dot path must.
    q is taken in fp32 (with an FP8 cache's key scale folded in), the probabilities are never rounded.
    Splits write partials as ``paged_attention_kernel``'s do."""
    row = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    grid_dependency_wait(PDL)
    n = row.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row)
    kv_lo, kv_hi = _split_keys(seq_len, split, NUM_SPLITS, BLOCK_N)
    table = block_tables_ptr + n * stride_bt
    offs_t = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    slot = (offs_t % BLOCK_SIZE).to(tl.int64)
    k_inner = k_cache_ptr + head * stride_kh + slot[:, None] * stride_ks + offs_d[None, :]  # [BLOCK_N, D]
    v_inner = v_cache_ptr + head * stride_vh + slot[:, None] * stride_vs + offs_d[None, :]
    q = tl.load(q_ptr + n * stride_qn + head * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32) * qk_scale
    FP8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.float8e4nv
    if FP8:
        q = q * tl.load(k_scale_ptr + head)
    if LANES:  # lane t of every tile folds into its own running max, sum and output
        m_i = tl.full([BLOCK_N], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    else:
        m_i = -1.0e30  # finite: see paged_attention_kernel
        l_i = 0.0
        acc = tl.zeros([D_PAD], dtype=tl.float32)
    # NOTE: int64 before multiplying: block id * block stride exceeds 2**31 in big pools.
    block = tl.load(table + (kv_lo + offs_t) // BLOCK_SIZE, mask=kv_lo + offs_t < kv_hi, other=0).to(tl.int64)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        valid = start + offs_t < kv_hi
        tile_ok = _head_cols(valid[:, None], offs_d, HEAD_DIM, D_PAD)
        k = tl.load(k_inner + block[:, None] * stride_kb, mask=tile_ok, other=0.0).to(tl.float32)
        v = tl.load(v_inner + block[:, None] * stride_vb, mask=tile_ok, other=0.0).to(tl.float32)
        # the next tile's block ids, issued before this tile's math waits on its loads
        after = start + BLOCK_N + offs_t
        block = tl.load(table + after // BLOCK_SIZE, mask=after < kv_hi, other=0).to(tl.int64)
        s = tl.where(valid, tl.sum(k * q[None, :], 1), float("-inf"))  # [BLOCK_N]
        if LANES:
            m_new = tl.maximum(m_i, s)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        if LANES:
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v
        else:
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    if LANES:  # the lanes' softmaxes combined by their maxima (a lane that saw no key weighs 0)
        m_all = tl.max(m_i, 0)
        w = tl.exp2(m_i - m_all)
        l_i = tl.sum(l_i * w, 0)
        acc = tl.sum(acc * w[:, None], 0)
        m_i = m_all
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe
    if FP8:
        o = o * tl.load(v_scale_ptr + head)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + n * stride_on + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)
    else:
        idx = (split * num_tokens + n) * num_heads + head
        tl.store(part_lse_ptr + idx, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")))
        tl.store(part_out_ptr + idx * HEAD_DIM + offs_d, o, mask=d_ok)


@_jit_step_sizes("num_tokens")
def merge_splits_kernel(
    part_out_ptr,  # [NUM_SPLITS, N, H, D] fp32, contiguous
    part_lse_ptr,  # [NUM_SPLITS, N, H] fp32, contiguous
    out_ptr,  # [N, H, D]
    num_tokens,
    num_heads,
    stride_on,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    idx = (tl.arange(0, SPLITS_PAD) * num_tokens + n) * num_heads + h  # [SPLITS_PAD]
    _merge_head(part_out_ptr, part_lse_ptr, out_ptr + n * stride_on + h * stride_oh, idx, NUM_SPLITS, SPLITS_PAD,
                HEAD_DIM, D_PAD, "")


@_jit
def _merge_head(part_out_ptr, part_lse_ptr, out_row, idx, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CACHE: tl.constexpr):
    """One head's split partials (at ``idx`` ``[SPLITS_PAD]`` of the workspaces) combined by their log-sum-exp
    into ``out_row``. CACHE: the loads' cache modifier (".cg" where other programs of the launch wrote them)."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_valid = offs_s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + idx, mask=s_valid, other=float("-inf"), cache_modifier=CACHE)
    # Split 0 holds key 0, which every query sees (the fused decode kernel: the last split holds the
    # row's own key), so the max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))  # [SPLITS_PAD]
    o = tl.load(part_out_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
                mask=_head_cols(s_valid[:, None], offs_d, HEAD_DIM, D_PAD), other=0.0, cache_modifier=CACHE)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)  # [D_PAD]
    _store_cols(out_row + offs_d, o.to(out_row.dtype.element_ty), offs_d, HEAD_DIM, D_PAD)


@_jit
def _rotate_half(x1, x2, c, s, dtype: tl.constexpr):
    """Rotate-half RoPE of the two halves, rounded like the reference: each product to dtype, then the sum."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return _rotated(x1, -x2, c, s, dtype), _rotated(x2, x1, c, s, dtype)


@_jit
def _rotated(x, partner, c, s, dtype: tl.constexpr):
    """``x * c + partner * s`` (fp32 inputs) rounded like the reference: each product to dtype, then the sum."""
    return ((x * c).to(dtype).to(tl.float32) + (partner * s).to(dtype).to(tl.float32)).to(dtype)


@_jit
def _store_half_heads(src, dst, mask, scale_ptrs, HALF: tl.constexpr):
    """Copies ``[BLOCK_H, 2 * HALF]`` head vectors (as two halves), cast to the destination's dtype (FP8:
    quantized by the heads' scales at ``scale_ptrs``, ``[BLOCK_H, 1]``)."""
    dtype = dst.dtype.element_ty
    tl.store(dst, _kv_value(tl.load(src, mask=mask), dtype, scale_ptrs, mask), mask=mask)
    tl.store(dst + HALF, _kv_value(tl.load(src + HALF, mask=mask), dtype, scale_ptrs, mask), mask=mask)


@_jit
def rope_write_kv_kernel(
    q_ptr,  # [N, H, D], unit last stride (may be a view of a packed projection); unused without ROTATE
    k_ptr,  # [N, KVH, D]
    v_ptr,  # [N, KVH, D]
    q_out_ptr,  # [N, H, D] contiguous
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,
    cos_ptr,  # [N, D] (both halves equal)
    sin_ptr,
    slot_mapping_ptr,  # [N] int64; < 0 = padding: q is still rotated, nothing is stored
    k_scale_ptr,  # [KVH] fp32, FP8 caches only (unread otherwise): stored = x / scale
    v_scale_ptr,
    num_heads,
    num_kv_heads,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cs,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    BLOCK_H: tl.constexpr,
    ROTATE: tl.constexpr,  # False: the plain K/V store (grid axis 1 covers k and v only)
    PDL: tl.constexpr,
):
    grid_dependency_wait(PDL)
    # Part 0 rotates q into q_out, 1 stores k (rotated with ROTATE) into the cache, 2 copies v into the cache.
    n = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1) + (0 if ROTATE else 1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h64 = heads.to(tl.int64)[:, None]
    offs_d = tl.arange(0, HALF_PAD)
    d = offs_d[None, :]
    if part == 0:
        mask = _head_cols((heads < num_heads)[:, None], offs_d, HALF, HALF_PAD)
        src = q_ptr + n * stride_qn + h64 * stride_qh + d
        c = _load_cols(cos_ptr + n * stride_cs + d, d, HALF, HALF_PAD).to(tl.float32)
        s = _load_cols(sin_ptr + n * stride_cs + d, d, HALF, HALF_PAD).to(tl.float32)
        o1, o2 = _rotate_half(tl.load(src, mask=mask, other=0.0), tl.load(src + HALF, mask=mask, other=0.0), c, s,
                              q_out_ptr.dtype.element_ty)
        dst = q_out_ptr + (n * num_heads + h64) * (2 * HALF) + d
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + n).to(tl.int64)
        if slot >= 0:
            mask = _head_cols((heads < num_kv_heads)[:, None], offs_d, HALF, HALF_PAD)
            block = slot // BLOCK_SIZE
            in_block = slot % BLOCK_SIZE
            if part == 1:
                src = k_ptr + n * stride_kn + h64 * stride_kh + d
                dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs + h64 * stride_kch + d
                if ROTATE:
                    c = _load_cols(cos_ptr + n * stride_cs + d, d, HALF, HALF_PAD).to(tl.float32)
                    s = _load_cols(sin_ptr + n * stride_cs + d, d, HALF, HALF_PAD).to(tl.float32)
                    # rounded to k's dtype first: an FP8 cache quantizes the key the model computes
                    o1, o2 = _rotate_half(tl.load(src, mask=mask, other=0.0),
                                          tl.load(src + HALF, mask=mask, other=0.0), c, s, k_ptr.dtype.element_ty)
                    cache_dtype = k_cache_ptr.dtype.element_ty
                    tl.store(dst, _kv_value(o1, cache_dtype, k_scale_ptr + h64, mask), mask=mask)
                    tl.store(dst + HALF, _kv_value(o2, cache_dtype, k_scale_ptr + h64, mask), mask=mask)
                else:
                    _store_half_heads(src, dst, mask, k_scale_ptr + h64, HALF)
            else:
                src = v_ptr + n * stride_vn + h64 * stride_vh + d
                dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs + h64 * stride_vch + d
                _store_half_heads(src, dst, mask, v_scale_ptr + h64, HALF)


@_jit
def _rotate_full(x, partner, c, s, first_half, dtype: tl.constexpr):
    """Rotate-half RoPE of whole head vectors, given each element's partner in the other half
    (``x[d ± D/2]``); rounded like :func:`_rotate_half`, so the values are the same."""
    partner = tl.where(first_half, -partner.to(tl.float32), partner.to(tl.float32))
    return _rotated(x.to(tl.float32), partner, c, s, dtype)


@_jit_step_sizes("num_tokens", "stride_bt")
def decode_attention_kernel(
    q_ptr,  # [N, H, D] this step's projections before rotary, unit last stride (views of the packed q/k/v)
    k_ptr,  # [N, KVH, D]
    v_ptr,  # [N, KVH, D]
    cos_ptr,  # [N, D] (both halves equal)
    sin_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,
    k_scale_ptr,  # [KVH] fp32, FP8 caches only (unread otherwise)
    v_scale_ptr,
    out_ptr,  # [N, H, D] (NUM_SPLITS == 1)
    part_out_ptr,  # [NUM_SPLITS, N, H, D] fp32, contiguous (NUM_SPLITS > 1)
    part_lse_ptr,  # [NUM_SPLITS, N, H] fp32, contiguous (NUM_SPLITS > 1)
    arrivals_ptr,  # [N * KVH] int32, zero between launches (LAST_MERGES): splits of (row, KV head) done
    seq_lens_ptr,  # [N] int32: row n's query is at position seq_lens[n] - 1
    block_tables_ptr,  # [N, max_blocks] int32
    slot_mapping_ptr,  # [N] int64, where the row's K/V goes (< 0: not stored)
    qk_scale,
    num_tokens,
    num_heads,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cs,
    stride_kb,
    stride_ks,
    stride_kch,
    stride_vb,
    stride_vs,
    stride_vch,
    stride_on,
    stride_oh,
    stride_bt,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two: the tiles' width
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the first key tile before the wait: 1.6x the registers, for small grids
    LAST_MERGES: tl.constexpr,  # the last split of a (row, KV head) to finish merges the partials (no merge launch)
    PDL: tl.constexpr,
):
    """Decode rows (one query each, row n = token n): rotary, the K/V store and attention in one launch.

    Grid ``(row, kv_head, split)``. The keys before the row's own position were written by earlier
    steps, so with PDL (and PREFETCH) a program loads its first tile of them *before* its grid-dependency wait,
    while the kernels before it still run. That is safe because the loop that calls attention
    starts with a kernel launched without PDL (``OuroForCausalLM.loop``'s RoPE gather), after the
    step's metadata is written: everything read before the wait was complete before that kernel
    began. After the wait the program rotates q; the last split also rotates the row's own key,
    stores its K/V in the cache for later steps and attends it from registers (no other program
    reads that position in this layer). With LAST_MERGES the split of a (row, KV head) that finishes
    last combines the partials itself (``DecodeLaunch.last_split_merges``), instead of merge_splits_kernel."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    n = row.to(tl.int64)
    hist = tl.load(seq_lens_ptr + row, eviction_policy="evict_last") - 1  # keys of earlier steps: 0 .. hist - 1
    kv_lo, kv_hi = _split_keys(hist, split, NUM_SPLITS, BLOCK_N)
    table = block_tables_ptr + row.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kch
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vch
    if PREFETCH:  # read once per step: streamed past L2
        k, v = _load_kv_tile(kv_lo, kv_hi, table, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                             BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, True, "evict_first")
    cache_dtype = k_cache_ptr.dtype.element_ty
    FP8: tl.constexpr = cache_dtype == tl.float8e4nv
    if FP8:  # fixed for the engine's life: read before the wait
        k_scale = tl.load(k_scale_ptr + kv_head, eviction_policy="evict_last")
        v_scale = tl.load(v_scale_ptr + kv_head, eviction_policy="evict_last")
    grid_dependency_wait(PDL)

    # FP8: the dots run in _fp8_dot_operand's dtype (the tiles widen to it), the head's scales fold into the
    # score and the output
    dot_dtype = (tl.float32 if q_ptr.dtype.element_ty == tl.float32 else tl.float16) if FP8 else cache_dtype
    if FP8:
        qk_scale = qk_scale * k_scale
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_valid = offs_m < G
    md_valid = _head_cols(m_valid[:, None], offs_d, HEAD_DIM, D_PAD)
    head = (kv_head * G + offs_m).to(tl.int64)  # [BLOCK_M] query heads of this KV head (rows >= G: padding)
    first_half = offs_d < HEAD_DIM // 2
    partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    c = _load_cols(cos_ptr + n * stride_cs + offs_d, offs_d, HEAD_DIM, D_PAD).to(tl.float32)
    s = _load_cols(sin_ptr + n * stride_cs + offs_d, offs_d, HEAD_DIM, D_PAD).to(tl.float32)
    q_rows = q_ptr + n * stride_qn + head[:, None] * stride_qh
    q = _rotate_full(tl.load(q_rows + offs_d[None, :], mask=md_valid, other=0.0),
                     tl.load(q_rows + partner[None, :], mask=md_valid, other=0.0),
                     c[None, :], s[None, :], first_half[None, :], q_ptr.dtype.element_ty)
    if FP8:
        q = _fp8_dot_operand(q)
    else:
        q = q.to(cache_dtype)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: see paged_attention_kernel
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    first = kv_lo
    if PREFETCH:
        visible = (kv_lo + tl.arange(0, BLOCK_N) < kv_hi)[None, :]
        m_i, l_i, acc = softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION, True)
        first = kv_lo + BLOCK_N
    # (Whole tiles without masks, in a loop of their own, measured slower: 1.110 vs 1.095 ms per one-row step.)
    for start in range(first, kv_hi, BLOCK_N):
        k, v = _load_kv_tile(start, kv_hi, table, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                             BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, True, "")
        visible = (start + tl.arange(0, BLOCK_N) < kv_hi)[None, :]
        m_i, l_i, acc = softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION, True)
    if split == NUM_SPLITS - 1:
        k_row = k_ptr + n * stride_kn + kv_head.to(tl.int64) * stride_kh
        k_new = _rotate_full(_load_cols(k_row + offs_d, offs_d, HEAD_DIM, D_PAD),
                             _load_cols(k_row + partner, offs_d, HEAD_DIM, D_PAD), c, s, first_half,
                             k_ptr.dtype.element_ty)
        v_new = _load_cols(v_ptr + n * stride_vn + kv_head.to(tl.int64) * stride_vh + offs_d, offs_d, HEAD_DIM, D_PAD)
        if FP8:  # attended as stored: quantized, then widened below (the scales are folded in)
            k_new = _to_fp8(k_new.to(tl.float32), k_scale)
            v_new = _to_fp8(v_new.to(tl.float32), v_scale)
        else:
            k_new = k_new.to(cache_dtype)
            v_new = v_new.to(cache_dtype)
        slot = tl.load(slot_mapping_ptr + n)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            in_block = slot % BLOCK_SIZE
            _store_cols(k_head + block * stride_kb + in_block * stride_ks + offs_d, k_new, offs_d, HEAD_DIM, D_PAD)
            _store_cols(v_head + block * stride_vb + in_block * stride_vs + offs_d, v_new, offs_d, HEAD_DIM, D_PAD)
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale  # [BLOCK_M]
        m_new = tl.maximum(m_i, score)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(score - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p.to(dot_dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if FP8:
        o = o * v_scale
    if NUM_SPLITS == 1:
        o_off = n * stride_on + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=md_valid)
    else:  # as paged_attention_kernel's partials; an empty split has lse = -inf
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        p_idx = (split * num_tokens + n) * num_heads + head
        tl.store(part_lse_ptr + p_idx, lse, mask=m_valid)
        tl.store(part_out_ptr + p_idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=md_valid)
        if LAST_MERGES:
            # Arrive once every thread's partials are stored (the barrier, then the release of the
            # atomic); the split that arrives last reads them all (acquire) and merges as
            # merge_splits_kernel does, then rearms the counter for the next launch.
            tl.debug_barrier()
            arrivals = arrivals_ptr + n * (num_heads // G) + kv_head
            if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                for g in tl.static_range(G):
                    _merge_head(part_out_ptr, part_lse_ptr, out_ptr + n * stride_on + (kv_head * G + g) * stride_oh,
                                (tl.arange(0, SPLITS_PAD) * num_tokens + n) * num_heads + kv_head * G + g,
                                NUM_SPLITS, SPLITS_PAD, HEAD_DIM, D_PAD, ".cg")
                tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")


@_jit
def copy_exited_kernel(
    k_cache_ptr,  # [L, num_blocks, BLOCK_SIZE, KVH, D], any dtype (FP8 caches come as uint8 views)
    v_cache_ptr,
    plane_slots_ptr,  # [B, P] int64 physical slot of each row's position in every plane
    loops_ptr,  # [B] the loop each row just ran (1-based)
    exits_ptr,  # [B] bool (as int8): the row's token exits at this loop
    num_planes,
    num_kv_heads,
    stride_ps,
    stride_kl,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vl,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency_wait(PDL)
    # One program per (row, layer, head chunk). A row that does not exit returns at once,
    # so a step where nothing exits early costs one tiny launch, not a copy per row.
    b = tl.program_id(0).to(tl.int64)
    if tl.load(exits_ptr + b) == 0:
        return
    e = tl.load(loops_ptr + b).to(tl.int32)  # planes e..P-1 (0-based) take plane e-1's K/V
    if e >= num_planes:
        return
    layer = tl.program_id(1).to(tl.int64)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    mask = _head_cols((offs_h < num_kv_heads)[:, None], offs_d, HEAD_DIM, D_PAD)
    heads = offs_h.to(tl.int64)[:, None]
    k_layer = k_cache_ptr + layer * stride_kl + heads * stride_kh + offs_d[None, :]  # [BLOCK_H, D] pointers
    v_layer = v_cache_ptr + layer * stride_vl + heads * stride_vh + offs_d[None, :]
    src = tl.load(plane_slots_ptr + b * stride_ps + (e - 1)).to(tl.int64)
    k = tl.load(k_layer + (src // BLOCK_SIZE) * stride_kb + (src % BLOCK_SIZE) * stride_ks, mask=mask)
    v = tl.load(v_layer + (src // BLOCK_SIZE) * stride_vb + (src % BLOCK_SIZE) * stride_vs, mask=mask)
    for p in range(e, num_planes):
        dst = tl.load(plane_slots_ptr + b * stride_ps + p).to(tl.int64)
        tl.store(k_layer + (dst // BLOCK_SIZE) * stride_kb + (dst % BLOCK_SIZE) * stride_ks, k, mask=mask)
        tl.store(v_layer + (dst // BLOCK_SIZE) * stride_vb + (dst % BLOCK_SIZE) * stride_vs, v, mask=mask)
