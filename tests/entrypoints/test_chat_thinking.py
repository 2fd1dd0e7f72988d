"""-Thinking checkpoints: the chat path ends the prompt with ``<think>\\n`` when the template does not."""
from __future__ import annotations

import shutil

import httpx
import pytest

from loopline import AsyncLLM, SamplingParams
from loopline.entrypoints.chat_utils import ChatEncoder, is_thinking_checkpoint
from loopline.entrypoints.openai.api_server import build_app


def in_thread(args) -> AsyncLLM:
    """An AsyncLLM whose engine loop runs on a thread of this process (the test reads ``llm.engine``)."""
    from loopline.engine import LLMEngine

    return AsyncLLM(engine=LLMEngine(args))


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PREFIX = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def thinking(tiny_factory):
    """The tiny checkpoint with ``<think>`` / ``</think>`` added to its tokenizer."""
    return tiny_factory(0, thinking=True)


def test_detection_rule(tiny_gqa, thinking):
    from loopline.models.loader import load_tokenizer

    assert not is_thinking_checkpoint(str(tiny_gqa.path), {"architectures": ["OuroForCausalLM"]})
    assert is_thinking_checkpoint(str(thinking.path), {"_name_or_path": thinking.cfg["_name_or_path"]})
    # A tokenizer with <think> is no evidence (base Ouro has it too): only names count.
    assert "<think>" in load_tokenizer(thinking.path).get_added_vocab()
    assert not is_thinking_checkpoint(str(tiny_gqa.path), {})
    assert is_thinking_checkpoint("/models/Ouro-1.4B-Thinking", {})
    assert is_thinking_checkpoint("/ckpt/step-100", {"_name_or_path": "ByteDance/Ouro-2.6B-Thinking"})
    assert is_thinking_checkpoint("/ckpt/step-100", {"architectures": ["OuroThinkingForCausalLM"]})
    assert not is_thinking_checkpoint("/models/Ouro-1.4B", {"_name_or_path": "ByteDance/Ouro-1.4B",
                                                             "architectures": ["OuroForCausalLM"]})


def test_llm_chat_adds_think_after_the_assistant_prefix(tiny_gqa, thinking):
    plain, llm = tiny_gqa.llm(), thinking.llm()
    tok = llm.tokenizer
    ids = llm.encode_chat(MESSAGES)
    assert tok.decode(ids).endswith(PREFIX + "<think>\n")
    assert ids[-2] == tok.convert_tokens_to_ids("<think>")  # one token, then "\n"
    assert tok.decode(plain.encode_chat(MESSAGES)).endswith(PREFIX)
    # only after a generation prompt, and never twice
    assert not tok.decode(llm.encode_chat(MESSAGES, add_generation_prompt=False)).endswith("<think>\n")
    opened = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    assert tok.decode(llm.encode_chat(MESSAGES, chat_template=opened)).count("<think>") == 1
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) == 3


def test_a_thinking_directory_name_is_enough(tiny_gqa, tmp_path):
    path = tmp_path / "Ouro-tiny-Thinking"
    shutil.copytree(tiny_gqa.path, path)
    from loopline import LLM

    llm = LLM(str(path), dtype="float32", device="cpu")
    text = llm.tokenizer.decode(llm.encode_chat(MESSAGES))
    assert ChatEncoder.for_engine(llm.llm_engine).thinking  # (how LLM builds its chat encoder)
    assert text.endswith(PREFIX + "<think>\n")  # "<think>" is plain text here


def test_chat_endpoint_and_tokenize_use_the_same_prompt(thinking, make_engine_args, serve_app):
    llm = in_thread(make_engine_args(model=str(thinking.path)))
    try:
        srv = serve_app(build_app(llm, "m", shutdown_engine=False))
        expected = ChatEncoder.for_engine(llm.engine).encode(MESSAGES)
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "max_tokens": 2, "return_token_ids": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"] == expected
        tokens = httpx.post(srv.base_url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert tokens == expected and llm.tokenizer.decode(tokens).endswith("<think>\n")
    finally:
        llm.shutdown()
