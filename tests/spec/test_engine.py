"""Loop self-speculation in the engine (#41, draft then verify): every committed token, exit depth and
logprob is what the non-speculative engine gives (greedy and seeded sampling alike, fixed depth and
adaptive exits, kv_layout last_exited), for several K and d, single and batched requests mixed with
requests that do not speculate, with max_tokens / stop tokens / stop strings / EOS inside an accepted
run, under both engine orders (overlapped and synchronous), and with preemption between rounds; the
greedy fixed-depth tokens also equal the independent oracle's (tests/reference.py); kv_layout shared, whose
reads follow the round schedule, equals that schedule's own oracle there."""
from __future__ import annotations

import random

import pytest
from engine_testing import run_arrivals
from reference import reference_generate, reference_speculative_shared  # tests/ is on pythonpath (pyproject.toml)

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.errors import InvalidRequestError

DEMO_PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    ", "class Foo:\n    def __init__(self",
                "for i in range(10):\n    print(", "# Copyright"]


def spec(k: int, d: int) -> dict:
    """Speculation pinned on (no adaptive stop, no batch bound): these tests check its mechanics."""
    return {"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": k, "draft_loops": d,
            "adaptive": False, "disable_by_batch_size": None}


# the depth pipeline (scheme 2, tests/spec/test_pipeline_engine.py), pinned on: the stop and abort tests below run
# both schemes
PIPE = {"method": "loop", "scheme": "pipeline", "draft_loops": 1, "adaptive": False, "disable_by_batch_size": None}


def engine(model: str | None = None, speculative: dict | None = None, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("skip_tokenizer_init", model is not None)
    return LLMEngine(EngineArgs(model=model, speculative_config=speculative, **kw))


def drain(eng: LLMEngine, requests: dict, arrivals: dict | None = None) -> dict:
    """Adds ``requests`` (id -> (prompt ids, params)) at their arrival steps; runs them to completion."""
    done = {rid: out.outputs[0] for rid, out in run_arrivals(eng, requests, arrivals).items()}
    assert eng.kv.num_used_blocks == 0, "finished requests must free their KV"
    return done


def assert_same(spec_out: dict, plain_out: dict, atol: float = 1e-4) -> None:
    assert spec_out.keys() == plain_out.keys()
    for rid, a in spec_out.items():
        b = plain_out[rid]
        assert a.token_ids == b.token_ids, rid
        assert a.exit_depths == b.exit_depths, rid
        assert a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason, rid
        if b.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys(), rid
                for t in y:
                    assert x[t].logprob == pytest.approx(y[t].logprob, abs=atol), rid


@pytest.fixture(scope="module")
def demo_prompts():
    from loopline.models.loader import load_tokenizer
    from loopline.models.tiny import default_checkpoint

    tok = load_tokenizer(default_checkpoint())
    return [tok.encode(p) for p in DEMO_PROMPTS]


def ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# exit_threshold 1.0: fixed depth (the demo model's own threshold is 0.5)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2, exit_threshold=1.0)


# --- M1: greedy at fixed depth ------------------------------------------------------------------
# default run: (3, 1) (d = 2: spec/test_engine_sampling.py's seeded (2, 2)); the others (~4 s each) slow
@pytest.mark.parametrize("k, d", [(3, 1), pytest.param(2, 2, marks=pytest.mark.slow),
                                  pytest.param(1, 3, marks=pytest.mark.slow),
                                  pytest.param(5, 1, marks=pytest.mark.slow)])
def test_greedy_fixed_depth_equals_plain_engine_on_the_demo_model(demo_prompts, k, d):
    reqs = {f"r{i}": (p, GREEDY) for i, p in enumerate(demo_prompts)}
    plain = drain(engine(), reqs, arrivals={"r2": 5, "r3": 9})
    eng = engine(speculative=spec(k, d))
    out = drain(eng, reqs, arrivals={"r2": 5, "r3": 9})
    assert_same(out, plain)
    stats = eng.stats
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens == k * stats.spec_num_drafts
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens  # the demo model's drafts are often right
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens


def test_one_request_alone_commits_several_tokens_per_round(demo_prompts):
    reqs = {"r0": (demo_prompts[0], GREEDY)}
    plain_eng = engine()
    plain = drain(plain_eng, reqs)
    eng = engine(speculative=spec(3, 1))
    assert_same(drain(eng, reqs), plain)
    assert eng.stats.steps < plain_eng.stats.steps  # 3 accepted drafts save loop steps


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_equals_the_independent_oracle_on_a_tiny_model(tiny_gqa, async_scheduling):
    prompts = [ids(5, 1), ids(11, 2), ids(3, 3)]
    reqs = {f"r{i}": (p, GREEDY.clone(max_tokens=10, logprobs=0)) for i, p in enumerate(prompts)}
    out = drain(engine(str(tiny_gqa.path), spec(2, 1), block_size=4, async_scheduling=async_scheduling), reqs)
    for i, p in enumerate(prompts):
        tokens, depths, logprobs = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, p, 10)
        got = out[f"r{i}"]
        assert got.token_ids == tokens and got.exit_depths == depths
        assert [next(iter(e.values())).logprob for e in got.logprobs] == pytest.approx(logprobs, abs=1e-4)


def test_speculating_requests_batch_with_plain_ones(demo_prompts):
    """A request with a penalty (or a too shallow max_loops) decodes plainly beside speculating ones."""
    reqs = {"spec0": (demo_prompts[0], GREEDY), "pen": (demo_prompts[1], GREEDY.clone(repetition_penalty=1.3)),
            "spec1": (demo_prompts[2], GREEDY.clone(max_tokens=17)),
            "shallow": (demo_prompts[3], GREEDY.clone(max_loops=1))}
    eng = engine(speculative=spec(2, 1))
    out = drain(eng, reqs, arrivals={"spec1": 3})
    assert_same(out, drain(engine(), reqs, arrivals={"spec1": 3}))


# --- M2: adaptive exits ------------------------------------------------------------------------
# default run: (3, 1); the others (~3-4 s each) are slow (d = 2 with sampling: spec/test_engine_sampling.py)
@pytest.mark.parametrize("k, d, exit_kw", [
    (3, 1, {"exit_threshold": 0.5}),
    pytest.param(2, 2, {"exit_threshold": 0.5}, marks=pytest.mark.slow),
    pytest.param(2, 3, {"exit_threshold": 0.7}, marks=pytest.mark.slow),
    # min_loops > d: nothing exits in the draft phase
    pytest.param(2, 1, {"exit_threshold": 0.5, "min_loops": 2}, marks=pytest.mark.slow),
    # a shallower target than the model's loops
    pytest.param(2, 2, {"exit_threshold": 0.3, "max_loops": 3}, marks=pytest.mark.slow),
])
def test_adaptive_exit_depths_equal_plain_decoding(demo_prompts, k, d, exit_kw):
    """The target is each token's own exit rule: a position exiting at e <= d in the draft is final, the
    others continue to their own exit in the verify; depths, tokens and logprobs are plain decoding's."""
    params = GREEDY.clone(**exit_kw)
    reqs = {f"r{i}": (p, params) for i, p in enumerate(demo_prompts)}
    plain = drain(engine(), reqs, arrivals={"r1": 4})
    out = drain(engine(speculative=spec(k, d)), reqs, arrivals={"r1": 4})
    assert_same(out, plain)
    depths = {e for o in plain.values() for e in o.exit_depths}
    assert len(depths) > 1, "the thresholds must make tokens exit at different depths"


def test_adaptive_exits_equal_the_independent_oracle(tiny_gqa):
    prompts = [ids(7, 4), ids(4, 5)]
    reqs = {f"r{i}": (p, GREEDY.clone(max_tokens=12, exit_threshold=0.6, logprobs=0)) for i, p in enumerate(prompts)}
    out = drain(engine(str(tiny_gqa.path), spec(3, 2), block_size=4), reqs)
    for i, p in enumerate(prompts):
        tokens, depths, logprobs = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, p, 12, exit_threshold=0.6)
        assert out[f"r{i}"].token_ids == tokens and out[f"r{i}"].exit_depths == depths
        assert [next(iter(e.values())).logprob for e in out[f"r{i}"].logprobs] == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_the_shared_oracle_at_full_draft_depth_is_plain_shared_decoding(tiny_gqa, threshold):
    """Drafting through every loop makes every draft its target and every read a final K/V: the speculative
    shared-plane oracle then is plain shared decoding's (the independent oracle's ``layout="shared"``). With
    one draft loop the schedule's shallower reads change the output."""
    departs = False
    for n, seed in ((5, 1), (9, 2), (6, 7)):
        p = ids(n, seed)
        plain = reference_generate(tiny_gqa.state_dict, tiny_gqa.cfg, p, 9, layout="shared", exit_threshold=threshold)
        full = reference_speculative_shared(tiny_gqa.state_dict, tiny_gqa.cfg, p, 9, k=2, d=4, exit_threshold=threshold)
        assert full == plain
        shallow = reference_speculative_shared(tiny_gqa.state_dict, tiny_gqa.cfg, p, 9, k=2, d=1,
                                               exit_threshold=threshold)
        departs |= shallow[:2] != plain[:2]
    assert departs


@pytest.mark.parametrize("k, d, threshold", [(2, 1, 1.0), (3, 2, 0.6),
                                             pytest.param(3, 1, 0.6, marks=pytest.mark.slow),
                                             pytest.param(2, 3, 1.0, marks=pytest.mark.slow)])
def test_shared_layout_equals_its_speculative_oracle(tiny_gqa, k, d, threshold):
    """kv_layout='shared' speculates by its own semantics (reads follow the round schedule over the one plane):
    tokens, exit depths and logprobs equal the independent oracle of exactly that schedule (tests/reference.py,
    :func:`reference_speculative_shared`), not plain shared decoding."""
    prompts = [ids(6, 7), ids(3, 8), ids(10, 9)]
    reqs = {f"r{i}": (p, GREEDY.clone(max_tokens=11, exit_threshold=threshold, logprobs=0))
            for i, p in enumerate(prompts)}
    eng = engine(str(tiny_gqa.path), spec(k, d), block_size=4, kv_layout="shared")
    out = drain(eng, reqs)
    for i, p in enumerate(prompts):
        tokens, depths, logprobs = reference_speculative_shared(tiny_gqa.state_dict, tiny_gqa.cfg, p, 11, k=k, d=d,
                                                                exit_threshold=threshold)
        got = out[f"r{i}"]
        assert got.token_ids == tokens and got.exit_depths == depths, f"r{i}"
        assert [next(iter(e.values())).logprob for e in got.logprobs] == pytest.approx(logprobs, abs=1e-4)
    assert eng.stats.spec_num_drafts > 0


def test_shared_layout_speculates_its_own_way(demo_prompts):
    """kv_layout='shared' holds one K/V per position: a draft reads the round's earlier positions at their
    draft depth and a verify loop at that same loop, where plain decoding reads their final K/V. So only
    a round's first committed token is plain shared decoding's; the rest may differ (docs/speculation.md)."""
    reqs = {f"r{i}": (p, GREEDY.clone(max_tokens=16)) for i, p in enumerate(demo_prompts)}
    plain = drain(engine(kv_layout="shared"), reqs)
    eng = engine(speculative=spec(3, 1), kv_layout="shared")
    out = drain(eng, reqs)
    for rid, o in out.items():
        assert len(o.token_ids) == 16 and all(1 <= e <= 4 for e in o.exit_depths)
        assert o.token_ids[:2] == plain[rid].token_ids[:2]  # from the prompt, and the first round's position 0
    assert eng.stats.spec_num_drafts > 0


# --- stops inside an accepted run ---------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 7])
def test_max_tokens_inside_an_accepted_run(demo_prompts, max_tokens):
    reqs = {"r": (demo_prompts[0], GREEDY.clone(max_tokens=max_tokens))}
    eng = engine(speculative=spec(4, 1))
    out = drain(eng, reqs)
    assert len(out["r"].token_ids) == max_tokens and out["r"].finish_reason == "length"
    assert_same(out, drain(engine(), reqs))


@pytest.mark.parametrize("speculative", [spec(4, 1), PIPE], ids=["draft_verify", "pipeline"])
def test_stop_token_eos_and_stop_string_inside_an_accepted_run(demo_prompts, speculative):
    plain = drain(engine(), {"r": (demo_prompts[0], GREEDY)})["r"]
    # a token the greedy continuation produces mid-way, never as a round's first token only
    stop_at = plain.token_ids[6]
    reqs = {"stop_id": (demo_prompts[0], GREEDY.clone(stop_token_ids=[stop_at])),
            "eos": (demo_prompts[0], GREEDY.clone(ignore_eos=False)),
            "text": (demo_prompts[0], GREEDY.clone(stop=["new Python"]))}
    out = drain(engine(speculative=speculative), reqs)
    ref = drain(engine(), reqs)
    assert_same(out, ref)
    assert out["stop_id"].token_ids[-1] == stop_at and out["stop_id"].stop_reason == stop_at
    assert out["text"].finish_reason == "stop" and "Python" not in out["text"].text
    assert len(out["text"].token_ids) < len(plain.token_ids)


@pytest.mark.parametrize("speculative", [spec(4, 1), PIPE], ids=["draft_verify", "pipeline"])
def test_eos_inside_an_accepted_run(tiny_gqa, tiny_factory, speculative):
    """A checkpoint whose EOS is a token the greedy continuation produces mid-way: speculative rounds stop
    there as plain decoding does (the committed run's tokens after it are dropped)."""
    prompt = ids(6, 7)
    free = drain(engine(str(tiny_gqa.path), block_size=4), {"r": (prompt, GREEDY.clone(max_tokens=16))})["r"]
    index = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t not in free.token_ids[:i])
    eos = tiny_factory(0, eos_token_id=free.token_ids[index])
    reqs = {"r": (prompt, GREEDY.clone(max_tokens=16, ignore_eos=False))}
    eng = engine(str(eos.path), speculative, block_size=4)
    out = drain(eng, reqs)
    assert out["r"].token_ids == free.token_ids[:index + 1] and out["r"].finish_reason == "stop"
    assert_same(out, drain(engine(str(eos.path), block_size=4), reqs))


# --- engine features around rounds ---------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling, seed, penalties", [(True, 20, False), (False, 20, False), (True, 31, False),
                                                              (True, 20, True)])
def test_preemption_between_rounds_is_exact(tiny_gqa, async_scheduling, seed, penalties):
    """Seed 31 (async): every request mid-round while one grew as its last round's commit was read, with no
    victim (speculating requests are preempted only between rounds); the scheduler aborted one as blocked
    until a round in flight stopped growing (its positions are allocated at its start)."""
    reqs = {f"r{i}": (ids(6 + 2 * i, seed=seed + i), GREEDY.clone(max_tokens=14, exit_threshold=0.7, logprobs=None))
            for i in range(4)}
    if penalties:  # their history (counts, seen mask) moves with the slot
        reqs["r1"] = (reqs["r1"][0], reqs["r1"][1].clone(repetition_penalty=1.4, frequency_penalty=0.5))
        reqs["r2"] = (reqs["r2"][0], reqs["r2"][1].clone(presence_penalty=0.7))
    roomy = drain(engine(str(tiny_gqa.path), block_size=4), reqs)
    eng = engine(str(tiny_gqa.path), spec(2, 1), block_size=4, kv_allocation="incremental",
                 enable_preemption=True, num_kv_blocks=4 * 14, async_scheduling=async_scheduling)
    tight = drain(eng, reqs)
    assert eng.scheduler.num_preemptions > 0
    assert_same(tight, roomy)
    assert not eng.runner.pages.snapshots


# default run: draft then verify; the pipeline (~2 s) is slow (its lanes dropped: spec/test_pipeline_engine.py's
# test_preemption_drops_lanes_and_resumes_exactly)
@pytest.mark.parametrize("speculative", [spec(3, 1), pytest.param(PIPE, marks=pytest.mark.slow)],
                         ids=["draft_verify", "pipeline"])
def test_abort_mid_round_frees_everything(demo_prompts, speculative):
    eng = engine(speculative=speculative)
    eng.add_request("a", {"prompt_token_ids": demo_prompts[0]}, GREEDY)
    eng.add_request("b", {"prompt_token_ids": demo_prompts[1]}, GREEDY)
    for _ in range(9):
        eng.step()
    eng.abort_request("a")
    out = drain(eng, {})
    assert eng.kv.num_used_blocks == 0 and not eng.scheduler.requests
    alone = drain(engine(), {"b": (demo_prompts[1], GREEDY)})
    assert out["b"].token_ids == alone["b"].token_ids


# --- configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    ({"method": "loop", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "loop", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "loop", "draft_loops": 0}, "speculative_config.draft_loops"),
    ({"method": "loop", "scheme": "pipelined"}, "speculative_config.scheme"),
    ({"method": "loop", "draftloops": 1}, "speculative_config.draftloops"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ("loop", "speculative_config"),
])
def test_bad_speculative_config_names_the_field(bad, field):
    with pytest.raises(InvalidRequestError) as e:
        EngineArgs(speculative_config=bad).validate()
    assert e.value.param == field


def test_draft_loops_must_be_below_the_model_loops():
    with pytest.raises(InvalidRequestError, match="draft_loops") as e:
        engine(speculative=spec(2, 4))  # the demo model has 4 loops
    assert e.value.param == "speculative_config.draft_loops" and "1..3" in str(e.value)


def test_cli_flag_is_vllm_spelled():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--speculative-config", '{"method": "loop", "num_speculative_tokens": 3, "draft_loops": 2}'])
    args = EngineArgs.from_cli_args(ns)
    assert args.speculative().num_speculative_tokens == 3 and args.speculative().draft_loops == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])


# --- metrics --------------------------------------------------------------------------------------
def test_bench_reports_acceptance_with_vllm_names():
    """``loopline bench --speculative-config``: the run's record carries vLLM's spec_decode counters of the
    measured part and the mean acceptance length."""
    from loopline.entrypoints.bench_cli import run_offline
    from loopline.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["bench", "--config", "tiny", "--device", "cpu", "--dtype", "float32",
                                    "--no-progress", "--input-len", "6", "--output-len", "10", "--concurrency", "2",
                                    "--speculative-config",
                                    '{"method": "loop", "scheme": "draft_verify", "num_speculative_tokens": 2, '
                                    '"adaptive": false}'])
    (point,) = run_offline(ns)["results"]
    run = point["variants"][0]["median"]
    spec_decode = run["spec_decode"]
    # random weights accept few drafts: adaptive speculation would stop before the measured part
    assert run["engine"]["speculative_config"] == {"method": "loop", "scheme": "draft_verify",
                                                   "num_speculative_tokens": 2, "adaptive": False}
    rounds = spec_decode["vllm:spec_decode_num_drafts"]
    assert rounds > 0 and spec_decode["vllm:spec_decode_num_draft_tokens"] == 2 * rounds
    accepted = spec_decode["vllm:spec_decode_num_accepted_tokens"]
    assert sum(spec_decode["vllm:spec_decode_num_accepted_tokens_per_pos"].values()) == accepted
    assert spec_decode["mean_acceptance_length"] == pytest.approx(1 + accepted / rounds)


def test_bench_no_spec_variant_gives_the_speedup_and_the_table_the_acceptance():
    """``--variants no_spec,loopline``: the same flags without speculation first, so "vs first" is the speedup;
    the text report prints each speculating run's acceptance under its table."""
    from loopline.bench.report import point_table
    from loopline.entrypoints.bench_cli import run_offline
    from loopline.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["bench", "--config", "tiny", "--device", "cpu", "--dtype", "float32",
                                    "--no-progress", "--input-len", "6", "--output-len", "8", "--concurrency", "1",
                                    "--repeats", "1", "--variants", "no_spec,loopline", "--speculative-config",
                                    '{"method": "loop", "adaptive": false}'])
    (point,) = run_offline(ns)["results"]
    off, on = (v["median"] for v in point["variants"])
    assert off["engine"]["speculative_config"] is None and off["spec_decode"] is None
    assert on["engine"]["speculative_config"] == {"method": "loop", "adaptive": False}
    assert on["spec_decode"]["vllm:spec_decode_num_draft_tokens"] > 0
    ratio = point["variants"][1]["ratio_output_throughput"]
    assert ratio == pytest.approx(on["output_throughput"] / off["output_throughput"])
    lines = point_table(point)
    accepted = on["spec_decode"]["vllm:spec_decode_num_accepted_tokens"]
    drafts = on["spec_decode"]["vllm:spec_decode_num_draft_tokens"]
    assert lines[-1].startswith(f"loopline: speculation {accepted:,} of {drafts:,} draft tokens accepted")
    assert not any(line.startswith("no_spec: speculation") for line in lines)


def test_stat_logger_line_reports_acceptance(demo_prompts):
    from loopline.engine.stat_logger import StatLogger

    eng = engine(speculative=spec(3, 1))
    drain(eng, {"r": (demo_prompts[0], GREEDY)})
    line = StatLogger(0.0).maybe_log(eng)
    assert "mean acceptance length" in line and f"of {eng.stats.spec_num_draft_tokens} draft tokens" in line


# --- through AsyncLLM ------------------------------------------------------------------------------
@pytest.mark.slow  # an engine process (~7-11 s on 2 cores). Default run: AsyncLLM's DELTA
# outputs (tests/entrypoints/test_output_kinds.py) and accepted runs committed together (the engine tests here)
def test_async_llm_streams_accepted_runs(demo_prompts):
    """AsyncLLM (the serving path) with speculation: DELTA outputs deliver a round's committed run together,
    and the whole completion equals plain decoding's."""
    import asyncio

    from loopline import AsyncLLM
    from loopline.sampling_params import RequestOutputKind

    params = GREEDY.clone(max_tokens=20, logprobs=None, output_kind=RequestOutputKind.DELTA)

    async def stream(llm) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) async for o in llm.generate({"prompt_token_ids": demo_prompts[0]},
                                                                         params, "r")]

    llm = AsyncLLM(EngineArgs(device="cpu", dtype="float32", max_num_seqs=2, speculative_config=spec(3, 1)))
    try:
        deltas = asyncio.run(stream(llm))
    finally:
        llm.shutdown()
    plain = drain(engine(), {"r": (demo_prompts[0], GREEDY.clone(max_tokens=20))})["r"]
    assert [t for d in deltas for t in d] == plain.token_ids
    assert max(len(d) for d in deltas) > 1  # an accepted run arrives in one delta
