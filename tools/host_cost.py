"""Host work of an engine step outside the forward, on the CPU (where a GPU step of a small model waits).

python tools/host_cost.py [--speculative-config JSON] [--params JSON] [--rows N] [--steps S]

A model so small (one layer, 16 wide) that its ops cost their dispatch; the step's forward (on a GPU one graph
replay) and its slot ops (on a GPU one Triton kernel each: ``pipe_accept``, ``pipe_draft_lanes``,
``pipe_store_draft``, ``advance``) are timed apart, so what is left is the host's own work a step: scheduling,
the step's inputs, the drafts' head and sampling, the readback. Speculation's verdicts are replayed
(``AcceptanceReplay``, the demo model's rates) so that lanes commit as on a trained model.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from step_phases import TIMES, timed  # (tools/, beside this script)

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.models.ouro import OuroConfig, OuroForCausalLM
from loopline.sampling_params import SamplingParams
from loopline.spec.replay import AcceptanceReplay

SLOT_OPS = ("pipe_accept", "pipe_draft_lanes", "pipe_store_draft", "advance")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speculative-config", default=None, help="the engine's speculative_config as JSON")
    ap.add_argument("--rows", type=int, default=1, help="requests decoding at once")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--params", default="{}",
                    help='SamplingParams fields as JSON, e.g. \'{"temperature": 1.0, "logprobs": 1}\' (default: greedy)')
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
                     num_key_value_heads=1, head_dim=16)
    spec = json.loads(a.speculative_config) if a.speculative_config else None
    engine = LLMEngine(EngineArgs(device="cpu", dtype="float32", skip_tokenizer_init=True, max_num_seqs=max(8, a.rows),
                                  kv_cache_memory_gb=0.25, speculative_config=spec), model=OuroForCausalLM(cfg))
    if spec is not None:  # (verdicts are draws: the outputs are meaningless, the work is a trained model's)
        engine.runner.spec.replay = AcceptanceReplay([0.89, 0.71, 0.68], loop_changes=[0.069, 0.029, 0.016])
    params = SamplingParams(**{"max_tokens": 4 * a.steps, "temperature": 0.0, "ignore_eos": True, "exit_threshold": 1.0,
                               **json.loads(a.params)})
    for i in range(a.rows):
        engine.add_request(f"r{i}", [3 + (i * 7919 + j) % 500 for j in range(16)], params)
    for _ in range(30):
        engine.step()
    runner = engine.runner
    timed(runner, "forward", "forward")
    for name in SLOT_OPS:
        timed(runner.decode_state.ops, name, "slot ops")
    tokens0 = sum(len(r.output) for r in engine.scheduler.requests.values())
    t0 = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.output) for r in engine.scheduler.requests.values()) - tokens0
    ms = {k: TIMES[k] / a.steps * 1e3 for k in ("forward", "slot ops")}
    step = elapsed / a.steps * 1e3
    print(f"rows={a.rows} spec={'yes' if spec else 'no'} params={a.params}: step {step:.3f} ms, forward {ms['forward']:.3f}, "
          f"slot ops {ms['slot ops']:.3f}, the host's own {step - ms['forward'] - ms['slot ops']:.3f} ms; "
          f"{tokens / a.steps:.2f} tokens a step")


if __name__ == "__main__":
    main()
