"""Scheduler on its own, driven by hand-made runner outputs (no model, no tensors).

The scheduler plans prefill chunks loop by loop and gives every decoding request a
row per step that names only its slot: the device decides the row's loop (and
``no_refill`` cohorts, see tests/worker/test_decode_state.py). A token reaches the
scheduler when a runner output carries it.
"""
from __future__ import annotations

from loopline.core.contracts import RunnerOutput, SampledToken
from loopline.core.exit_policy import make_exit_policy
from loopline.core.queue import PriorityQueue, make_queue
from loopline.core.request import Request, RequestStatus
from loopline.core.scheduler import Preemption, Scheduler, make_allocation
from loopline.kv.layout import make_layout
from loopline.kv.manager import KVCacheManager
from loopline.sampling_params import SamplingParams

R = 4
BLOCK = 4


def create_scheduler(budget=64, seqs=4, layout="last_exited", blocks=256, allocation="full", swap_blocks=None,
                     policy="fcfs", prefix_caching=False) -> Scheduler:
    kv = KVCacheManager(blocks, BLOCK, make_layout(layout, R), prefix_caching)
    return Scheduler(kv, make_exit_policy("threshold"), make_queue(policy), seqs, budget, R,
                     allocation=make_allocation(allocation),
                     preemption=Preemption(swap_blocks) if swap_blocks is not None else None)


def req(rid, n=5, max_tokens=8, seq=0, priority=0):
    params = SamplingParams(max_tokens=max_tokens, max_loops=R, exit_threshold=1.0, priority=priority)  # effective
    return Request(rid, list(range(3, 3 + n)), params, 0, max_tokens, frozenset(), seq)


def step(s: Scheduler, sampled: set[str] | None = None, token: int = 7):
    """One step. Prefill rows finishing their prompt sample a token; decode rows of ``sampled``
    requests sample one (their token exited on the device this step)."""
    out = s.schedule()
    flags, samples = [], []
    for row in out.rows:
        done = row.loop == R and row.is_last_chunk if row.is_prefill else row.request_id in (sampled or set())
        flags.append(done)
        samples.append(SampledToken(token, R if row.is_prefill else 2) if done else None)
    s.update(out, RunnerOutput(flags, samples))
    return out


def prefill(s: Scheduler) -> None:
    for _ in range(R):
        step(s)


def test_prefill_runs_every_loop_then_decode_rows_name_the_slot():
    s = create_scheduler()
    s.add_request(req("a"))
    loops = [step(s).rows[0].loop for _ in range(R)]
    assert loops == [1, 2, 3, 4]
    a = s.requests["a"]
    assert a.status == RequestStatus.DECODE and a.num_output_tokens == 1
    out = s.schedule()
    (row,) = out.rows
    assert not row.is_prefill and row.slot == a.slot and row.exit.max_loops == R and row.num_tokens == 1


def test_refill_every_decoding_request_gets_a_row_every_step():
    """A row per step whatever the device does with it: a token arrives only when it exited."""
    s = create_scheduler()
    for i, rid in enumerate("ab"):
        s.add_request(req(rid, seq=i))
    prefill(s)
    for sampled in ({"a"}, set(), {"a", "b"}, {"b"}):
        out = step(s, sampled)
        assert sorted(r.request_id for r in out.rows) == ["a", "b"]
    assert (s.requests["a"].num_output_tokens, s.requests["b"].num_output_tokens) == (3, 3)


def test_results_of_finished_requests_are_ignored():
    """The overlapped engine reads step n after scheduling n+1: a request finished meanwhile drops its token."""
    s = create_scheduler()
    s.add_request(req("a"))
    prefill(s)
    out = s.schedule()
    s.finish_request("a", "stop")
    assert s.update(out, RunnerOutput([True], [SampledToken(9, 1)])) == []
    assert s.kv.num_used_blocks == 0 and s.schedule().finished_request_ids == ["a"]


def test_token_budget_chunks_prefill_and_decode_never_starves():
    s = create_scheduler(budget=4, seqs=2)
    s.add_request(req("a", n=3, seq=0))
    prefill(s)
    s.add_request(req("b", n=20, seq=1))
    for _ in range(30):
        out = step(s)
        assert any(not r.is_prefill for r in out.rows), "decode row must run every step"
        assert out.num_tokens <= 4
        assert any(r.is_prefill for r in out.rows) or s.requests["b"].status == RequestStatus.DECODE


def test_finish_and_abort_free_blocks_and_slots():
    s = create_scheduler(seqs=1)
    s.add_request(req("a", seq=0))
    s.add_request(req("b", seq=1))
    step(s)
    assert s.num_running == 1 and s.num_waiting == 1
    s.finish_request("a", "abort")
    assert s.kv.num_used_blocks == 0
    out = step(s)
    assert out.finished_request_ids == ["a"] and out.rows[0].request_id == "b"


def test_prefill_chunks_fit_beside_a_full_decode_batch():
    """A chunk re-runs every loop at the size it was cut: it must fit later, fuller budgets too."""
    s = create_scheduler(budget=8, seqs=4)
    s.add_request(req("a", n=2, max_tokens=40, seq=0))
    prefill(s)
    s.add_request(req("d", n=30, seq=1))  # its first chunk is cut while only a decodes
    step(s)
    s.add_request(req("b", n=2, max_tokens=40, seq=2))
    s.add_request(req("c", n=2, max_tokens=40, seq=3))
    stalled = 0
    for _ in range(60):
        out = step(s)
        d_rows = [r for r in out.rows if r.request_id == "d"]
        assert all(r.num_tokens <= 8 - 4 + 1 for r in d_rows if r.is_prefill)
        if s.requests["d"].status == RequestStatus.DECODE:
            break
        stalled += not d_rows
    assert s.requests["d"].status == RequestStatus.DECODE
    assert stalled == 0  # with a, b, c decoding, d's chunks still fit the budget every step


def test_shared_layout_prefill_is_depth_major():
    """``shared``: every chunk finishes loop r before any chunk starts loop r + 1."""
    s = create_scheduler(budget=4, seqs=1, layout="shared")
    s.add_request(req("a", n=10))
    seen = []
    while s.requests["a"].status != RequestStatus.DECODE:
        seen += [(r.loop, r.start) for r in step(s).rows]
    assert [loop for loop, _ in seen] == sorted(loop for loop, _ in seen)
    assert len(seen) == R * 3  # three chunks (4 + 4 + 2 tokens), each at every loop


def test_incremental_allocation_grows_one_page_at_a_time():
    s = create_scheduler(allocation="incremental")
    s.add_request(req("a", n=3, max_tokens=12))
    prefill(s)
    kv = s.kv
    planes = kv.layout.num_planes
    assert kv.get("a").num_blocks == planes * 1  # the prompt's 3 positions; decode rows grow it as they go
    grown = []
    for _ in range(12):
        out = step(s, {"a"})
        if out.block_updates:
            grown.append(s.requests["a"].num_output_tokens)
            assert [len(b) for b in out.block_updates["a"]] == [1] * planes
        if s.requests["a"].num_output_tokens >= 11:
            break
    assert kv.get("a").num_blocks == planes * -(-(3 + 12) // BLOCK)
    assert grown, "the pages grew while decoding"


def test_incremental_allocation_reserves_growth_without_preemption():
    """Without preemption an admitted request can always finish: admission keeps its growth free."""
    planes = R
    s = create_scheduler(allocation="incremental", blocks=planes * 4, seqs=2)
    s.add_request(req("a", n=3, max_tokens=12, seq=0))  # needs 4 pages a plane at the end
    s.add_request(req("b", n=3, max_tokens=4, seq=1))
    prefill(s)
    assert s.num_running == 1 and s.num_waiting == 1


def test_preemption_swaps_the_lowest_priority_victim_and_resumes_it():
    planes = R
    s = create_scheduler(allocation="incremental", blocks=planes * 3, seqs=2, swap_blocks=planes * 8,
                         policy="priority")
    s.add_request(req("low", n=3, max_tokens=20, seq=0, priority=5))
    prefill(s)
    s.add_request(req("high", n=6, max_tokens=4, seq=1, priority=0))
    out = s.schedule()
    assert out.preempted_request_ids == ["low"] and s.requests["low"].status == RequestStatus.PREEMPTED
    assert [n.request_id for n in out.new_requests] == ["high"]
    s.update(out, RunnerOutput([False] * len(out.rows), [None] * len(out.rows)))
    for _ in range(R - 1):
        step(s)
    while "high" in s.requests:
        step(s, {"high"})
        if s.requests["high"].num_output_tokens >= 4:
            s.finish_request("high", "length")
    out = s.schedule()
    resumed = [r.request_id for r in out.resumed_requests]
    assert resumed == ["low"] and s.requests["low"].status == RequestStatus.DECODE
    assert s.preemption.swapped_blocks == 0 and s.num_preemptions == 1


def test_priority_queue_orders_and_bounds_bypass():
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
