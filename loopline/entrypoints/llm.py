"""``LLM``: the offline batch API, named like vLLM's."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from loopline.config import EngineArgs
from loopline.engine import LLMEngine, PromptType
from loopline.engine.verbs import verb_mixin
from loopline.entrypoints.chat_utils import ChatEncoder
from loopline.errors import EngineStateError, InvalidRequestError
from loopline.outputs import RequestOutput
from loopline.sampling_params import RequestOutputKind, SamplingParams
from loopline.vllm_flags import log_engine_option_notes


# The control verbs as LLM methods (``llm.sleep(2)``, ``llm.is_paused()``), from engine/verbs.py.
LLMVerbs = verb_mixin("LLMVerbs")


class LLM(LLMVerbs):
    """Generate from a looped model offline.

    ``LLM()`` with no model uses the bundled demo model. Keyword
    arguments are the fields of :class:`~loopline.config.EngineArgs`.
    The RL control verbs (``pause_generation``, ``update_weights``, ``sleep``, ...; docs/rl.md)
    are inherited from ``engine/verbs.py`` and run on :attr:`llm_engine`.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise InvalidRequestError(f"unknown engine argument(s): {sorted(unknown)}", param=sorted(unknown)[0])
        args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(args)
        log_engine_option_notes(args)  # vLLM options that change nothing here (trust_remote_code, ...)
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
             add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Applies the checkpoint's chat template; generation also stops at the end-of-turn token.

        On a -Thinking checkpoint the prompt ends with ``<think>\n`` (see ``encode_chat``). ``tools``:
        OpenAI function tools, passed to the template (or rendered by the hermes fallback of
        ``loopline.entrypoints.chat_utils`` when the template does not read ``tools``).
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.encode_chat(c, add_generation_prompt, chat_template) if tools is None
                    else self._chat.encode(c, add_generation_prompt, chat_template, tools=tools)} for c in convs]
        params = self._params_for(prompts, sampling_params)
        return self._run(prompts, params, use_tqdm, chat=True)

    def encode_chat(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
        """Prompt token ids of one conversation through the chat template; on a -Thinking
        checkpoint ``<think>\n`` follows the assistant prefix (``loopline.entrypoints.chat_utils``)."""
        return self._chat.encode(conversation, add_generation_prompt, chat_template)

    # --- RL: weights and lifecycle (engine/verbs.py; see docs/rl.md) ----------------------
    def control_call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """Runs a control verb on the engine (``llm.sleep(2)`` is ``llm.control_call("sleep", 2)``)."""
        return self.llm_engine.control_call(verb, *args, **kwargs)

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
        # NOTE: only final outputs are returned, so the engine builds no other (vLLM's LLM does the same)
        final_only = {k: p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                      for k, p in {id(p): p for p in params}.items() if isinstance(p, SamplingParams)}
        added = []
        try:
            for rid, prompt, p in zip(ids, batch, params):
                engine.add_request(rid, prompt, final_only.get(id(p), p), chat_stop=chat)
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
