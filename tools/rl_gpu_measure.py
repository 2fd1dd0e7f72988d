"""RL-facing costs on the GPU (Ouro shapes, random bf16 weights): one JSON line (and --out DIR/rl.json).

python tools/rl_gpu_measure.py [--config ouro-1.4b] [--device cuda] [--out DIR]
(a) logprob-collection overhead: output tok/s with logprobs=None / 0 / 5, same seeds;
(b) full-weight update downtime: start/update_weights (CPU state dict, 4 shards)/finish,
    and update_weights_from_disk from a safetensors directory;
(c) peak extra device memory during an update;
(d) bucketed publication (loopline.rl.buckets) of a trainer's state, per bucket size
    (--bucket-mb) and trainer dtype (--trainer-dtypes), from three sources:
    ``cpu`` (pageable host tensors), ``device`` (resident on the engine's device, as a
    colocated trainer's parameters) and ``device_gathered`` (a fresh device copy per tensor,
    as FSDP's full_tensor() yields them), over two routes: ``in_process`` (LLMEngine in this
    process: device-to-device copies) and ``engine_process`` (AsyncLLM with the engine in its
    own process: CUDA tensors cross the pipe as IPC handles). Each record: downtime (start ->
    commit, median of --repeats), and peak extra device memory in this process
    (``caller_peak_extra_gib``: the gathered buckets, casts) and in the engine's
    (``engine_peak_extra_gib``).

(e) ``ipc_bytes``: a bucket of device tensors packed with ``loopline.rl.ipc`` (CUDA IPC handles as
    plain bytes, what the verl adapter sends over Ray) and rebuilt in another process: whether
    every tensor arrived intact, and the bytes sent for the bucket's size.

On the CPU (``--device cpu``, the test's reduced form) the ``device`` sources are CPU tensors and
memory figures are None.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.entrypoints.async_llm import AsyncLLM
from loopline.models.ouro import OuroForCausalLM
from loopline.models.tiny import make_tiny_checkpoint, random_checkpoint_config, tiny_config
from loopline.rl.buckets import publish, publish_async
from loopline.sampling_params import SamplingParams

GIB = 2**30
SOURCES = ("cpu", "device", "device_gathered")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def throughput(engine: LLMEngine, logprobs, prompts: int, input_len: int, output_len: int) -> float:
    p = SamplingParams(max_tokens=output_len, temperature=1.0, seed=0, ignore_eos=True, logprobs=logprobs)
    for i in range(prompts):
        engine.add_request(f"lp{logprobs}-{i}", list(range(3, 3 + input_len)), p)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync(engine.config.device)
    return prompts * output_len / (time.perf_counter() - t0)


def write_checkpoint(ckpt: Path, cfg, state: dict[str, torch.Tensor]) -> None:
    make_tiny_checkpoint(ckpt)  # config/tokenizer files; weights replaced below
    (ckpt / "config.json").write_text(json.dumps({
        **json.loads((ckpt / "config.json").read_text()),
        **{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "total_ut_steps", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                                        "early_exit_threshold")}}))
    save_file({k: v.contiguous() for k, v in state.items()}, str(ckpt / "model.safetensors"))


# --- (d) bucketed publication ---------------------------------------------------------------------
def trainer_state(state: dict[str, torch.Tensor], source: str, device: torch.device, dtype: torch.dtype
                  ) -> dict[str, torch.Tensor]:
    """What the trainer holds: host tensors (``cpu``) or device tensors (both ``device`` sources)."""
    where = "cpu" if source == "cpu" else device
    return {k: v.to(device=where, dtype=dtype).clone() for k, v in state.items()}


def stream(held: dict[str, torch.Tensor], source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` stream a trainer yields; ``device_gathered`` allocates each tensor anew."""
    for name, t in held.items():
        yield name, (t.clone() if source == "device_gathered" else t)


def _peak_start(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_extra(device: torch.device, base: int | None) -> float | None:
    if base is None:
        return None
    return round((torch.cuda.max_memory_allocated(device) - base) / GIB, 4)


def measure_in_process(engine: LLMEngine, state, device, sources, dtypes, buckets_mb, repeats) -> list[dict]:
    records = []
    for dtype in dtypes:
        for source in sources:
            held = trainer_state(state, source, device, dtype)
            for mb in buckets_mb:
                times, peaks = [], []
                for _ in range(repeats):
                    base = _peak_start(device)
                    t0 = time.perf_counter()
                    stats = publish(engine, stream(held, source), engine.get_weight_version() + 1,
                                    bucket_bytes=max(1, int(mb * 2**20)))
                    sync(device)
                    times.append(time.perf_counter() - t0)
                    peaks.append(_peak_extra(device, base))
                records.append(_record("in_process", source, dtype, mb, stats.buckets, times, peaks, peaks))
            del held
    return records


def _record(route: str, source: str, dtype: torch.dtype, mb: float, buckets: int, times: list[float],
            caller: list, engine: list) -> dict:
    """One (route, source, dtype, bucket size) row: the median downtime and the highest peaks."""
    return {"route": route, "source": source, "trainer_dtype": str(dtype).split(".")[1], "bucket_mib": mb,
            "buckets": buckets, "downtime_s": round(statistics.median(times), 4),
            "caller_peak_extra_gib": max(caller) if caller[0] is not None else None,
            "engine_peak_extra_gib": max(engine) if engine[0] is not None else None}


async def _measure_engine_process(llm: AsyncLLM, state, device, sources, dtypes, buckets_mb, repeats) -> list[dict]:
    records = []
    for dtype in dtypes:
        for source in sources:
            held = trainer_state(state, source, device, dtype)
            for mb in buckets_mb:
                times, caller, engine = [], [], []
                for _ in range(repeats):
                    await llm.device_memory_stats(reset_peak=True)
                    before = await llm.device_memory_stats()
                    base = _peak_start(device)
                    t0 = time.perf_counter()
                    stats = await publish_async(llm, stream(held, source), await llm.get_weight_version() + 1,
                                                bucket_bytes=max(1, int(mb * 2**20)))
                    times.append(time.perf_counter() - t0)
                    caller.append(_peak_extra(device, base))
                    after = await llm.device_memory_stats()
                    engine.append(round((after["peak"] - before["allocated"]) / GIB, 4) if after else None)
                records.append(_record("engine_process", source, dtype, mb, stats.buckets, times, caller, engine))
            del held
    return records


def measure_engine_process(ckpt: Path, engine_dtype: str, device: torch.device, state, sources, dtypes, buckets_mb,
                           repeats) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    llm = AsyncLLM(EngineArgs(model=str(ckpt), dtype=engine_dtype, device=str(device), skip_tokenizer_init=True,
                              max_num_seqs=8, kv_cache_memory_gb=1 if device.type == "cuda" else 0.05,
                              disable_log_stats=True))
    start_s = time.perf_counter() - t0
    try:
        records = []
        for source in sources:  # one failing route (e.g. a small /dev/shm for host tensors) spares the others
            try:
                records += asyncio.run(_measure_engine_process(llm, state, device, [source], dtypes, buckets_mb, repeats))
            except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                records.append({"route": "engine_process", "source": source, "error": f"{type(e).__name__}: {e}"})
        return records, start_s
    finally:
        llm.shutdown()


_IPC_RECEIVER = """
import json, pickle, sys
from loopline.rl.ipc import unpack_bucket
tensors = unpack_bucket(pickle.loads(sys.stdin.buffer.read()))
print(json.dumps({n: float(t.double().sum()) for n, t in tensors}))
"""


def check_ipc_bytes(state: dict[str, torch.Tensor], device: torch.device, n: int = 8) -> dict | None:
    """(e): ``n`` tensors on the device cross to a fresh process as IPC handles in bytes (CUDA only)."""
    if device.type != "cuda":
        return None
    import os
    import pickle
    import subprocess
    import sys

    from loopline.rl.ipc import pack_bucket

    bucket = [(k, v.to(device)) for k, v in list(state.items())[:n]]
    payload = pickle.dumps(pack_bucket(bucket))
    root = str(Path(__file__).resolve().parents[1])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _IPC_RECEIVER], input=payload, capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr.decode(errors="replace")[-2000:]}
    seen = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    ok = all(abs(seen[k] - float(v.double().sum())) <= 1e-6 * max(1.0, abs(seen[k])) for k, v in bucket)
    return {"ok": ok and len(seen) == len(bucket), "tensors": len(bucket), "payload_bytes": len(payload),
            "bucket_bytes": sum(v.numel() * v.element_size() for _, v in bucket),
            "receiver_process_s": round(seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="ouro-1.4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--bucket-mb", default="64,256,1024", help="bucket sizes (MiB, comma-separated) for (d)")
    ap.add_argument("--trainer-dtypes", default="bfloat16,float32", help="dtypes the trainer holds, for (d)")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-engine-process", action="store_true", help="skip (d) through an engine process")
    ap.add_argument("--out", default=None, help="also write the JSON to OUT/rl.json")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine_dtype = str(dtype).split(".")[1]
    cfg = tiny_config() if a.config == "tiny" else random_checkpoint_config(a.config)
    with torch.device(device):
        model = OuroForCausalLM(cfg).to(dtype)
    engine = LLMEngine(EngineArgs(device=a.device, dtype=engine_dtype, skip_tokenizer_init=True,
                                  max_num_seqs=max(8, a.prompts), kv_cache_memory_gb=8 if device.type == "cuda" else 0.25),
                       model=model)
    throughput(engine, None, 4, a.input_len, 8)  # warm up
    tps = {str(lp): throughput(engine, lp, a.prompts, a.input_len, a.output_len) for lp in (None, 0, 5)}

    state = {k: v.detach().to("cpu").clone() for k, v in engine.model.state_dict().items()}
    names = list(state)
    shards = [names[i::4] for i in range(4)]
    base = _peak_start(device)
    t0 = time.perf_counter()
    engine.start_weight_update(1)
    for shard in shards:
        engine.update_weights((n, state[n]) for n in shard)
    engine.finish_weight_update()
    sync(device)
    update_s = time.perf_counter() - t0
    peak_extra = _peak_extra(device, base)

    buckets_mb = [float(x) for x in a.bucket_mb.split(",") if x]
    dtypes = [getattr(torch, x) for x in a.trainer_dtypes.split(",") if x]
    sources = [s for s in a.sources.split(",") if s]
    bad = [s for s in sources if s not in SOURCES]
    if bad:
        raise SystemExit(f"--sources: unknown {bad}; allowed: {list(SOURCES)}")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        write_checkpoint(ckpt, cfg, state)
        sync(device)
        t0 = time.perf_counter()
        engine.update_weights_from_disk(str(ckpt), 2)
        sync(device)
        disk_s = time.perf_counter() - t0
        bucketed = measure_in_process(engine, state, device, sources, dtypes, buckets_mb, a.repeats)
        proc_start_s = None
        if not a.no_engine_process:
            records, proc_start_s = measure_engine_process(ckpt, engine_dtype, device, state, sources, dtypes,
                                                           buckets_mb, a.repeats)
            bucketed += records
    after = throughput(engine, None, 4, a.input_len, 8)
    result = {
        "config": a.config, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "workload": f"{a.prompts} prompts x {a.input_len} in / {a.output_len} out, temperature 1, seed 0",
        "output_tok_s": {k: round(v, 1) for k, v in tps.items()},
        "logprobs_overhead": {k: round(tps["None"] / v - 1, 4) for k, v in tps.items() if k != "None"},
        "update_from_memory_s": round(update_s, 3), "update_from_disk_s": round(disk_s, 3),
        "peak_extra_gib": peak_extra,
        "weights_gib": round(sum(v.numel() * v.element_size() for v in state.values()) / GIB, 3),
        "engine_dtype": engine_dtype, "bucketed": bucketed, "engine_process_start_s":
            round(proc_start_s, 2) if proc_start_s is not None else None,
        "version_after": engine.get_weight_version(), "generates_after_update": after > 0,
        "ipc_bytes": check_ipc_bytes(state, device),
    }
    line = json.dumps(result)
    print(line)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "rl.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
