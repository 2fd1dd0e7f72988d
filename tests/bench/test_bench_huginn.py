"""``loopline bench --config huginn-*`` (#46): Huginn through the offline harness on the CPU (tiny shapes), and
the ``huginn-3.5b`` config's shapes (the H200 run's; its random weights are not built here)."""
from __future__ import annotations

import pytest

from loopline.bench.metrics import ByteModel
from loopline.bench.offline import random_config
from loopline.entrypoints.bench_cli import run_offline
from loopline.entrypoints.cli import build_parser
from loopline.models import huginn

HUGINN_TINY = ["--config", "huginn-tiny", "--device", "cpu", "--dtype", "float32", "--no-progress"]


def bench(*argv: str) -> dict:
    return run_offline(build_parser().parse_args(["bench", *HUGINN_TINY, *argv]))


def test_fixed_refill_no_refill_and_adaptive_runs():
    """Fixed iterations, and the convergence exit under refill and no_refill: every request completes with
    its output tokens; fixed runs every token max_loops iterations, the adaptive ones fewer."""
    record = bench("--input-len", "6", "--output-len", "5", "--concurrency", "2", "--num-prompts", "3",
                   "--compare", "--repeats", "1", "--exit-threshold", "0.5", "--max-num-loops", "8")
    assert record["params"]["total_ut_steps"] == 6  # the checkpoint's default iterations (mean_recurrence)
    runs = {v["name"]: v["median"] for v in record["results"][0]["variants"]}
    assert set(runs) == {"refill", "no_refill", "fixed"}
    for run in runs.values():
        assert (run["completed"], run["failed"], run["output_tokens"]) == (3, 0, 15)
    assert runs["fixed"]["mean_loops_per_token"] == pytest.approx(6.0)
    assert runs["refill"]["mean_loops_per_token"] < 6.0
    assert runs["refill"]["exit_depth_counts"] == runs["no_refill"]["exit_depth_counts"]


def test_trace_depths_replay_on_huginn():
    record = bench("--input-len", "4", "--output-len", "8", "--concurrency", "2", "--num-prompts", "2",
                   "--repeats", "1", "--depth-dist", "2:0.5,6:0.5")
    run = record["results"][0]["variants"][0]["median"]
    assert set(run["exit_depth_counts"]) <= {"2", "6"}


def test_huginn_3_5b_config_is_huginn_0125():
    cfg, build, _ = random_config("huginn-3.5b")
    assert cfg == huginn.HuginnConfig() and build is huginn.HuginnForCausalLM
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.mean_recurrence, cfg.padded_vocab_size) == (5280, 55, 32, 65536)
    assert 3.5e9 < huginn.parameter_count(cfg) < 3.6e9
    # one engine loop reads the 4 core layers and the adapter (bf16); a step with an exit also the prelude's and
    # the coda's 4 layers and lm_head; 8 layers' K/V per position
    reads = ByteModel.for_config(cfg, __import__("torch").bfloat16)
    layer = 2 * (5280 * 3 * 5280 + 5280 * 5280 + 3 * 5280 * 17920 + 4 * 5280)
    assert reads.head == 65536 * 5280 * 2 + 4 * layer and reads.kv_per_token_loop == 2 * 8 * 5280 * 2
    assert reads.body == 4 * layer + 2 * (2 * 5280 * 5280 + 5280)
    assert 0.8 * 2 * (huginn.parameter_count(cfg) - 65536 * 5280) < reads.body + reads.head - 65536 * 5280 * 2 \
        < 2 * huginn.parameter_count(cfg)
