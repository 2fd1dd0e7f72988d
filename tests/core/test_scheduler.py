"""Scheduler on its own, driven by hand-made runner outputs (no model, no tensors)."""
from __future__ import annotations

from loopline.core.contracts import RunnerOutput, SampledToken
from loopline.core.exit_policy import make_exit_policy
from loopline.core.queue import make_queue
from loopline.core.request import Request, RequestStatus
from loopline.core.scheduler import Scheduler, make_scheduling_mode
from loopline.kv.layout import make_layout
from loopline.kv.manager import KVCacheManager
from loopline.sampling_params import SamplingParams

R = 4


def make(mode="refill", budget=64, seqs=4, layout="last_exited", blocks=256):
    kv = KVCacheManager(blocks, 4, make_layout(layout, R))
    return Scheduler(kv, make_exit_policy("threshold", R, 1.0), make_scheduling_mode(mode), make_queue("fcfs"),
                     seqs, budget, R)


def req(rid, n=5, max_tokens=8, seq=0):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, max_loops=R), 0, max_tokens,
                   frozenset(), seq)


def step(s, exits):
    """One step; ``exits[request_id]`` says whether that request's decode row exits (prefill rows exit when done)."""
    out = s.schedule()
    flags, samples = [], []
    for row in out.rows:
        if row.is_prefill:
            done = row.loop == R and row.is_last_chunk
        else:
            done = exits.get(row.request_id, row.loop == R)
        flags.append(done)
        samples.append(SampledToken(7, row.loop) if done else None)
    s.update(out, RunnerOutput(flags, samples))
    return out


def test_prefill_then_refill_decode_one_loop_per_step():
    s = make()
    s.add_request(req("a"))
    loops = [step(s, {}).rows[0].loop for _ in range(R)]
    assert loops == [1, 2, 3, 4]
    a = s.requests["a"]
    assert a.status == RequestStatus.DECODE and a.num_output_tokens == 1
    out = step(s, {"a": True})  # decode token exits at loop 1
    assert out.rows[0].loop == 1 and out.rows[0].input_token_ids == [7]
    out = step(s, {"a": False})  # refill: next token starts at loop 1 at once
    assert out.rows[0].loop == 1 and a.num_output_tokens == 2
    assert step(s, {"a": False}).rows[0].loop == 2


def test_no_refill_idles_exited_rows_until_cohort_exits():
    s = make(mode="no_refill")
    for i, rid in enumerate("ab"):
        s.add_request(req(rid, seq=i))
    for _ in range(R):
        step(s, {})
    out = step(s, {"a": True, "b": False})
    assert {r.request_id for r in out.rows} == {"a", "b"}
    out = step(s, {"b": False})
    assert [r.request_id for r in out.rows] == ["b"]  # a idles
    out = step(s, {"b": True})
    assert [r.request_id for r in out.rows] == ["b"]
    out = step(s, {})
    assert {r.request_id for r in out.rows} == {"a", "b"} and all(r.loop == 1 for r in out.rows)


def test_token_budget_chunks_prefill_and_decode_never_starves():
    s = make(budget=4, seqs=2)
    s.add_request(req("a", n=3, seq=0))
    for _ in range(R):
        step(s, {})
    s.add_request(req("b", n=20, seq=1))
    for _ in range(30):
        out = step(s, {"a": False})
        assert any(not r.is_prefill for r in out.rows), "decode row must run every step"
        assert out.num_tokens <= 4
        assert any(r.is_prefill for r in out.rows) or s.requests["b"].status == RequestStatus.DECODE


def test_finish_and_abort_free_blocks_and_slots():
    s = make(seqs=1)
    s.add_request(req("a", seq=0))
    s.add_request(req("b", seq=1))
    step(s, {})
    assert s.num_running == 1 and s.num_waiting == 1
    s.finish_request("a", "abort")
    assert s.kv.num_used_blocks == 0
    out = step(s, {})
    assert out.finished_request_ids == ["a"] and out.rows[0].request_id == "b"


def test_prefill_chunks_fit_beside_a_full_decode_batch():
    """A chunk re-runs every loop at the size it was cut: it must fit later, fuller budgets too."""
    s = make(budget=8, seqs=4)
    s.add_request(req("a", n=2, max_tokens=40, seq=0))
    for _ in range(R):
        step(s, {})  # a decodes: one row per step
    s.add_request(req("d", n=30, seq=1))  # its first chunk is cut while only a decodes
    step(s, {})
    s.add_request(req("b", n=2, max_tokens=40, seq=2))
    s.add_request(req("c", n=2, max_tokens=40, seq=3))
    stalled = 0
    for _ in range(60):
        out = step(s, {})
        d_rows = [r for r in out.rows if r.request_id == "d"]
        assert all(r.num_tokens <= 8 - 4 + 1 for r in d_rows if r.is_prefill)
        if s.requests["d"].status == RequestStatus.DECODE:
            break
        stalled += not d_rows
    assert s.requests["d"].status == RequestStatus.DECODE
    assert stalled == 0  # with a, b, c decoding, d's chunks still fit the budget every step


def test_priority_queue_orders_and_bounds_bypass():
    from loopline.core.queue import PriorityQueue

    def r(rid, prio, seq):
        return Request(rid, [3], SamplingParams(max_tokens=1, priority=prio), 0, 1, frozenset(), seq)

    q = PriorityQueue(max_bypass=3)
    q.push(r("low", 5, 0))
    seq = 1
    served = []
    for _ in range(6):  # urgent requests keep arriving, one per admission
        q.push(r(f"hi{seq}", 0, seq))
        seq += 1
        served.append(q.pop().request_id)
    assert served[:3] == ["hi1", "hi2", "hi3"]  # lower priority value first while bypass is bounded
    assert served[3] == "low"  # overtaken 3 times: it goes next
    q2 = PriorityQueue()
    for i, p in enumerate([2, 1, 1, 0]):
        q2.push(r(f"r{i}", p, i))
    assert [q2.pop().request_id for _ in range(4)] == ["r3", "r1", "r2", "r0"]  # stable among equals
