"""Speculation's throughput guard (loopline/core/step_clock.py; docs/speculation.md, "When it pays"): the engine
measures the output tokens a second of its plain decode steps and of its steps with speculating rows, by requests
a step; where speculating steps commit fewer, speculation turns off, whatever the cost model says. A new request
decodes plainly until plain steps' rate at its running count is known."""
from __future__ import annotations

import logging
import time

import pytest
from spec.test_engine import engine

from loopline import SamplingParams
from loopline.core.contracts import PipeLane, ScheduledRow
from loopline.core.speculation import PROBE_EVERY, PipelineSpeculation
from loopline.core.step_clock import StepClock
from loopline.spec import SpeculativeConfig
from loopline.spec.replay import AcceptanceReplay


def rows(plain: int, speculating: int = 0, prefill: bool = False) -> list[ScheduledRow]:
    """A step's rows: ``plain`` decode rows, ``speculating`` requests of two lanes each, a prompt's chunk."""
    out = [ScheduledRow(request_id=f"p{i}", is_prefill=False, start=-1, end=0, loop=1, plane=0, input_token_ids=None,
                        slot=i) for i in range(plain)]
    out += [ScheduledRow(request_id=f"s{i}", is_prefill=False, start=-1, end=0, loop=0, plane=-1, input_token_ids=None,
                         slot=plain + i, spec=PipeLane(j)) for i in range(speculating) for j in range(2)]
    if prefill:
        out.append(ScheduledRow(request_id="new", is_prefill=True, start=0, end=8, loop=1, plane=0,
                                input_token_ids=list(range(8)), slot=99))
    return out


def steps(clock: StepClock, step: list[ScheduledRow], n: int, seconds: float, tokens: int) -> None:
    for _ in range(n + 1):  # (the first of a run of one kind is not counted)
        clock.record(step, seconds, tokens)


def test_the_guard_compares_tokens_a_second_at_as_many_requests():
    clock = StepClock()
    assert clock.pays(8) is None and not clock.has_baseline(8)
    steps(clock, rows(8), StepClock.MIN_STEPS, 0.001, 2)  # 8 plain rows at 4 loops: 2 tokens a step
    assert clock.has_baseline(8) and clock.plain_rate(8) == pytest.approx(2000) and clock.pays(8) is None
    # one request pipelining beside seven plain ones: 4.5 tokens in three times a plain step's time (0.75x)
    steps(clock, rows(7, 1), StepClock.MIN_STEPS, 0.003, 4.5)
    assert clock.pays(8) is False and "commit 1500 tokens/s at 8 requests a step, plain steps 2000" in clock.why_not(8)
    assert clock.pays(8, margin=0.7) is True
    # steps with a prompt's chunk, and the first step after a change of kind, do not count
    for step in (rows(7, 1, prefill=True), rows(8), rows(0, 8), rows(8)):
        clock.record(step, 1.0, 0)
    assert clock.plain_rate(8) == pytest.approx(2000) and clock.spec_rate(8) == pytest.approx(1500)
    # every request pipelining, 12 tokens in twice a plain step's time: it pays; 1.85 tokens in a plain step's
    # time (0.925x plain) is within the margin
    steps(clock, rows(0, 8), 200, 0.002, 12)
    assert clock.pays(8) is True and clock.why_not(8) is None
    steps(clock, rows(0, 8), 400, 0.001, 1.85)
    assert clock.spec_rate(8) == pytest.approx(1850, rel=0.01) and clock.pays(8) is True
    steps(clock, rows(0, 8), 400, 0.001, 1.7)  # 0.85x: new requests do not start, speculating ones go on
    assert clock.pays(8) is False and clock.why_not(8) is None


def test_a_verdict_is_forgotten_after_enough_plain_steps():
    clock = StepClock()
    steps(clock, rows(2), StepClock.MIN_STEPS, 0.001, 0.5)
    steps(clock, rows(0, 2), StepClock.MIN_STEPS, 0.004, 0.5)
    assert clock.pays(2) is False
    steps(clock, rows(2), StepClock.FORGET_STEPS - 1, 0.001, 0.5)
    assert clock.pays(2) is False
    steps(clock, rows(2), 2, 0.001, 0.5)
    assert clock.pays(2) is None  # the next requests try again


def test_a_plain_rate_of_fewer_requests_stands_in_down_to_half():
    clock = StepClock()
    steps(clock, rows(4), StepClock.MIN_STEPS, 0.002, 1)
    assert [clock.plain_rate(c) is not None for c in (3, 4, 5, 7, 8, 9)] == [False, True, True, True, True, False]
    assert [clock.has_baseline(c) for c in (1, 3, 4, 8, 9)] == [True, True, True, True, False]
    # a request added with 99 others running or waiting joins steps of at most max_requests; one added first of
    # a burst, steps of at least as many as the last one held
    clock.max_requests = 4
    assert clock.joining(99) == 4 and clock.joining(0) == 4 and clock.joining(2) == 4
    clock.record(rows(1), 0.001, 0)
    assert clock.joining(0) == 1


def test_a_pause_counts_as_four_steps_at_most():
    clock = StepClock()
    steps(clock, rows(2), StepClock.MIN_STEPS, 0.001, 1)
    clock.record(rows(2), 5.0, 1)  # a collection pause
    assert clock.plain_rate(2) == pytest.approx(1 / (0.001 + 0.05 * 0.003))


def test_new_requests_decode_plainly_until_plain_steps_are_measured_then_as_the_guard_says(caplog):
    s = PipelineSpeculation(SpeculativeConfig(num_speculative_tokens=3, draft_loops=1, scheme="pipeline"), 4)
    assert not s.starts(0)  # (it would run alone: no plain step of one request measured yet)
    steps(s.clock, rows(1), StepClock.MIN_STEPS, 0.001, 0.25)
    assert s.starts(0)
    steps(s.clock, rows(0, 1), StepClock.MIN_STEPS, 0.003, 0.5)  # two thirds of the plain rate
    with caplog.at_level(logging.INFO, logger="loopline.core.speculation"):
        assert not any(s.starts(0) for _ in range(2 * PROBE_EVERY))  # (no probe either)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["speculation off at 1 requests a step: steps with speculating rows commit 167 tokens/s at 1 "
                    "requests a step, plain steps 250 (throughput_guard)"]  # once, where it changed
    steps(s.clock, rows(1), StepClock.FORGET_STEPS + 1, 0.001, 0.25)  # the verdict forgotten: the next one tries
    with caplog.at_level(logging.INFO, logger="loopline.core.speculation"):
        assert s.starts(0)
    assert caplog.records[-1].getMessage() == "speculation on again at 1 requests a step (throughput_guard)"
    off = PipelineSpeculation(SpeculativeConfig(draft_loops=1, scheme="pipeline", throughput_guard=False), 4)
    assert off.starts(0) and off.clock is None
    with pytest.raises(Exception, match="throughput_guard"):
        SpeculativeConfig(throughput_guard="yes")


@pytest.mark.parametrize("guard", [True, False])
def test_speculating_steps_that_commit_fewer_tokens_a_second_turn_speculation_off(tiny_gqa, guard):
    """Drafts accepted but at the exit half the time (replayed), so the cost model says the pipeline pays; but
    each speculating step is made 15 ms dearer than a plain one (a few ms here). With the guard the first
    request decodes plainly (measuring plain steps), the second pipelines until the guard, once its rate is
    known, stops it, and the engine turns the third away; without it the second pipelines to its end."""
    spec = {"method": "loop", "scheme": "pipeline", "draft_loops": 1, "throughput_guard": guard}
    eng = engine(str(tiny_gqa.path), speculative=spec, max_num_seqs=1, block_size=4)
    eng.runner.spec.replay = AcceptanceReplay([1.0], loop_changes=[0.0, 0.0, 0.5])
    launch = eng.runner.launch

    def dear(sched, *args, **kw):
        if any(r.spec is not None for r in sched.rows):
            time.sleep(0.015)
        return launch(sched, *args, **kw)

    eng.runner.launch = dear
    prompt = [3 + (j * 11) % 250 for j in range(6)]
    drafts = {}
    for rid in ("a", "b", "c") if guard else ("b",):
        before = eng.stats.spec_num_draft_tokens
        eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=64, temperature=0.0,
                                                                           ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        drafts[rid] = eng.stats.spec_num_draft_tokens - before
    if not guard:
        assert drafts["b"] >= 55, drafts
    else:
        assert drafts["a"] == 0 and 0 < drafts["b"] < 40 and drafts["c"] == 0, drafts
