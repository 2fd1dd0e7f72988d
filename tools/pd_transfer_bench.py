"""KV transfer micro-benchmark for prefill/decode disaggregation: bandwidth and overlap per chunk size.

    python3 tools/pd_transfer_bench.py --transport cuda_ipc --out OUT/transfer.json     # one GPU, two processes
    python3 tools/pd_transfer_bench.py --transport gloo --chunk-tokens 16,64 --layers 2  # the CPU form

Two processes, as a prefill and a decode worker are: the sender exports a chunk's KV pages
(``[2, layers, planes * pages, block_size, kv_heads, head_dim]``, Ouro-1.4B's shape by default:
24 layers, 16 KV heads of 128, bf16, 4 planes for ``last_exited``) through the transport
(``loopline.distributed.kv_transfer``, the code the workers run), the receiver gets it through the
same call the decode worker makes, and tells the sender over a pipe. Per chunk size it reports

* ``bandwidth_gbs``: bytes / (send -> received) time, median of ``--repeats``;
* ``overlap``: how much of the transfer hides behind compute on the receiver (the decode
  worker's steps): a matmul loop of about the transfer's length runs alone, the transfer runs
  alone, then both at once; overlap = (t_compute + t_transfer - t_both) / min(t_compute, t_transfer)
  (1: fully hidden, 0: serialized).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp


def _shape(a: argparse.Namespace, tokens: int) -> tuple[int, ...]:
    pages = -(-tokens // a.block_size)
    return (2, a.layers, a.planes * pages, a.block_size, a.kv_heads, a.head_dim)


def _compute(device: torch.device, iters: int, size: int) -> float:
    """A stand-in for the decode worker's steps: ``iters`` matmuls on the default stream; returns seconds."""
    x = torch.randn(size, size, device=device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    t0 = time.perf_counter()
    for _ in range(iters):
        x = torch.tanh(x @ x * (1.0 / size))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _receiver(a: argparse.Namespace, conn, init_method: str) -> None:
    from loopline.distributed.kv_transfer import make_transport
    device = torch.device(a.device)
    torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    transport = make_transport(a.transport, 60.0)
    transport.start(1, 2, init_method, device)
    dtype = getattr(torch, a.dtype)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        kind, payload, shape, tag, iters = msg
        if kind == "compute":
            conn.send(("computed", _compute(device, iters, a.matmul_size)))
            continue
        t0 = time.perf_counter()
        future = transport.recv(payload, shape, dtype, 0, tag)
        compute_s = _compute(device, iters, a.matmul_size) if iters else 0.0
        out = future.result()
        t_both = time.perf_counter() - t0
        conn.send(("received", t_both, compute_s, float(out.view(-1)[:8].float().sum())))
    transport.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="cuda_ipc", choices=["gloo", "nccl", "cuda_ipc", "nixl"])
    ap.add_argument("--device", default=None, help="default: cuda:0 when available, else cpu")
    ap.add_argument("--chunk-tokens", default="64,256,1024,4096", help="prompt tokens per chunk (comma list)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--planes", type=int, default=4, help="4: last_exited (R=4 loops), 1: shared")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--matmul-size", type=int, default=None, help="compute stand-in size (default 4096 GPU, 256 CPU)")
    ap.add_argument("--out", default=None, help="write the record as JSON here")
    a = ap.parse_args()
    a.device = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    a.matmul_size = a.matmul_size or (4096 if a.device.startswith("cuda") else 256)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from loopline.distributed.kv_transfer import make_transport
    from loopline.distributed.worker_pool import free_port
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(a, child, init_method), daemon=True)
    proc.start()
    transport = make_transport(a.transport, 60.0)
    transport.start(0, 2, init_method, device)
    dtype = getattr(torch, a.dtype)
    tag = 0

    def transfer(tokens: int, iters: int) -> tuple[float, float]:
        nonlocal tag
        tag += 1
        kv = torch.randn(_shape(a, tokens), device=device, dtype=torch.float32).to(dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        payload, sent = transport.send(kv, 1, tag)
        conn.send(("transfer", payload, tuple(kv.shape), tag, iters))
        reply = conn.recv()
        sent.result()
        return time.perf_counter() - t0, reply[2]

    rows = []
    transfer(int(a.chunk_tokens.split(",")[0]), 0)  # warm-up (group, IPC, allocator)
    for tokens in (int(t) for t in a.chunk_tokens.split(",")):
        nbytes = torch.empty(_shape(a, tokens), dtype=dtype, device="meta").numel() * torch.empty(0, dtype=dtype).element_size()
        t_transfer = statistics.median(transfer(tokens, 0)[0] for _ in range(a.repeats))
        # a compute loop of about the transfer's length on the receiver
        conn.send(("compute", None, None, 0, 8))
        per_iter = conn.recv()[1] / 8
        iters = max(1, round(t_transfer / per_iter))
        computes, boths = [], []
        for _ in range(a.repeats):
            conn.send(("compute", None, None, 0, iters))
            computes.append(conn.recv()[1])
            boths.append(transfer(tokens, iters)[0])
        t_compute, t_both = statistics.median(computes), statistics.median(boths)
        overlap = (t_compute + t_transfer - t_both) / min(t_compute, t_transfer)
        row = {"chunk_tokens": tokens, "bytes": nbytes, "transfer_ms": t_transfer * 1e3,
               "bandwidth_gbs": nbytes / t_transfer / 1e9, "compute_ms": t_compute * 1e3, "both_ms": t_both * 1e3,
               "overlap": max(0.0, min(1.0, overlap))}
        rows.append(row)
        print(f"{tokens:6d} tok {nbytes / 2**20:9.1f} MiB  {row['transfer_ms']:8.2f} ms  {row['bandwidth_gbs']:7.2f} GB/s  "
              f"overlap {row['overlap']:.2f} (compute {row['compute_ms']:.2f} ms, both {row['both_ms']:.2f} ms)", flush=True)
    conn.send(None)
    proc.join(30)
    transport.close()
    record = {"transport": a.transport, "device": str(device), "dtype": a.dtype,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "shape": {"layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "planes": a.planes,
                        "block_size": a.block_size}, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
