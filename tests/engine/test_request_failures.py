"""An engine bug hit while serving one request fails that request alone (docs/security.md).

Faults are injected for one request (the one with ``max_tokens=9``) at each place the engine works
per request: the runner's readback of its row, its prompt logprobs, detokenization, the stop check,
the final flush when it finishes, and building its output. The requests sharing its steps must end
exactly as in a serial run without it, the failed one with an error id, and no KV left in use.
"""
from __future__ import annotations

import pytest

from loopline import SamplingParams
from loopline.core.scheduler import Scheduler
from loopline.engine.input_processor import parent_request_id
from loopline.engine.output_processor import OutputProcessor
from loopline.worker.model_runner import ModelRunner

PROMPTS = ["The river town woke slowly.", "Once upon a time", "A list of numbers: 1, 2,"]
GOOD = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, exit_threshold=0.7),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)]
BAD_PROMPT = "Something that will fail"
SITES = ["readback", "prompt_logprobs", "detokenize", "stop_check", "flush", "output"]


def _is_bad(params) -> bool:
    return params.max_tokens == 9


def _bad_params(site: str) -> SamplingParams:
    return SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=1 if site == "prompt_logprobs" else None)


def _arm(monkeypatch, site: str) -> None:
    """Makes the engine raise for the bad request at ``site`` (a few tokens in, where it can be)."""
    def boom(*_args, **_kwargs):
        raise RuntimeError("an engine bug (secret detail)")

    bad: dict[str, str] = {}  # the bad request -> its first completion (recorded as it is added)
    real_add = OutputProcessor.add

    def add(self, request_id, prompt, prompt_ids, params, children, weight_version=None):
        real_add(self, request_id, prompt, prompt_ids, params, children, weight_version)
        if _is_bad(params):
            bad[request_id] = children[0]
            detok = self.detokenizer(children[0])
            if site == "flush":
                detok.flush = boom
            elif site == "detokenize":
                push, pushed = detok.push, []

                def failing_push(token_id):
                    pushed.append(token_id)
                    return boom() if len(pushed) == 3 else push(token_id)

                detok.push = failing_push

    monkeypatch.setattr(OutputProcessor, "add", add)
    if site == "readback":
        real = ModelRunner._sampled_token

        def sampled_token(host, j, params):
            return boom() if _is_bad(params) else real(host, j, params)

        monkeypatch.setattr(ModelRunner, "_sampled_token", staticmethod(sampled_token))
    elif site == "prompt_logprobs":
        real_plp = OutputProcessor.add_prompt_logprobs

        def add_prompt_logprobs(self, child_id, entries):
            return boom() if parent_request_id(child_id) in bad else real_plp(self, child_id, entries)

        monkeypatch.setattr(OutputProcessor, "add_prompt_logprobs", add_prompt_logprobs)
    elif site == "stop_check":
        real_stop = Scheduler.check_stop

        def check_stop(self, req):
            return boom() if _is_bad(req.params) and req.num_output_tokens == 3 else real_stop(self, req)

        monkeypatch.setattr(Scheduler, "check_stop", check_stop)
    elif site == "output":
        real_on_token, real_output, booked = OutputProcessor.on_token, OutputProcessor._output, {}

        def on_token(self, req, *args, **kwargs):
            booked[req.request_id] = req.num_output_tokens  # the completion's tokens, this one included
            return real_on_token(self, req, *args, **kwargs)

        def output(self, parent):
            first = bad.get(parent.request_id)
            return boom() if first is not None and booked.get(first) == 3 else real_output(self, parent)

        monkeypatch.setattr(OutputProcessor, "on_token", on_token)
        monkeypatch.setattr(OutputProcessor, "_output", output)
    elif site not in ("detokenize", "flush"):
        raise AssertionError(site)


def _summary(out, approx: bool = False):
    """What must match exactly; logprobs (``approx``: of the run compared to a reference) to float
    rounding: a batch of another size may sum in another order."""
    c = out.outputs[0]
    logprobs = [(list(e), [lp.logprob for lp in e.values()]) for e in c.logprobs or []]
    if approx:
        logprobs = [(ids, pytest.approx(lps, abs=1e-4)) for ids, lps in logprobs]
    return c.token_ids, c.exit_depths, c.text, c.finish_reason, logprobs, c.error_id


@pytest.fixture(scope="module")
def serial(tiny_gqa):
    """Each good request alone, one after the other, on a fresh engine."""
    llm = tiny_gqa.llm(max_num_seqs=4)
    return [_summary(llm.generate(p, sp, use_tqdm=False)[0]) for p, sp in zip(PROMPTS, GOOD)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("site", SITES)
def test_a_failure_in_one_request_fails_it_alone(tiny_gqa, serial, monkeypatch, caplog, site, overlap):
    llm = tiny_gqa.llm(max_num_seqs=4, async_scheduling=overlap)
    engine = llm.llm_engine
    _arm(monkeypatch, site)
    with caplog.at_level("ERROR", logger="loopline"):
        outs = llm.generate(PROMPTS[:1] + [BAD_PROMPT] + PROMPTS[1:], GOOD[:1] + [_bad_params(site)] + GOOD[1:],
                            use_tqdm=False)
    bad = outs.pop(1)
    c = bad.outputs[0]
    assert bad.finished and c.finish_reason == "abort" and c.error_id is not None and bad.error_id == c.error_id
    assert "internal error" in c.stop_reason and "secret" not in c.stop_reason
    assert any(c.error_id in r.getMessage() for r in caplog.records)  # the log has the id (and the traceback)
    assert [_summary(o, approx=True) for o in outs] == serial
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.stats.failed_requests == 1 and engine.dead_reason is None
    # the engine serves on, identically (the fault is still armed for max_tokens=9 only)
    assert [_summary(o, approx=True) for o in llm.generate(PROMPTS, GOOD, use_tqdm=False)] == serial
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failing_forward_fails_its_step_and_the_engine_serves_on(tiny_gqa, serial, monkeypatch, overlap):
    """Not attributable to a request (the model itself raised): the step's requests fail with an error id,
    their KV and slots are freed, and the next requests run exactly as on a fresh engine."""
    llm = tiny_gqa.llm(max_num_seqs=4, async_scheduling=overlap)
    engine = llm.llm_engine
    real_loop, calls = engine.model.loop, []

    def loop(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("a bug in the forward")
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(engine.model, "loop", loop)
    outs = llm.generate(PROMPTS, GOOD, use_tqdm=False)
    assert all(o.finished and o.error_id is not None and o.outputs[0].finish_reason == "abort" for o in outs)
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.stats.failed_requests == len(PROMPTS) and engine.dead_reason is None
    assert [_summary(o, approx=True) for o in llm.generate(PROMPTS, GOOD, use_tqdm=False)] == serial
    assert engine.kv.num_used_blocks == 0


def test_a_failed_choice_leaves_its_siblings_running(tiny_gqa, monkeypatch):
    """``n=2``: the choice that fails ends with an error id; the other finishes as it would have."""
    llm = tiny_gqa.llm(max_num_seqs=4)
    two = SamplingParams(n=2, max_tokens=9, temperature=1.0, seed=5, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], two, use_tqdm=False)[0]
    _arm(monkeypatch, "detokenize")
    out = llm.generate(PROMPTS[0], two, use_tqdm=False)[0]
    assert out.finished and out.outputs[0].error_id is not None and out.outputs[0].finish_reason == "abort"
    assert out.error_id == out.outputs[0].error_id
    c1, a1 = out.outputs[1], alone.outputs[1]
    assert (c1.token_ids, c1.exit_depths, c1.text, c1.finish_reason, c1.error_id) == \
        (a1.token_ids, a1.exit_depths, a1.text, "length", None)
    assert llm.llm_engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("how", ["abort_request", "pause_abort"])
def test_a_failure_while_aborting_fails_only_that_request(tiny_gqa, how):
    """Aborting flushes each request's text; a request whose flush fails ends with an error id, the
    others aborted with it end as plain aborts, and nothing is left in use."""
    llm = tiny_gqa.llm(max_num_seqs=4)
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(PROMPTS, GOOD)):
        engine.add_request(f"r{i}", prompt, sp.clone(max_tokens=50))
    for _ in range(4):
        engine.step()

    def boom():
        raise RuntimeError("an engine bug")

    engine.outputs.detokenizer("r1#0").flush = boom
    if how == "pause_abort":
        engine.pause_generation("abort")
    else:
        engine.abort_request(["r0", "r1", "r2"])
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"r0", "r1", "r2"} and all(o.finished for o in outs.values())
    assert outs["r1"].error_id is not None and outs["r1"].outputs[0].finish_reason == "abort"
    assert all(outs[r].error_id is None and outs[r].outputs[0].finish_reason == "abort" for r in ("r0", "r2"))
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
