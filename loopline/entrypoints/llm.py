"""``LLM``: the offline batch API, named like vLLM's."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from loopline.config import EngineArgs
from loopline.engine import LLMEngine, PromptType
from loopline.entrypoints.chat_utils import ChatEncoder
from loopline.errors import EngineStateError, InvalidRequestError
from loopline.outputs import RequestOutput
from loopline.sampling_params import SamplingParams


class LLM:
    """Generate from a looped model offline.

    ``LLM()`` with no model uses the bundled demo model. Keyword
    arguments are the fields of :class:`~loopline.config.EngineArgs`.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise InvalidRequestError(f"unknown engine argument(s): {sorted(unknown)}", param=sorted(unknown)[0])
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._chat = ChatEncoder.for_engine(self.llm_engine)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in input order."""
        batch = self._as_batch(prompts)
        params = self._params_for(batch, sampling_params)
        return self._run(batch, params, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Applies the checkpoint's chat template; generation also stops at the end-of-turn token.

        On a -Thinking checkpoint the prompt ends with ``<think>\n`` (see ``encode_chat``).
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.encode_chat(c, add_generation_prompt, chat_template)} for c in convs]
        params = self._params_for(prompts, sampling_params)
        return self._run(prompts, params, use_tqdm, chat=True)

    def encode_chat(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
        """Prompt token ids of one conversation through the chat template; on a -Thinking
        checkpoint ``<think>\n`` follows the assistant prefix (``loopline.entrypoints.chat_utils``)."""
        return self._chat.encode(conversation, add_generation_prompt, chat_template)

    # --- RL: weights and lifecycle (LLMEngine methods; see docs/rl.md) --------------------
    def get_weight_version(self) -> int:
        return self.llm_engine.get_weight_version()

    def start_weight_update(self, version: int) -> None:
        self.llm_engine.start_weight_update(version)

    def update_weights(self, weights: Any) -> int:
        return self.llm_engine.update_weights(weights)

    def finish_weight_update(self) -> int:
        return self.llm_engine.finish_weight_update()

    def abort_weight_update(self) -> None:
        self.llm_engine.abort_weight_update()

    def update_weights_from_disk(self, path: str, version: int) -> int:
        return self.llm_engine.update_weights_from_disk(path, version)

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def pause_generation(self, mode: str = "abort") -> None:
        self.llm_engine.pause_generation(mode)

    def resume_generation(self) -> None:
        self.llm_engine.resume_generation()

    def is_paused(self) -> bool:
        return self.llm_engine.is_paused

    def sleep(self, level: int = 1) -> None:
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping

    # --- internals ----------------------------------------------------------------------
    @staticmethod
    def _as_batch(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidRequestError("prompts must be a string, a prompt dict, or a non-empty list of them", param="prompts")
        return list(prompts)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate(..., sampling_params=None)`` uses: ``SamplingParams`` with the model's
        generation_config.json defaults (``generation_config="auto"``; none with ``"vllm"``)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def _params_for(self, batch: list, sampling_params: Any) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * len(batch)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(batch)
        if len(sampling_params) != len(batch):
            raise InvalidRequestError(f"got {len(sampling_params)} sampling_params for {len(batch)} prompts", param="sampling_params")
        return list(sampling_params)

    def _run(self, batch: list[PromptType], params: list[SamplingParams], use_tqdm: bool, chat: bool = False) -> list[RequestOutput]:
        engine = self.llm_engine
        if engine.is_paused:  # requests would be held until a resume this call can never see
            raise EngineStateError("generation is paused; call resume_generation() first")
        ids = [f"llm-{next(self._ids)}" for _ in batch]
        added = []
        try:
            for rid, prompt, p in zip(ids, batch, params):
                engine.add_request(rid, prompt, p, chat_stop=chat)
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # a bad prompt leaves nothing half-queued
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2, dynamic_ncols=True)
        wanted = set(ids)
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[r] for r in ids]
