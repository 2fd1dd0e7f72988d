"""Would a mixed step run faster with its decode rows and its prompt chunk on two halves of the chip? (GPU)

python3 tools/split_step_probe.py [--sms 48,64,80] [--chunks 1024,2048,4096,8192] [--rows 128] [--context 1024]
                                  [--blas cublaslt|cublas] [--disjoint] [--green-check]

The design this tests: one engine step, two sub-forwards. The decode rows (``--rows`` tokens over
``--context`` keys) run their 24 layers on a CUDA green context of N SMs while a prompt chunk of C tokens
runs its 24 layers on the rest of the chip (cuBLAS told to leave N SMs out, so its GEMM grids fit the
rest). The step ends when both have. Against it: the engine's mixed step on the whole chip, where every
layer's GEMMs take the decode rows and the chunk together and the two attention launches run one after
the other.

Per layer: the four projection GEMMs of Ouro-1.4B (qkv, o, gate/up, down) and attention (the engine's
Triton launches: decode rows over paged 1K histories; the chunk as C / 1,024 prompts of 1,024 tokens with
their work list). Norms, rotary and SwiGLU are left out (on the whole chip they are ~10% of a mixed step),
so is the decode step's own traffic beyond attention and weights. Weights cycle through four copies and
K/V through four pools so that layers do not hit in L2.

``--disjoint`` confines the chunk too: the driver API splits the SMs once into N and the rest, and each
half runs on a green context of its own (``disjoint_streams``), so neither half's blocks can land on the
other's SMs. ``--green-check`` asks instead whether two green contexts made one after the other get disjoint SMs (so
that both halves could be confined): a compute-bound kernel filling each, alone and both at once.

Prints, per (N, C): the whole-chip mixed step, the decode half alone on N SMs, the chunk alone on the rest,
both at once, and the split step's time as a fraction of the whole-chip one (below 1: the split wins).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))

from overlap_probe import HIDDEN, INTER, decode_case, fork, green_stream, layer_weights, timed  # noqa: E402

from loopline.attention.bench_attention import make_step, with_work  # noqa: E402
from loopline.attention.triton_backend import TritonAttentionBackend  # noqa: E402

LAYERS, COPIES = 24, 4
SCALE = 128 ** -0.5


def disjoint_streams(num_sms: int) -> tuple[torch.cuda.ExternalStream, torch.cuda.ExternalStream, int]:
    """Streams of two green contexts on *disjoint* SMs, ``num_sms`` and the rest, by the driver API.

    ``GreenContext.create`` splits the whole device each time, so its contexts share SMs (``--green-check``);
    this splits once and keeps the remainder. Returns (first stream, rest stream, SMs of the rest)."""
    import ctypes

    torch.cuda.init()
    cu = ctypes.CDLL("libcuda.so.1")

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    resource = lambda: (ctypes.c_ubyte * 144)()  # noqa: E731  CUdevResource (CUDA 12.4+ ABI v1: 4 + 92 + 48 bytes)
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
    whole, group, rest = resource(), resource(), resource()
    check(cu.cuDeviceGetDevResource(dev, whole, 1), "cuDeviceGetDevResource")  # CU_DEV_RESOURCE_TYPE_SM
    groups = ctypes.c_uint(1)
    check(cu.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), whole, rest, 0, num_sms),
          "cuDevSmResourceSplitByCount")
    streams = []
    for res in (group, rest):
        desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(cu.cuDevResourceGenerateDesc(ctypes.byref(desc), res, 1), "cuDevResourceGenerateDesc")
        check(cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, 1), "cuGreenCtxCreate")  # default stream
        check(cu.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, 1, 0), "cuGreenCtxStreamCreate")  # non-blocking
        streams.append(torch.cuda.ExternalStream(stream.value))
    rest_sms = int.from_bytes(bytes(rest[96:100]), "little")  # CUdevSmResource.smCount
    return streams[0], streams[1], rest_sms


def green_check() -> None:
    """The ``--green-check`` measurement (see the module docstring)."""
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out, ITERS: tl.constexpr):
        x = tl.arange(0, 128).to(tl.float32) + tl.program_id(0)
        y = x * 0.5
        for _ in range(ITERS):
            x = x * 1.0000001 + y
            y = y * 0.9999999 - x * 1e-7
        tl.store(out + tl.program_id(0) * 128 + tl.arange(0, 128), x + y)

    def filler(n: int):
        out = torch.empty(n * 8 * 128, device="cuda")
        return lambda: spin[(n * 8,)](out, ITERS=20000, num_warps=4)  # 8 programs of 4 warps per SM

    def pair(label: str, a: torch.cuda.Stream, b: torch.cuda.Stream, na: int, nb: int) -> None:
        fa, fb = filler(na), filler(nb)
        t_a, t_b = timed(lambda: fork(a, fa), 5), timed(lambda: fork(b, fb), 5)
        t_ab = timed(lambda: fork(a, fa, lambda: fork(b, fb)), 5)
        verdict = "disjoint" if t_ab < 1.3 * max(t_a, t_b) else "the same SMs"
        print(f"{label} {na} and {nb} SMs: alone {t_a:.2f} / {t_b:.2f} ms, both at once {t_ab:.2f} ms ({verdict})",
              flush=True)

    for na, nb in ((64, 64), (48, 80), (32, 96)):
        pair("green contexts of", green_stream(na), green_stream(nb), na, nb)
        a, b, rest = disjoint_streams(na)
        pair("driver split into", a, b, na, rest)


def main() -> None:
    ints = lambda v: [int(n) for n in v.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=ints, default=[48, 64, 80])
    ap.add_argument("--chunks", type=ints, default=[1024, 2048, 4096, 8192])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--green-check", action="store_true", help="only check whether two green contexts share SMs")
    ap.add_argument("--disjoint", action="store_true",
                    help="the chunk on a green context of the other SMs too (driver API split), not the default stream")
    ap.add_argument("--blas", choices=("cublas", "cublaslt"), default="cublaslt",
                    help="torch's BLAS library for every GEMM here (only cuBLASLt honours the SM carveout)")
    a = ap.parse_args()
    if a.green_check:
        return green_check()
    torch.backends.cuda.preferred_blas_library(a.blas)
    dev, bf16 = "cuda", torch.bfloat16
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = [layer_weights() for _ in range(COPIES)]
    backend = TritonAttentionBackend()
    decode_kv = [decode_case(a.rows, a.context) for _ in range(COPIES)]
    # decode side, chunk side (None: the chunk runs on the default stream, free to use any SM)
    streams = {n: disjoint_streams(n)[:2] if a.disjoint else (green_stream(n), None) for n in a.sms}

    def layers(tokens: int, attend) -> Callable[[], None]:
        """24 layers' GEMMs for ``tokens`` rows, with ``attend(layer)`` after each qkv projection."""
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
        act = torch.randn(tokens, INTER, device=dev, dtype=bf16)

        def run() -> None:
            for layer in range(LAYERS):
                w = weights[layer % COPIES]
                torch.nn.functional.linear(x, w[0])
                attend(layer)
                torch.nn.functional.linear(x, w[1])
                torch.nn.functional.linear(x, w[2])
                torch.nn.functional.linear(act, w[3])
        return run

    def decode_attention(layer: int) -> None:
        q, k, v, meta = decode_kv[layer % COPIES]
        backend.attend(q, k, v, meta, SCALE)

    for chunk in a.chunks:
        prompts = [(1024, 1024)] * max(1, chunk // 1024)
        pools = []
        for _ in range(COPIES):
            pq, pk, pv, pmeta = make_step(prompts)
            pools.append((pq, pk, pv, with_work(pmeta, prompts, backend)))

        def prefill_attention(layer: int) -> None:
            pq, pk, pv, pmeta = pools[layer % COPIES]
            backend.attend(pq, pk, pv, pmeta, SCALE)

        def both_attentions(layer: int) -> None:
            decode_attention(layer)
            prefill_attention(layer)

        whole = timed(layers(a.rows + chunk, both_attentions), a.reps)
        decode, prefill = layers(a.rows, decode_attention), layers(chunk, prefill_attention)
        torch.backends.cuda.preferred_blas_library("cublas")  # what the engine runs
        whole_cublas = timed(layers(a.rows + chunk, both_attentions), a.reps)
        torch.backends.cuda.preferred_blas_library(a.blas)
        print(f"chunk {chunk:5d}: whole-chip step {whole:.2f} ms ({whole_cublas:.2f} with default cuBLAS); "
              f"decode half alone {timed(decode, a.reps):.2f}, chunk alone {timed(prefill, a.reps):.2f} ms", flush=True)
        for n in a.sms:
            side, rest = streams[n]
            # cuBLAS sizes its grids by the carveout: the decode GEMMs for the n SMs they run on, the
            # chunk's for the rest. Both are set before each launch, from this one host thread.
            def decode_side(n=n) -> None:
                torch._C._set_sm_carveout_experimental(total_sms - n)
                decode()

            def prefill_main(n=n, rest=rest) -> None:
                torch._C._set_sm_carveout_experimental(n)
                if rest is None:
                    prefill()
                else:
                    fork(rest, prefill)

            try:
                t_dec = timed(lambda: fork(side, decode_side), a.reps)
                t_pre = timed(prefill_main, a.reps)
                t_both = timed(lambda: fork(side, decode_side, prefill_main), a.reps)
            finally:
                torch._C._set_sm_carveout_experimental(None)
            print(f"chunk {chunk:5d}, decode on {n:3d} SMs: whole-chip step {whole:7.2f} ms; decode half alone "
                  f"{t_dec:6.2f}, chunk alone on the rest {t_pre:6.2f}, both {t_both:6.2f} ms: "
                  f"{t_both / whole:.2f} of the whole-chip step", flush=True)


if __name__ == "__main__":
    main()
