"""The engine reports deltas (engine/deltas.py): added up they are the cumulative outputs, field by field;
``output_kind`` decides what a consumer gets; a delta costs what it adds, never the history."""
from __future__ import annotations

import pytest

from loopline import SamplingParams
from loopline.engine.deltas import CompletionDelta, OutputBuilder, OutputDelta
from loopline.engine.output_processor import OutputProcessor
from loopline.sampling_params import RequestOutputKind

PROMPT = "The river town woke slowly."
CASES = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    "n3-logprobs": SamplingParams(max_tokens=9, temperature=0.9, seed=11, n=3, logprobs=2, ignore_eos=True),
    "stop": SamplingParams(max_tokens=40, temperature=1.0, seed=5, stop=["e", "th"], ignore_eos=True),
    # a stop string that never comes: its length - 1 characters stay held back until the end
    "holdback": SamplingParams(max_tokens=20, temperature=0.0, stop=["\x00" * 7], ignore_eos=True),
    "stop-kept": SamplingParams(max_tokens=40, temperature=1.0, seed=5, stop=["the", "an"],
                                include_stop_str_in_output=True, ignore_eos=True),
    "prompt-logprobs": SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=2, logprobs=0, ignore_eos=True),
}
FIELDS = ("text", "token_ids", "logprobs", "cumulative_logprob", "exit_depths", "weight_versions", "finish_reason",
          "stop_reason", "seed", "error_id")


@pytest.fixture(scope="module")
def engine(tiny_gqa):
    return tiny_gqa.llm(max_num_seqs=4).llm_engine


def _run(engine, rid, params, deltas: bool, abort_after: int | None = None) -> list:
    engine.add_request(rid, PROMPT, params)
    outs, steps = [], 0
    while engine.has_unfinished_requests():
        outs += [o for o in (engine.step_deltas() if deltas else engine.step()) if o.request_id == rid]
        steps += 1
        if steps == abort_after:
            engine.abort_request(rid)
    return outs


class Added:
    """The oracle: deltas added up by hand (text replaced from ``text_start``, lists extended)."""

    def __init__(self, n: int) -> None:
        self.comps = [dict(text="", token_ids=[], logprobs=None, cumulative_logprob=None, exit_depths=[],
                           weight_versions=[], finish_reason=None, stop_reason=None, seed=None, error_id=None)
                      for _ in range(n)]

    def add(self, delta: OutputDelta) -> None:
        for d in delta.outputs:
            c = self.comps[d.index]
            c["text"] = c["text"][:d.text_start] + d.text
            for name in ("token_ids", "exit_depths", "weight_versions"):
                c[name] = c[name] + getattr(d, name)
            if d.logprobs is not None:
                c["logprobs"] = (c["logprobs"] or []) + d.logprobs
            for name in ("cumulative_logprob", "finish_reason", "stop_reason", "seed", "error_id"):
                c[name] = getattr(d, name)


@pytest.mark.parametrize("abort", [False, True], ids=["to-the-end", "aborted"])
@pytest.mark.parametrize("case", list(CASES))
def test_deltas_add_up_to_the_cumulative_outputs(engine, case, abort):
    params = CASES[case]
    cumulative = _run(engine, f"c-{case}-{abort}", params, deltas=False, abort_after=4 if abort else None)
    deltas = _run(engine, f"d-{case}-{abort}", params, deltas=True, abort_after=4 if abort else None)
    assert len(deltas) == len(cumulative) and cumulative[-1].finished and deltas[-1].finished
    added = Added(params.n)
    for i, (delta, whole) in enumerate(zip(deltas, cumulative)):
        assert (delta.head is not None) == (i == 0)  # the prompt and params travel once
        for d in delta.outputs:  # never the history: at most the one token of this step
            assert len(d.token_ids) <= 1 and len(d.exit_depths) == len(d.token_ids) == len(d.weight_versions)
            assert d.logprobs is None or len(d.logprobs) == len(d.token_ids)
        added.add(delta)
        for c in whole.outputs:
            got = added.comps[c.index]
            for name in FIELDS:
                if name == "logprobs" and got["logprobs"] is None and c.logprobs == []:
                    continue  # a choice with no token yet: no delta of it came
                if name in ("cumulative_logprob", "seed") and not got["token_ids"] and not c.token_ids:
                    continue
                if name == "seed" and params.seed is None:
                    continue  # drawn for each request
                assert got[name] == getattr(c, name), (case, i, c.index, name)
    if params.prompt_logprobs is not None:
        assert deltas[0].prompt_logprobs == cumulative[-1].prompt_logprobs
        assert all(d.prompt_logprobs is None for d in deltas[1:])  # filled once: sent once


def test_text_that_changed_earlier(engine, monkeypatch):
    """``text_start`` before the end of the text sent: a cumulative output has the new text; a DELTA
    consumer never gets text taken back (the server streams what extends past what it sent)."""
    def delta(start, text, finished=False, head=True):
        comp = CompletionDelta(0, text, start, [1], [4], [0], None, None, "stop" if finished else None, None, 3)
        params = SamplingParams(output_kind=kind)
        return OutputDelta("r", [comp], finished, 0, None, (None, [1, 2], params) if head else None)

    steps = [(0, "ab"), (2, "cd"), (2, "X"), (3, "yz")]  # "ab", "abcd", "abX", "abXyz"
    for kind, texts in ((RequestOutputKind.CUMULATIVE, ["ab", "abcd", "abX", "abXyz"]),
                        (RequestOutputKind.DELTA, ["ab", "cd", "", "z"])):
        builder = OutputBuilder()
        got = [builder.build([delta(s, t, i == 3, i == 0)])[0].outputs for i, (s, t) in enumerate(steps)]
        assert [o[0].text if o else "" for o in got] == texts, kind
        assert not len(builder)

    # an engine whose output could not be built: the request fails, its text is replaced by ""
    real = OutputProcessor._output
    calls = []

    def failing(self, parent):
        calls.append(1)
        return real(self, parent) if len(calls) != 3 else 1 / 0

    monkeypatch.setattr(OutputProcessor, "_output", failing)
    deltas = _run(engine, "fails", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), deltas=True)
    last = deltas[-1].outputs[0]
    assert (last.text_start, last.text, last.finish_reason) == (0, "", "abort") and last.error_id is not None
    whole = OutputBuilder().build(deltas)[-1]
    assert whole.finished and whole.outputs[0].text == "" and whole.error_id == last.error_id
    assert whole.outputs[0].token_ids == [t for d in deltas for t in d.outputs[0].token_ids]


def _fields(out):
    return [tuple(getattr(c, f) for f in FIELDS) for c in out.outputs]


def test_output_kinds_of_engine_step(engine):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=3, n=3, logprobs=1, stop=["e "], ignore_eos=True)
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE  # the default: as before
    cumulative = _run(engine, "k-c", params, deltas=False)
    final = _run(engine, "k-f", params.clone(output_kind=RequestOutputKind.FINAL_ONLY), deltas=False)
    assert len(final) == 1 and final[0].finished and _fields(final[0]) == _fields(cumulative[-1])
    delta = _run(engine, "k-d", params.clone(output_kind=RequestOutputKind.DELTA), deltas=False)
    assert len(delta) == len(cumulative) and delta[-1].finished
    finished: set[int] = set()
    for out in delta:
        for c in out.outputs:  # only what changed: no choice without news, no finish reported twice
            assert c.token_ids or c.text or (c.finish_reason is not None and c.index not in finished)
            if c.finish_reason is not None:
                finished.add(c.index)
    for whole in cumulative[-1].outputs:
        parts = [c for out in delta for c in out.outputs if c.index == whole.index]
        assert "".join(c.text for c in parts) == whole.text
        assert [t for c in parts for t in c.token_ids] == whole.token_ids
        assert [e for c in parts for e in c.logprobs] == whole.logprobs
        assert [d for c in parts for d in c.exit_depths] == whole.exit_depths
        assert parts[-1].cumulative_logprob == whole.cumulative_logprob
        assert (parts[-1].finish_reason, parts[-1].stop_reason) == (whole.finish_reason, whole.stop_reason)


def test_a_delta_output_is_the_deltas_own_lists():
    """A DELTA consumer's output holds the lists the engine's delta brought (no copy, no history kept),
    and deltas a slow consumer did not take merge into one output."""
    builder = OutputBuilder()
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, logprobs=0)
    kept = []
    for i in range(3000):
        comp = CompletionDelta(0, "w", i, [i], [2], [0], [{i: None}], -1.0, None, None, 1)
        delta = OutputDelta("r", [comp], False, 0, None, (None, [1], params) if i == 0 else None)
        assert builder.add(delta)
        out = builder.take("r").outputs[0]
        assert out.token_ids is comp.token_ids and out.logprobs is comp.logprobs and out.exit_depths is comp.exit_depths
        assert len(builder) == 1 and builder.held("r") == 0  # nothing of the history stays
        kept.append(out)
    assert [o.token_ids for o in kept[:3]] == [[0], [1], [2]]  # earlier outputs do not grow
    a = CompletionDelta(0, "x", 3000, [7], [1], [0], [{7: None}], -1.0, None, None, 1)
    b = CompletionDelta(0, "y", 3001, [8], [3], [0], [{8: None}], -2.0, "length", None, 1)
    builder.add(OutputDelta("r", [a], False, 0, None))
    builder.add(OutputDelta("r", [b], True, 0, None))
    out = builder.take("r")
    assert out.finished and (out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].exit_depths) == ("xy", [7, 8], [1, 3])
    assert out.outputs[0].cumulative_logprob == -2.0 and not len(builder)
