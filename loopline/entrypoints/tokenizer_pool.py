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
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from loopline.entrypoints.chat_utils import ChatEncoder

T = TypeVar("T")

DEFAULT_WORKERS = 2


class TokenizerPool:
    """Worker threads that each own a copy of ``tokenizer`` (and a chat encoder over it)."""

    def __init__(self, tokenizer: Any, model_path: str | None, config_extra: dict[str, Any] | None,
                 workers: int = DEFAULT_WORKERS) -> None:
        # One (tokenizer, chat encoder) per worker thread; a thread takes one on its first job.
        self._spare = [(tok, ChatEncoder(tok, model_path, config_extra))
                       for tok in (copy.deepcopy(tokenizer) for _ in range(workers))]
        self._lock = threading.Lock()
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loopline-tokenizer")

    def _own(self) -> tuple[Any, ChatEncoder]:
        """This worker's tokenizer copy and chat encoder."""
        if not hasattr(self._local, "pair"):
            with self._lock:
                self._local.pair = self._spare.pop()  # the executor never runs more threads than copies
        return self._local.pair

    async def run(self, fn: Callable[[Any, ChatEncoder], T]) -> T:
        """``fn(tokenizer, chat_encoder)`` on a worker thread; its exception reaches the caller."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*self._own()))

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
        self._executor.shutdown(wait=False, cancel_futures=True)
