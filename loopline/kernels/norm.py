"""The sandwich norm's math as a Triton helper, shared by the add + RMSNorm kernel and the GEMV's prologue."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the kernels are unusable without triton
    triton = None


if triton is not None:

    @triton.jit
    def sandwich_norm(x, b, wb, wn, n_cols, eps, HAS_BRANCH: tl.constexpr, dtype: tl.constexpr):
        """``(x', norm(x') * wn)`` for one row, with ``x' = x + norm(b) * wb`` (``HAS_BRANCH``) or ``x``.

        Rounded as :meth:`loopline.models.ops.TorchOps.add_rms_norm`: statistics in fp32, the norm to
        ``dtype``, times the weight to ``dtype``, the sum to ``dtype``. Entries past ``n_cols`` must be 0
        (masked loads); they stay 0 in ``x'``. Returns fp32 tensors holding ``dtype`` values."""
        xf = x.to(tl.float32)
        if HAS_BRANCH:
            bf = b.to(tl.float32)
            rb = tl.rsqrt(tl.sum(bf * bf, axis=0) / n_cols + eps)
            bn = ((bf * rb).to(dtype).to(tl.float32) * wb.to(tl.float32)).to(dtype)
            xf = (xf + bn.to(tl.float32)).to(dtype).to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = ((xf * r).to(dtype).to(tl.float32) * wn.to(tl.float32)).to(dtype).to(tl.float32)
        return xf, y
else:  # pragma: no cover
    sandwich_norm = None
