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
"""
from __future__ import annotations

import torch
from torch import Tensor

from loopline.kernels import grid_dependency_wait, pdl_options

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernels are unusable without triton
    triton = None

_CHUNK = 2048


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
    def _chunk_sample_kernel(x_ptr, z_ptr, temp_ptr, seed_ptr, index_ptr, val_ptr, idx_ptr, nan_ptr, n_cols,
                             stride_x, stride_z, n_chunks, eps, CHUNK: tl.constexpr, HAS_Z: tl.constexpr,
                             PDL: tl.constexpr):
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
                z = tl.load(x_ptr + row * stride_x + cols, mask=m, other=float("-inf")) / temp
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


def sample_rows(x: Tensor, temperature: Tensor, seeds: Tensor, token_index: Tensor, eps: float,
                z: Tensor | None = None) -> Tensor:
    """The sampler's token choice in two launches: int64 ``[B]``.

    A row with ``temperature < eps`` takes ``argmax(x)``; another takes the Gumbel-max draw
    ``argmax(z - log(-log u))`` with ``u = counter_uniform(seeds, token_index, V)`` and ``z = x / temperature``,
    or the given ``z`` (fp32 ``[B, V]``, unit column stride) when filters made it. ``temperature`` fp32 ``[B]``,
    ``seeds`` and ``token_index`` int64 ``[B]``, non-negative."""
    _check_logits("sample_rows", x)
    if z is not None:
        _check_logits("sample_rows (z)", z)
        if z.shape != x.shape:
            raise ValueError(f"sample_rows: z has shape {tuple(z.shape)}, the logits {tuple(x.shape)}")
    b = x.shape[0]
    for name, t, dtype in (("temperature", temperature, torch.float32), ("seeds", seeds, torch.int64),
                           ("token_index", token_index, torch.int64)):
        if t.shape != (b,) or t.dtype != dtype:
            raise ValueError(f"sample_rows wants {name} as {dtype} [{b}], got {t.dtype} {tuple(t.shape)}")

    def chunks(val, idx, nan, n, pdl):
        zz = x if z is None else z
        _chunk_sample_kernel[(b, n)](x, zz, temperature, seeds, token_index, val, idx, nan, x.shape[1],
                                     x.stride(0), zz.stride(0), n, eps, CHUNK=_CHUNK, HAS_Z=z is not None, **pdl,
                                     num_warps=8)

    return _reduce(x, chunks)


__all__ = ["argmax_rows", "available", "sample_rows"]
