"""The engine half of prefill/decode disaggregation, in one process: a prefill-only engine hands
each request off after its first token and a decode engine adopts it; together they give exactly
what one engine gives (tokens, exit depths, logprobs, text), in both KV layouts."""
from __future__ import annotations

import random

import pytest
import torch
from matching import approx_floats

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.engine.input_processor import child_request_id


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def engine_for(tiny, prefill_only=False, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 4)
    return LLMEngine(EngineArgs(model=str(tiny.path), **kw), prefill_only=prefill_only)


def drain(engine, requests):
    done = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def drain_pd(prefill, decode, requests):
    """Both engines stepped in turn: after every step the prompt pages that became final are copied
    out (as a prefill worker streams them) and written into the pages the decode engine reserved
    when the first of them arrived; every ready request moves with the rest."""
    done, moved, sent = {}, 0, {}

    def put(child, prompt, first, kv):
        if first == 0:
            decode.handoff.reserve(child, prompt)
        decode.handoff.write_pages(child, first, kv)

    for rid, (prompt, params) in requests.items():
        prefill.add_request(rid, {"prompt_token_ids": prompt}, params)
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        for out in prefill.step():
            if out.finished:  # it ended on the prefill engine (its first token): what it sent goes
                done[out.request_id] = out
                child = child_request_id(out.request_id, 0)
                dropped[0] += sent.pop(child, 0) > 0
                decode.handoff.release(child)
        for child, pages in prefill.handoff.final_prompt_pages().items():
            first = sent.get(child, 0)
            if pages > first and child not in prefill.handoff.ready():
                used = decode.kv.num_used_blocks
                put(child, prefill.scheduler.requests[child].prompt_token_ids, first,
                    prefill.handoff.export_pages(child, first, pages).clone())
                sent[child] = pages
                streamed[0] += 1
                if first == 0:  # its prompt pages are held on the decode side while it still prefills
                    grown = decode.kv.num_used_blocks - used
                    reserved[0] += grown > 0
                    assert grown == decode.kv.blocks_needed(prefill.scheduler.requests[child].prompt_len) - \
                        decode.kv.layout.num_planes * (decode.kv.get(child).num_cached_tokens // decode.kv.block_size)
        for child in prefill.handoff.ready():
            first = sent.pop(child, 0)
            handoff, rest = prefill.handoff.take(child, first)
            put(child, handoff.prompt_token_ids, first, rest)
            decode.handoff.adopt(handoff)
            moved += 1
        done.update((o.request_id, o) for o in decode.step() if o.finished)
    return done, moved


streamed = [0]  # pieces sent before a request's handoff, over the module
reserved = [0]  # requests whose pages the decode engine reserved before their handoff
dropped = [0]  # requests that sent pages but ended on the prefill engine


def result(out):
    """Tokens, exit depths, text and finish reason (compared exactly) and logprobs (compared through
    `approx_floats`: a decode worker's batches differ from the single engine's, and a batch's size moves
    the last bits)."""
    return [(c.token_ids, c.exit_depths, c.text, c.finish_reason,
             [{k: v.logprob for k, v in e.items()} for e in c.logprobs] if c.logprobs else None)
            for c in out.outputs]


def requests():
    system = ids(13, seed=99)
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, exit_threshold=0.6, logprobs=2)
    sampled = SamplingParams(max_tokens=9, temperature=1.0, seed=5, ignore_eos=True, exit_threshold=0.6)
    penalized = sampled.clone(seed=8, presence_penalty=0.5, repetition_penalty=1.2)
    return {"a": (system + ids(7, seed=1), greedy), "b": (system + ids(22, seed=2), sampled),
            "c": (ids(3, seed=3), greedy.clone(max_tokens=1)), "d": (ids(30, seed=4), penalized),
            "e": (system + ids(5, seed=5), sampled.clone(seed=None))}


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_handoff_gives_the_single_engines_outputs(tiny_gqa, layout):
    kw = dict(kv_layout=layout, max_num_batched_tokens=8, enable_prefix_caching=True)
    single = drain(engine_for(tiny_gqa, **kw), requests())
    prefill, decode = engine_for(tiny_gqa, prefill_only=True, **kw), engine_for(tiny_gqa, **kw)
    pd, moved = drain_pd(prefill, decode, requests())
    assert moved == 4 and dropped[0] > 0  # "c" ends with its first token on the prefill engine, after its pages left
    assert streamed[0] > 0 and reserved[0] > 0  # chunks' pages left, into reserved pages, before their prompt finished
    assert approx_floats({k: result(v) for k, v in pd.items()}) == {k: result(v) for k, v in single.items()}
    depths = {d for out in single.values() for d in out.outputs[0].exit_depths}
    assert len(depths) > 1  # the adaptive exits vary
    assert prefill.kv.num_used_blocks == 0 and decode.kv.num_used_blocks == 0
    if layout == "last_exited":  # handed-off prompt pages are cached on the decode side and shared there
        assert decode.kv.prefix_cache.stats.hits > 0
    assert not decode.runner.pages.snapshots and not prefill.runner.requests


# --- the decode worker's loop, with a transport that fails ---------------------------------------
class FailingTransport:
    """Every receive fails, as a dead or silent prefill worker's would (after the timeout)."""

    def recv(self, payload, shape, dtype, peer, tag):
        import concurrent.futures

        from loopline.distributed.kv_transfer import KVTransferError
        f = concurrent.futures.Future()
        f.set_exception(KVTransferError("receiving KV pages from worker 0 failed: timed out"))
        return f


class LocalTransport:
    """The payload is the pages tensor itself: every receive completes at once."""

    def recv(self, payload, shape, dtype, peer, tag):
        import concurrent.futures
        f = concurrent.futures.Future()
        f.set_result(payload)
        return f


class PendingTransport:
    """Receives that complete only when the test says so."""

    def __init__(self):
        self.futures = []

    def recv(self, payload, shape, dtype, peer, tag):
        import concurrent.futures
        self.futures.append(concurrent.futures.Future())
        return self.futures[-1]


def decode_core(engine, transport):
    from loopline.distributed.pd_worker import DecodeCore
    from loopline.runtime.core import Inbox
    return DecodeCore(engine, Inbox(), lambda msg: None, transport)


def apply_all(core, *cmds):
    """Applies commands, then what their receives' completions put in the loop's inbox."""
    for cmd in cmds:
        core.apply(cmd)
    for cmd in core.inbox.take(lambda: True, False)[0]:  # (returns at once, also with none)
        core.apply(cmd)


def piece_cmd(rid, child, prompt, first, kv, reserve=True):
    from loopline.runtime.protocol import PageReservation, PieceCmd, PieceMsg
    return PieceCmd(PieceMsg(rid, 7 + first, kv, tuple(kv.shape), kv.dtype, first,
                             PageReservation(child, prompt) if reserve else None), src_rank=0)


def prefill_until_pieces(prefill, rid, prompt, params):
    """Steps a prefill engine until the request has final pages but still prefills."""
    prefill.add_request(rid, {"prompt_token_ids": prompt}, params)
    child = child_request_id(rid, 0)
    while prefill.handoff.final_prompt_pages().get(child, 0) == 0:
        prefill.step()
    assert not prefill.handoff.ready()
    return child, prefill.handoff.final_prompt_pages()[child]


def test_a_failed_transfer_fails_its_request_alone(tiny_gqa):
    from loopline.runtime.protocol import AcceptCmd
    from loopline.errors import EngineInternalError

    prefill, decode = engine_for(tiny_gqa, prefill_only=True), engine_for(tiny_gqa)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompt = ids(9, seed=1)
    prefill.add_request("lost", {"prompt_token_ids": prompt}, params)
    while not prefill.handoff.ready():
        prefill.step()
    handoff, rest = prefill.handoff.take(prefill.handoff.ready()[0])
    core = decode_core(decode, FailingTransport())
    core.apply(piece_cmd("lost", handoff.child_id, prompt, 0, rest))
    assert decode.kv.num_used_blocks == decode.kv.blocks_needed(9)  # reserved as the piece arrived
    apply_all(core, AcceptCmd(handoff, 1, src_rank=0))
    (rid, error), = core.outbox.failures
    assert rid == "lost" and isinstance(error, EngineInternalError) and error.error_id
    assert not core.incoming and not decode.scheduler.requests and not decode.runner.pages.snapshots
    assert decode.kv.num_used_blocks == 0 and prefill.kv.num_used_blocks == 0 and not decode.handoff.num_reserved


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_pieces_are_written_into_pages_reserved_before_the_handoff(tiny_gqa, device):
    """The decode side holds a request's prompt pages (every plane) from its first piece on, while its
    prefill still runs; each piece lands in those pages (on CUDA: on a stream of its own, which the
    step resuming the request waits for), and adoption copies nothing."""
    from loopline.runtime.protocol import AcceptCmd

    # a pool of its own size: on CUDA the default (90% of the GPU) would leave nothing for the second engine
    kw = dict(max_num_batched_tokens=8, device=device, enforce_eager=True, num_kv_blocks=128)
    prefill, decode = engine_for(tiny_gqa, prefill_only=True, **kw), engine_for(tiny_gqa, **kw)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = ids(30, seed=7)
    child, pages = prefill_until_pieces(prefill, "r", prompt, params)
    core = decode_core(decode, LocalTransport())
    first = prefill.handoff.export_pages(child, 0, pages).clone()
    apply_all(core, piece_cmd("r", child, prompt, 0, first))
    assert decode.kv.num_used_blocks == decode.kv.blocks_needed(30) == decode.kv.layout.num_planes * 8
    tables = decode.kv.get(child).block_tables
    if device == "cuda":
        torch.cuda.synchronize()
    for p, table in enumerate(tables):  # plane p's pages [0, pages) hold the piece's plane p
        got = decode.runner.k_cache[:, table[:pages]]
        assert torch.equal(got, first[0][:, p * pages:(p + 1) * pages])
    while not prefill.handoff.ready():
        prefill.step()
    handoff, rest = prefill.handoff.take(child, pages)
    apply_all(core, piece_cmd("r", child, prompt, pages, rest, reserve=False), AcceptCmd(handoff, 2, src_rank=0))
    assert not core.outbox.failures and "r" in core.live_requests
    assert decode.runner.pages.snapshots[child].k is None  # nothing staged: the pages are in the pool
    assert decode.kv.get(child).block_tables[0][:8] == tables[0][:8]  # adoption kept the pages
    single = drain(engine_for(tiny_gqa, **kw), {"r": (prompt, params)})["r"].outputs[0]
    tokens = [handoff.first.token_id]
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens = [handoff.first.token_id, *out.outputs[0].token_ids[1:]] if out.outputs[0].token_ids else tokens
    assert tokens == single.token_ids
    assert decode.kv.num_used_blocks == 0 and prefill.kv.num_used_blocks == 0


def test_dropped_and_aborted_requests_free_their_reserved_pages(tiny_gqa):
    from loopline.runtime.protocol import AcceptCmd, DropCmd
    from loopline.runtime.protocol import AbortCmd

    kw = dict(max_num_batched_tokens=8)
    prefill, decode = engine_for(tiny_gqa, prefill_only=True, **kw), engine_for(tiny_gqa, **kw)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core = decode_core(decode, LocalTransport())
    # dropped: it ended on its prefill worker after some pages left
    prompt = ids(30, seed=8)
    child, pages = prefill_until_pieces(prefill, "gone", prompt, params)
    apply_all(core, piece_cmd("gone", child, prompt, 0, prefill.handoff.export_pages(child, 0, pages).clone()))
    assert decode.kv.num_used_blocks == decode.kv.blocks_needed(30)
    prefill.abort_request("gone")
    apply_all(core, DropCmd("gone"))
    assert decode.kv.num_used_blocks == 0 and not core.incoming and not decode.handoff.num_reserved
    # dropped while a receive is still on its way (a dead prefill worker's, until its timeout): the
    # pages go at once, and what arrives later is written nowhere
    pending = PendingTransport()
    core.transport = pending
    prompt = ids(30, seed=10)
    child, pages = prefill_until_pieces(prefill, "dead", prompt, params)
    kv = prefill.handoff.export_pages(child, 0, pages).clone()
    apply_all(core, piece_cmd("dead", child, prompt, 0, kv))
    assert decode.kv.num_used_blocks == decode.kv.blocks_needed(30)
    prefill.abort_request("dead")
    apply_all(core, DropCmd("dead"))
    assert decode.kv.num_used_blocks == 0 and not decode.handoff.num_reserved and "dead" in core.incoming
    pending.futures[0].set_result(kv)
    apply_all(core)
    assert not core.incoming and decode.kv.num_used_blocks == 0
    core.transport = LocalTransport()
    # aborted while its pages were on their way: it is taken over, then ends as aborted
    prompt = ids(30, seed=9)
    child, pages = prefill_until_pieces(prefill, "abort", prompt, params)
    apply_all(core, piece_cmd("abort", child, prompt, 0, prefill.handoff.export_pages(child, 0, pages).clone()))
    while not prefill.handoff.ready():
        prefill.step()
    handoff, rest = prefill.handoff.take(child, pages)
    apply_all(core, AbortCmd(["abort"]))  # (the front end sends aborts to the worker holding the request)
    assert core.incoming["abort"].aborted and decode.kv.num_used_blocks == decode.kv.blocks_needed(30)
    apply_all(core, piece_cmd("abort", child, prompt, pages, rest, reserve=False),
              AcceptCmd(handoff, 2, src_rank=0, aborted=True))
    outs = decode.step()
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"]
    assert decode.kv.num_used_blocks == 0 and not decode.runner.pages.snapshots and not core.incoming


def test_a_reservation_that_does_not_fit_fails_its_request_cleanly(tiny_gqa):
    """The front end's credits should prevent it; if it happens anyway the request fails with a clear
    error, its pieces are still received (the sender's transfers complete), and nothing leaks."""
    from loopline.runtime.protocol import AcceptCmd
    from loopline.errors import EngineStateError

    planes = 4
    prefill = engine_for(tiny_gqa, prefill_only=True)
    decode = engine_for(tiny_gqa, num_kv_blocks=planes * 4)
    assert decode.kv.layout.num_planes == planes
    decode.handoff.reserve("other#0", ids(8, seed=2))  # 2 of the 4 pages per plane
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = ids(9, seed=3)  # 3 pages per plane
    prefill.add_request("big", {"prompt_token_ids": prompt}, params)
    while not prefill.handoff.ready():
        prefill.step()
    handoff, rest = prefill.handoff.take(prefill.handoff.ready()[0])
    core = decode_core(decode, LocalTransport())
    apply_all(core, piece_cmd("big", handoff.child_id, prompt, 0, rest), AcceptCmd(handoff, 1, src_rank=0))
    (rid, error), = core.outbox.failures
    assert rid == "big" and isinstance(error, EngineStateError) and "no room" in str(error)
    assert decode.kv.num_used_blocks == planes * 2 and not core.incoming and not decode.scheduler.requests
    decode.handoff.release("other#0")
    assert decode.kv.num_used_blocks == 0 and prefill.kv.num_used_blocks == 0


def test_reserve_handoff_validates(tiny_gqa):
    from loopline.errors import CapacityError, EngineStateError, InvalidRequestError

    decode = engine_for(tiny_gqa, num_kv_blocks=4 * 4)
    with pytest.raises(CapacityError) as e:
        decode.handoff.reserve("huge#0", ids(17))
    assert e.value.param == "prompt"
    decode.handoff.reserve("a#0", ids(5))
    with pytest.raises(InvalidRequestError):
        decode.handoff.reserve("a#0", ids(5))
    with pytest.raises(EngineStateError):
        decode.handoff.write_pages("nobody#0", 0, torch.zeros(1))
    with pytest.raises(ValueError, match="expected"):  # a piece of the wrong shape writes nothing
        decode.handoff.write_pages("a#0", 0, torch.zeros(2, 1, 4, 4, 1, 1))
    with pytest.raises(ValueError, match="expected"):
        decode.handoff.write_pages("a#0", 0, torch.zeros(3))
    piece = torch.zeros(2, *decode.runner.k_cache.shape[:1], 4 * 2, *decode.runner.k_cache.shape[2:])
    with pytest.raises(ValueError, match="outside the 2 reserved"):  # pages [1, 3) of a 2-page prompt
        decode.handoff.write_pages("a#0", 1, piece)
    decode.handoff.release("a#0")
    decode.handoff.release("a#0")  # (twice: ignored)
    assert decode.kv.num_used_blocks == 0


def test_reserve_shares_cached_prompt_pages_only_under_the_same_cache_salt(tiny_gqa):
    """A decode worker looks a handed-off prompt up in its prefix cache under the request's cache_salt."""
    decode = engine_for(tiny_gqa, enable_prefix_caching=True, max_model_len=64)
    prompt = ids(13, seed=7)  # three full pages of 4
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode.add_request("seed", {"prompt_token_ids": prompt, "cache_salt": "a"}, params)
    while decode.has_unfinished_requests():
        decode.step()
    for child, salt, cached in (("b#0", "b", 0), ("none#0", None, 0), ("a#0", "a", 12)):
        decode.handoff.reserve(child, prompt, salt)
        assert decode.kv.get(child).num_cached_tokens == cached, salt
        decode.handoff.release(child)
