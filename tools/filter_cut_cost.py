"""Top-k / top-p / min-p on CUDA: the filters' cuts (``filter_cut``) and the draw against the torch filters and
the same draw, per call, whether the cuts keep exactly the sort's tokens, and how many rows' worth of values the
cut's passes read (``reads/row``: its cost apart from the launch).

python tools/filter_cut_cost.py [--rows 1,8,32,128] [--vocab 49152] [--sweep]

To time an earlier kernel against this one, run the tool again with ``PYTHONPATH`` on a copy of the tree whose
``loopline/kernels/sampling.py`` is the earlier one (``git show 0eb43f6:loopline/kernels/sampling.py``); a kernel
without ``read=`` reports -1 rows.

Logits ``3 * randn``; a call's time is 50 calls then one synchronize (the host's launches included: where
they take longer than the GPU, that is what it measures); "on the GPU" is the cut's time in a replayed CUDA
graph, without the host's launch cost. ``--sweep`` also times (on the GPU) the cut's launch shapes (columns
a program, the pivot pass's pivots and block). On the CPU (under ``TRITON_INTERPRET=1``) it checks the kept
tokens only.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from loopline.kernels import sampling
from loopline.worker.sampler import SAMPLING_EPS, _apply_min_p, _apply_top_k_top_p

CASES = ((20, 1.0, 0.0), (0, 0.7, 0.0), (20, 0.7, 0.0), (0, 1.0, 0.05), (50, 0.9, 0.05))  # top_k, top_p, min_p


def timed(f, device: str, n: int = 50) -> float:
    """ms a call (nan on the CPU, where the interpreter's time means nothing)."""
    if device != "cuda":
        f()
        return float("nan")
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def graphed(f, device: str, n: int = 20, replays: int = 5) -> float:
    """ms of the GPU's time a call: ``n`` calls captured in a CUDA graph, replayed between CUDA events (no host
    launch cost; nan on the CPU)."""
    if device != "cuda":
        return float("nan")
    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            f()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (n * replays)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--sweep", action="store_true", help="also time the cut kernel's launch shapes")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    V = a.vocab
    for B in (int(r) for r in a.rows.split(",")):
        x = torch.randn(B, V, device=dev) * 3
        temp = torch.ones(B, device=dev)
        seeds, idx = torch.arange(B, device=dev), torch.zeros(B, dtype=torch.int64, device=dev)
        for top_k, top_p, min_p in CASES:
            k = torch.full((B,), top_k, dtype=torch.int64, device=dev)
            p = torch.full((B,), top_p, device=dev)
            mp = torch.full((B,), min_p, device=dev)

            def filtered() -> torch.Tensor:  # the torch filters, as the sampler's torch route applies them
                z = x / temp[:, None]
                if top_k or top_p < 1:
                    z = _apply_top_k_top_p(z, k, p, top_k > 0, top_p < 1)
                return _apply_min_p(z, mp) if min_p else z

            read = torch.full((B,), -V, dtype=torch.int32, device=dev)  # (-1 rows: a kernel that cannot count)
            try:
                cut = sampling.filter_cut(x, temp, k, p, mp, SAMPLING_EPS, read=read)
            except TypeError:  # an earlier kernel (0eb43f6 and before), timed against this one: no read=
                cut = sampling.filter_cut(x, temp, k, p, mp, SAMPLING_EPS)
            z = x / temp[:, None]
            kept = (z >= cut.thr[:, None]) & (torch.exp(z - cut.top[:, None]) >= mp[:, None])
            same = bool(torch.equal(kept, torch.isfinite(filtered())))
            t_cut = timed(lambda: sampling.filter_cut(x, temp, k, p, mp, SAMPLING_EPS), dev)
            g_cut = graphed(lambda: sampling.filter_cut(x, temp, k, p, mp, SAMPLING_EPS), dev)
            t_new = timed(lambda: sampling.sample_rows(
                x, temp, seeds, idx, SAMPLING_EPS, cut=sampling.filter_cut(x, temp, k, p, mp, SAMPLING_EPS)), dev)
            t_old = timed(lambda: sampling.sample_rows(x, temp, seeds, idx, SAMPLING_EPS, filtered()), dev)
            print(f"B={B} top_k={top_k} top_p={top_p} min_p={min_p}: same={same} kept/row={kept.sum().item() / B:.1f} "
                  f"reads/row={read.double().mean().item() / V:.2f} rows, "
                  f"cut {t_cut:.3f} ms ({g_cut * 1e3:.1f} us on the GPU), cut+draw {t_new:.3f} ms, "
                  f"torch filters+draw {t_old:.3f} ms", flush=True)
        if a.sweep and dev == "cuda":
            sweep(x, temp, V, dev)


SHAPES = ("_CUT_SPLIT", "_CUT_WIDE_PIVOTS", "_CUT_WIDE_BLOCK", "_CUT_PIVOTS")


def sweep(x: torch.Tensor, temp: torch.Tensor, V: int, dev: str) -> None:
    """The cut per call over its launch shapes (the module's constants: columns a program of the row-wide
    passes, the pivot pass's pivots and block, the finishing search's pivots); fastest first."""
    B = x.shape[0]
    today = tuple(getattr(sampling, c) for c in SHAPES)
    for top_k, top_p in ((0, 0.7), (20, 0.9)):
        k = torch.full((B,), top_k, dtype=torch.int64, device=dev)
        p = torch.full((B,), top_p, device=dev)
        mp = torch.zeros(B, device=dev)
        rows = []
        for shape in itertools.product((1024, 2048, 4096), (8, 16, 32), (128, 256), (8,)):
            for c, v in zip(SHAPES, shape):
                setattr(sampling, c, v)
            rows.append((graphed(lambda: sampling.filter_cut(x, temp, k, p, mp, SAMPLING_EPS), dev), shape))
        for c, v in zip(SHAPES, today):
            setattr(sampling, c, v)
        now = next(ms for ms, shape in rows if shape == today)
        rows.sort()
        print(f"B={B} top_k={top_k} top_p={top_p}, ms on the GPU: today's shape {now:.3f}; fastest "
              + ", ".join(f"{ms:.3f} ms (split {sp}, wide pivots {wp}, wide block {wb})" for ms, (sp, wp, wb, _) in
                          rows[:5]), flush=True)


if __name__ == "__main__":
    main()
