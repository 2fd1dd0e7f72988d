"""The Ray backend: two replicas as Ray actors in one placement group (CPU bundles), the same
outputs as one engine, and an actor killed mid-stream failing only its requests. Skipped when
``ray`` is not installed (``pip install 'loopline[ray]'``)."""
from __future__ import annotations

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")

from loopline import AsyncLLM, SamplingParams  # noqa: E402
from loopline.engine import LLMEngine  # noqa: E402
from loopline.errors import EngineDeadError  # noqa: E402


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one(make_engine_args):
    llm = AsyncLLM(engine=LLMEngine(make_engine_args()))
    yield llm
    llm.shutdown()


def answer(out) -> list[tuple]:
    return [(c.token_ids, c.logprobs, c.exit_depths, c.finish_reason, c.text) for c in out.outputs]


def test_ray_replicas_in_a_placement_group_match_one_engine_and_survive_a_killed_actor(cluster, one,
                                                                                        make_engine_args):
    from ray.util import placement_group_table

    t0 = time.monotonic()
    llm = AsyncLLM(make_engine_args(data_parallel_size=2, distributed_executor_backend="ray"))
    started = time.monotonic() - t0
    try:
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert len(groups) == 1 and list(groups[0]["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
        params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1),
                  SamplingParams(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True, logprobs=0),
                  SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.5, ignore_eos=True)]
        owners = []

        async def alone(llm, i, p):  # one request at a time: both engines run the same batches
            out = await llm.generate_tokens([40 + i, 41, 42], p, f"r-{i}")
            return out

        for i, p in enumerate(params):
            got = run(alone(llm, i, p))
            assert answer(got) == answer(run(alone(one, i, p)))
        assert run(llm.get_weight_version()) == 0

        async def kill_mid_stream():
            long = SamplingParams(max_tokens=60, temperature=1.0, seed=4, ignore_eos=True)
            gens = {rid: llm.generate([50 + i, 51], long, rid) for i, rid in enumerate(("a", "b"))}
            for g in gens.values():
                await g.__anext__()
            owners.extend(llm.client.owner(rid) for rid in gens)
            assert sorted(owners) == [0, 1]
            ray.kill(llm.client.replicas()[owners[0]].actor)
            with pytest.raises(EngineDeadError, match=rf"^data-parallel replica {owners[0]}: "):
                async for _ in gens["a"]:
                    pass
            last = [out async for out in gens["b"]][-1]
            after = await llm.generate_tokens([60, 61], SamplingParams(max_tokens=3, ignore_eos=True), "after")
            return last, after

        last, after = run(kill_mid_stream())
        want = run(one.generate_tokens([51, 51], SamplingParams(max_tokens=60, temperature=1.0, seed=4,
                                                                 ignore_eos=True), "b"))
        assert answer(last) == answer(want)
        assert len(after.outputs[0].token_ids) == 3 and llm.health_problem() is None
        problems = [r.problem for r in llm.replicas()]
        assert problems[owners[1]] is None and "Ray actor died" in problems[owners[0]]
    finally:
        llm.shutdown(10)
    assert not [g for g in placement_group_table().values() if g["state"] == "CREATED"]  # released
    print(f"ray replicas started in {started:.1f}s")
