"""The startup heap kept out of the cyclic collector (loopline.runtime.heap): the bench's measured window and
the engine process freeze it; verbs that drop long-lived state run with it thawed, so what they drop is freed."""
from __future__ import annotations

import contextlib
import gc
import weakref

import pytest

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.runtime import core as core_module
from loopline.runtime import heap
from loopline.runtime.core import EngineCore, Inbox
from loopline.runtime.protocol import CallCmd


class Node:
    pass


def cycle() -> Node:
    """An object only a reference cycle keeps alive: reference counting never frees it, the collector does."""
    node = Node()
    node.me = node
    return node


@pytest.fixture(autouse=True)
def unfrozen():
    """Each test starts from an unfrozen heap (conftest freezes the suite's own) and leaves it as it was."""
    assert not heap._frozen
    gc.unfreeze()
    yield
    gc.unfreeze()
    heap._frozen = False
    gc.collect()
    gc.freeze()


def test_frozen_heap_spares_what_lived_before_it_then_gives_it_back():
    node = cycle()
    ref = weakref.ref(node)
    with heap.frozen_heap():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: the collector does not scan it
    assert gc.get_freeze_count() == 0 and not heap._frozen
    gc.collect()
    assert ref() is None


def test_frozen_heap_leaves_a_heap_frozen_before_it_as_it_is():
    gc.freeze()  # (the application's own freeze)
    frozen = gc.get_freeze_count()
    node = cycle()
    ref = weakref.ref(node)
    # (a frozen object freed meanwhile, by another test's thread, leaves the permanent generation: the count may
    # fall a little; an unfreeze would empty it, a refreeze raise it by everything made since, `node` included)
    with heap.frozen_heap():
        assert 0 < gc.get_freeze_count() <= frozen and not heap._frozen
    assert 0 < gc.get_freeze_count() <= frozen
    del node
    gc.collect()
    assert ref() is None  # made after that freeze: still the collector's


def test_thawed_does_nothing_where_nothing_froze_the_heap():
    node = cycle()
    with heap.thawed():
        assert gc.get_freeze_count() == 0
    assert gc.get_freeze_count() == 0 and not heap._frozen
    del node


def test_thawed_collects_what_its_block_drops_and_freezes_again():
    node = cycle()
    ref = weakref.ref(node)
    heap.freeze_startup_heap()
    gc.collect()
    assert ref() is not None and gc.get_freeze_count() > 0
    with heap.thawed():
        assert gc.get_freeze_count() == 0
        del node
    assert ref() is None  # collected on the way out
    assert gc.get_freeze_count() > 0 and heap._frozen


def test_the_engine_loop_thaws_the_heap_for_sleep_and_wake_up_only(tiny_gqa, monkeypatch):
    seen = []

    @contextlib.contextmanager
    def recording():
        seen.append("thawed")
        yield

    monkeypatch.setattr(core_module, "thawed", recording)
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", max_num_seqs=2,
                                  max_model_len=64, skip_tokenizer_init=True))
    core = EngineCore(engine, Inbox(), lambda msg: None)
    core.apply(CallCmd(1, "get_weight_version"))
    assert seen == []
    core.apply(CallCmd(2, "sleep", (1,)))
    core.apply(CallCmd(3, "wake_up", (None,)))
    assert seen == ["thawed", "thawed"]
    assert [r.error for r in core.outbox.replies] == [None, None, None]
    assert not engine.control_call("is_sleeping")
