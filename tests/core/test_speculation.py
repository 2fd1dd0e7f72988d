"""The scheduler's side of loop self-speculation (loopline.core.speculation), with hand-made runner outputs:
a round's fixed shape, step by step; which requests speculate; the KV lookahead; preemption only between
rounds; and a round's committed run handed over token by token."""
from __future__ import annotations

from loopline.core.contracts import RunnerOutput, SampledToken
from loopline.core.exit_policy import make_exit_policy
from loopline.core.queue import make_queue
from loopline.core.request import Request
from loopline.core.scheduler import Preemption, Scheduler, make_allocation
from loopline.core.speculation import LoopSpeculation
from loopline.kv.layout import make_layout
from loopline.kv.manager import KVCacheManager
from loopline.sampling_params import SamplingParams
from loopline.spec import SpeculativeConfig

R, BLOCK, K, D = 4, 4, 2, 2


def scheduler(allocation: str = "full", swap_blocks: int | None = None, blocks: int = 256) -> Scheduler:
    kv = KVCacheManager(blocks, BLOCK, make_layout("last_exited", R), False)
    # (no throughput guard: it times engine steps, which a scheduler alone does not run; tests/spec/test_step_clock.py)
    spec = LoopSpeculation(SpeculativeConfig(scheme="draft_verify", num_speculative_tokens=K, draft_loops=D,
                                             throughput_guard=False), R)
    return Scheduler(kv, make_exit_policy("threshold"), make_queue("fcfs"), 4, 64, R,
                     allocation=make_allocation(allocation), speculation=spec,
                     preemption=Preemption(swap_blocks) if swap_blocks is not None else None)


def request(rid: str, seq: int = 0, **params) -> Request:
    p = SamplingParams(max_tokens=8, max_loops=params.pop("max_loops", R), exit_threshold=1.0, **params)
    return Request(rid, [3, 4, 5, 6, 7], p, 0, 8, frozenset(), seq)


def run_prefill(s: Scheduler) -> None:
    for _ in range(R):
        out = s.schedule()
        s.update(out, RunnerOutput([r.loop == R for r in out.rows],
                                   [SampledToken(9, R) if r.loop == R else None for r in out.rows]))


def test_a_round_is_drafts_then_verify_steps():
    s = scheduler()
    s.add_request(request("a"))
    run_prefill(s)
    phases = []
    for _ in range(2 * ((K + 1) * D + R - D)):  # two rounds
        (row,) = s.schedule().rows
        phases.append((row.spec.index, row.spec.loop, row.spec.queries, row.spec.draft_end, row.spec.last))
        assert row.num_tokens == row.spec.queries
    first = [(0, 1, 1, False, False), (0, 2, 1, True, False), (1, 1, 1, False, False), (1, 2, 1, True, False),
             (2, 1, 1, False, False), (2, 2, 1, False, False),  # the last position drafts nothing
             (-1, 3, K + 1, False, False), (-1, 4, K + 1, False, True)]
    assert phases == first + first


def test_who_speculates_and_what_it_reserves():
    s = scheduler()
    for rid, kw in [("spec", {}), ("greedy_pen", {"repetition_penalty": 1.2}), ("shallow", {"max_loops": D}),
                    ("bias", {"logit_bias": {5: 1.0}}), ("sampled", {"temperature": 0.7, "top_p": 0.9}),
                    ("off", {"speculate": False})]:
        s.add_request(request(rid, **kw))
    speculative = {rid: r.speculative for rid, r in s.requests.items()}
    # penalties read the round's drafts as history (loopline.worker.spec_rows.round_history): they speculate
    assert speculative == {"spec": True, "greedy_pen": True, "shallow": False, "bias": True, "sampled": True,
                           "off": False}
    assert s.requests["spec"].num_tokens_reserved == 5 + 8 + 2 * K
    assert s.requests["off"].num_tokens_reserved == 5 + 8


def test_preemption_waits_for_the_round_to_end():
    s = scheduler(allocation="incremental", swap_blocks=1000)
    s.add_request(request("a"))
    run_prefill(s)
    a = s.requests["a"]
    s.schedule()  # the round's first draft step
    assert a.spec_step == 1 and s._victims() == []
    for _ in range((K + 1) * D + R - D - 1):
        s.schedule()
    assert a.spec_step == 0 and s._victims() == [a]  # between rounds


def test_a_committed_run_is_handed_over_token_by_token():
    s = scheduler()
    s.add_request(request("a"))
    run_prefill(s)
    rounds = (K + 1) * D + R - D
    for _ in range(rounds - 1):
        out = s.schedule()
        s.update(out, RunnerOutput([False], [None]))
    out = s.schedule()
    run = [SampledToken(t, R) for t in (11, 12, 13)]
    (a,) = s.update(out, RunnerOutput([True], [run[0]], more={0: run[1:]}))
    assert [t.token_id for t in a.output] == [9, 11]
    assert s.take_unbooked(a) and s.take_unbooked(a) and not s.take_unbooked(a)
    assert [t.token_id for t in a.output] == [9, 11, 12, 13]
