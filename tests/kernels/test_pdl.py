"""Programmatic dependent launch: the kernels that launch early must wait before they depend on anything.

A kernel launched with PDL may start while the kernel before it still runs, so every program has to
pass ``griddepcontrol.wait`` before it reads an activation, writes, or returns. The CPU interpreter
cannot run the GDC instructions, so these tests compile the kernels for an H100/H200 (sm_90) on the
CPU and read the order of the instructions in the PTX.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton_testing  # noqa: F401  (first: sets up the interpreter for the kernel tests sharing this process)

pytest.importorskip("triton")
if getattr(pytest.importorskip("triton.language.extra.cuda"), "gdc_wait", None) is None:
    pytest.skip("this triton has no grid dependency control, so kernels never launch with PDL",
                allow_module_level=True)

WAIT = "griddepcontrol.wait"
_ATTN_POINTERS = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32",
                  "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "work_tiles_ptr": "*i32"}
_G = {"BLOCK_N": 4, "BLOCK_K": 256, "EVEN_K": True}
_SKINNY = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN_K": True, "PRECISION": "tf32"}
_DECODE_POINTERS = {**_ATTN_POINTERS, "slot_mapping_ptr": "*i64", "arrivals_ptr": "*i32"}
_DECODE = {"G": 2, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "D_PAD": 64, "NUM_SPLITS": 2,
           "SPLITS_PAD": 2, "DOT_PRECISION": "tf32", "LAST_MERGES": False}
# name: (module, kernel, pointer types (default *bf16), constexprs, PDL)
CASES = {
    "gemv": ("loopline.kernels.gemv", "_gemv_kernel", {"needed_ptr": "*i8"},
             {**_G, "SILU": False, "PREDICATED": False}, True),
    "gemv_silu": ("loopline.kernels.gemv", "_gemv_kernel", {"needed_ptr": "*i8"},
                  {**_G, "SILU": True, "PREDICATED": False}, True),
    "gemv_predicated": ("loopline.kernels.gemv", "_gemv_kernel", {"needed_ptr": "*i8"},
                        {**_G, "SILU": False, "PREDICATED": True}, True),
    "gemv_no_pdl": ("loopline.kernels.gemv", "_gemv_kernel", {"needed_ptr": "*i8"},
                    {**_G, "SILU": False, "PREDICATED": False}, False),
    "norm_gemv": ("loopline.kernels.gemv", "_norm_gemv_kernel", {},
                  {"BLOCK_N": 4, "BLOCK_K": 256, "EVEN_K": True, "HAS_BRANCH": True}, True),
    "skinny": ("loopline.kernels.skinny_gemm", "_skinny_kernel", {}, _SKINNY, True),
    "skinny_no_pdl": ("loopline.kernels.skinny_gemm", "_skinny_kernel", {}, _SKINNY, False),
    "split_k_reduce": ("loopline.kernels.skinny_gemm", "_split_k_reduce_kernel", {"ws_ptr": "*fp32"},
                       {"SPLIT_K": 2, "BLOCK": 1024}, True),
    "add_rms_norm": ("loopline.kernels.fused", "_add_rms_norm_kernel", {},
                     {"BLOCK": 256, "HAS_BRANCH": True, "SPLITS": 0}, True),
    # the branch as split-K partials (TritonOps(split_sums_in_norm=True))
    "add_rms_norm_splits": ("loopline.kernels.fused", "_add_rms_norm_kernel", {"b_ptr": "*fp32"},
                            {"BLOCK": 256, "HAS_BRANCH": True, "SPLITS": 4}, True),
    "norm_exit_gate": ("loopline.kernels.fused", "_norm_exit_gate_kernel", {"gate_ptr": "*fp32"},
                       {"BLOCK": 256, "HAS_BRANCH": True, "SPLITS": 0, "HAS_BIAS": True}, True),
    "norm_exit_gate_splits": ("loopline.kernels.fused", "_norm_exit_gate_kernel",
                              {"gate_ptr": "*fp32", "b_ptr": "*fp32"},
                              {"BLOCK": 256, "HAS_BRANCH": True, "SPLITS": 4, "HAS_BIAS": True}, True),
    "rope_write_kv": ("loopline.attention.triton_kernels", "rope_write_kv_kernel", {"slot_mapping_ptr": "*i64"},
                      {"BLOCK_SIZE": 16, "HALF": 32, "HALF_PAD": 32, "BLOCK_H": 4, "ROTATE": True}, True),
    "write_kv": ("loopline.attention.triton_kernels", "rope_write_kv_kernel", {"slot_mapping_ptr": "*i64"},
                 {"BLOCK_SIZE": 16, "HALF": 32, "HALF_PAD": 32, "BLOCK_H": 4, "ROTATE": False}, True),
    "merge_splits": ("loopline.attention.triton_kernels", "merge_splits_kernel",
                     {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"},
                     {"NUM_SPLITS": 4, "SPLITS_PAD": 4, "HEAD_DIM": 64, "D_PAD": 64}, True),
    "paged_attention": ("loopline.attention.triton_kernels", "paged_attention_kernel", _ATTN_POINTERS,
                        {"G": 2, "TILE_T": 8, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_SIZE": 16, "HEAD_DIM": 64,
                         "D_PAD": 64, "NUM_SPLITS": 2, "DOT_PRECISION": "tf32", "WORK_LIST": True}, True),
    "mha_decode": ("loopline.attention.triton_kernels", "mha_decode_kernel",
                   {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "seq_lens_ptr": "*i32",
                    "block_tables_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"},
                   {"BLOCK_N": 16, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "D_PAD": 64, "NUM_SPLITS": 2, "LANES": False},
                   True),
    "mha_decode_lanes": ("loopline.attention.triton_kernels", "mha_decode_kernel",
                         {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "seq_lens_ptr": "*i32",
                          "block_tables_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"},
                         {"BLOCK_N": 16, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "D_PAD": 64, "NUM_SPLITS": 1, "LANES": True},
                         True),
    "decode_attention": ("loopline.attention.triton_kernels", "decode_attention_kernel", _DECODE_POINTERS,
                         {**_DECODE, "PREFETCH": False}, True),
    "decode_attention_prefetch": ("loopline.attention.triton_kernels", "decode_attention_kernel", _DECODE_POINTERS,
                                  {**_DECODE, "PREFETCH": True}, True),
    # the last split merges (DecodeLaunch(last_split_merges=True)): its arrival counter after the wait only
    "decode_attention_last_merges": ("loopline.attention.triton_kernels", "decode_attention_kernel",
                                     _DECODE_POINTERS, {**_DECODE, "PREFETCH": True, "LAST_MERGES": True}, True),
    # the lookahead exit rule in one kernel (exit_mode="lookahead")
    "lookahead_decide": ("loopline.kernels.lookahead", "_decide_kernel",
                         {**{f"{n}_ptr": "*fp32" for n in ("h", "prev", "gate", "cdf", "thr", "scal", "bias", "out_w",
                                                           "out_b", "probs")},
                          **{f"{n}_ptr": "*i64" for n in ("loop", "pos", "min", "max", "target", "out", "slots",
                                                          "tindex", "depths", "last")}},
                         {"W": 32, "BLOCK": 32, "LOOPS": 4, "REPLAY": True, "PROBS": True}, True),
    # the small kernels around the layers: the exit rule, the exit copy, the greedy choice and the advance
    "exit_and_store": ("loopline.worker.triton_slot_ops", "_exit_and_store_kernel",
                       {"gate_ptr": "*fp32", "slots_ptr": "*i64", "loops_ptr": "*i64", "min_ptr": "*i64",
                        "max_ptr": "*i64", "thr_ptr": "*fp32", "hidden_s": "*bf16", "survival_s": "*fp32",
                        "ex_out": "*i8"}, {"BLOCK": 256}, True),
    "pipe_finish": ("loopline.worker.triton_slot_ops", "_pipe_finish_kernel",
                    {**{f"{n}_ptr": "*i64" for n in ("slots", "lane", "loop", "min", "max")}, "gate_ptr": "*fp32",
                     "live_ptr": "*i8", "thr_ptr": "*fp32", "hidden_r": "*bf16", "surv_r": "*fp32", "loop_r": "*i64",
                     "exit_r": "*i64", "ex_out": "*i8"}, {"BLOCK": 256}, True),
    "copy_exited": ("loopline.attention.triton_kernels", "copy_exited_kernel",
                    {"plane_slots_ptr": "*i64", "loops_ptr": "*i64", "exits_ptr": "*i8"},
                    {"BLOCK_SIZE": 16, "HEAD_DIM": 64, "D_PAD": 64, "BLOCK_H": 4}, True),
    "chunk_argmax": ("loopline.kernels.sampling", "_chunk_argmax_kernel",
                     {"x_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32"}, {"CHUNK": 2048},
                     True),
    "pick_chunk": ("loopline.kernels.sampling", "_pick_chunk_kernel",
                   {"val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32", "out_ptr": "*i64"}, {"CHUNKS_PAD": 32},
                   True),
    "advance": ("loopline.worker.triton_slot_ops", "_advance_kernel",
                {**{f"{n}_ptr": "*i64" for n in ("loop", "token", "pos", "tidx", "slots", "loops", "sampled", "record")},
                 "run_ptr": "*i8", "exited_ptr": "*i8"}, {"BLOCK": 128, "RECORD": True}, True),
}


def compile_cases() -> dict[str, list[str]]:
    """Each case's memory, return and grid-dependency instructions in PTX order, compiled for sm_90
    (runtime ints i32, ``qk_scale`` / ``eps`` fp32). Needs the kernels as compiled (not interpreted)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for name, (module, attr, pointers, constants, pdl) in CASES.items():
        kernel = getattr(importlib.import_module(module), attr)
        signature = {}
        for arg in kernel.arg_names:
            if arg in constants or arg == "PDL":
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr") or arg in pointers:
                signature[arg] = pointers.get(arg, "*bf16")
            else:
                signature[arg] = "fp32" if arg in ("qk_scale", "eps", "inv_log_max_pos") else "i32"
        src = ASTSource(fn=kernel, signature=signature, constexprs={**constants, "PDL": pdl})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "num_stages": 2, "launch_pdl": pdl}).asm["ptx"]
        out[name] = [x.strip() for x in ptx.splitlines()
                     if re.search(r"griddepcontrol|\b(ld|st|atom|red)\.global|\bret;", x)]
    return out


@pytest.fixture(scope="module")
def ptx() -> dict[str, list[str]]:
    # A fresh process: kernels imported under TRITON_INTERPRET=1 (the CPU kernel tests) cannot be compiled.
    code = ("import json, sys; sys.path[:0] = sys.argv[1:]; import test_pdl; "
            "print(json.dumps(test_pdl.compile_cases()))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    here = Path(__file__).parent
    run = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent)], env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _check_waits_first(lines: list[str], prefetch: tuple[str, ...] | str | None = None) -> None:
    """No store, atomic or return before the wait; loads before it only of the ``prefetch`` kinds."""
    wait = next((i for i, x in enumerate(lines) if WAIT in x), None)
    assert wait is not None, "no griddepcontrol.wait"
    before = lines[:wait]
    assert not [x for x in before if re.search(r"\b(st|atom|red)\.global|\bret;", x)], "writes before the wait"
    loads = [x for x in before if "ld.global" in x]
    if prefetch is None:
        assert not loads, f"loads before the wait: {loads[:2]}"
    else:
        kinds = (prefetch,) if isinstance(prefetch, str) else prefetch
        assert loads and all(any(k in x for k in kinds) for x in loads), "the prefetch is missing or reads other data"


@pytest.mark.parametrize("case", ["gemv", "gemv_silu", "norm_gemv"])
def test_gemv_prefetches_only_weights_before_the_wait(ptx, case):
    # Weight loads carry evict_first; the row (written by the kernel before) is read after the wait.
    _check_waits_first(ptx[case], prefetch="evict_first")


def test_predicated_gemv_reads_nothing_before_the_wait(ptx):
    # The coda must not stream the vocabulary projection for a token that does not exit.
    _check_waits_first(ptx["gemv_predicated"])


def test_without_pdl_no_grid_dependency_control(ptx):
    for case in ("gemv_no_pdl", "skinny_no_pdl"):
        assert ptx[case] and not any("griddepcontrol" in x for x in ptx[case]), case


def test_skinny_gemm_prefetches_its_first_weight_tile_only(ptx):
    # Before the wait: the first K tile of the weight (evict_first); the token rows after it, then the loop.
    _check_waits_first(ptx["skinny"], prefetch="evict_first")
    after = ptx["skinny"][[WAIT in x for x in ptx["skinny"]].index(True):]
    assert any("ld.global" in x and "evict" not in x for x in after)  # the rows, after the wait
    # The split-K reduction reads only partials the skinny kernel wrote.
    _check_waits_first(ptx["split_k_reduce"])


def test_decode_attention_prefetches_only_history_before_the_wait(ptx):
    # Before its wait the fused decode kernel reads the row's length (evict_last), its block table and the
    # K/V of earlier steps (evict_first); q, k, v of this step and the cos/sin rows come after it.
    _check_waits_first(ptx["decode_attention_prefetch"], prefetch=("evict_first", "evict_last"))
    after = ptx["decode_attention_prefetch"][[WAIT in x for x in ptx["decode_attention_prefetch"]].index(True):]
    assert any("ld.global" in x and "evict" not in x for x in after)  # the activations, after the wait
    # Without the prefetch (large batches) only the row's length is read before the wait.
    _check_waits_first(ptx["decode_attention"], prefetch=("evict_last",))


@pytest.mark.parametrize("case", ["add_rms_norm", "add_rms_norm_splits", "norm_exit_gate", "norm_exit_gate_splits",
                                  "rope_write_kv", "write_kv", "merge_splits",
                                  "paged_attention", "mha_decode", "mha_decode_lanes", "exit_and_store", "pipe_finish", "copy_exited", "chunk_argmax",
                                  "pick_chunk", "advance", "lookahead_decide"])
def test_kernels_wait_before_everything(ptx, case):
    _check_waits_first(ptx[case])


def test_pdl_options_off_without_a_hopper_gpu(monkeypatch):
    from loopline.kernels import pdl_options

    assert pdl_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    if torch.cuda.is_available():
        monkeypatch.setenv("LOOPLINE_PDL", "0")
        assert pdl_options(torch.device("cuda")) == {"PDL": False, "launch_pdl": False}
