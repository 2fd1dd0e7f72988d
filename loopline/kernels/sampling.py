"""Token choice as Triton kernels: the argmax of each row of fp32 logits, plain or with Gumbel noise.

``torch.argmax`` over a ``[B, 49152]`` vocabulary runs as one reduction kernel
that took 12.8 us per step on an H200 at one row, more than the exit rule and
the decode-state ops together. Here the vocabulary is split into chunks that
reduce in parallel, then one program per row picks among the chunks: two short
launches. The result is ``torch.argmax``'s: the first index of the maximum, and
the first NaN if the row has one (NaN counts as the largest value).

:func:`sample_rows` is the sampler's Gumbel-max draw in the same two launches:
the counter-based uniforms (``loopline.worker.sampler.counter_uniform``, the
same 32-bit hash, bit for bit), the temperature and the noise are computed
inside the chunk reduction. In torch the hash alone is ~120 small launches, a
few milliseconds of host time per sampling step.

:func:`filter_cut` replaces top-k, top-p and min-p's sort of every row (torch:
a segmented sort, a softmax, a cumsum and a dozen small launches) by one
program per row that finds each cut as a value: the k-th largest value, and
the smallest value whose strictly-larger mass stays below top_p, each by a
search over the order-preserving integer keys of fp32 values: NPIV pivots a
pass spread over the values between the search's bounds, the bounds snapped to
the row's values inside them, so a search ends when one value is left (4-8
passes over a row of logits; the keys' 32 bits took ~10 before); from its
second pass a search keeps the values inside its interval in a scratch row and
reads only those afterwards, and top-p's total mass comes with the first pass
(the row's maximum) when there is no top-k. The draw then
drops what lies below the cut inside its chunk reduction. The cuts are the
sort's (``loopline.worker.sampler._apply_top_k_top_p``: ties at a cut are all
kept), up to the summation order of the nucleus's mass.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from loopline.kernels import grid_dependency_wait, pdl_options

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernels are unusable without triton
    triton = None

_CHUNK = 2048
_CUT_BLOCK = 1024  # columns a pass of filter_cut loads at once
_CUT_PIVOTS = 8  # keys tested a pass: each pass narrows the search ~9x


class RowCut(NamedTuple):
    """What the draw keeps of a row of tempered logits ``z``: ``z >= thr`` (top-k and top-p) and
    ``exp(z - top) >= min_p`` (min-p: the token's probability at least ``min_p`` times the top token's)."""

    thr: Tensor  # fp32 [B]
    top: Tensor  # fp32 [B], the row's largest z
    min_p: Tensor  # fp32 [B], 0 => off


if triton is not None:

    @triton.jit
    def _fmix32(h):
        """MurmurHash3's 32-bit finalizer on uint32 (wrapping products), as the sampler's torch version."""
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _row_key(start, seed, index):
        """One of a row's two 32-bit keys: ``h = fmix32(h ^ word)`` over the seed's and the token index's
        low and high halves, from the key's start constant."""
        h = tl.full((), start, tl.uint32)
        h = _fmix32(h ^ (seed & 0xFFFFFFFF).to(tl.uint32))
        h = _fmix32(h ^ (seed >> 32).to(tl.uint32))
        h = _fmix32(h ^ (index & 0xFFFFFFFF).to(tl.uint32))
        return _fmix32(h ^ (index >> 32).to(tl.uint32))

    @triton.jit
    def _store_chunk_max(x, out, col0, val_ptr, idx_ptr, nan_ptr):
        """A chunk's maximum, its first index (``col0`` + offset) and whether it holds a NaN, at ``out``: the
        first NaN stands for the maximum, as in ``torch.argmax``."""
        is_nan = x != x
        first_nan = tl.argmax(is_nan.to(tl.int32), 0, tie_break_left=True)
        x = tl.where(is_nan, float("-inf"), x)
        best = tl.argmax(x, 0, tie_break_left=True)
        has_nan = tl.max(is_nan.to(tl.int32), 0)
        tl.store(val_ptr + out, tl.max(x, 0))
        tl.store(idx_ptr + out, col0 + tl.where(has_nan > 0, first_nan, best))
        tl.store(nan_ptr + out, has_nan)

    @triton.jit
    def _chunk_sample_kernel(x_ptr, z_ptr, temp_ptr, seed_ptr, index_ptr, thr_ptr, top_ptr, minp_ptr, val_ptr,
                             idx_ptr, nan_ptr, n_cols, stride_x, stride_z, n_chunks, eps, CHUNK: tl.constexpr,
                             HAS_Z: tl.constexpr, HAS_CUT: tl.constexpr, PDL: tl.constexpr):
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        m = cols < n_cols
        temp = tl.load(temp_ptr + row)
        if temp < eps:  # a greedy row: the argmax of its logits
            x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=float("-inf"))
        else:
            if HAS_Z:  # logits already tempered and filtered (top-k, top-p, min-p)
                z = tl.load(z_ptr + row * stride_z + cols, mask=m, other=float("-inf"))
            else:
                z = tl.div_rn(tl.load(x_ptr + row * stride_x + cols, mask=m, other=float("-inf")), temp)
                if HAS_CUT:  # filter_cut's cuts (the same z: x / temperature; a row it did not cut has top -inf)
                    top = tl.load(top_ptr + row)
                    cut = top > float("-inf")
                    near = tl.exp(z - tl.where(cut, top, 0.0)) >= tl.where(cut, tl.load(minp_ptr + row), 0.0)
                    keep = (z >= tl.load(thr_ptr + row)) & near
                    z = tl.where(keep, z, float("-inf"))
            seed = tl.load(seed_ptr + row)
            index = tl.load(index_ptr + row)
            a = _row_key(0x243F6A88, seed, index)
            b = _row_key(0x85A308D3, seed, index)
            h = _fmix32(a ^ (cols.to(tl.uint32) * 0x9E3779B9))
            h = _fmix32(h ^ b)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # exact: (k + 1/2) / 2**23
            x = z - tl.log(-tl.log(u))  # (past the row's end -inf, as z)
        _store_chunk_max(x, row * n_chunks + chunk, chunk * CHUNK, val_ptr, idx_ptr, nan_ptr)

    @triton.jit
    def _key(x):
        """fp32 -> int32 in the same order (a total order: -0.0 below +0.0, which callers fold first)."""
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _unkey(k):
        b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.int32)
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _tempered(x_ptr, row, stride_x, c, n_cols, temp):
        # (+ 0.0 folds -0.0 into +0.0, which compare equal as floats but not as keys)
        # (div_rn: IEEE division, torch's z bit for bit; Triton's "/" may be a few ulp off, enough to move a
        # top-k cut past the value it was found at)
        return tl.div_rn(tl.load(x_ptr + row * stride_x + c, mask=c < n_cols, other=float("-inf")), temp) + 0.0

    @triton.jit
    def _narrow(lo, hi, piv, ok):
        """One pass's verdicts on the pivots -> the narrower (lo, hi]: the search keeps the predicate false
        at lo and true at hi (the pivots in any order)."""
        lo = tl.maximum(lo, tl.max(tl.where(ok, lo, piv), 0))
        hi = tl.minimum(hi, tl.min(tl.where(ok, piv, hi), 0))
        return lo, hi

    @triton.jit
    def _append(buf_row, written, z, keep):
        """Stores the kept z of one block at ``buf_row[written:]``, in order; returns the new count. In place
        over buf itself a value's new place is at or before its old one, read by the same block."""
        at = written + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(buf_row + at, z, mask=keep)
        return written + tl.sum(keep.to(tl.int32), 0)

    @triton.jit
    def _search(x_ptr, buf_ptr, row, stride_x, n_cols, temp, lo, hi, fmin, top, target, listed,
                MASS: tl.constexpr, BLOCK: tl.constexpr, NPIV: tl.constexpr):
        """The smallest key K in (lo, hi] at which ``count(key(z) > K) < target`` (MASS: the mass
        ``sum exp(z - top)`` of those z ``< target``) holds, given it fails at lo and holds at hi.

        Pivots are spread evenly over the values of the interval (logits sit in a few units: ~9x narrower a
        pass), or over its keys once six passes have gone (the values can be spread badly: a -1e30 beside
        logits near 0; keys narrow 9x a pass whatever the values). Each pass also finds the smallest and the
        largest key inside the interval, where the predicate is the same as at its ends (it changes only at
        the row's keys): the search stops once one value is left, not at the key's last bit.

        From the second pass on, a pass keeps the values inside its interval in ``buf`` (the row's scratch,
        compacted in place) and counts those above it once; later passes read only what was kept (after two
        passes typically a few percent of the row). ``listed`` >= 0: buf already holds the interval's values,
        that many, and every pass reads them."""
        offs = tl.arange(0, BLOCK)
        steps = tl.arange(0, NPIV) + 1
        n = 0
        read = 0  # values the passes read (the search's cost)
        kept = tl.where(listed >= 0, listed, n_cols)  # values in buf (or x's, until the second pass wrote buf)
        if MASS:
            above = tl.zeros((), tl.float32)  # count (mass) of the values dropped from buf above its interval
        else:
            above = tl.zeros((), tl.int32)
        while hi - lo > 1:
            listing = (n >= 1) | (listed >= 0)  # this pass keeps its interval's values in buf
            kp = lo + ((hi - lo) * steps.to(tl.int64)) // (NPIV + 1)  # (int64: the product; every key fits int32)
            va = tl.maximum(_unkey(lo + 1), fmin)
            vb = _unkey(hi)
            pv = _key(va + (vb - va) * (steps.to(tl.float32) / (NPIV + 1))).to(tl.int64)
            piv = tl.where((pv > lo) & (pv < hi) & (n < 6), pv, kp)
            piv32 = piv.to(tl.int32)
            if MASS:
                acc = tl.zeros((BLOCK, NPIV), tl.float32)
                up = tl.zeros((BLOCK,), tl.float32)
            else:
                acc = tl.zeros((BLOCK, NPIV), tl.int32)  # (summed once a pass: a sum is a block-wide sync)
                up = tl.zeros((BLOCK,), tl.int32)
            least = tl.full((BLOCK,), 2147483647, tl.int32)
            most = tl.full((BLOCK,), -2147483648, tl.int32)
            written = 0
            read += kept
            for start in range(0, kept, BLOCK):
                c = start + offs
                if (n < 2) & (listed < 0):
                    z = _tempered(x_ptr, row, stride_x, c, n_cols, temp)
                else:
                    z = tl.load(buf_ptr + row * n_cols + c, mask=c < kept, other=float("-inf"))
                kz = _key(z)  # (padding and masked tokens: -inf, below lo)
                inside = (kz > lo) & (kz <= hi)
                least = tl.minimum(least, tl.where(inside, kz, 2147483647))
                most = tl.maximum(most, tl.where(inside, kz, -2147483648))
                above_piv = kz[:, None] > piv32[None, :]
                if MASS:
                    e = tl.exp(z - top)
                    acc += tl.where(above_piv, e[:, None], 0.0)
                    up += tl.where(kz > hi, e, 0.0)
                else:
                    acc += above_piv.to(tl.int32)
                    up += (kz > hi).to(tl.int32)
                if listing:
                    written = _append(buf_ptr + row * n_cols, written, z, inside)
            lo, hi = _narrow(lo, hi, piv, tl.sum(acc, 0) + above < target)
            lo = tl.maximum(lo, tl.min(least, 0).to(tl.int64) - 1)
            hi = tl.minimum(hi, tl.max(most, 0).to(tl.int64))
            if listing:  # buf holds the pass's interval's values; those above it count from now
                kept = written
                above += tl.sum(up, 0)
            n += 1
        return hi, read

    @triton.jit
    def _cut_kernel(x_ptr, temp_ptr, k_ptr, p_ptr, active_ptr, thr_ptr, top_ptr, buf_ptr, read_ptr, n_cols, stride_x,
                    eps, BLOCK: tl.constexpr, NPIV: tl.constexpr, HAS_ACTIVE: tl.constexpr, HAS_READ: tl.constexpr,
                    PDL: tl.constexpr):
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        temp = tl.load(temp_ptr + row)
        go = temp >= eps  # (a greedy row takes argmax(x): no cut)
        if HAS_ACTIVE:  # (a row whose token nobody reads: no cut either)
            go = go & (tl.load(active_ptr + row) != 0)
        offs = tl.arange(0, BLOCK)
        thr = _key(tl.full((), float("-inf"), tl.float32)).to(tl.int64)  # -inf: keep all
        top = tl.full((), float("-inf"), tl.float32)
        read = 0
        if go:
            read += n_cols
            k = tl.load(k_ptr + row)
            p = tl.load(p_ptr + row)
            k_on = (k > 0) & (k < n_cols)
            # one pass: the largest z, the smallest finite one, how many are finite, and (top-p without top-k)
            # sum exp(z - top) by lanes (each lane's sum against its own maximum, rescaled as that grows)
            big = tl.full((BLOCK,), float("-inf"), tl.float32)
            small = tl.full((BLOCK,), float("inf"), tl.float32)
            finite = tl.zeros((BLOCK,), tl.int32)
            mass = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, n_cols, BLOCK):
                z = _tempered(x_ptr, row, stride_x, start + offs, n_cols, temp)
                fin = z > float("-inf")
                grown = tl.maximum(big, z)
                if (p < 1.0) & (k_on == 0):  # (two exps a value; after top-k the total is what top-k kept)
                    ref = tl.where(grown > float("-inf"), grown, 0.0)  # (a lane of -inf so far: its sum stays 0)
                    mass = mass * tl.exp(big - ref) + tl.exp(z - ref)
                big = grown
                small = tl.minimum(small, tl.where(fin, z, float("inf")))
                finite += fin.to(tl.int32)
            top = tl.max(big, 0)
            total = tl.sum(mass * tl.exp(big - tl.where(top > float("-inf"), top, 0.0)), 0)
            fmin = tl.min(small, 0)  # the smallest finite z: every search starts just below it
            lo = _key(fmin).to(tl.int64) - 1
            hi = _key(top).to(tl.int64)
            listed = -1  # (top-p after top-k: the values top-k kept, in buf)
            # top-k: the k-th largest z (fewer finite tokens than k: keep all; -inf never wins the draw)
            if k_on & (tl.sum(finite, 0) >= k):
                thr, r = _search(x_ptr, buf_ptr, row, stride_x, n_cols, temp, lo, hi, fmin, top, k, -1, False, BLOCK,
                                 NPIV)
                read += r
            if k_on & (p < 1.0):  # top-p counts the mass of what top-k kept (all when it kept all), and searches
                # only those values (in buf)
                tk = _unkey(thr)
                sacc = tl.zeros((BLOCK,), tl.float32)
                listed = 0
                for start in range(0, n_cols, BLOCK):
                    z = _tempered(x_ptr, row, stride_x, start + offs, n_cols, temp)
                    keep = (z >= tk) & (z > float("-inf"))  # (tk -inf when top-k kept all: not masked ones)
                    sacc += tl.where(keep, tl.exp(z - top), 0.0)
                    listed = _append(buf_ptr + row * n_cols, listed, z, keep)
                total = tl.sum(sacc, 0)
                read += n_cols
            if (p < 1.0) & (top > float("-inf")):  # of what top-k kept, the smallest z whose larger mass is < p
                # (above tk's key - 1 every z is kept: the search's mass needs no top-k test)
                thr, r = _search(x_ptr, buf_ptr, row, stride_x, n_cols, temp, tl.maximum(lo, thr - 1), hi, fmin,
                                 top, p * total, listed, True, BLOCK, NPIV)
                read += r
        tl.store(thr_ptr + row, _unkey(thr))
        tl.store(top_ptr + row, top)
        if HAS_READ:
            tl.store(read_ptr + row, read)

    @triton.jit
    def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, n_cols, stride_x, n_chunks, CHUNK: tl.constexpr,
                             PDL: tl.constexpr):
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        _store_chunk_max(x, row * n_chunks + chunk, chunk * CHUNK, val_ptr, idx_ptr, nan_ptr)

    @triton.jit
    def _pick_chunk_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, n_chunks, CHUNKS_PAD: tl.constexpr,
                           PDL: tl.constexpr):
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, CHUNKS_PAD)
        m = c < n_chunks
        val = tl.load(val_ptr + row * n_chunks + c, mask=m, other=float("-inf"))
        nan = tl.load(nan_ptr + row * n_chunks + c, mask=m, other=0)
        # the first chunk holding a NaN, else the first chunk holding the maximum
        pick = tl.where(tl.max(nan, 0) > 0, tl.argmax(nan, 0, tie_break_left=True),
                        tl.argmax(val, 0, tie_break_left=True))
        tl.store(out_ptr + row, tl.load(idx_ptr + row * n_chunks + pick).to(tl.int64))


def available() -> bool:
    """Whether :func:`argmax_rows` can run (triton is installed; CUDA, or the CPU interpreter)."""
    return triton is not None


def _check_logits(name: str, x: Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"{name} wants fp32 [B, V] logits with unit column stride, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if x.shape[0] and x.shape[1] == 0:
        raise ValueError(f"{name}: the rows are empty")


def _check_rows(name: str, b: int, fields: list[tuple[str, Tensor, torch.dtype]]) -> None:
    """Each per-row argument ``(field, tensor, dtype)`` of kernel wrapper ``name`` is ``dtype`` ``[b]``."""
    for field, t, dtype in fields:
        if t.shape != (b,) or t.dtype != dtype:
            raise ValueError(f"{name} wants {field} as {dtype} [{b}], got {t.dtype} {tuple(t.shape)}")


def _reduce(x: Tensor, launch_chunks) -> Tensor:
    """The second launch of both reductions: ``launch_chunks(val, idx, nan, chunks, pdl)`` writes each chunk's
    maximum, its first index and whether it holds a NaN; one program per row picks among the chunks."""
    b, v = x.shape
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    chunks = triton.cdiv(v, _CHUNK)
    val = torch.empty((b, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((b, chunks), dtype=torch.int32, device=x.device)
    nan = torch.empty((b, chunks), dtype=torch.int32, device=x.device)
    pdl = pdl_options(x.device)
    launch_chunks(val, idx, nan, chunks, pdl)
    _pick_chunk_kernel[(b,)](val, idx, nan, out, chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), **pdl,
                             num_warps=1)
    return out


def argmax_rows(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` for fp32 ``x`` ``[B, V]`` with unit column stride: int64 ``[B]``."""
    _check_logits("argmax_rows", x)

    def chunks(val, idx, nan, n, pdl):
        _chunk_argmax_kernel[(x.shape[0], n)](x, val, idx, nan, x.shape[1], x.stride(0), n, CHUNK=_CHUNK, **pdl,
                                              num_warps=8)

    return _reduce(x, chunks)


def filter_cut(x: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, eps: float,
               active: Tensor | None = None, read: Tensor | None = None) -> RowCut:
    """Top-k, top-p and min-p of tempered logits ``x / temperature`` as per-row cuts (:class:`RowCut`), in one
    launch. ``top_k`` int64 ``[B]`` (<= 0 or >= V: off), ``top_p`` fp32 ``[B]`` in (0, 1] (1: off), ``min_p``
    fp32 ``[B]`` (0: off); rows with ``temperature < eps`` are greedy and get no cut. Top-p counts the mass of
    what top-k kept; ties at a cut are all kept. ``active`` (bool ``[B]``): the rows whose token is used; the
    others get no cut (a decode row that does not exit this step: the search is most of the launch's time).
    ``read`` (int32 ``[B]``, optional): gets how many values each row's passes read, the cut's cost."""
    _check_logits("filter_cut", x)
    b = x.shape[0]
    _check_rows("filter_cut", b, [("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                                  ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32)]
                + ([("active", active, torch.bool)] if active is not None else [])
                + ([("read", read, torch.int32)] if read is not None else []))
    thr = torch.empty(b, dtype=torch.float32, device=x.device)
    top = torch.empty(b, dtype=torch.float32, device=x.device)
    if b:
        buf = torch.empty_like(x, memory_format=torch.contiguous_format)  # the searches' kept values, a row each
        _cut_kernel[(b,)](x, temperature, top_k, top_p, temperature if active is None else active, thr, top, buf,
                          thr if read is None else read, x.shape[1], x.stride(0), eps, BLOCK=_CUT_BLOCK,
                          NPIV=_CUT_PIVOTS, HAS_ACTIVE=active is not None, HAS_READ=read is not None,
                          **pdl_options(x.device), num_warps=8)
    return RowCut(thr, top, min_p)


def sample_rows(x: Tensor, temperature: Tensor, seeds: Tensor, token_index: Tensor, eps: float,
                z: Tensor | None = None, cut: RowCut | None = None) -> Tensor:
    """The sampler's token choice in two launches: int64 ``[B]``.

    A row with ``temperature < eps`` takes ``argmax(x)``; another takes the Gumbel-max draw
    ``argmax(z - log(-log u))`` with ``u = counter_uniform(seeds, token_index, V)`` and ``z = x / temperature``,
    or the given ``z`` (fp32 ``[B, V]``, unit column stride) when filters made it, or ``z`` cut by
    :func:`filter_cut`'s ``cut``. ``temperature`` fp32 ``[B]``, ``seeds`` and ``token_index`` int64 ``[B]``,
    non-negative."""
    _check_logits("sample_rows", x)
    if z is not None:
        _check_logits("sample_rows (z)", z)
        if z.shape != x.shape:
            raise ValueError(f"sample_rows: z has shape {tuple(z.shape)}, the logits {tuple(x.shape)}")
    if z is not None and cut is not None:
        raise ValueError("sample_rows takes filtered logits z or a cut, not both")
    b = x.shape[0]
    _check_rows("sample_rows", b, [("temperature", temperature, torch.float32), ("seeds", seeds, torch.int64),
                                   ("token_index", token_index, torch.int64)]
                + ([(f"cut.{f}", t, torch.float32) for f, t in cut._asdict().items()] if cut is not None else []))

    def chunks(val, idx, nan, n, pdl):
        zz = x if z is None else z
        thr, top, min_p = cut if cut is not None else (temperature, temperature, temperature)  # (unread)
        _chunk_sample_kernel[(b, n)](x, zz, temperature, seeds, token_index, thr, top, min_p, val, idx, nan,
                                     x.shape[1], x.stride(0), zz.stride(0), n, eps, CHUNK=_CHUNK,
                                     HAS_Z=z is not None, HAS_CUT=cut is not None, **pdl, num_warps=8)

    return _reduce(x, chunks)


__all__ = ["RowCut", "argmax_rows", "available", "filter_cut", "sample_rows"]
