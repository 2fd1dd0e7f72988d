"""Data-parallel replicas on GPUs (Ouro shapes, random bf16 weights): records under OUTDIR.

    python tools/dp_gpu_measure.py OUTDIR [--config ouro-1.4b] [--sizes 1,2,4,8] [--concurrency 64]
    python tools/dp_gpu_measure.py OUTDIR --cpu-smoke          # the same steps, reduced, on the CPU

For each variant, through ``AsyncLLM`` (no HTTP server: the GPU host has no FastAPI):

* ``single``: one engine process (``MPClient``), the baseline;
* ``dp1``: the data-parallel front end over that one engine process (``DPClient``): its routing cost;
* ``dpN`` for each N in ``--sizes`` up to the visible GPUs: N replicas, one per GPU.

(a) **throughput**: a closed loop of ``--num-prompts`` random prompts at ``--concurrency``: output tok/s,
    median TTFT and E2E, and how many requests each replica served;
(b) **exactness**: 4 greedy prompts run one at a time give the same token ids and exit depths as ``single``;
(c) **prefix affinity** (N >= 2): prompts in up to 8 groups that share a 4-page prefix, with prefix caching on;
    the prefix-cache hit rate with the default router against a router that ignores prefixes.

Writes ``OUTDIR/dp_measure.json`` (one record per variant) and prints a summary table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from loopline import AsyncLLM, EngineArgs, SamplingParams
from loopline.distributed.dp import DPClient
from loopline.distributed.launch import make_client
from loopline.distributed.router import LoadAffinityRouter, ReplicaLoad
from loopline.runtime.client import EngineClient, MPClient
from loopline.models.tiny import make_tiny_checkpoint, random_checkpoint_config


class LoadOnlyRouter(LoadAffinityRouter):
    """The default router without prefix affinity (the affinity run's baseline)."""

    def prefix_keys(self, prompt_token_ids):
        return []


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


async def closed_loop(llm: AsyncLLM, ids: list[list[int]], output_len: int, concurrency: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=1.0, seed=0, ignore_eos=True)
    sem = asyncio.Semaphore(concurrency)
    ttft, e2e = [], []

    async def one(i: int, prompt: list[int]) -> int:
        async with sem:
            t0 = time.perf_counter()
            first = None
            async for out in llm.generate({"prompt_token_ids": prompt}, params, f"bench-{i}"):
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
            ttft.append(first)
            e2e.append(time.perf_counter() - t0)
            return len(out.outputs[0].token_ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(ids))))
    wall = time.perf_counter() - t0
    return {"output_tok_s": tokens / wall, "wall_s": wall, "requests": len(ids),
            "ttft_median_s": statistics.median(ttft), "e2e_median_s": statistics.median(e2e)}


async def greedy_alone(llm: AsyncLLM, ids: list[list[int]], output_len: int) -> list[tuple]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    outs = [await llm.generate_tokens(p, params, f"exact-{i}") for i, p in enumerate(ids)]
    return [(o.outputs[0].token_ids, o.outputs[0].exit_depths) for o in outs]


def counting(client: DPClient) -> list[int]:
    """Wraps the client's router so that it counts the requests routed to each replica."""
    counts = [0] * len(client.replicas())
    choose = client.router.choose

    def counted(ids, loads: list[ReplicaLoad]) -> int:
        i = choose(ids, loads)
        counts[i] += 1
        return i

    client.router.choose = counted
    return counts


def measure(name: str, llm: AsyncLLM, client: EngineClient, a: argparse.Namespace, vocab: int,
            exact_ref: list | None) -> dict:
    """One variant's record; ``client`` is the one ``llm`` runs on (its router counts the requests per replica)."""
    counts = counting(client) if isinstance(client, DPClient) else None
    asyncio.run(closed_loop(llm, prompts(min(8, a.concurrency), a.input_len, vocab, 99), 8, a.concurrency))  # warm-up
    if counts is not None:
        counts[:] = [0] * len(counts)
    rec = {"variant": name, "replicas": len(llm.replicas())}
    rec.update(asyncio.run(closed_loop(llm, prompts(a.num_prompts, a.input_len, vocab, 0), a.output_len, a.concurrency)))
    rec["requests_per_replica"] = list(counts) if counts is not None else None
    exact = asyncio.run(greedy_alone(llm, prompts(4, a.input_len, vocab, 1), 16))
    rec["exact_vs_single"] = None if exact_ref is None else exact == exact_ref
    return rec, exact


def affinity(args: EngineArgs, n: int, a: argparse.Namespace, vocab: int, block_size: int) -> dict:
    """Prefix-cache hit rate over N replicas: the default router against one without affinity."""
    n_groups = max(2, min(8, a.num_prompts // 8))
    groups = prompts(n_groups, 4 * block_size, vocab, 5)
    rng = random.Random(6)
    ids = [groups[rng.randrange(n_groups)] + [rng.randrange(3, vocab) for _ in range(a.input_len // 4)] for _ in range(a.num_prompts)]
    out = {}
    for label, router in (("affinity", None), ("load_only", LoadOnlyRouter(page_size=block_size))):
        client = make_client(EngineArgs(**{**vars_of(args), "data_parallel_size": n, "enable_prefix_caching": True}))
        if router is not None:
            client.router = router
        llm = AsyncLLM(client=client)
        try:
            run = asyncio.run(closed_loop(llm, ids, a.output_len // 4 or 1, a.concurrency))
            snap = llm.snapshot
            out[label] = {"hit_rate": snap.prefix_cache_hits / max(1, snap.prefix_cache_queries),
                          "output_tok_s": run["output_tok_s"], "ttft_median_s": run["ttft_median_s"]}
        finally:
            llm.shutdown()
    return out


def vars_of(args: EngineArgs) -> dict:
    return {k: getattr(args, k) for k in args.__dataclass_fields__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--config", default="ouro-1.4b")
    ap.add_argument("--sizes", default="1,2,4,8", help="data-parallel sizes (those above the visible GPUs are skipped)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, sizes 1,2, a few requests")
    a = ap.parse_args()
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    if a.cpu_smoke:
        a.sizes, a.concurrency, a.num_prompts, a.input_len, a.output_len = "1,2", 4, 8, 40, 8
        ckpt = make_tiny_checkpoint(out / "ckpt", seed=0)
        base = dict(model=str(ckpt), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=256)
        gpus = 2
    else:
        cfg = random_checkpoint_config(a.config)
        fields = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "extra"}
        ckpt = make_tiny_checkpoint(out / "ckpt", seed=0, **fields)
        base = dict(model=str(ckpt), dtype="bfloat16", max_num_seqs=max(a.concurrency, 8))
        gpus = torch.cuda.device_count()
    args = EngineArgs(**base)
    vocab = min(32000, json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"])
    sizes = [n for n in (int(s) for s in a.sizes.split(",")) if n <= gpus]
    records = []

    client = MPClient(args)
    llm = AsyncLLM(client=client)
    try:
        rec, ref = measure("single", llm, client, a, vocab, None)
    finally:
        llm.shutdown()
    records.append(rec)
    for n in sizes:
        client = DPClient([MPClient(args)]) if n == 1 else make_client(EngineArgs(**{**base, "data_parallel_size": n}))
        llm = AsyncLLM(client=client)
        try:
            rec, _ = measure(f"dp{n}", llm, client, a, vocab, ref)
        finally:
            llm.shutdown()
        records.append(rec)
        if n >= 2:
            rec["prefix_cache"] = affinity(args, n, a, vocab, args.block_size)
        print(json.dumps(rec), flush=True)
    meta = {"command": " ".join(sys.argv), "gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus and not a.cpu_smoke
            else "cpu", "torch": torch.__version__}
    (out / "dp_measure.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    single = records[0]["output_tok_s"]
    print(f"{'variant':8} {'tok/s':>10} {'x single':>9} {'ttft p50':>9} {'e2e p50':>8}  exact  per replica")
    for r in records:
        print(f"{r['variant']:8} {r['output_tok_s']:10.1f} {r['output_tok_s'] / single:9.3f} {r['ttft_median_s']:9.3f} "
              f"{r['e2e_median_s']:8.2f}  {r['exact_vs_single']!s:5}  {r['requests_per_replica']}"
              + (f"  prefix hits {r['prefix_cache']['affinity']['hit_rate']:.2f} vs "
                 f"{r['prefix_cache']['load_only']['hit_rate']:.2f} without affinity" if "prefix_cache" in r else ""))


if __name__ == "__main__":
    main()
