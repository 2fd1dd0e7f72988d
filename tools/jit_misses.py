"""Which Triton kernels an engine still compiles after start-up, and what its first requests pay for them (GPU).

python3 tools/jit_misses.py --config ouro-1.4b [--speculative-config JSON] [--kv-cache-dtype fp8]

Builds the engine a server builds (random weights of ``--config``, bf16, CUDA graphs, the default KV pool and
limits), then runs phases of requests, each phase all at once to the end: one 1,024-token prompt, the same
again, 4 and 16 such prompts, one of 300 tokens, and four of mixed lengths. For each phase it prints the wall
time and every Triton kernel specialization first launched in it (a miss of the process's in-memory kernel
cache, Triton's ``jit_cache_hook``; with an empty ``TRITON_CACHE_DIR`` each is a compile, else a load from the
disk cache), with the seconds between the miss and its compile's end (``jit_post_compile_hook``). A second
identical phase costs nothing: what the first pays beyond it is the start-up's missing warm-up.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import torch
import triton

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.ouro import OuroForCausalLM
from loopline.models.tiny import random_checkpoint_config
from loopline.sampling_params import SamplingParams

PHASES = (("one 1024-token prompt", [1024]), ("the same again", [1024]), ("4 prompts of 1024", [1024] * 4),
          ("16 prompts of 1024", [1024] * 16), ("one 300-token prompt", [300]),
          ("4 prompts of 77 / 200 / 513 / 1024", [77, 200, 513, 1024]))


class MissLog:
    """Triton's in-memory cache misses (kernel name, seconds to its compile's end), by phase."""

    def __init__(self) -> None:
        self.phase = "engine start-up"
        self.misses: dict[str, list[list]] = collections.defaultdict(list)
        self.open: dict[object, list] = {}

    def install(self) -> MissLog:
        """Makes this log Triton's ``jit_cache_hook`` and ``jit_post_compile_hook``."""
        triton.knobs.runtime.jit_cache_hook = self.on_miss
        triton.knobs.runtime.jit_post_compile_hook = self.on_compiled
        return self

    def on_miss(self, *args, **kw) -> bool:
        fn = kw.get("fn")
        entry = [getattr(fn, "name", str(fn)), time.perf_counter()]
        self.misses[self.phase].append(entry)
        self.open[id(fn.jit_function) if hasattr(fn, "jit_function") else entry[0]] = entry
        return False  # compile as usual

    def on_compiled(self, *args, **kw) -> None:
        fn = kw.get("fn")
        entry = self.open.pop(id(fn.jit_function) if hasattr(fn, "jit_function") else getattr(fn, "name", ""), None)
        if entry is not None and len(entry) == 2:
            entry.append(time.perf_counter() - entry[1])


def run_phase(engine: LLMEngine, name: str, lengths: list[int], log: MissLog, output_len: int) -> dict:
    """Submits one request per prompt length at once and steps until all finish."""
    log.phase = name
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, n in enumerate(lengths):
        engine.add_request(f"{name}-{i}", [3 + (len(name) * 131 + i * 977 + j * 7919) % 30000 for j in range(n)], params)
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return {"phase": name, "wall_s": time.perf_counter() - t0, "misses": len(log.misses[name])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="ouro-1.4b")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--speculative-config", default=None)
    ap.add_argument("--json", default=None, help="also write the phases and their misses to this file")
    a = ap.parse_args()
    log = MissLog().install()
    cfg = random_checkpoint_config(a.config)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = OuroForCausalLM(cfg).to(torch.bfloat16)
    engine = LLMEngine(EngineArgs(device="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048,
                                  kv_cache_dtype=a.kv_cache_dtype,
                                  speculative_config=json.loads(a.speculative_config) if a.speculative_config else None),
                       model=model)
    rows = [{"phase": "engine start-up", "wall_s": time.perf_counter() - t0, "misses": len(log.misses[log.phase])}]
    rows += [run_phase(engine, name, lengths, log, a.output_len) for name, lengths in PHASES]
    for row in rows:
        kernels = collections.Counter(m[0] for m in log.misses[row["phase"]])
        compile_s = sum(m[2] for m in log.misses[row["phase"]] if len(m) > 2)
        print(f"{row['phase']:<36} {row['wall_s']:8.2f} s  {row['misses']:3d} kernel misses ({compile_s:.2f} s to compile)")
        if row["phase"] != "engine start-up":
            for name, n in kernels.most_common():
                print(f"    {n:3d}x {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "misses": log.misses}, f, indent=1)


if __name__ == "__main__":
    main()
