"""Tokenization for the async front end, off the event loop and off the engine thread.

A 2 MB prompt takes seconds to tokenize; done on the event loop it stalls
``/health`` and every stream, done on the engine thread it stalls every
running request. :class:`TokenizerPool` runs it on a few worker threads
instead. NOTE: one Hugging Face fast tokenizer must not be used from two
threads at once, so each worker gets its own copy. The copies are made when
the pool is built, before the engine thread starts detokenizing with the
original (copying reads the tokenizer).
"""
from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from loopline.entrypoints.chat_utils import ChatEncoder

T = TypeVar("T")

DEFAULT_WORKERS = 2


class TokenizerPool:
    """Worker threads that each own a copy of ``tokenizer`` (and a chat encoder over it).

    NOTE: daemon threads, not a ``ThreadPoolExecutor``: Python joins executor threads at exit, so a
    job stuck in C code would hold the process after shutdown; chat templates render under budgets
    (:mod:`loopline.entrypoints.template_budget`) that end them, and shutdown never waits on one.
    """

    def __init__(self, tokenizer: Any, model_path: str | None, config_extra: dict[str, Any] | None,
                 workers: int = DEFAULT_WORKERS) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = []
        for i in range(workers):
            tok = copy.deepcopy(tokenizer)
            pair = (tok, ChatEncoder(tok, model_path, config_extra))
            thread = threading.Thread(target=self._work, args=(pair,), name=f"loopline-tokenizer-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self, pair: tuple[Any, ChatEncoder]) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future, loop = job
            try:
                outcome: tuple[Any, Exception | None] = (fn(*pair), None)
            except Exception as e:  # handed to the caller, who re-raises it
                outcome = (None, e)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the caller's event loop has closed: nobody waits for this answer
                pass

    async def run(self, fn: Callable[[Any, ChatEncoder], T]) -> T:
        """``fn(tokenizer, chat_encoder)`` on a worker thread; its exception reaches the caller."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._jobs.put((fn, future, loop))
        return await future

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return await self.run(lambda tok, _: list(tok.encode(text, add_special_tokens=add_special_tokens)))

    async def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text, in one job (a request with thousands of prompts is one job, not thousands)."""
        return await self.run(lambda tok, _: [list(tok.encode(t, add_special_tokens=add_special_tokens)) for t in texts])

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self.run(lambda tok, _: tok.decode(ids, skip_special_tokens=skip_special_tokens))

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          chat_template: str | None = None) -> list[int]:
        return await self.run(lambda _, chat: chat.encode(messages, add_generation_prompt, chat_template))

    async def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return await self.run(lambda tok, _: tok.convert_ids_to_tokens(ids))

    def shutdown(self) -> None:
        """Stops the workers once their current jobs end; waits for none of them."""
        for _ in self._threads:
            self._jobs.put(None)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.cancelled():  # the request went away while its job ran
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
