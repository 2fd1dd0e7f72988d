"""Speculation's measured step cost (loopline/core/step_clock.py; docs/speculation.md, "When it pays"): the engine
times its plain and speculating decode steps by requests a step, prices a speculating request's step at
``1 + (C/S)(t_spec/t_plain - 1)`` plain steps, and decodes a new request plainly until a plain step's time is
known. A step that costs more than its tokens save turns speculation off, whatever the cost model says."""
from __future__ import annotations

import time

import pytest
from spec.test_engine import engine

from loopline import SamplingParams
from loopline.core.contracts import PipeLane, ScheduledRow
from loopline.core.speculation import PipelineSpeculation, pipe_step_cost
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


def test_the_clock_prices_a_speculating_step_by_what_it_costs_the_batch():
    clock = StepClock()
    assert clock.step_cost(8) is None and not clock.has_baseline(8)
    for _ in range(StepClock.MIN_SAMPLES + 1):  # the first of a run of one kind is not timed
        clock.record(rows(8), 0.001)
    assert clock.plain_seconds(8) == pytest.approx(0.001) and clock.step_cost(8) is None
    for _ in range(StepClock.MIN_SAMPLES + 1):  # one request speculating beside seven plain ones, 3x the time
        clock.record(rows(7, 1), 0.003)
    assert clock.step_cost(8) == pytest.approx(1 + 8 * 2.0)  # its step, and 2 extra steps' time for all 8
    # steps with a prompt's chunk, and the step after a change of kind, are not timed
    for step in (rows(7, 1, prefill=True), rows(8), rows(7, 1), rows(8)):
        clock.record(step, 1.0)
    assert clock.step_cost(8) == pytest.approx(17.0) and clock.plain_seconds(8) == pytest.approx(0.001)


def test_every_request_speculating_shares_the_extra_time():
    clock = StepClock()
    for step, seconds in ((rows(4), 0.002), (rows(0, 4), 0.003)):
        for _ in range(StepClock.MIN_SAMPLES + 1):
            clock.record(step, seconds)
    assert clock.step_cost(4) == pytest.approx(1.5)
    assert clock.step_cost(3) is None  # (no speculating steps at 3 requests)


def test_a_plain_step_of_fewer_requests_stands_in_down_to_half():
    clock = StepClock()
    for _ in range(StepClock.MIN_SAMPLES + 1):
        clock.record(rows(4), 0.002)
    assert [clock.has_baseline(c) for c in (3, 4, 5, 7, 8, 9)] == [False, True, True, True, True, False]
    clock.max_requests = 4  # (a request admitted behind many waiting ones decodes at most 4 to a step)
    assert clock.has_baseline(100)


def test_an_outlier_moves_the_mean_only_so_far():
    clock = StepClock()
    for _ in range(StepClock.MIN_SAMPLES + 1):
        clock.record(rows(2), 0.001)
    clock.record(rows(2), 5.0)  # a collection pause: counted as 4x the mean at most
    assert clock.plain_seconds(2) == pytest.approx(0.001 + 0.003 / 9)  # (the 9th sample weighs 1/9)


def test_a_new_request_decodes_plainly_until_a_plain_step_is_timed():
    s = PipelineSpeculation(SpeculativeConfig(num_speculative_tokens=3, draft_loops=1, scheme="pipeline"), 4)
    assert not s.starts(0)  # (it would run alone: no plain step of one request timed yet)
    for _ in range(StepClock.MIN_SAMPLES + 1):
        s.observe_step(rows(1), 0.001)
    assert s.starts(0) and s.cost(4, 1, 3) == pipe_step_cost(s.lanes, 1)  # the model until measured
    for _ in range(StepClock.MIN_SAMPLES + 1):
        s.observe_step(rows(0, 1), 0.004)
    assert s.cost(4, 1, 3) == pytest.approx(4.0)
    model = PipelineSpeculation(SpeculativeConfig(draft_loops=1, scheme="pipeline", step_cost="model"), 4)
    assert model.starts(0) and model.clock is None
    with pytest.raises(Exception, match="step_cost"):
        SpeculativeConfig(step_cost="guess")


@pytest.mark.parametrize("step_cost", ["measured", "model"])
def test_speculating_steps_that_cost_more_than_they_save_turn_speculation_off(tiny_gqa, step_cost):
    """Every draft accepted (replayed), so the cost model says the pipeline pays; but each speculating step
    is made 15 ms dearer than a plain one (a few ms here). Measured, the first request decodes plainly (timing
    a plain step), the second pipelines until its own measured payoff stops it, and the engine turns the
    third away; priced by the model, the second pipelines to its end."""
    spec = {"method": "loop", "scheme": "pipeline", "draft_loops": 1, "step_cost": step_cost}
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
    for rid in ("a", "b", "c") if step_cost == "measured" else ("b",):
        before = eng.stats.spec_num_draft_tokens
        eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=64, temperature=0.0,
                                                                           ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        drafts[rid] = eng.stats.spec_num_draft_tokens - before
    if step_cost == "model":
        assert drafts["b"] >= 55, drafts
    else:
        assert drafts["a"] == 0 and 0 < drafts["b"] < 40 and drafts["c"] == 0, drafts
