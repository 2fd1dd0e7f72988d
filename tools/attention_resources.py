"""What the decode attention kernels compile to on an H100/H200 (sm_90), without a GPU.

TRITON_INTERPRET=0 python3 tools/attention_resources.py [--kv bf16|fp8] [--kernel paged|fused|mha] [LAUNCH ...]

LAUNCH is ``BLOCK_N,WARPS,STAGES`` (paged: e.g. 64,4,2 32,4,4; fused: BLOCK_N,WARPS,STAGES,SPLITS; mha:
BLOCK_N,WARPS,LANES). Compiles the kernel as a decode-only step launches it (one query per row, 16-row query
tile, 16 KV heads of 128, 16-token pages; integer arguments marked divisible by 16 the way Triton specializes
them at launch) and prints, per launch: registers per thread (``cuobjdump`` from Triton's own CUDA tools),
spilled bytes, shared memory per program, how many programs fit on one SM by each resource, and (paged) how deep
the pipeliner buffers the K/V tiles (``memdesc<N x ...>`` in the TTGIR: 1 means each program loads, waits, then
computes). ``paged_attention_kernel`` is the unsplit (and split) launch of 32-128 rows, ``decode_attention_kernel``
the fused launch of 1-8 rows, ``mha_decode_kernel`` the CUDA-core one. Under Triton 3.6 (the device image's)
these matched Nsight Compute on an H200 (114 registers, 38.9 KB at bf16 64,4,2); other Triton versions allocate
differently (3.8: 106), so run it with 3.6 (``pip install --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR``).
The shared-memory count assumes the whole 228 KB: the driver may configure less per SM (ncu showed 168 KB).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from sm90 import sm_limits  # (tools/, beside this script)
from triton.compiler import ASTSource

from loopline.attention import triton_kernels as tk

_POINTERS = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32", "arrivals_ptr": "*i32",
             "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "work_tiles_ptr": "*i32", "slot_mapping_ptr": "*i64",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
_NOT_SPECIALIZED = ("num_work_tiles", "num_tokens", "stride_bt", "qk_scale", "num_heads")
DEFAULTS = {"paged": ["64,4,2", "64,4,3", "32,4,4", "128,8,2"], "fused": ["64,4,1,20", "128,4,1,10"],
            "mha": ["16,1,0", "16,2,1"]}


def _compile(kernel, constexprs: dict, kv: str, warps: int, stages: int):
    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("k_cache_ptr", "v_cache_ptr"):
            signature[arg] = {"bf16": "*bf16", "fp8": "*fp8e4nv"}[kv]
        elif arg.endswith("_ptr"):
            signature[arg] = _POINTERS.get(arg, "*bf16")
        else:
            signature[arg] = "fp32" if arg == "qk_scale" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
             if signature[arg] != "constexpr" and arg not in _NOT_SPECIALIZED}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "launch_pdl": True})


def compile_launch(kernel: str, launch: str, kv: str):
    """``(compiled, warps)`` of one launch of ``kernel`` (paged / fused / mha) over ``kv`` pages."""
    values = [int(v) for v in launch.split(",")]
    common = {"BLOCK_N": values[0], "BLOCK_SIZE": 16, "HEAD_DIM": 128, "D_PAD": 128, "PDL": True}
    if kernel == "paged":
        block_n, warps, stages = values
        constexprs = {**common, "G": 1, "TILE_T": 16, "BLOCK_M": 16, "NUM_SPLITS": 1, "DOT_PRECISION": "tf32",
                      "WORK_LIST": False}
        return _compile(tk.paged_attention_kernel, constexprs, kv, warps, stages), warps
    if kernel == "fused":
        block_n, warps, stages, splits = values
        constexprs = {**common, "G": 1, "BLOCK_M": 16, "NUM_SPLITS": splits,
                      "SPLITS_PAD": triton.next_power_of_2(splits), "DOT_PRECISION": "tf32", "PREFETCH": splits > 1,
                      "LAST_MERGES": False}
        return _compile(tk.decode_attention_kernel, constexprs, kv, warps, stages), warps
    block_n, warps, lanes = values
    constexprs = {**common, "NUM_SPLITS": 1, "LANES": bool(lanes)}
    return _compile(tk.mha_decode_kernel, constexprs, kv, warps, 1), warps


def resources(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and spilled (stack) bytes of a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    return int(re.search(r"REG:(\d+)", out.stdout).group(1)), int(re.search(r"STACK:(\d+)", out.stdout).group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--kernel", choices=tuple(DEFAULTS), default="paged")
    ap.add_argument("launches", nargs="*")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, {a.kernel} kernel over {a.kv} pages, sm_90")
    for launch in a.launches or DEFAULTS[a.kernel]:
        compiled, warps = compile_launch(a.kernel, launch, a.kv)
        regs, spilled = resources(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        allocs = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+x", compiled.asm["ttgir"])
        limits = sm_limits(regs, shared, warps)
        print(f"{launch:>11}: {regs} registers, {spilled} B spilled, {shared / 1024:.1f} KB shared, programs per SM "
              f"{limits['registers']} by registers / {limits['shared']} by shared memory / "
              f"{min(limits['warps'], limits['blocks'])} by warps and blocks, K/V buffers "
              f"{max(map(int, allocs), default=1)}")


if __name__ == "__main__":
    main()
