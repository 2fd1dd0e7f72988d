"""Prefix caching, incremental allocation, priorities, preemption, watermark (issue: KV and scheduling features).

Every feature must leave outputs unchanged, token for token and exit depth for
exit depth, against a plain roomy run.
"""
from __future__ import annotations

import random

import pytest
from engine_testing import run_arrivals as drain

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.engine.input_processor import child_request_id


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def engine_for(tiny, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineArgs(model=str(tiny.path), **kw))


def result(out):
    return [(c.token_ids, c.exit_depths) for c in out.outputs]


ADAPTIVE = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, exit_threshold=0.7)


# --- prefix caching ------------------------------------------------------------------------------
def shared_prefix_requests(params):
    system = ids(13, seed=99)
    return {f"r{i}": (system + ids(3 + i, seed=i), params) for i in range(4)}


# default run: greedy under refill, sampled under no_refill; the other two pairings (~1 s each) are slow
@pytest.mark.parametrize("params, mode", [
    pytest.param(ADAPTIVE, "refill", id="params0-refill"),
    pytest.param(ADAPTIVE, "no_refill", id="params0-no_refill", marks=pytest.mark.slow),
    pytest.param(SAMPLED, "refill", id="params1-refill", marks=pytest.mark.slow),
    pytest.param(SAMPLED, "no_refill", id="params1-no_refill")])
def test_prefix_caching_equals_no_caching(tiny_gqa, params, mode):
    reqs = shared_prefix_requests(params)
    arrivals = {"r0": 0, "r1": 30, "r2": 30, "r3": 60}  # later requests find r0's pages cached
    plain = drain(engine_for(tiny_gqa, scheduling_mode=mode), reqs, arrivals)
    eng = engine_for(tiny_gqa, enable_prefix_caching=True, scheduling_mode=mode)
    cached = drain(eng, reqs, arrivals)
    assert {k: result(v) for k, v in cached.items()} == {k: result(v) for k, v in plain.items()}
    stats = eng.kv.prefix_cache.stats
    assert stats.hits == 3 * 12  # three later requests reuse the 3 full pages of the 13-token system prompt
    assert stats.queries == sum(len(p) for p, _ in reqs.values())
    assert eng.kv.num_used_blocks == 0  # cached pages are idle, not in use


def test_prefix_cache_eviction_under_pressure_and_reset(tiny_gqa):
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reqs = {f"q{i}": (ids(12, seed=100 + i), p) for i in range(6)}  # all different prompts
    eng = engine_for(tiny_gqa, enable_prefix_caching=True, num_kv_blocks=48, max_num_seqs=2)
    out = drain(eng, reqs)
    plain = drain(engine_for(tiny_gqa), reqs)
    assert {k: result(v) for k, v in out.items()} == {k: result(v) for k, v in plain.items()}
    cache = eng.kv.prefix_cache
    assert cache.stats.evictions > 0 and cache.num_pages * 4 <= 48
    again = drain(eng, {"again": (ids(12, seed=105), p)})  # the last prompt is still cached
    assert cache.stats.hits >= 8 and result(again["again"]) == result(plain["q5"])
    eng.reset_prefix_cache()
    assert cache.num_pages == 0 and eng.kv.num_used_blocks == 0
    hits = cache.stats.hits
    drain(eng, {"after_reset": (ids(12, seed=105), p)})
    assert cache.stats.hits == hits


def test_prefix_cache_keyed_by_weight_version(tiny_gqa):
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng = engine_for(tiny_gqa, enable_prefix_caching=True)
    drain(eng, {"a": (ids(12, seed=7), p)})
    eng.scheduler.cache_salt = "v2"  # what a weight update does
    drain(eng, {"b": (ids(12, seed=7), p)})
    assert eng.kv.prefix_cache.stats.hits == 0


def test_shared_layout_reuses_nothing(tiny_gqa):
    reqs = shared_prefix_requests(ADAPTIVE)
    arrivals = {"r0": 0, "r1": 30, "r2": 30, "r3": 60}
    eng = engine_for(tiny_gqa, kv_layout="shared", enable_prefix_caching=True)
    out = drain(eng, reqs, arrivals)
    plain = drain(engine_for(tiny_gqa, kv_layout="shared"), reqs, arrivals)
    assert eng.kv.prefix_cache is None  # documented: no sound reuse for `shared`
    assert {k: result(v) for k, v in out.items()} == {k: result(v) for k, v in plain.items()}


# --- incremental allocation, watermark -------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_incremental_allocation_grows_and_matches_full(tiny_gqa, async_scheduling):
    reqs = {f"r{i}": (ids(5 + 3 * i, seed=i), ADAPTIVE.clone(max_tokens=12)) for i in range(3)}
    peaks = {}

    def watch(kind):
        def f(engine):
            peaks[kind] = max(peaks.get(kind, 0), engine.kv.num_used_blocks)
        return f

    full = drain(engine_for(tiny_gqa), reqs, watch=watch("full"))
    inc = drain(engine_for(tiny_gqa, kv_allocation="incremental", async_scheduling=async_scheduling), reqs,
                watch=watch("inc"))
    assert {k: result(v) for k, v in inc.items()} == {k: result(v) for k, v in full.items()}
    assert peaks["inc"] < peaks["full"]


def test_incremental_without_preemption_reserves_growth(tiny_gqa):
    # Two requests each need 4 planes * ceil((8+15)/4)=6 -> 24 blocks at full length; 40 blocks hold one.
    reqs = {f"r{i}": (ids(8, seed=i), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for i in range(2)}
    peak = []
    eng = engine_for(tiny_gqa, kv_allocation="incremental", num_kv_blocks=40)
    out = drain(eng, reqs, watch=lambda e: peak.append((e.kv.num_used_blocks, e.scheduler.num_running)))
    assert max(n for _, n in peak) == 1  # the second waits: admitting it could deadlock both
    assert all(len(o.outputs[0].token_ids) == 16 for o in out.values())


def test_watermark_keeps_headroom(tiny_gqa):
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reqs = {f"r{i}": (ids(8, seed=i), p) for i in range(4)}  # 4 planes * 3 blocks = 12 blocks each
    running = []
    eng = engine_for(tiny_gqa, num_kv_blocks=40, kv_watermark=0.25)  # keep 10 free: at most 2 running
    drain(eng, reqs, watch=lambda e: running.append(e.scheduler.num_running))
    assert max(running) == 2
    running.clear()
    drain(engine_for(tiny_gqa, num_kv_blocks=40), reqs, watch=lambda e: running.append(e.scheduler.num_running))
    assert max(running) == 3


# --- priorities ------------------------------------------------------------------------------------
def test_priority_order_under_contention(tiny_gqa):
    eng = engine_for(tiny_gqa, scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=16)
    order = []
    prios = {"low": 5, "mid_a": 1, "high": -3, "mid_b": 1}
    reqs = {rid: (ids(4, seed=i), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, priority=pr))
            for i, (rid, pr) in enumerate(prios.items())}
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["high", "mid_a", "mid_b", "low"]  # lower first, stable among equals


# --- preemption ------------------------------------------------------------------------------------
# default run: four of the eight, each pair of mode, layout and engine order once; the rest (~1 s each) slow
_PREEMPTION_DEFAULT = {("refill", "last_exited", False), ("refill", "shared", True), ("no_refill", "last_exited", True),
                       ("no_refill", "shared", False)}


@pytest.mark.parametrize("mode, layout, async_scheduling", [
    pytest.param(m, lay, a, id=f"{m}-{lay}-{a}", marks=[] if (m, lay, a) in _PREEMPTION_DEFAULT else [pytest.mark.slow])
    for m in ("refill", "no_refill") for lay in ("last_exited", "shared") for a in (False, True)])
def test_preemption_under_tiny_pool_equals_unpressured_run(tiny_gqa, layout, mode, async_scheduling):
    reqs = {f"r{i}": (ids(6 + 2 * i, seed=20 + i), (ADAPTIVE if i % 2 else SAMPLED).clone(max_tokens=14))
            for i in range(4)}
    roomy = drain(engine_for(tiny_gqa, kv_layout=layout, scheduling_mode=mode), reqs)
    planes = 4 if layout == "last_exited" else 1
    eng = engine_for(tiny_gqa, kv_layout=layout, scheduling_mode=mode, kv_allocation="incremental",
                     enable_preemption=True, num_kv_blocks=planes * 12, async_scheduling=async_scheduling)
    tight = drain(eng, reqs)
    assert eng.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in tight.values()) == eng.scheduler.num_preemptions
    assert all(o.metrics.num_preemptions == 0 for o in roomy.values())
    assert {k: result(v) for k, v in tight.items()} == {k: result(v) for k, v in roomy.items()}
    assert eng.kv.num_used_blocks == 0 and not eng.runner.pages.snapshots


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_higher_priority_arrival_preempts_and_victim_resumes_exactly(tiny_gqa, async_scheduling):
    low = {"low": (ids(10, seed=1), SAMPLED.clone(max_tokens=20, priority=10))}
    high = {"high": (ids(6, seed=2), ADAPTIVE.clone(priority=0))}
    eng = engine_for(tiny_gqa, scheduling_policy="priority", enable_preemption=True, max_num_seqs=1,
                     async_scheduling=async_scheduling)
    out = drain(eng, {**low, **high}, arrivals={"low": 0, "high": 12})
    assert eng.scheduler.num_preemptions == 1
    assert (out["low"].metrics.num_preemptions, out["high"].metrics.num_preemptions) == (1, 0)
    assert out["high"].metrics.finished_time < out["low"].metrics.finished_time
    alone = drain(engine_for(tiny_gqa), low)
    assert result(out["low"]) == result(alone["low"])


def test_full_swap_space_makes_requests_wait(tiny_gqa):
    reqs = {f"r{i}": (ids(6, seed=i), ADAPTIVE.clone(max_tokens=10)) for i in range(3)}
    eng = engine_for(tiny_gqa, kv_allocation="incremental", enable_preemption=True, num_kv_blocks=24, swap_space=0.0)
    out = drain(eng, reqs)
    assert eng.scheduler.num_preemptions == 0
    roomy = drain(engine_for(tiny_gqa), reqs)
    assert {k: result(v) for k, v in out.items()} == {k: result(v) for k, v in roomy.items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_preemption_mid_prefill_resumes_exactly(tiny_gqa, layout, async_scheduling):
    low = {"low": (ids(40, seed=3), SAMPLED.clone(max_tokens=6, priority=10))}
    high = {"high": (ids(5, seed=4), ADAPTIVE.clone(max_tokens=4, priority=0))}
    statuses = []
    eng = engine_for(tiny_gqa, kv_layout=layout, scheduling_policy="priority", enable_preemption=True,
                     max_num_seqs=1, max_num_batched_tokens=8, async_scheduling=async_scheduling)

    def watch(engine):
        low = engine.scheduler.requests.get(child_request_id("low", 0))
        statuses.append(low.status.value if low is not None else None)

    out = drain(eng, {**low, **high}, arrivals={"low": 0, "high": 3}, watch=watch)
    assert eng.scheduler.num_preemptions == 1
    assert statuses[2] == "prefill" and statuses[3] == "preempted"  # preempted while its prompt was half done
    alone = drain(engine_for(tiny_gqa, kv_layout=layout, max_num_seqs=1, max_num_batched_tokens=8), low)
    assert result(out["low"]) == result(alone["low"])


def test_async_preemption_keeps_device_state(tiny_gqa):
    """Async scheduling keeps penalty counts and trace depths per slot on the device: a victim's move
    out and back (to another slot) must carry them."""
    pen = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=1.2,
                         exit_depths=[2, 4, 1, 3, 4, 2])
    reqs = {f"r{i}": (ids(6 + 2 * i, seed=40 + i), pen) for i in range(4)}
    roomy = drain(engine_for(tiny_gqa, exit_mode="trace"), reqs)
    eng = engine_for(tiny_gqa, exit_mode="trace", kv_allocation="incremental", enable_preemption=True,
                     num_kv_blocks=4 * 12, async_scheduling=True)
    tight = drain(eng, reqs)
    assert eng.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in tight.values()) == eng.scheduler.num_preemptions
    assert all(o.metrics.num_preemptions == 0 for o in roomy.values())
    assert {k: result(v) for k, v in tight.items()} == {k: result(v) for k, v in roomy.items()}
