"""AsyncLLM's RL control calls under concurrent requests: pause modes, weight updates, sleep."""
from __future__ import annotations

import asyncio
import time

import pytest

from loopline import AsyncLLM, SamplingParams
from loopline.errors import EngineStateError, InvalidRequestError, WeightUpdateError


def in_thread(args) -> AsyncLLM:
    """An AsyncLLM whose engine loop runs on a thread of this process (the test reads ``llm.engine``)."""
    from loopline.engine import LLMEngine

    return AsyncLLM(engine=LLMEngine(args))


LONG = SamplingParams(max_tokens=120, temperature=1.0, ignore_eos=True, logprobs=0)


def run(coro):
    return asyncio.run(coro)


def ids(n: int, start: int = 3) -> list[int]:
    return [start + (7 * i) % 400 for i in range(n)]


async def final(llm: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str):
    return await llm.generate_tokens(prompt, params, rid)


async def wait_until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture
def llm(make_engine_args):
    llm = in_thread(make_engine_args(max_num_batched_tokens=16))
    yield llm
    llm.shutdown()


class StepCounter:
    """Counts the engine loop's ``engine.step_deltas()`` calls, to tell a waiting engine thread from a spinning one."""

    def __init__(self, engine) -> None:
        self.calls = 0
        self._step = engine.step_deltas
        engine.step_deltas = self

    def __call__(self):
        self.calls += 1
        return self._step()


def started(llm: AsyncLLM, n: int) -> bool:
    # The scheduler, not the snapshot: a snapshot may still count a request that just finished.
    reqs = list(llm.engine.scheduler.requests.values())
    return len(reqs) == n and all(len(r.output) > 0 for r in reqs)


def test_pause_abort_ends_in_flight_requests_and_holds_new_ones_without_spinning(llm):
    counter = StepCounter(llm.engine)

    async def main():
        tasks = [asyncio.ensure_future(final(llm, ids(5 + 4 * i), LONG.clone(seed=i), f"r{i}")) for i in range(3)]
        await wait_until(lambda: started(llm, 3))
        await llm.pause_generation("abort")
        assert await llm.is_paused()
        outs = await asyncio.gather(*tasks)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "abort" and 0 < len(c.token_ids) == len(c.token_logprobs) == len(c.exit_depths) < 120
        assert llm.engine.kv.num_used_blocks == 0
        late = asyncio.ensure_future(final(llm, ids(6), LONG.clone(max_tokens=4, seed=9), "late"))
        await asyncio.sleep(0.05)
        calls = counter.calls
        await asyncio.sleep(0.3)
        assert not late.done() and llm.engine.has_unfinished_requests()
        assert counter.calls - calls <= 1, "the engine thread steps while only held requests exist"
        await llm.resume_generation()
        assert not await llm.is_paused()
        out = await late
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4

    run(main())


def test_pause_wait_returns_when_drained_and_holds_new_requests(llm):
    async def main():
        params = [LONG.clone(max_tokens=6 + 3 * i, seed=i) for i in range(3)]
        tasks = [asyncio.ensure_future(final(llm, ids(5 + i), p, f"w{i}")) for i, p in enumerate(params)]
        await wait_until(lambda: llm.snapshot.num_running == 3)
        await llm.pause_generation("wait")
        assert all(t.done() for t in tasks) and llm.engine.is_drained
        assert [len(t.result().outputs[0].token_ids) for t in tasks] == [6, 9, 12]
        assert all(t.result().outputs[0].finish_reason == "length" for t in tasks)
        late = asyncio.ensure_future(final(llm, ids(4), LONG.clone(max_tokens=3, seed=5), "late"))
        await asyncio.sleep(0.1)
        assert not late.done()
        await llm.resume_generation()
        assert (await late).outputs[0].finish_reason == "length"

    run(main())


def test_pause_wait_fails_when_resumed_before_drained(llm):
    async def main():
        task = asyncio.ensure_future(final(llm, ids(5), LONG.clone(max_tokens=200, seed=1), "long"))
        await wait_until(lambda: started(llm, 1))
        pause = asyncio.ensure_future(llm.pause_generation("wait"))
        await wait_until(lambda: llm.engine.is_paused)
        await llm.resume_generation()
        with pytest.raises(EngineStateError, match="resumed before"):
            await pause
        await llm.abort("long")
        assert (await task).outputs[0].finish_reason == "abort"

    run(main())


def test_keep_pause_continues_exactly(llm):
    params = LONG.clone(max_tokens=60, seed=21)
    reference = run(final(llm, ids(9), params, "ref")).outputs[0]

    async def main():
        task = asyncio.ensure_future(final(llm, ids(9), params, "kept"))
        await wait_until(lambda: started(llm, 1))
        await llm.pause_generation("keep")
        counter = StepCounter(llm.engine)
        await asyncio.sleep(0.2)
        assert not task.done() and counter.calls == 0, "the engine thread steps while its requests are frozen"
        await llm.resume_generation()
        return await task

    kept = run(main()).outputs[0]
    assert (kept.token_ids, kept.exit_depths, kept.token_logprobs) == (
        reference.token_ids, reference.exit_depths, reference.token_logprobs)


def test_weight_update_across_a_keep_pause_and_errors_keep_their_type(llm, tiny_factory):
    new = tiny_factory(3).state_dict
    names = sorted(new)

    async def main():
        task = asyncio.ensure_future(final(llm, ids(7), LONG.clone(max_tokens=100, seed=4), "kept"))
        await wait_until(lambda: started(llm, 1))
        with pytest.raises(EngineStateError, match="idle or paused"):  # still generating
            await llm.start_weight_update(1)
        await llm.pause_generation("keep")
        with pytest.raises(WeightUpdateError) as info:
            await llm.start_weight_update(-1)
        assert info.value.param == "version"
        await llm.start_weight_update(1)
        with pytest.raises(WeightUpdateError) as info:
            await llm.update_weights([("model.no_such.weight", new[names[0]])])
        assert info.value.param == "model.no_such.weight"
        # the rejected call closed the update without copying anything: start again
        await llm.start_weight_update(1)
        for i in range(4):  # a dict, a list and generators: all accepted
            shard = {n: new[n] for n in names[i::4]}
            held = await llm.update_weights(shard if i == 0 else list(shard.items()) if i == 1 else
                                            ((n, t) for n, t in shard.items()))
            assert held == len(shard)
        assert await llm.finish_weight_update() == 1
        assert await llm.get_weight_version() == 1
        await llm.resume_generation()
        return await task

    out = run(main())
    versions = out.outputs[0].weight_versions
    assert out.weight_version == 1 and versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions) and len(out.outputs[0].token_ids) == 100


def test_update_weights_from_disk_and_sleep(llm, tiny_factory, make_engine_args):
    new = tiny_factory(3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    fresh = in_thread(make_engine_args(model=str(new.path)))
    try:
        expected = run(final(fresh, ids(8), params, "x")).outputs[0].token_ids
    finally:
        fresh.shutdown()

    async def main():
        with pytest.raises(InvalidRequestError) as info:
            await llm.pause_generation("sometimes")
        assert info.value.param == "mode"
        await llm.pause_generation("abort")
        with pytest.raises(Exception) as info:
            await llm.update_weights_from_disk(str(new.path / "missing"), 2)
        assert "does not exist" in str(info.value)
        assert await llm.get_weight_version() == 0
        assert await llm.update_weights_from_disk(str(new.path), 2) == 2
        with pytest.raises(InvalidRequestError) as info:
            await llm.sleep(3)
        assert info.value.param == "level"
        await llm.sleep(2)
        assert await llm.is_sleeping()
        with pytest.raises(EngineStateError, match="asleep"):
            await llm.resume_generation()
        await llm.wake_up(["weights"])
        await llm.wake_up(["kv_cache"])
        assert not await llm.is_sleeping()
        await llm.reset_prefix_cache()
        await llm.resume_generation()
        out = await final(llm, ids(8), params, "y")
        assert out.weight_version == 2
        return out.outputs[0].token_ids

    assert run(main()) == expected


def test_abort_all_and_control_calls_after_shutdown(make_engine_args):
    from loopline.errors import EngineDeadError

    llm = in_thread(make_engine_args())

    async def main():
        tasks = [asyncio.ensure_future(final(llm, ids(5 + i), LONG.clone(seed=i), f"a{i}")) for i in range(2)]
        await wait_until(lambda: started(llm, 2))
        assert sorted(await llm.abort_all()) == ["a0", "a1"]
        assert all(o.outputs[0].finish_reason == "abort" for o in await asyncio.gather(*tasks))
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            await llm.get_weight_version()

    run(main())


def test_pause_keep_then_a_half_failed_update_then_pause_wait_keeps_the_engine_alive(llm, tiny_factory):
    """The sequence that used to kill the engine thread: a step that raises fails only the
    requests in flight, /health says why, and a complete update brings generation back."""
    new_state_dict = tiny_factory(3).state_dict

    async def main():
        names = sorted(new_state_dict)
        task = asyncio.ensure_future(final(llm, ids(5), LONG, "inflight"))
        await wait_until(lambda: llm.snapshot.num_running == 1)
        await llm.pause_generation("keep")
        await llm.start_weight_update(1)
        await llm.update_weights({n: new_state_dict[n] for n in names[:3]})  # copied: now partially new
        with pytest.raises(WeightUpdateError, match="incomplete"):
            await llm.finish_weight_update()
        assert "partially updated" in llm.health_problem() and llm.weights_state() == "partially_updated"
        await llm.pause_generation("wait")  # frozen requests would step on broken weights: they fail instead
        with pytest.raises(EngineStateError, match="partially updated"):
            await task
        assert llm.is_running and llm.engine.kv.num_used_blocks == 0
        await llm.start_weight_update(2)
        await llm.update_weights(new_state_dict)
        assert await llm.finish_weight_update() == 2
        await llm.resume_generation()
        assert llm.health_problem() is None and llm.weights_state() == "committed"
        out = await final(llm, ids(5), SamplingParams(max_tokens=3, ignore_eos=True), "after")
        assert out.weight_version == 2 and len(out.outputs[0].token_ids) == 3

    run(main())
