"""The control verbs are declared once (``loopline/engine/verbs.py``): ``LLMEngine``, ``LLM`` and
``AsyncLLM`` have every verb with the table's signature and doc, none of them writes one by hand,
each dispatches through its one control port, and a verb the table does not know is refused on
every path, the engine loop's included."""
from __future__ import annotations

import asyncio
import inspect

import pytest

from loopline import LLM, AsyncLLM, EngineArgs
from loopline.engine import LLMEngine
from loopline.engine.control import EngineControl
from loopline.engine.verbs import VERBS, Combine, verb_mixin
from loopline.errors import InvalidRequestError
from loopline.runtime.core import EngineCore

ALL = list(VERBS.values())


@pytest.mark.parametrize("verb", ALL, ids=[v.name for v in ALL])
def test_every_verb_is_on_every_surface_with_the_tables_signature_and_doc(verb):
    surfaces = [AsyncLLM] if verb.loop else [LLMEngine, LLM, AsyncLLM]
    for cls in surfaces:
        assert verb.name not in cls.__dict__, f"{cls.__name__}.{verb.name} is written by hand"
        if cls is LLMEngine and verb.state:  # engine.is_paused: a property, as vLLM's engine has it
            prop = inspect.getattr_static(cls, verb.name)
            assert isinstance(prop, property) and prop.__doc__ == verb.doc
            continue
        method = getattr(cls, verb.name)
        assert inspect.signature(method) == verb.signature, cls
        assert inspect.getdoc(method) == inspect.cleandoc(verb.doc)
        assert inspect.iscoroutinefunction(method) == (cls is AsyncLLM)
    if verb.loop:  # served by the engine loop: only the async front end has it
        assert not hasattr(LLMEngine, verb.name) and not hasattr(LLM, verb.name)
        assert callable(getattr(EngineCore, f"call_{verb.name}"))
    else:  # the engine's implementation is EngineControl's member of the same name
        served = inspect.getattr_static(EngineControl, verb.name)
        assert isinstance(served, property) == verb.state


def test_help_shows_the_signature_and_the_doc():
    assert str(inspect.signature(LLM.sleep)) == "(self, level: int = 1) -> None"
    assert str(inspect.signature(AsyncLLM.wake_up)) == "(self, tags: list[str] | None = None) -> None"
    assert str(inspect.signature(LLMEngine.update_weights_from_disk)) == "(self, path: str, version: int) -> int"
    assert LLM.pause_generation.__doc__ == VERBS["pause_generation"].doc and LLM.sleep.__name__ == "sleep"


def test_the_table_is_well_formed():
    assert all(v.doc and isinstance(v.combine, Combine) for v in ALL)
    assert all(v.read_only and not v.params for v in ALL if v.state)
    # prefill/decode disaggregation: what PD sent to every worker before the table (and is_drained, read-only)
    assert {v.name for v in ALL if v.disaggregated} == {"reset_prefix_cache", "abort_all", "get_weight_version",
                                                       "is_paused", "is_sleeping", "is_drained"}
    assert VERBS["abort_all"].combine is Combine.UNION and VERBS["get_weight_version"].combine is Combine.SAME


def test_bind_fills_defaults_and_names_the_wait():
    pause = VERBS["pause_generation"]
    assert pause.bind() == ("abort",) and not pause.until_drained(pause.bind())
    assert pause.bind((), {"mode": "wait"}) == ("wait",) and pause.until_drained(("wait",))
    assert not pause.until_drained(("keep",))
    assert VERBS["update_weights_from_disk"].bind(("/ckpt",), {"version": 3}) == ("/ckpt", 3)
    with pytest.raises(TypeError, match=r"^sleep\(\): "):
        VERBS["sleep"].bind((1, 2))
    with pytest.raises(TypeError, match="is_paused"):
        VERBS["is_paused"].bind((True,))


def test_an_unknown_verb_is_refused_with_the_known_ones_listed():
    with pytest.raises(InvalidRequestError, match=r"unknown control verb 'pause'; the verbs are .*pause_generation") as e:
        VERBS.lookup("pause")
    assert e.value.param == "verb"
    with pytest.raises(InvalidRequestError):
        VERBS.lookup(None)


def test_a_mixin_dispatches_every_method_through_control_call():
    calls = []

    class Recorder(verb_mixin("RecorderVerbs")):
        def control_call(self, verb, *args, **kwargs):
            calls.append((verb, args, kwargs))
            return verb

    r = Recorder()
    assert r.sleep(2) == "sleep" and r.wake_up(tags=["weights"]) == "wake_up" and r.is_paused() == "is_paused"
    assert calls == [("sleep", (2,), {}), ("wake_up", (), {"tags": ["weights"]}), ("is_paused", (), {})]
    assert not hasattr(r, "abort_all")  # the engine loop's verbs only with loop_verbs=True


@pytest.fixture
def engine(tiny_gqa):
    return LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                block_size=4, num_kv_blocks=64, disable_log_stats=True))


def test_the_engine_runs_verbs_through_its_control_port(engine):
    assert engine.control_call("get_weight_version") == 0 == engine.get_weight_version()
    engine.control_call("pause_generation", mode="keep")
    assert engine.is_paused and engine.control_call("is_paused") and engine.control.frozen
    assert engine.is_drained  # nothing was in flight
    engine.resume_generation()
    assert not engine.is_paused
    engine.sleep()  # level 1 by the table's default
    assert engine.is_sleeping and not engine.control.weights_asleep
    engine.control_call("wake_up", None)
    assert not engine.is_sleeping and engine.device_memory_stats() is None  # CPU
    with pytest.raises(InvalidRequestError, match="unknown control verb 'add_request'"):
        engine.control_call("add_request", "x", [1, 2])
    with pytest.raises(InvalidRequestError, match="abort_all is served by the engine loop"):
        engine.control_call("abort_all")
    with pytest.raises(TypeError, match="sleep"):
        engine.sleep(1, 2)


def test_the_engine_loop_runs_only_verbs_of_the_table(engine):
    llm = AsyncLLM(engine=engine)

    async def main():
        with pytest.raises(InvalidRequestError, match="unknown control verb 'nope'"):
            await llm.control_call("nope")
        for name, args in (("add_request", ("x", [1, 2, 3])), ("step", ()), ("nope", ())):  # a raw call, past AsyncLLM
            with pytest.raises(InvalidRequestError, match=f"unknown control verb '{name}'"):
                await asyncio.wrap_future(llm.client.call(name, args))
        assert not engine.outputs.has("x")  # nothing was added
        await llm.pause_generation("wait")  # nothing in flight: answers at once
        assert await llm.is_paused() and await llm.is_drained() and await llm.abort_all() == []
        await llm.resume_generation()
        await llm.start_weight_update(0)  # re-publishes the committed version
        assert await llm.update_weights(x for x in []) == 0  # a generator: consumed here, as a list there
        await llm.abort_weight_update()  # nothing was copied: the weights still serve
        assert llm.weights_state() == "committed"

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
