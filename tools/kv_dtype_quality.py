"""What a KV cache dtype costs in quality, on the bundled demo model (CPU or GPU).

python3 tools/kv_dtype_quality.py [--kv auto,bfloat16,fp8] [--windows 32] [--prompts 40 --tokens 250] [--out F]

For each ``kv_cache_dtype``: the held-out loss through the engine (``loopline.train.engine_eval.engine_curve``:
prompt logprobs of held-out windows, every position at its engine exit depth) at full depth (threshold 1.0)
and at the model's shipped ``early_exit_threshold``, the exit-depth histogram there, and greedy generation
(temperature 0, shipped threshold) from held-out prompts. Greedy tokens are compared with the first
``--kv`` entry's: the fraction of sequences identical, the fraction of positions equal, and the tokens
generated before the first difference. The model computes in ``--dtype`` (default float32), so ``auto``
is an fp32 cache.
"""
from __future__ import annotations

import argparse
import json
import time

from loopline.models.loader import load_config
from loopline.models.tiny import default_checkpoint
from loopline.train.engine_eval import engine_curve, heldout_stream


def greedy(model_dir: str, prompts: list[list[int]], tokens: int, kv: str, device: str, dtype: str,
           threshold: float) -> tuple[list[list[int]], list[float]]:
    from loopline import LLM, SamplingParams

    llm = LLM(model=model_dir, device=device, dtype=dtype, kv_cache_dtype=kv, disable_log_stats=True)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, exit_threshold=threshold,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].mean_exit_depth for o in outs]


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    equal = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    prefix = []
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
        prefix.append(n)
    return {"sequences_identical": sum(r == g for r, g in zip(ref, got)) / len(ref),
            "positions_equal": equal / total, "tokens": total,
            "mean_tokens_before_first_difference": sum(prefix) / len(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    ap.add_argument("--kv", default="auto,bfloat16,fp8", help="kv_cache_dtype values; the first is the reference")
    ap.add_argument("--windows", type=int, default=32, help="held-out windows of --seq-len tokens for the loss")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=250, help="greedy tokens per prompt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    model_dir = a.model or str(default_checkpoint())
    shipped = load_config(model_dir).early_exit_threshold
    stream = heldout_stream(model_dir)
    # greedy prompts: held-out text after the loss windows' span, one every 997 tokens
    start = len(stream) // 2
    prompts = [stream[start + i * 997: start + i * 997 + a.prompt_len] for i in range(a.prompts)]
    results: dict = {"model": model_dir, "dtype": a.dtype, "device": a.device, "shipped_threshold": shipped,
                     "windows": a.windows, "seq_len": a.seq_len, "kv": {}}
    ref_tokens = None
    for kv in a.kv.split(","):
        t0 = time.perf_counter()
        curve = engine_curve(model_dir, stream, seq_len=a.seq_len, max_windows=a.windows, thresholds=(1.0, shipped),
                             device=a.device, dtype=a.dtype, kv_cache_dtype=kv)
        tokens, depths = greedy(model_dir, prompts, a.tokens, kv, a.device, a.dtype, shipped)
        entry = {"full_depth": curve[0], "shipped": curve[1], "greedy_mean_depth": sum(depths) / len(depths),
                 "seconds": round(time.perf_counter() - t0, 1)}
        if ref_tokens is None:
            ref_tokens = tokens
        else:
            entry["greedy_vs_reference"] = compare(ref_tokens, tokens)
        results["kv"][kv] = entry
        print(f"{kv:>9}: loss full depth {curve[0]['loss']:.5f}, at {shipped} {curve[1]['loss']:.5f} "
              f"(mean depth {curve[1]['mean_depth']:.3f}, histogram {curve[1]['depth_histogram']})"
              + (f"; greedy vs {a.kv.split(',')[0]}: {entry['greedy_vs_reference']}" if "greedy_vs_reference" in entry
                 else ""), flush=True)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
