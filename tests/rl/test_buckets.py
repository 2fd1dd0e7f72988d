"""loopline.rl.buckets: size-bounded buckets over a (name, tensor) stream, and a bucketed publication."""
from __future__ import annotations

import pytest
import torch

from loopline.errors import InvalidRequestError, WeightUpdateError
from loopline.rl.buckets import iter_buckets, publish, tensor_bytes


def _stream(sizes, log=None):
    for i, n in enumerate(sizes):
        if log is not None:
            log.append(i)
        yield f"t{i}", torch.zeros(n, dtype=torch.float32)  # 4 bytes per element


def test_buckets_are_bounded_ordered_and_complete():
    sizes = [3, 5, 2, 10, 1, 1, 30, 4]
    buckets = list(iter_buckets(_stream(sizes), bucket_bytes=40))
    assert [n for b in buckets for n, _ in b] == [f"t{i}" for i in range(len(sizes))]  # order kept, nothing lost
    for b in buckets:
        total = sum(tensor_bytes(t) for _, t in b)
        assert total <= 40 or len(b) == 1  # an oversized tensor (30 x 4 bytes) travels alone
    assert [len(b) for b in buckets] == [3, 1, 2, 1, 1]  # 12+20+8 | 40 | 4+4 | 120 alone | 16


def test_buckets_read_the_stream_one_bucket_at_a_time():
    log: list[int] = []
    it = iter_buckets(_stream([4, 4, 4, 4], log), bucket_bytes=32)
    first = next(it)
    assert [n for n, _ in first] == ["t0", "t1"]
    assert log == [0, 1, 2]  # the third tensor was read to close the first bucket, the fourth not yet


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_bucket_bytes_is_checked(bad):
    with pytest.raises(InvalidRequestError) as e:
        list(iter_buckets(_stream([1]), bucket_bytes=bad))
    assert e.value.param == "bucket_bytes"


def test_publish_in_buckets_commits_the_new_weights(tiny_gqa, engine_for, run, ids):
    from loopline import SamplingParams

    engine = engine_for(tiny_gqa)
    state = {k: v.clone() * 1.01 for k, v in tiny_gqa.state_dict.items()}
    stats = publish(engine, iter(state.items()), 1, bucket_bytes=4096)
    assert stats.version == engine.get_weight_version() == 1
    assert stats.tensors == len(state) and stats.buckets > 1 and stats.largest_bucket_bytes >= 4096 // 2
    served = engine.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in state.items())
    out = run(engine, {"a": (ids(5), SamplingParams(max_tokens=3, temperature=0))})["a"]
    assert out.weight_version == 1


def test_publish_failure_aborts_and_keeps_the_old_version(tiny_gqa, engine_for):
    engine = engine_for(tiny_gqa)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    items = [(k, v.clone()) for k, v in tiny_gqa.state_dict.items()]
    items[0] = ("model.no_such.weight", items[0][1])  # the first bucket is refused: nothing copied
    with pytest.raises(WeightUpdateError):
        publish(engine, items, 1, bucket_bytes=1 << 30)
    assert engine.get_weight_version() == 0 and not engine.control.weights.in_progress
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())


def test_publish_async_in_buckets(tiny_gqa, tiny_factory, ids, engine_for, run):
    import asyncio

    from loopline import AsyncLLM, SamplingParams
    from loopline.rl.buckets import publish_async

    other = tiny_factory(7)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)

    async def main(engine):
        llm = AsyncLLM(engine=engine)
        try:
            assert await llm.device_memory_stats() is None  # CPU
            stats = await publish_async(llm, iter(other.state_dict.items()), 1, bucket_bytes=2048)
            return stats, await llm.generate_tokens(ids(5), params)
        finally:
            llm.shutdown()

    stats, out = asyncio.run(main(engine_for(tiny_gqa)))
    assert stats.version == 1 and stats.buckets > 1 and stats.tensors == len(other.state_dict)
    ref = run(engine_for(other), {"r": (ids(5), params)})["r"].outputs[0]  # a fresh engine on the new weights
    assert out.weight_version == 1 and out.outputs[0].token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(out.outputs[0].token_logprobs, ref.token_logprobs)) <= 1e-5
