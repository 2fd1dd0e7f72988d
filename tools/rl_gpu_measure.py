"""RL-facing costs on the GPU (Ouro shapes, random bf16 weights): one JSON line.

python tools/rl_gpu_measure.py [--config ouro-1.4b] [--device cuda]
(a) logprob-collection overhead: output tok/s with logprobs=None / 0 / 5, same seeds;
(b) full-weight update downtime: start/update_weights (CPU state dict, 4 shards)/finish,
    and update_weights_from_disk from a safetensors directory;
(c) peak extra device memory during an update.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.ouro import OuroForCausalLM
from loopline.models.tiny import make_tiny_checkpoint, random_checkpoint_config, tiny_config
from loopline.sampling_params import SamplingParams


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="ouro-1.4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = tiny_config() if a.config == "tiny" else random_checkpoint_config(a.config)
    with torch.device(device):
        model = OuroForCausalLM(cfg).to(dtype)
    engine = LLMEngine(EngineArgs(device=a.device, dtype=str(dtype).split(".")[1], skip_tokenizer_init=True,
                                  max_num_seqs=max(8, a.prompts), kv_cache_memory_gb=8 if device.type == "cuda" else 0.25),
                       model=model)
    throughput(engine, None, 4, a.input_len, 8)  # warm up
    tps = {str(lp): throughput(engine, lp, a.prompts, a.input_len, a.output_len) for lp in (None, 0, 5)}

    state = {k: v.detach().to("cpu").clone() for k, v in engine.model.state_dict().items()}
    names = list(state)
    shards = [names[i::4] for i in range(4)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    sync(device)
    t0 = time.perf_counter()
    engine.start_weight_update(1)
    for shard in shards:
        engine.update_weights((n, state[n]) for n in shard)
    engine.finish_weight_update()
    sync(device)
    update_s = time.perf_counter() - t0
    peak_extra = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        make_tiny_checkpoint(ckpt)  # config/tokenizer files; weights replaced below
        (ckpt / "config.json").write_text(json.dumps({
            **json.loads((ckpt / "config.json").read_text()),
            **{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim",
                                            "total_ut_steps", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                                            "early_exit_threshold")}}))
        save_file({k: v.contiguous() for k, v in state.items()}, str(ckpt / "model.safetensors"))
        sync(device)
        t0 = time.perf_counter()
        engine.update_weights_from_disk(str(ckpt), 2)
        sync(device)
        disk_s = time.perf_counter() - t0
    after = throughput(engine, None, 4, a.input_len, 8)
    print(json.dumps({
        "config": a.config, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "workload": f"{a.prompts} prompts x {a.input_len} in / {a.output_len} out, temperature 1, seed 0",
        "output_tok_s": {k: round(v, 1) for k, v in tps.items()},
        "logprobs_overhead": {k: round(tps["None"] / v - 1, 4) for k, v in tps.items() if k != "None"},
        "update_from_memory_s": round(update_s, 3), "update_from_disk_s": round(disk_s, 3),
        "peak_extra_gib": round(peak_extra / 2**30, 3) if peak_extra is not None else None,
        "weights_gib": round(sum(v.numel() * v.element_size() for v in state.values()) / 2**30, 3),
        "version_after": engine.get_weight_version(), "generates_after_update": after > 0,
    }))


if __name__ == "__main__":
    main()
