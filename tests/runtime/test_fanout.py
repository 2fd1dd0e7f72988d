"""One control call answered by several engines (``loopline/runtime/fanout.py``): each combine rule on
hand-made replies, the first error in engine order (named by the front end), and the whole round
over engine clients that answer later, on other threads."""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest

from loopline.engine.verbs import VERBS, Combine, Verb
from loopline.errors import EngineDeadError, EngineStateError, InvalidRequestError
from loopline.runtime.fanout import Gather, Outcome, combine, fan_out


def verb(rule: Combine) -> Verb:
    return Verb("v", (), Any, "A verb made for the test.", rule)


def test_each_combine_rule_on_hand_made_replies():
    assert combine(verb(Combine.NONE), [("a", 1), ("b", 2)], "engines") is None
    assert combine(verb(Combine.SAME), [("a", 3), ("b", 3)], "engines") == 3
    with pytest.raises(EngineStateError, match=r"^the engines disagree on v: replica 0: 3, replica 1: 4$"):
        combine(verb(Combine.SAME), [("replica 0", 3), ("replica 1", 4)], "engines")
    assert combine(verb(Combine.ALL), [("a", True), ("b", True)], "engines") is True
    assert combine(verb(Combine.ALL), [("a", True), ("b", False)], "engines") is False
    assert combine(verb(Combine.UNION), [("a", ["y", "x"]), ("b", ["x", "z"]), ("c", [])], "engines") == ["x", "y", "z"]
    # the table's own rules
    assert combine(VERBS["abort_all"], [("p", ["b"]), ("d", ["a", "b"])], "workers") == ["a", "b"]
    assert combine(VERBS["reset_prefix_cache"], [("p", None), ("d", None)], "workers") is None


def test_gather_answers_once_every_engine_did_with_the_first_error_in_engine_order():
    named = lambda key, error: EngineStateError(f"engine {key}: {error}")  # noqa: E731
    g = Gather(verb(Combine.SAME), [0, 1, 2], engines="engines", name_error=named)
    assert g.reply(2, error=EngineStateError("late")) is None  # engine 2 fails first...
    assert g.reply(7, 5) is None and g.reply(2, 5) is None  # a stranger's reply, a second reply: ignored
    assert g.reply(0, 5) is None
    outcome = g.reply(1, error=EngineStateError("busy"))  # ... but engine 1 comes first in engine order
    assert isinstance(outcome.error, EngineStateError) and str(outcome.error) == "engine 1: busy"

    g = Gather(verb(Combine.SAME), ["p", "d"], engines="workers", label={"p": "prefill 0", "d": "decode 0"}.get)
    assert g.reply("d", 1) is None
    outcome = g.reply("p", 2)
    assert outcome.result is None and str(outcome.error) == "the workers disagree on v: prefill 0: 2, decode 0: 1"
    g = Gather(VERBS["get_weight_version"], ["p", "d"], engines="workers")
    g.reply("p", 4)
    assert g.reply("d", 4) == Outcome(4)


class _Later:
    """An engine client whose calls are answered later, on a thread of their own."""

    def __init__(self, result=None, error=None):
        self.result, self.error, self.calls = result, error, []

    def call(self, name, args=(), until_drained=False) -> concurrent.futures.Future:
        self.calls.append((name, args, until_drained))
        f = concurrent.futures.Future()
        answer = (lambda: f.set_exception(self.error)) if self.error is not None else (lambda: f.set_result(self.result))
        threading.Timer(0.01, answer).start()
        return f


def test_fan_out_sends_the_call_to_every_client_and_combines_their_answers():
    a, b = _Later(["r2"]), _Later(["r1", "r2"])
    out = fan_out(VERBS["abort_all"], (), False, [(0, a), (1, b)], engines="replicas")
    assert out.result(5) == ["r1", "r2"]
    pause = VERBS["pause_generation"]
    assert fan_out(pause, ("wait",), True, [(0, a), (1, b)], engines="replicas").result(5) is None
    assert a.calls[-1] == b.calls[-1] == ("pause_generation", ("wait",), True)
    failing = fan_out(pause, ("abort",), False, [(0, _Later()), (1, _Later(error=EngineStateError("busy")))],
                      engines="replicas", name_error=lambda i, e: EngineStateError(f"replica {i}: {e}"))
    with pytest.raises(EngineStateError, match="^replica 1: busy$"):
        failing.result(5)
    with pytest.raises(EngineDeadError, match="none of the replicas is left to answer pause_generation"):
        fan_out(pause, ("abort",), False, [], engines="replicas").result(5)


def test_prefill_decode_refuses_what_the_table_does_not_mark_disaggregated():
    from loopline.distributed.pd import disaggregation_refusal

    for v in VERBS.values():
        error = disaggregation_refusal(v.name)
        if v.disaggregated:
            assert error is None, v.name
            assert str(disaggregation_refusal(v.name, until_drained=True)) == \
                f"{v.name} is not supported with prefill/decode disaggregation"
        else:
            assert isinstance(error, EngineStateError)
            assert str(error) == f"{v.name} is not supported with prefill/decode disaggregation"
    assert isinstance(disaggregation_refusal("nope"), InvalidRequestError)


class _Worker:
    def __init__(self, kind: str, rank: int):
        self.kind, self.rank, self.name, self.alive, self.sent = kind, rank, f"{kind} worker {rank}", True, []

    def _send(self, cmd):
        self.sent.append(cmd)


def test_prefill_decode_combines_the_workers_replies_by_the_tables_rule():

    from loopline.distributed.pd import Broadcast
    from loopline.runtime.protocol import CallCmd, Reply

    calls = Broadcast()  # PDClient's control calls to its workers: no worker processes
    prefill, decode, dead = _Worker("prefill", 0), _Worker("decode", 1), _Worker("decode", 2)
    dead.alive = False
    assert calls.send(CallCmd(7, "abort_all"), [prefill, decode, dead]) is None
    assert prefill.sent == decode.sent == [CallCmd(7, "abort_all")] and not dead.sent
    assert calls.reply(decode, Reply(7, ["b", "a"])) is None
    assert calls.reply(prefill, Reply(7, ["a"])) == Reply(7, ["a", "b"])
    calls.send(CallCmd(8, "get_weight_version"), [prefill, decode])
    calls.reply(prefill, Reply(8, 0))
    reply = calls.reply(decode, Reply(8, 1))
    assert str(reply.error) == ("the prefill/decode workers disagree on get_weight_version: "
                                "prefill worker 0: 0, decode worker 1: 1")
    assert calls.reply(prefill, Reply(9, "x")) == Reply(9, "x")  # not a broadcast: passed on
    # a refused verb is answered at once and sent nowhere
    refusal = calls.send(CallCmd(10, "sleep", (1,)), [prefill, decode])
    assert isinstance(refusal.error, EngineStateError) and refusal.id == 10 and len(prefill.sent) == 2
    # a worker that dies answers what it still owes with its error: the first in rank order wins
    calls.send(CallCmd(11, "get_weight_version"), [prefill, decode])
    assert calls.fail(decode, EngineDeadError("decode gone")) == []
    (done,) = calls.fail(prefill, EngineDeadError("prefill gone"))
    assert done.id == 11 and str(done.error) == "prefill gone"
