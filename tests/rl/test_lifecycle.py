"""Pause modes under concurrent load, keep-mode exactness, updates across a keep pause, sleep / wake-up."""
from __future__ import annotations

import pytest

from loopline import SamplingParams
from loopline.core.request import RequestStatus
from loopline.errors import EngineStateError, InvalidRequestError

SAMPLED = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True, logprobs=0, exit_threshold=0.6)


def load(ids, n=4):
    """Concurrent requests of varied lengths; seeded so that runs are comparable."""
    return {f"r{i}": (ids(5 + 6 * i, seed=i), SAMPLED.clone(seed=40 + i)) for i in range(n)}


def add_all(engine, reqs):
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)


def steps(engine, k):
    outs = []
    for _ in range(k):
        outs += engine.step()
    return outs


def summary(done):
    return {rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths, o.outputs[0].token_logprobs)
            for rid, o in done.items()}


@pytest.fixture
def small(tiny_gqa, engine_for):
    """Small token budget: prompts prefill in chunks, so a pause catches requests mid-prefill too."""
    return lambda **kw: engine_for(tiny_gqa, max_num_seqs=4, max_num_batched_tokens=8, **kw)


def test_pause_abort_under_load(small, run, ids):
    engine = small()
    add_all(engine, load(ids))
    steps(engine, 9)
    assert engine.scheduler.num_running > 0
    engine.pause_generation("abort")
    assert engine.is_paused and engine.kv.num_used_blocks == 0 and not engine.scheduler.has_unfinished()
    engine.add_request("late", {"prompt_token_ids": ids(6)}, SAMPLED)  # held while paused
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"r0", "r1", "r2", "r3"}
    for o in outs.values():
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "abort"
        assert len(c.token_ids) == len(c.exit_depths) == len(c.token_logprobs) < 10
    assert engine.step() == [] and engine.has_unfinished_requests()  # "late" waits for the resume
    engine.resume_generation()
    done = run(engine)
    assert done["late"].outputs[0].finish_reason == "length"


def test_pause_wait_drains_in_flight_and_holds_new(small, run, ids):
    engine = small()
    add_all(engine, load(ids, 3))
    steps(engine, 4)
    engine.pause_generation("wait")
    engine.add_request("late", {"prompt_token_ids": ids(6)}, SAMPLED)
    assert not engine.is_drained
    done = {}
    while not engine.is_drained:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == {"r0", "r1", "r2"}
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 10 for o in done.values())
    assert engine.has_unfinished_requests() and engine.step() == []
    engine.resume_generation()
    assert not engine.is_paused
    assert run(engine)["late"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("pause_at", [2, 7])
def test_pause_keep_freezes_and_resumes_exactly(small, run, ids, layout, pause_at, async_scheduling):
    reference = summary(run(small(kv_layout=layout), load(ids)))
    engine = small(kv_layout=layout, async_scheduling=async_scheduling)
    add_all(engine, load(ids))
    done = {o.request_id: o for o in steps(engine, pause_at) if o.finished}
    engine.pause_generation("keep")
    frozen = {rid: (len(r.output), r.status) for rid, r in engine.scheduler.requests.items()}
    assert frozen, "requests must be in flight when the pause lands"
    assert steps(engine, 5) == []
    assert {rid: (len(r.output), r.status) for rid, r in engine.scheduler.requests.items()} == frozen
    engine.resume_generation()
    done.update(run(engine))
    got = summary(done)
    # The pause changes how rows are batched: tokens and depths identical, logprobs to fp32 tolerance.
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in reference.items()}
    assert all(abs(a - b) < 1e-5 for k in got for a, b in zip(got[k][2], reference[k][2]))


def test_keep_pause_across_a_weight_update(tiny_factory, small, engine_for, run, ids):
    new = tiny_factory(3)
    engine = small(enable_prefix_caching=True)
    reqs = load(ids)
    add_all(engine, reqs)
    steps(engine, 3)
    engine.pause_generation("keep")
    mid_prefill = [rid.rsplit("#", 1)[0] for rid, r in engine.scheduler.requests.items()
                   if r.status == RequestStatus.PREFILL]
    assert mid_prefill
    engine.start_weight_update(1)
    engine.update_weights(new.state_dict.items())
    engine.finish_weight_update()
    engine.resume_generation()
    done = run(engine)
    for rid, o in done.items():
        versions = o.outputs[0].weight_versions
        assert len(versions) == 10 and versions[-1] == 1 and o.weight_version == 1
        assert versions == sorted(versions)  # old tokens first, then the new weights
    # A prompt whose prefill straddled the update is not cached under the new version:
    # the same prompt again gives what a fresh engine with the new weights gives.
    prompt, params = reqs[mid_prefill[0]]
    again = run(engine, {"x": (prompt, params)})["x"]
    fresh = run(engine_for(new, max_num_seqs=4, max_num_batched_tokens=8), {"x": (prompt, params)})["x"]
    assert summary({"x": again}) == summary({"x": fresh})


def test_sleep_and_wake_up(tiny_gqa, tiny_factory, small, engine_for, run, ids):
    engine = small()
    before = summary(run(engine, load(ids, 2)))
    engine.add_request("busy", {"prompt_token_ids": ids(4)}, SAMPLED)
    with pytest.raises(EngineStateError, match="in flight"):
        engine.sleep()
    engine.abort_request("busy")
    engine.step()

    engine.sleep(level=1)
    assert engine.is_sleeping and engine.runner.k_cache.numel() == 0
    with pytest.raises(EngineStateError, match="asleep"):
        engine.add_request("x", {"prompt_token_ids": ids(4)}, SAMPLED)
    engine.wake_up()
    assert not engine.is_sleeping and summary(run(engine, load(ids, 2))) == before

    engine.sleep(level=2)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(EngineStateError, match="wake_up"):
        engine.start_weight_update(1)
    engine.wake_up(tags=["weights"])  # a colocated trainer: weights first, update, then the KV cache
    assert engine.is_sleeping
    new = tiny_factory(3)
    engine.start_weight_update(1)
    engine.update_weights(new.state_dict.items())
    engine.finish_weight_update()
    engine.wake_up(tags=["kv_cache"])
    after = run(engine, load(ids, 2))
    assert summary(after) == summary(run(engine_for(new, max_num_seqs=4, max_num_batched_tokens=8), load(ids, 2)))
    assert all(o.weight_version == 1 for o in after.values())


def test_bad_lifecycle_arguments(small):
    engine = small()
    with pytest.raises(InvalidRequestError, match="mode"):
        engine.pause_generation("retract")
    with pytest.raises(InvalidRequestError, match="level"):
        engine.sleep(level=3)
    with pytest.raises(InvalidRequestError, match="tags"):
        engine.wake_up(tags=["weights", "graphs"])
    engine.resume_generation()  # not paused: a no-op
    assert not engine.is_paused
