"""What the decode attention launch compiles to on an H100/H200 (sm_90), without a GPU.

TRITON_INTERPRET=0 python3 tools/attention_resources.py [BLOCK_N,WARPS,STAGES ...]   e.g. 64,4,2 32,4,4

Compiles ``paged_attention_kernel`` as a 128-row decode-only step launches it (one query per row, 16-row
query tile, 16 KV heads of 128, 16-token pages, bf16; integer arguments marked divisible by 16 the way
Triton specializes them at launch) and prints, per launch: registers per thread (``cuobjdump`` from
Triton's own CUDA tools), shared memory per program, how many programs fit on one SM by each, and how
deep the pipeliner buffers the K/V tiles (``memdesc<N x ...>`` in the TTGIR: 1 means each program loads,
waits, then computes). Under Triton 3.6 (the device image's) these matched Nsight Compute on an H200
(114 registers, 38.9 KB at 64,4,2); other Triton versions allocate differently. The shared-memory count
assumes the whole 228 KB: the driver may configure less per SM (ncu showed 168 KB, hence 4 programs).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loopline.attention.triton_kernels import paged_attention_kernel

_POINTERS = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32",
             "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "work_tiles_ptr": "*i32"}
_NOT_SPECIALIZED = ("num_work_tiles", "num_tokens", "stride_bt", "qk_scale", "num_heads")
SM_REGISTERS, SM_SHARED, SM_WARPS = 65536, 228 * 1024, 64


def compile_launch(block_n: int, warps: int, stages: int):
    kernel = paged_attention_kernel
    constexprs = {"G": 1, "TILE_T": 16, "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_SIZE": 16, "HEAD_DIM": 128, "D_PAD": 128,
                  "NUM_SPLITS": 1, "DOT_PRECISION": "tf32", "WORK_LIST": False, "PDL": True}
    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = _POINTERS.get(arg, "*bf16")
        else:
            signature[arg] = "fp32" if arg == "qk_scale" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
             if signature[arg] != "constexpr" and arg not in _NOT_SPECIALIZED}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "launch_pdl": True})


def registers(cubin: bytes) -> int:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    return int(re.search(r"REG:(\d+)", out.stdout).group(1))


def main() -> None:
    launches = sys.argv[1:] or ["64,4,2", "64,4,3", "32,4,4", "128,8,2"]
    for launch in launches:
        block_n, warps, stages = (int(v) for v in launch.split(","))
        compiled = compile_launch(block_n, warps, stages)
        regs, shared = registers(compiled.asm["cubin"]), compiled.metadata.shared
        depth = max(int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+x",
                                                compiled.asm["ttgir"]))
        by_regs, by_shared = SM_REGISTERS // (regs * 32 * warps), SM_SHARED // max(shared, 1)
        print(f"{launch:>9}: {regs} registers, {shared / 1024:.1f} KB shared, programs per SM {by_regs} by "
              f"registers / {by_shared} by shared memory / {SM_WARPS // warps} by warps, K/V buffers {depth}")


if __name__ == "__main__":
    main()
