"""Request defaults from a checkpoint's generation_config.json (vLLM's ``--generation-config``):
read and checked by the loader, applied by ``LLM.generate(..., None)``, by unset HTTP fields and by
``loopline generate`` flags that were not given; ``"vllm"`` turns them off."""
from __future__ import annotations

import json
import shutil

import pytest

from loopline import EngineArgs, SamplingParams
from loopline.entrypoints.cli import build_parser, sampling_from_ns
from loopline.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from loopline.errors import InvalidRequestError
from loopline.models.loader import CheckpointError, load_sampling_defaults, sampling_defaults
from loopline.models.tiny import default_checkpoint

PROMPT = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def greedy_ckpt(tiny_gqa, tmp_path_factory):
    """The tiny checkpoint with greedy, 5-token request defaults."""
    path = tmp_path_factory.mktemp("gencfg") / "tiny"
    shutil.copytree(tiny_gqa.path, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=5, do_sample=False)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_loader_maps_the_keys_vllm_reads(greedy_ckpt, tmp_path):
    assert load_sampling_defaults(greedy_ckpt) == {"temperature": 0.0, "max_tokens": 5}
    assert sampling_defaults("vllm", greedy_ckpt) == {}
    assert sampling_defaults("auto", None) == {}
    demo = load_sampling_defaults(default_checkpoint())
    assert demo["temperature"] == 0.5 and demo["top_k"] == 20 and demo["max_tokens"] == 48
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(CheckpointError, match="top_p=1.5"):
        load_sampling_defaults(tmp_path)


def test_generation_config_option_is_validated(tmp_path):
    EngineArgs(generation_config="vllm").validate()
    with pytest.raises(InvalidRequestError) as e:
        EngineArgs(generation_config=str(tmp_path)).validate()  # no generation_config.json there
    assert e.value.param == "generation_config"


def test_llm_generate_without_params_uses_the_models_defaults(greedy_ckpt, tiny_gqa):
    from loopline import LLM

    small = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=2)  # a small KV pool each
    llm = LLM(str(greedy_ckpt), **small)
    assert llm.get_default_sampling_params().temperature == 0.0
    out = llm.generate({"prompt_token_ids": PROMPT}, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=5),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) == 5
    del llm
    plain = LLM(str(greedy_ckpt), generation_config="vllm", **small)
    assert plain.get_default_sampling_params() == SamplingParams()
    del plain
    other = LLM(str(tiny_gqa.path), generation_config=str(greedy_ckpt), **small)
    assert other.get_default_sampling_params().max_tokens == 5  # a folder of its own


def test_http_requests_fill_unset_fields_from_the_defaults():
    defaults = {"temperature": 0.3, "top_k": 7, "repetition_penalty": 1.2, "max_tokens": 9}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).to_sampling_params(defaults)
    assert (chat.temperature, chat.top_k, chat.repetition_penalty, chat.max_tokens, chat.top_p) == (0.3, 7, 1.2, 9, 1.0)
    mine = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.0, top_k=0,
                                 max_tokens=3).to_sampling_params(defaults)
    assert (mine.temperature, mine.top_k, mine.max_tokens, mine.repetition_penalty) == (0.0, 0, 3, 1.2)
    comp = CompletionRequest(prompt="x").to_sampling_params(defaults)
    assert comp.max_tokens == 16 and comp.temperature == 0.3  # OpenAI's completions default max_tokens stays
    assert CompletionRequest(prompt="x").to_sampling_params() == CompletionRequest(prompt="x").to_sampling_params({})


def test_cli_flags_not_given_take_the_defaults():
    defaults = {"temperature": 0.5, "top_k": 20, "max_tokens": 48}
    ns = build_parser().parse_args(["generate", "--top-k", "3"])
    params = sampling_from_ns(ns, defaults)
    assert (params.temperature, params.top_k, params.max_tokens, params.top_p) == (0.5, 3, 48, 1.0)
    plain, own = sampling_from_ns(build_parser().parse_args(["generate"])), SamplingParams()
    assert [(getattr(plain, f), getattr(own, f)) for f in ("temperature", "top_p", "top_k", "min_p",
            "repetition_penalty", "max_tokens")] == [(getattr(own, f),) * 2 for f in ("temperature", "top_p",
            "top_k", "min_p", "repetition_penalty", "max_tokens")]


def test_served_defaults_reach_the_server(greedy_ckpt, serve_app):
    import httpx

    from loopline import AsyncLLM
    from loopline.engine import LLMEngine
    from loopline.entrypoints.openai.api_server import build_app

    llm = AsyncLLM(engine=LLMEngine(EngineArgs(model=str(greedy_ckpt), dtype="float32", device="cpu",
                                               max_model_len=256)))
    srv = serve_app(build_app(llm, "t"))
    body = {"model": "t", "messages": [{"role": "user", "content": "hello"}]}
    first = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    again = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert first["usage"]["completion_tokens"] <= 5  # max_new_tokens
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]  # greedy
    llm.shutdown()
