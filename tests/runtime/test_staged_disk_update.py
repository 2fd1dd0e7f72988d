"""``update_weights_from_disk`` through the engine loop (issue #43): the checkpoint is read and validated on
a reader thread while requests keep generating; new requests are held once it is validated, the requests
in flight finish on the old weights, and the copy runs between two steps. A load that fails changes nothing
and the requests in flight go on; a second update while one is under way is refused."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from reads_testing import count_live_reads
from safetensors.torch import load_file, save_file

from loopline import AsyncLLM, EngineArgs, SamplingParams
from loopline.engine import LLMEngine
from loopline.engine import control as control_module
from loopline.errors import EngineStateError, WeightUpdateError

PROMPT = [5, 9, 23, 7, 11, 40, 2, 17]
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)  # still generating when the load ends
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class GatedReader:
    """Replaces the checkpoint reader: records the thread of each tensor read and holds the first read
    until :meth:`release` (the test generates meanwhile)."""

    def __init__(self, monkeypatch) -> None:
        self.threads: list[str] = []
        self.gate = threading.Event()
        real = control_module.iter_checkpoint_tensors

        def gated(path):
            for entry in real(path):
                self.threads.append(threading.current_thread().name)
                self.gate.wait(60)
                yield entry

        monkeypatch.setattr(control_module, "iter_checkpoint_tensors", gated)

    def release(self) -> None:
        self.gate.set()


@pytest.fixture
def llm(tiny_gqa):
    llm = AsyncLLM(engine=LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", max_num_seqs=4,
                                               max_num_batched_tokens=64, max_model_len=256,
                                               skip_tokenizer_init=True)))
    yield llm
    llm.shutdown()


async def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


async def tokens_while_the_reader_waits(llm, reader, stream, update, more: int = 8) -> int:
    """Reads ``stream`` until it produced ``more`` tokens after the reader started on its first tensor, and
    checks the reader is still held there and the update unanswered; returns the tokens seen so far."""
    await wait_until(lambda: reader.threads)
    steps = llm.engine.stats.steps
    async def tokens() -> int:  # (a reader on the engine thread would hold the stream: fail, not hang)
        return len((await asyncio.wait_for(stream.__anext__(), 10)).outputs[0].token_ids)

    seen = start = await tokens()
    while seen < start + more:
        seen = await tokens()
    assert len(reader.threads) == 1 and not update.done()
    assert llm.engine.stats.steps > steps  # the engine stepped while the checkpoint was being read
    return seen


def test_requests_generate_while_the_checkpoint_is_read_then_the_new_weights_serve(llm, tiny_factory, monkeypatch):
    new = tiny_factory(3)
    expected = new.llm(max_num_seqs=4, max_model_len=256, skip_tokenizer_init=True).generate(
        {"prompt_token_ids": PROMPT}, SHORT, use_tqdm=False)[0].outputs[0].token_ids
    reader = GatedReader(monkeypatch)
    control = llm.engine.control

    async def main():
        stream = llm.generate({"prompt_token_ids": PROMPT}, LONG, "in-flight")
        update = asyncio.ensure_future(llm.update_weights_from_disk(str(new.path), 1))
        seen = await tokens_while_the_reader_waits(llm, reader, stream, update)
        # one update at a time: the others are refused at once, the one under way goes on
        with pytest.raises(EngineStateError, match="under way"):
            await llm.update_weights_from_disk(str(new.path), 2)
        with pytest.raises(EngineStateError, match="under way"):
            await llm.start_weight_update(2)
        reader.release()
        await wait_until(lambda: control.swap_pending)  # validated: from now on new requests wait for the swap
        later = asyncio.ensure_future(llm.generate_tokens(PROMPT, SHORT, "later"))
        async for out in stream:
            pass
        return seen, out, await update, await later

    seen, in_flight, version, later = asyncio.run(main())
    c = in_flight.outputs[0]
    assert seen < 200 and len(c.token_ids) == 200 and c.finish_reason == "length"
    assert set(c.weight_versions) == {0} and in_flight.weight_version == 0  # one version per generation
    assert version == 1 and later.weight_version == 1 and set(later.outputs[0].weight_versions) == {1}
    assert later.outputs[0].token_ids == expected  # the new weights serve, copied whole
    assert set(reader.threads) == {"loopline-weights-reader"}  # never read on the engine thread
    assert len(reader.threads) == 2 * len(control.weights.names)  # a validating read, then the copying one
    assert control.disk_load is None and not control.held and not control.weights.in_progress


def nan_checkpoint(src, dst):
    """``src``'s checkpoint with NaN in its last tensor (found only at the end of the validating read)."""
    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    tensors[max(tensors)][0] = float("nan")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_failed_load_changes_nothing_and_the_requests_in_flight_go_on(llm, tiny_factory, monkeypatch, tmp_path):
    bad = nan_checkpoint(tiny_factory(3).path, tmp_path / "nan")
    before = {n: p.detach().clone() for n, p in llm.engine.model.named_parameters()}
    reader = GatedReader(monkeypatch)

    async def main():
        stream = llm.generate({"prompt_token_ids": PROMPT}, LONG, "in-flight")
        update = asyncio.ensure_future(llm.update_weights_from_disk(str(bad), 1))
        await tokens_while_the_reader_waits(llm, reader, stream, update)
        reader.release()
        with pytest.raises(WeightUpdateError, match="non-finite") as info:
            await update
        assert not llm.engine.control.swap_pending
        async for out in stream:
            pass
        return info.value, out, await llm.get_weight_version()

    error, in_flight, version = asyncio.run(main())
    assert error.param is not None and version == 0 and llm.weights_state() == "committed"
    c = in_flight.outputs[0]
    assert len(c.token_ids) == 200 and c.finish_reason == "length" and set(c.weight_versions) == {0}
    assert all(torch.equal(p, before[n]) for n, p in llm.engine.model.named_parameters())
    assert llm.engine.control.disk_load is None
    monkeypatch.undo()  # a good checkpoint now loads
    assert asyncio.run(llm.update_weights_from_disk(str(tiny_factory(3).path), 1)) == 1


def test_a_keep_pause_lets_the_swap_in_at_once_and_the_frozen_request_continues_on_the_new_weights(llm, tiny_factory):
    new = tiny_factory(3)

    async def main():
        stream = llm.generate({"prompt_token_ids": PROMPT}, LONG.clone(max_tokens=40), "frozen")
        first = await stream.__anext__()
        await llm.pause_generation("keep")
        version = await asyncio.wait_for(llm.update_weights_from_disk(str(new.path), 1), 30)  # frozen: not generating
        await llm.resume_generation()
        async for out in stream:
            pass
        return first, version, out

    first, version, out = asyncio.run(main())
    versions = out.outputs[0].weight_versions
    assert version == 1 and len(versions) == 40 and versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions) and len(first.outputs[0].token_ids) >= 1


def test_shutdown_during_a_load_answers_the_update_and_stops_its_reader(tiny_gqa, tiny_factory, monkeypatch):
    reader = GatedReader(monkeypatch)
    llm = AsyncLLM(engine=LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu",
                                               max_model_len=256, skip_tokenizer_init=True)))

    async def main():
        update = asyncio.ensure_future(llm.update_weights_from_disk(str(tiny_factory(3).path), 1))
        await wait_until(lambda: reader.threads)
        t0 = time.monotonic()
        llm.shutdown()
        with pytest.raises(EngineStateError, match="shut down"):
            await asyncio.wait_for(update, 10)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5
    reader.release()  # the reader finds the load cancelled at its next tensor and ends
    deadline = time.monotonic() + 10
    while any(t.name == "loopline-weights-reader" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the reader thread outlived its cancelled load"
        time.sleep(0.01)


def test_the_staged_reads_hold_at_most_two_tensors(llm, tiny_factory, monkeypatch):
    """Both reads stream: when a tensor is read, at most two read earlier are still alive (the one the engine
    is copying and the one just handed over), never a shard or the checkpoint."""
    seen = count_live_reads(monkeypatch)
    assert asyncio.run(llm.update_weights_from_disk(str(tiny_factory(3).path), 1)) == 1
    assert seen.reads == 2 * len(llm.engine.control.weights.names) and seen.most <= 2, seen.most


def test_a_file_swapped_for_a_symlink_out_while_the_swap_waits_is_refused_before_any_copy(llm, tmp_path,
                                                                                          monkeypatch):
    from loopline.models.loader import CheckpointError
    from loopline.models.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3)
    before = {n: p.detach().clone() for n, p in llm.engine.model.named_parameters()}
    # The copy pass waits until the file is swapped: on a busy machine the request in flight could
    # otherwise finish, and the copy start, before the swap below.
    swapped, copy_pass = threading.Event(), control_module.DiskLoad.pieces

    def after_the_swap(self):
        assert swapped.wait(30)
        yield from copy_pass(self)

    monkeypatch.setattr(control_module.DiskLoad, "pieces", after_the_swap)

    async def main():
        stream = llm.generate({"prompt_token_ids": PROMPT}, LONG, "in-flight")
        update = asyncio.ensure_future(llm.update_weights_from_disk(str(ckpt), 1))
        await wait_until(lambda: llm.engine.control.swap_pending)  # validated; waits for the request in flight
        outside = tmp_path / "outside.safetensors"
        (ckpt / "model.safetensors").rename(outside)
        (ckpt / "model.safetensors").symlink_to(outside)
        swapped.set()
        async for out in stream:
            pass
        with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
            await update
        return out

    out = asyncio.run(main())
    assert set(out.outputs[0].weight_versions) == {0} and len(out.outputs[0].token_ids) == 200
    assert llm.weights_state() == "committed" and not llm.engine.control.weights.broken
    assert all(torch.equal(p, before[n]) for n, p in llm.engine.model.named_parameters())
