"""The control verbs, declared once: weight updates, pause / resume, sleep / wake up, the prefix
cache and the state queries a trainer or an operator asks of a running engine.

:data:`VERBS` is the only list of them. Every surface derives from it or dispatches through it:

* ``LLMEngine``, ``LLM`` and ``AsyncLLM`` inherit the mixins :func:`verb_mixin` builds from the
  table -- one method per verb, with the verb's signature and docstring (``help(LLM.sleep)``) --
  and each method calls the class's one control port, ``control_call(verb, *args, **kwargs)``.
  ``LLMEngine`` serves the verbs through its :class:`~loopline.engine.control.EngineControl`;
  the state verbs (``is_paused``, ``is_drained``, ``is_sleeping``) are properties there, as vLLM's
  engine has them, and methods on ``LLM`` and ``AsyncLLM``.
* the engine loop (``runtime.core``) runs a ``CallCmd`` only for a verb of this table;
* the data-parallel and prefill/decode front ends fan a call out to their engines and combine
  the answers with the verb's :class:`Combine` rule (``runtime.fanout``); prefill/decode
  disaggregation refuses the verbs whose ``disaggregated`` is False;
* the HTTP routes (``entrypoints/openai/serving_rl.py``) call verbs by name through
  ``AsyncLLM.control_call``; the rollout server and the verl / vime adapters call the surfaces.

Adding a verb: one :class:`Verb` here and its implementation, a method (or, for a state verb,
a property) of ``EngineControl`` with the same name -- or, for a ``loop`` verb, an
``EngineCore.call_<name>`` method. Nothing else lists verbs.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from loopline.errors import InvalidRequestError

__all__ = ["Combine", "Param", "Verb", "VERBS", "VerbTable", "verb_mixin"]

_EMPTY = inspect.Parameter.empty


class Combine(Enum):
    """How the answers of several engines (data-parallel replicas, prefill/decode workers) to one
    call become one answer. An error on any engine is the call's error, whatever the rule."""

    NONE = "none"  # the verb answers nothing: None once every engine answered
    SAME = "same"  # every engine must give the same answer (else EngineStateError listing each)
    ALL = "all"  # True only if every engine answers True
    UNION = "union-sorted"  # lists merged: each item once, sorted


@dataclass(frozen=True)
class Param:
    """One parameter of a verb: its name, type (an annotation object) and default, if any."""

    name: str
    annotation: Any
    default: Any = _EMPTY


@dataclass(frozen=True)
class Verb:
    """One control verb: its signature and doc, and how every surface treats it.

    ``state``: a read-only fact without parameters (a property of ``LLMEngine``, a method elsewhere).
    ``read_only``: changes nothing in the engine. ``disaggregated``: prefill/decode disaggregation
    sends it to every worker (else refuses it). ``waits_when``: ``(parameter, value)`` for which the
    reply waits until no request is in flight (``pause_generation("wait")``). ``loop``: served by the
    engine loop itself (``EngineCore.call_<name>``), so only ``AsyncLLM`` has it. ``materialize``: a
    parameter given as an iterable, which ``AsyncLLM`` turns into a list on the caller's thread
    before the call crosses to the engine loop (so a generator that gathers tensors, e.g. with
    collectives, runs where the caller expects, and several engines can each read it). ``staged``:
    the engine loop serves it in stages (``EngineControl.stage_<name>(*args)`` returns a
    ``DiskLoad``): the reading runs on a thread of its own while the engine keeps stepping, the
    copy between two steps; the reply comes once it is done (``LLMEngine`` runs the stages in one call).
    """

    name: str
    params: tuple[Param, ...]
    returns: Any
    doc: str
    combine: Combine
    read_only: bool = False
    state: bool = False
    disaggregated: bool = False
    waits_when: tuple[str, Any] | None = None
    loop: bool = False
    materialize: str | None = None
    staged: bool = False

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        assert not self.state or (self.read_only and not names), self.name  # a state verb is a read-only fact
        assert self.waits_when is None or self.waits_when[0] in names, self.name
        assert self.materialize is None or self.materialize in names, self.name

    @property
    def signature(self) -> inspect.Signature:
        """The methods' signature: ``(self, <params>) -> returns``."""
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = [inspect.Parameter("self", kind)]
        params += [inspect.Parameter(p.name, kind, default=p.default, annotation=p.annotation) for p in self.params]
        return inspect.Signature(params, return_annotation=self.returns)

    def bind(self, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> tuple:
        """The call's arguments as one positional tuple, defaults filled in (what a ``CallCmd``
        carries); a ``TypeError`` as Python's for arguments the verb does not take."""
        try:
            bound = self.signature.bind(None, *args, **(kwargs or {}))
        except TypeError as e:
            raise TypeError(f"{self.name}(): {e}") from None
        bound.apply_defaults()
        return tuple(bound.arguments.values())[1:]

    def until_drained(self, args: tuple) -> bool:
        """Whether the reply to a call with these (bound) arguments waits until no request is in flight."""
        if self.waits_when is None:
            return False
        name, value = self.waits_when
        return args[[p.name for p in self.params].index(name)] == value


class VerbTable(Mapping[str, Verb]):
    """The verbs by name; :meth:`lookup` refuses an unknown name with an error that lists the known ones."""

    def __init__(self, *verbs: Verb) -> None:
        self._verbs = {v.name: v for v in verbs}
        assert len(self._verbs) == len(verbs), "a verb is declared twice"

    def __getitem__(self, name: str) -> Verb:
        return self._verbs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._verbs)

    def __len__(self) -> int:
        return len(self._verbs)

    def lookup(self, name: Any) -> Verb:
        verb = self._verbs.get(name) if isinstance(name, str) else None
        if verb is None:
            raise InvalidRequestError(f"unknown control verb {name!r}; the verbs are {', '.join(self._verbs)}",
                                      param="verb")
        return verb


VERBS = VerbTable(
    # --- weights (docs/rl.md section 4) ---------------------------------------------------------
    Verb("get_weight_version", (), int, "The committed weight version (0 for the weights loaded at start).",
         Combine.SAME, read_only=True, disaggregated=True),
    Verb("start_weight_update", (Param("version", int),), None,
         "Opens a full-weight update to ``version`` (>= the committed one; equal re-publishes).\n\n"
         "The engine must be idle or paused with nothing generating (``\"abort\"``, a drained\n"
         "``\"wait\"``, or ``\"keep\"``, whose frozen requests continue on the new weights).",
         Combine.NONE),
    Verb("update_weights", (Param("weights", Any),), int,
         "Validates, then copies in place, one batch of ``(HF name, tensor)`` pairs (a dict or an\n"
         "iterable; call once per shard or bucket); returns how many tensors it held.\n\n"
         "``AsyncLLM`` consumes the iterable on the caller's thread before handing it to the engine:\n"
         "a generator that materializes tensors (e.g. with collectives) runs where the caller expects.",
         Combine.SAME, materialize="weights"),
    Verb("finish_weight_update", (), int,
         "Commits the update once every parameter arrived: prefix cache reset, new salt, new version\n"
         "(returned).", Combine.SAME),
    Verb("abort_weight_update", (), None,
         "Drops an open update: the old weights still serve unless some tensors were already copied.",
         Combine.NONE),
    Verb("update_weights_from_disk", (Param("path", str), Param("version", int)), int,
         "Publishes a safetensors checkpoint directory as ``version`` (returned): every tensor is read\n"
         "and validated before anything is copied, then read again and copied one tensor at a time.\n\n"
         "``LLMEngine`` and ``LLM`` need an idle or paused engine, as ``start_weight_update``. ``AsyncLLM``\n"
         "reads the checkpoint on a thread of its own while generation goes on; once it is validated, new\n"
         "requests are held, those in flight finish on the old weights, and the copy runs between two\n"
         "steps. One update from disk at a time: another weight update meanwhile is refused.",
         Combine.SAME, staged=True),
    Verb("reset_prefix_cache", (), None,
         "Forgets every cached prompt page (pages in use stay with their requests).",
         Combine.NONE, disaggregated=True),
    # --- pause / resume (docs/rl.md section 5) --------------------------------------------------
    Verb("pause_generation", (Param("mode", str, "abort"),), None,
         "Pauses generation: ``\"abort\"`` in-flight requests, ``\"wait\"`` for them to drain, or\n"
         "``\"keep\"`` them frozen with their KV. New requests are held until resume.\n\n"
         "On ``LLMEngine`` the outputs of aborted requests come from the next ``step()`` and a\n"
         "``\"wait\"`` needs the caller to keep stepping (``is_drained`` says when none is left).\n"
         "``AsyncLLM`` returns once the pause is in force: for ``\"abort\"`` every aborted request's\n"
         "stream has its final output; for ``\"wait\"`` every request in flight has finished (it raises\n"
         "``EngineStateError`` if the pause is lifted or turned into ``\"keep\"`` before that).",
         Combine.NONE, waits_when=("mode", "wait")),
    Verb("resume_generation", (), None,
         "Resumes after a pause: frozen requests continue, held ones are queued in arrival order.", Combine.NONE),
    Verb("is_paused", (), bool, "Whether generation is paused.", Combine.SAME, read_only=True, state=True,
         disaggregated=True),
    Verb("is_drained", (), bool, "Paused and no request left in flight (held ones have not started).",
         Combine.ALL, read_only=True, state=True, disaggregated=True),
    # --- sleep / wake up ------------------------------------------------------------------------
    Verb("sleep", (Param("level", int, 1),), None,
         "Frees device memory for a colocated trainer: level 1 the KV pool, level 2 also the\n"
         "weights (moved to CPU memory). Needs no request in flight.", Combine.NONE),
    Verb("wake_up", (Param("tags", list[str] | None, None),), None,
         "Restores what ``sleep`` released (``tags``: ``\"weights\"`` and/or ``\"kv_cache\"``; default both).",
         Combine.NONE),
    Verb("is_sleeping", (), bool, "Whether the KV pool or the weights are released by ``sleep``.", Combine.SAME,
         read_only=True, state=True, disaggregated=True),
    # --- measurements and the engine loop -------------------------------------------------------
    Verb("device_memory_stats", (Param("reset_peak", bool, False),), dict[str, int] | None,
         "``{\"allocated\", \"peak\"}`` bytes of the engine process's CUDA allocator on the engine's\n"
         "device (``None`` on the CPU); ``reset_peak`` starts a new peak.", Combine.SAME),
    Verb("abort_all", (), list[str],
         "Aborts every unfinished request (running, waiting, frozen or held); returns their ids.\n\n"
         "Their streams end with ``finish_reason=\"abort\"`` and the tokens produced so far.",
         Combine.UNION, disaggregated=True, loop=True),
)


def verb_mixin(name: str, *, asynchronous: bool = False, state_properties: bool = False,
               loop_verbs: bool = False) -> type:
    """A class with one method per verb of :data:`VERBS`, each ``self.control_call(verb, *args,
    **kwargs)`` (awaited when ``asynchronous``), with the verb's signature and docstring.
    ``state_properties``: the state verbs are properties; ``loop_verbs``: the engine loop's verbs too."""
    namespace: dict[str, Any] = {"__doc__": f"The control verbs of ``loopline.engine.verbs.VERBS`` ({name}).",
                                 "__module__": __name__, "__slots__": ()}
    for verb in VERBS.values():
        if verb.loop and not loop_verbs:
            continue
        if verb.state and state_properties:
            namespace[verb.name] = property(_method(verb, name, False), doc=verb.doc)
        else:
            namespace[verb.name] = _method(verb, name, asynchronous)
    return type(name, (), namespace)


def _method(verb: Verb, owner: str, asynchronous: bool) -> Any:
    name = verb.name
    if asynchronous:
        async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await self.control_call(name, *args, **kwargs)
    else:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self.control_call(name, *args, **kwargs)
    method.__name__ = name
    method.__qualname__ = f"{owner}.{name}"
    method.__doc__ = verb.doc
    method.__signature__ = verb.signature  # type: ignore[attr-defined]  (help() and inspect read it)
    method.__annotations__ = {**{p.name: p.annotation for p in verb.params}, "return": verb.returns}
    return method
