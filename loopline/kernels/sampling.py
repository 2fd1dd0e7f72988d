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
a segmented sort, a softmax, a cumsum and a dozen small launches) by four
launches that find each cut as a value: the k-th largest value, and the
smallest value whose strictly-larger mass stays below top_p, each by a search
over the order-preserving integer keys of fp32 values. Three passes read the
row, a program per 2,048 columns, so that a few rows still fill the GPU: the
row's maximum, smallest finite value, finite count and (top-p) total mass;
the count or mass above 16 pivots spread over the row's range, which narrows
the search ~17x; the values above the narrowed interval's bottom, listed
(typically a few dozen to a few hundred). A program per row then finishes the
search over the list: pivots spread over the interval's values, the bounds
snapped to the values inside it, so it ends when one value is left, and each
pass keeps only the interval's values. Top-p after top-k searches the values
top-k kept. The draw then drops what lies below the cut inside its chunk
reduction. The cuts are the
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
_CUT_SPLIT = 2048  # columns one program of filter_cut's row-wide passes reads (a multiple of their blocks)
_CUT_BLOCK = 1024  # columns a row-wide pass of filter_cut loads at once
_CUT_WIDE_BLOCK = 256  # (the pivot pass: two [BLOCK, PIVOTS] accumulators; 512 spills registers on sm_90)
_CUT_WIDE_PIVOTS = 16  # keys the row-wide pivot pass tests: the search's interval ~17x narrower
_CUT_LIST_BLOCK = 512  # listed values a pass of the search's end loads at once (the list: typically fewer)
_CUT_PIVOTS = 8  # keys tested a pass of the search's end: each narrows it ~9x


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
    def _pivots(lo, hi, fmin, by_keys, NPIV: tl.constexpr):
        """NPIV keys inside (lo, hi), increasing: spread evenly over the interval's values (logits sit in a few
        units), or over its keys (``by_keys``, or where a value's key falls outside: values spread badly, a
        -1e30 beside logits near 0; keys narrow the interval NPIV + 1 times whatever the values)."""
        steps = tl.arange(0, NPIV) + 1
        kp = lo + ((hi - lo) * steps.to(tl.int64)) // (NPIV + 1)  # (int64: the product; every key fits int32)
        va = tl.maximum(_unkey(lo + 1), fmin)
        vb = _unkey(hi)
        pv = _key(va + (vb - va) * (steps.to(tl.float32) / (NPIV + 1))).to(tl.int64)
        return tl.where((pv > lo) & (pv < hi) & (by_keys == 0), pv, kp)

    @triton.jit
    def _row_pivots(fmin, top, NPIV: tl.constexpr):
        """The row's whole search interval (lo, hi] and the pivot pass's NPIV pivots over it, three in four by
        value, one in four by key: pass 2 counts above them and pass 3 reads its counts back by the same keys."""
        lo = _key(fmin).to(tl.int64) - 1
        hi = _key(top).to(tl.int64)
        return lo, hi, _pivots(lo, hi, fmin, tl.arange(0, NPIV) % 4 == 3, NPIV)

    @triton.jit
    def _search(buf_ptr, row, n_cols, lo, hi, fmin, top, target, listed, MASS: tl.constexpr,
                COMPACT: tl.constexpr, BLOCK: tl.constexpr, NPIV: tl.constexpr):
        """The smallest key K in (lo, hi] at which ``count(key(z) > K) < target`` (MASS: the mass
        ``sum exp(z - top)`` of those z ``< target``) holds, given it fails at lo and holds at hi, over the
        ``listed`` values at the start of the row's scratch ``buf`` (every value of the row above lo).

        Pivots as :func:`_pivots` (by keys once six passes have gone). Each pass also finds the smallest and
        the largest key inside the interval, where the predicate is the same as at its ends (it changes only
        at the row's keys): the search stops once one value is left, not at the key's last bit. COMPACT: each
        pass keeps only its interval's values in buf (compacted in place) and counts those above it once;
        otherwise buf is left as it was (top-p reads it after top-k)."""
        offs = tl.arange(0, BLOCK)
        n = 0
        read = 0  # values the passes read (the search's cost)
        kept = listed
        if MASS:
            above = tl.zeros((), tl.float32)  # count (mass) of the values dropped from buf above its interval
        else:
            above = tl.zeros((), tl.int32)
        while hi - lo > 1:
            piv = _pivots(lo, hi, fmin, n >= 6, NPIV)
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
                z = tl.load(buf_ptr + row * n_cols + c, mask=c < kept, other=float("-inf"))
                kz = _key(z)  # (padding: -inf, below lo)
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
                if COMPACT:
                    written = _append(buf_ptr + row * n_cols, written, z, inside)
            lo, hi = _narrow(lo, hi, piv, tl.sum(acc, 0) + above < target)
            lo = tl.maximum(lo, tl.min(least, 0).to(tl.int64) - 1)
            hi = tl.minimum(hi, tl.max(most, 0).to(tl.int64))
            if COMPACT:  # buf holds the pass's interval's values; those above it count from now
                kept = written
                above += tl.sum(up, 0)
            n += 1
        return hi, read

    @triton.jit
    def _go(temp_ptr, active_ptr, row, eps, HAS_ACTIVE: tl.constexpr):
        """Whether the row gets a cut: a sampled row (a greedy one takes argmax(x)) whose token is read."""
        go = tl.load(temp_ptr + row) >= eps
        if HAS_ACTIVE:
            go = go & (tl.load(active_ptr + row) != 0)
        return go

    @triton.jit
    def _plan(k_ptr, p_ptr, row, n_cols, top, finite):
        """Which search the wide passes narrow: top-k's (when it cuts: fewer finite tokens than k keep all, as
        the sort does; -inf never wins the draw) or else top-p's over the whole row."""
        k = tl.load(k_ptr + row)
        p = tl.load(p_ptr + row)
        by_k = (k > 0) & (k < n_cols) & (finite >= k)
        by_p = (by_k == 0) & (p < 1.0) & (top > float("-inf"))
        return k, p, by_k, by_p

    @triton.jit
    def _cut_stats_kernel(x_ptr, temp_ptr, p_ptr, active_ptr, stats_ptr, n_cols, stride_x, n_split, eps,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_ACTIVE: tl.constexpr, PDL: tl.constexpr):
        """Pass 1 of the cut, a program per SPLIT columns of a row: their largest z, smallest finite z, how
        many are finite and (top-p) sum exp(z - largest), by lanes (each lane's sum against its own maximum,
        rescaled as that grows)."""
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        if _go(temp_ptr, active_ptr, row, eps, HAS_ACTIVE):
            temp = tl.load(temp_ptr + row)
            p = tl.load(p_ptr + row)
            offs = tl.arange(0, BLOCK)
            big = tl.full((BLOCK,), float("-inf"), tl.float32)
            small = tl.full((BLOCK,), float("inf"), tl.float32)
            finite = tl.zeros((BLOCK,), tl.float32)
            mass = tl.zeros((BLOCK,), tl.float32)
            for start in range(s * SPLIT, s * SPLIT + SPLIT, BLOCK):
                z = _tempered(x_ptr, row, stride_x, start + offs, n_cols, temp)
                fin = z > float("-inf")
                grown = tl.maximum(big, z)
                if p < 1.0:  # (two exps a value that top-k and min-p rows need not pay)
                    ref = tl.where(grown > float("-inf"), grown, 0.0)  # (a lane of -inf so far: its sum stays 0)
                    mass = mass * tl.exp(big - ref) + tl.exp(z - ref)
                big = grown
                small = tl.minimum(small, tl.where(fin, z, float("inf")))
                finite += fin.to(tl.float32)
            top = tl.max(big, 0)
            out = stats_ptr + (row * n_split + s) * 4
            tl.store(out, top)
            tl.store(out + 1, tl.min(small, 0))
            tl.store(out + 2, tl.sum(mass * tl.exp(big - tl.where(top > float("-inf"), top, 0.0)), 0))
            tl.store(out + 3, tl.sum(finite, 0))  # (exact: fewer than 2**24 columns)

    @triton.jit
    def _cut_wide_kernel(x_ptr, temp_ptr, k_ptr, p_ptr, active_ptr, stats_ptr, info_ptr, part_ptr, n_cols,
                         stride_x, n_split, eps, SPLIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                         NPIV: tl.constexpr, HAS_ACTIVE: tl.constexpr, PDL: tl.constexpr):
        """Pass 2, a program per SPLIT columns: the row's statistics from pass 1's parts (the first program
        keeps them in ``info``), then the count and (top-p) the mass of the program's z above each of NPIV
        pivots spread over the whole row's range, three in four by value, one in four by key: ``part[row, s,
        0]`` the masses (top-k: the counts), ``part[row, s, 1]`` the counts."""
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        if _go(temp_ptr, active_ptr, row, eps, HAS_ACTIVE):
            i = tl.arange(0, SPLITS)
            part = stats_ptr + (row * n_split + i) * 4
            there = i < n_split
            tops = tl.load(part, mask=there, other=float("-inf"))
            top = tl.max(tops, 0)
            fmin = tl.min(tl.load(part + 1, mask=there, other=float("inf")), 0)
            masses = tl.load(part + 2, mask=there, other=0.0)
            total = tl.sum(masses * tl.exp(tops - tl.where(top > float("-inf"), top, 0.0)), 0)
            finite = tl.sum(tl.load(part + 3, mask=there, other=0.0), 0)
            if s == 0:
                tl.store(info_ptr + row * 4, top)
                tl.store(info_ptr + row * 4 + 1, fmin)
                tl.store(info_ptr + row * 4 + 2, total)
                tl.store(info_ptr + row * 4 + 3, finite)
            k, p, by_k, by_p = _plan(k_ptr, p_ptr, row, n_cols, top, finite)
            if by_k | by_p:
                temp = tl.load(temp_ptr + row)
                _, _, piv = _row_pivots(fmin, top, NPIV)
                piv = piv.to(tl.int32)
                offs = tl.arange(0, BLOCK)
                mass = tl.zeros((BLOCK, NPIV), tl.float32)
                count = tl.zeros((BLOCK, NPIV), tl.int32)
                for start in range(s * SPLIT, s * SPLIT + SPLIT, BLOCK):
                    z = _tempered(x_ptr, row, stride_x, start + offs, n_cols, temp)
                    above = _key(z)[:, None] > piv[None, :]
                    count += above.to(tl.int32)
                    if by_p:
                        mass += tl.where(above, tl.exp(z - top)[:, None], 0.0)
                out = part_ptr + (row * n_split + s) * 2 * NPIV + tl.arange(0, NPIV)
                n = tl.sum(count, 0)
                tl.store(out, tl.where(by_k, n.to(tl.float32), tl.sum(mass, 0)))
                tl.store(out + NPIV, n.to(tl.float32))  # (exact: fewer than 2**24 columns)

    @triton.jit
    def _cut_list_kernel(x_ptr, temp_ptr, k_ptr, p_ptr, active_ptr, stats_ptr, info_ptr, part_ptr, bounds_ptr,
                         buf_ptr, n_cols, stride_x, n_split, eps, SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                         BLOCK: tl.constexpr, NPIV: tl.constexpr, HAS_ACTIVE: tl.constexpr, PDL: tl.constexpr):
        """Pass 3, a program per SPLIT columns: pass 2's parts summed narrow the search to (lo, hi]; the
        program's z above lo go to the row's scratch, in column order, each program at the place its
        predecessors' counts above lo (pass 2's) leave it. The first program keeps lo, hi and how many were
        listed (typically a few dozen to a few hundred) in ``bounds``."""
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        if _go(temp_ptr, active_ptr, row, eps, HAS_ACTIVE):
            top = tl.load(info_ptr + row * 4)
            fmin = tl.load(info_ptr + row * 4 + 1)
            k, p, by_k, by_p = _plan(k_ptr, p_ptr, row, n_cols, top, tl.load(info_ptr + row * 4 + 3))
            if by_k | by_p:
                lo, hi, piv = _row_pivots(fmin, top, NPIV)
                i = tl.arange(0, SPLITS)
                there = i < n_split
                at = part_ptr + (row * n_split + i[:, None]) * 2 * NPIV + tl.arange(0, NPIV)[None, :]
                target = tl.where(by_k, k.to(tl.float32), p * tl.load(info_ptr + row * 4 + 2))
                bottom = lo
                lo, hi = _narrow(lo, hi, piv, tl.sum(tl.load(at, mask=there[:, None], other=0.0), 0) < target)
                # each program's count above lo: pass 2's at the pivot lo is, or (lo still the row's bottom) its
                # finite count
                counts = tl.load(at + NPIV, mask=there[:, None], other=0.0)
                n = tl.max(tl.where(piv[None, :] == lo, counts, -1.0), 1)
                n = tl.where(lo == bottom, tl.load(stats_ptr + (row * n_split + i) * 4 + 3, mask=there, other=0.0), n)
                n = tl.where(there, n, 0.0).to(tl.int32)
                if s == 0:
                    tl.store(bounds_ptr + row * 4, lo.to(tl.int32))
                    tl.store(bounds_ptr + row * 4 + 1, hi.to(tl.int32))
                    tl.store(bounds_ptr + row * 4 + 2, tl.sum(n, 0))
                temp = tl.load(temp_ptr + row)
                offs = tl.arange(0, BLOCK)
                written = tl.sum(tl.where(i < s, n, 0), 0)
                for start in range(s * SPLIT, s * SPLIT + SPLIT, BLOCK):
                    z = _tempered(x_ptr, row, stride_x, start + offs, n_cols, temp)
                    written = _append(buf_ptr + row * n_cols, written, z, _key(z) > lo)

    @triton.jit
    def _cut_finish_kernel(temp_ptr, k_ptr, p_ptr, active_ptr, info_ptr, bounds_ptr, buf_ptr, thr_ptr, top_ptr,
                           read_ptr, n_cols, eps, BLOCK: tl.constexpr, NPIV: tl.constexpr,
                           HAS_ACTIVE: tl.constexpr, HAS_READ: tl.constexpr, PDL: tl.constexpr):
        """Pass 4, a program per row: the search finished over pass 3's list; top-p after top-k counts the mass
        of what top-k kept and searches only those values."""
        grid_dependency_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        thr = _key(tl.full((), float("-inf"), tl.float32)).to(tl.int64)  # -inf: keep all
        top = tl.full((), float("-inf"), tl.float32)
        read = 0
        if _go(temp_ptr, active_ptr, row, eps, HAS_ACTIVE):
            top = tl.load(info_ptr + row * 4)
            fmin = tl.load(info_ptr + row * 4 + 1)
            total = tl.load(info_ptr + row * 4 + 2)
            k, p, by_k, by_p = _plan(k_ptr, p_ptr, row, n_cols, top, tl.load(info_ptr + row * 4 + 3))
            read += n_cols
            if by_k | by_p:
                read += 2 * n_cols
                lo = tl.load(bounds_ptr + row * 4).to(tl.int64)
                hi = tl.load(bounds_ptr + row * 4 + 1).to(tl.int64)
                listed = tl.load(bounds_ptr + row * 4 + 2)
                if by_k:  # the k-th largest z; the list kept whole for top-p
                    thr, r = _search(buf_ptr, row, n_cols, lo, hi, fmin, top, k, listed, False, False, BLOCK, NPIV)
                    read += r
                    if p < 1.0:  # top-p counts the mass of what top-k kept
                        tk = _unkey(thr)
                        offs = tl.arange(0, BLOCK)
                        sacc = tl.zeros((BLOCK,), tl.float32)
                        for start in range(0, listed, BLOCK):
                            z = tl.load(buf_ptr + row * n_cols + start + offs, mask=start + offs < listed,
                                        other=float("-inf"))
                            sacc += tl.where(z >= tk, tl.exp(z - top), 0.0)
                        total = tl.sum(sacc, 0)
                        read += listed
                        lo = thr - 1  # (every z top-k kept is above it; those below are in no pivot's mass)
                        hi = _key(top).to(tl.int64)
                if by_p | (by_k & (p < 1.0)):  # of what top-k kept, the smallest z whose larger mass is < p
                    thr, r = _search(buf_ptr, row, n_cols, lo, hi, fmin, top, p * total, listed, True, True, BLOCK,
                                     NPIV)
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
    """Top-k, top-p and min-p of tempered logits ``x / temperature`` as per-row cuts (:class:`RowCut`), in four
    launches. ``top_k`` int64 ``[B]`` (<= 0 or >= V: off), ``top_p`` fp32 ``[B]`` in (0, 1] (1: off),
    ``min_p`` fp32 ``[B]`` (0: off); rows with ``temperature < eps`` are greedy and get no cut. Top-p counts the
    mass of what top-k kept; ties at a cut are all kept. ``active`` (bool ``[B]``): the rows whose token is
    used; the others get no cut (a decode row that does not exit this step). ``read`` (int32 ``[B]``,
    optional): gets how many values each row's passes read, the cut's cost.

    Three passes over the row run a program per ``_CUT_SPLIT`` columns (statistics; counts or masses above
    pivots spread over the row's range; the values above the narrowed interval's bottom, listed), so that a
    few rows still fill the GPU; the fourth, a program per row, finishes the search over what was listed."""
    _check_logits("filter_cut", x)
    b, v = x.shape
    _check_rows("filter_cut", b, [("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                                  ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32)]
                + ([("active", active, torch.bool)] if active is not None else [])
                + ([("read", read, torch.int32)] if read is not None else []))
    thr = torch.empty(b, dtype=torch.float32, device=x.device)
    top = torch.empty(b, dtype=torch.float32, device=x.device)
    if b == 0:
        return RowCut(thr, top, min_p)
    n_split = triton.cdiv(v, _CUT_SPLIT)
    # one scratch allocation: the listed values (a row each), then the passes' small parts
    sizes = (b * v, b * n_split * 4, b * n_split * 2 * _CUT_WIDE_PIVOTS, b * 4, b * 4)
    buf, stats, part, info, bounds = torch.empty(sum(sizes), dtype=torch.float32, device=x.device).split(sizes)
    bounds = bounds.view(torch.int32)
    act = temperature if active is None else active  # (unread without HAS_ACTIVE)
    rows = dict(HAS_ACTIVE=active is not None, **pdl_options(x.device))
    wide = dict(SPLIT=_CUT_SPLIT, SPLITS=triton.next_power_of_2(n_split), NPIV=_CUT_WIDE_PIVOTS, **rows)
    _cut_stats_kernel[(b, n_split)](x, temperature, top_p, act, stats, v, x.stride(0), n_split, eps,
                                    SPLIT=_CUT_SPLIT, BLOCK=_CUT_BLOCK, **rows, num_warps=8)
    _cut_wide_kernel[(b, n_split)](x, temperature, top_k, top_p, act, stats, info, part, v, x.stride(0), n_split,
                                   eps, BLOCK=_CUT_WIDE_BLOCK, **wide, num_warps=8)
    _cut_list_kernel[(b, n_split)](x, temperature, top_k, top_p, act, stats, info, part, bounds, buf, v,
                                   x.stride(0), n_split, eps, BLOCK=_CUT_BLOCK, **wide, num_warps=8)
    _cut_finish_kernel[(b,)](temperature, top_k, top_p, act, info, bounds, buf, thr, top,
                             thr if read is None else read, v, eps, BLOCK=_CUT_LIST_BLOCK, NPIV=_CUT_PIVOTS,
                             HAS_READ=read is not None, **rows, num_warps=8)
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
