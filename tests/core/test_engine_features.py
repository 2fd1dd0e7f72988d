"""Sampling, stopping, lifecycle and bad input at the engine / LLM level."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from loopline import LLM, SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.entrypoints.cli import main as cli_main
from loopline.errors import CapacityError, InvalidRequestError
from reference import reference_forward


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    return tiny_gqa.llm(max_num_seqs=8, max_num_batched_tokens=64, block_size=4)


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def test_seeded_sampling_is_batch_invariant(llm):
    p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": ids(7)}, p, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": ids(n, seed=n)} for n in (3, 12, 5)]
    mixed = llm.generate(others[:2] + [{"prompt_token_ids": ids(7)}] + others[2:],
                         [SamplingParams(max_tokens=8, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2)] + [p]
                         + [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone


def test_unseeded_requests_differ_and_report_their_seed(llm):
    p = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids(6)}] * 4, p, use_tqdm=False)
    seqs = {tuple(o.outputs[0].token_ids) for o in outs}
    assert len(seqs) > 1, "a GRPO group must not collapse"
    seeds = [o.outputs[0].seed for o in outs]
    assert all(s is not None for s in seeds) and len(set(seeds)) == 4
    again = llm.generate({"prompt_token_ids": ids(6)}, p.clone(seed=seeds[0]), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids  # the reported seed reproduces the sample


def test_n_completions(llm):
    out = llm.generate({"prompt_token_ids": ids(5)}, SamplingParams(n=3, max_tokens=6, seed=7, ignore_eos=True,
                                                                    logprobs=1), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.token_ids) == 6 == len(c.logprobs) == len(c.exit_depths)
        assert c.cumulative_logprob == pytest.approx(sum(c.token_logprobs), abs=1e-5)


def test_stop_token_ids_and_stop_strings(llm):
    prompt = "Once upon a time"
    base = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    toks = base.outputs[0].token_ids
    stop_id = toks[3]
    first = toks.index(stop_id)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    text = base.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), "pick a visible stop string"
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert base.outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_gqa, tmp_path):
    llm = tiny_gqa.llm()
    eos = 0
    # Make eos the greedy choice by sampling with a huge presence penalty elsewhere is brittle; use stop ids via eos config:
    engine = llm.llm_engine
    assert eos in engine.model_config.eos_token_ids
    prompt = {"prompt_token_ids": ids(5)}
    greedy = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    # the same weights, from a checkpoint whose only eos is that token (config.json and generation_config.json)
    path = tmp_path / "eos"
    shutil.copytree(tiny_gqa.path, path)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**cfg, "eos_token_id": greedy.outputs[0].token_ids[2]}))
    llm = LLM(str(path), dtype="float32", device="cpu")
    assert llm.llm_engine.model_config.eos_token_ids == (greedy.outputs[0].token_ids[2],)
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)[0].outputs[0]
    cut = greedy.outputs[0].token_ids.index(greedy.outputs[0].token_ids[2]) + 1
    assert out.token_ids == greedy.outputs[0].token_ids[:cut] and out.finish_reason == "stop" and out.stop_reason is None


def test_logprobs_and_prompt_logprobs_match_reference(tiny_gqa, llm):
    prompt = ids(9, seed=4)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3,
                                                                   prompt_logprobs=2), use_tqdm=False)[0]
    ref = reference_forward(tiny_gqa.state_dict, tiny_gqa.cfg, torch.tensor(prompt), tiny_gqa.cfg["total_ut_steps"])
    logp = torch.log_softmax(ref["logits"][-1], dim=-1)  # last loop (fixed depth)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(float(logp[pos - 1, prompt[pos]]), abs=1e-4)
        top2 = torch.topk(logp[pos - 1], 2).indices.tolist()
        assert set(top2) <= set(entry)
    step = out.outputs[0].logprobs[0]
    top3 = torch.topk(logp[-1], 3)
    assert [t for t, lp in sorted(step.items(), key=lambda kv: kv[1].rank)][:3] == top3.indices.tolist()
    assert step[out.outputs[0].token_ids[0]].logprob == pytest.approx(float(top3.values[0]), abs=1e-4)


def test_processed_logprobs_mode(tiny_gqa):
    llm = tiny_gqa.llm(logprobs_mode="processed_logprobs")
    p = SamplingParams(max_tokens=4, temperature=0.5, top_k=3, seed=3, logprobs=5, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids(5)}, p, use_tqdm=False)[0].outputs[0]
    for tid, step in zip(out.token_ids, out.logprobs):
        finite = [lp.logprob for lp in step.values() if lp.logprob > float("-inf")]
        assert len(finite) <= 3  # top-k=3 leaves three tokens with probability
        assert sum(torch.tensor(finite).exp().tolist()) == pytest.approx(1.0, abs=1e-4)
        assert step[tid].logprob > float("-inf")


def test_abort_frees_kv_at_once(tiny_gqa):
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True))
    engine.add_request("a", ids(10), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", ids(4), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):
        engine.step()
    used = engine.kv.num_used_blocks
    assert used > 0
    engine.abort_request("a")
    assert engine.kv.num_used_blocks < used
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    engine.abort_request(["b", "unknown"])
    assert engine.kv.num_used_blocks == 0
    assert engine.has_unfinished_requests()  # b's abort is still to be returned
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    assert not engine.has_unfinished_requests()


def _finals(engine) -> dict:
    """Steps until nothing is unfinished: each finished request's first completion."""
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    return done


def _drain(engine, requests):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = [(c.token_ids, c.exit_depths) for c in o.outputs]
    return done


@pytest.mark.parametrize("overlap", [False, True])
def test_request_id_reused_right_after_it_finished(tiny_gqa, overlap):
    """The overlapped engine reads a step after launching the next: a step still in flight for a finished
    request must not feed a new request that took its id."""
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  async_scheduling=overlap))
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    first = _drain(engine, {"x": (ids(5, seed=1), p)})
    again = _drain(engine, {"x": (ids(9, seed=2), p)})
    fresh = _drain(LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu",
                                        skip_tokenizer_init=True)), {"x": (ids(9, seed=2), p)})
    assert len(first["x"][0][0]) == 6 and again == fresh


def test_child_ids_never_collide_with_user_ids(tiny_gqa):
    """``n=2`` as ``x`` and a request named ``x#0`` run side by side, each its own."""
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True))
    two = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    one = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    both = _drain(engine, {"x": (ids(6, seed=1), two), "x#0": (ids(4, seed=2), one)})
    alone = _drain(LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu",
                                        skip_tokenizer_init=True)), {"x#0": (ids(4, seed=2), one)})
    assert [len(t) for t, _ in both["x"]] == [5, 5] and both["x#0"] == alone["x#0"]


def test_a_request_the_device_cannot_hold_fails_alone(tiny_gqa):
    """Values past the device's types (entry points refuse them; here they slip past) fail only their
    request, before anything changed: the request sharing its step goes on exactly."""
    import copy

    args = dict(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True)
    engine = LLMEngine(EngineArgs(**args))
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    engine.add_request("good", ids(5, seed=1), p)
    engine.add_request("bad", ids(4, seed=2), p)
    bad = engine.scheduler.requests["bad#0"]
    bad.params = copy.copy(bad.params)
    object.__setattr__(bad.params, "top_k", 2**63)  # as if validation had missed it
    done = _finals(engine)
    assert done["bad"].finish_reason == "abort" and "internal error" in done["bad"].stop_reason
    alone = _drain(LLMEngine(EngineArgs(**args)), {"good": (ids(5, seed=1), p)})["good"][0]
    assert (done["good"].token_ids, done["good"].exit_depths) == alone and engine.stats.failed_requests == 1
    assert engine.kv.num_used_blocks == 0


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(tiny_gqa, monkeypatch):
    """An unexpected error inside a step fails the requests of that step (KV and slots freed) and nothing else."""
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True))
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("good", ids(5, seed=1), p)
    for _ in range(6):
        engine.step()
    launch = engine.runner.launch

    def broken_launch(sched):
        handle = launch(sched)  # the step is queued (the runner's state changed), then it fails
        if any(new.request_id.startswith("bad") for new in sched.new_requests):
            raise OverflowError("a value the device cannot hold")
        return handle

    monkeypatch.setattr(engine.runner, "launch", broken_launch)
    engine.add_request("bad", ids(4, seed=2), p)
    done = _finals(engine)
    assert done["bad"].finish_reason == "abort" and "internal error" in done["bad"].stop_reason
    assert done["good"].finish_reason == "abort"  # it shared the failed step
    assert engine.kv.num_used_blocks == 0 and engine.stats.failed_requests == 2
    monkeypatch.setattr(engine.runner, "launch", launch)
    assert _drain(engine, {"after": (ids(5, seed=1), p)})["after"][0][0] == _drain(
        LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True)),
        {"after": (ids(5, seed=1), p)})["after"][0][0]


def test_kv_pressure_waits_and_never_overcommits(tiny_gqa):
    prompts = [ids(n, seed=n) for n in (6, 10, 3, 8, 12)]
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # 4 planes * ceil((12+5)/4)=5 blocks -> 20 blocks for the biggest request; 24 fit one at a time.
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                  block_size=4, num_kv_blocks=24))
    for i, pr in enumerate(prompts):
        engine.add_request(f"r{i}", pr, p)
    done, peak, waited = {}, 0, False
    while engine.has_unfinished_requests():
        waited |= engine.scheduler.num_waiting > 0 and engine.scheduler.num_running > 0
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        peak = max(peak, engine.kv.num_used_blocks)
    assert peak <= 24 and waited
    roomy = tiny_gqa.llm(skip_tokenizer_init=True).generate([{"prompt_token_ids": pr} for pr in prompts], p, use_tqdm=False)
    assert [done[f"r{i}"] for i in range(5)] == [o.outputs[0].token_ids for o in roomy]


def test_bad_input_is_rejected_and_others_keep_running(tiny_gqa):
    engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", block_size=4,
                                  num_kv_blocks=64, max_model_len=64))
    good = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("good", ids(6), good)
    engine.step()
    bad_cases = [
        (("x1", "", good), "prompt"),
        (("x2", [], good), "prompt_token_ids"),
        (("x3", [1, 2, 10**6], good), "prompt_token_ids"),
        (("x4", ids(70), good), "prompt"),
        (("x5", ids(10), SamplingParams(max_tokens=60)), "max_tokens"),
        (("x6", ids(5), SamplingParams(max_loops=9)), "max_loops"),
        (("x7", ids(5), SamplingParams(logprobs=50)), "logprobs"),  # above the engine's max_logprobs (20)
        (("good", ids(5), good), "request_id"),
    ]
    for args, param in bad_cases:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(*args)
        assert e.value.param == param, (args, str(e.value))
    with pytest.raises(CapacityError):  # fits max_model_len but never the 64-block pool: 4 * 16 + ... blocks
        small = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", block_size=4,
                                     num_kv_blocks=8, skip_tokenizer_init=True))
        small.add_request("big", ids(20), good)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-3), dict(n=0), dict(logprobs=-2), dict(exit_threshold=1.5),
                dict(min_loops=3, max_loops=2), dict(presence_penalty=5), dict(seed="x")):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**bad)
        assert e.value.param in bad
    done = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            done = o
    solo = tiny_gqa.llm().generate({"prompt_token_ids": ids(6)}, good, use_tqdm=False)[0]
    assert done.request_id == "good" and done.outputs[0].token_ids == solo.outputs[0].token_ids
    assert engine.kv.num_used_blocks == 0


def test_chat_uses_template_and_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>user\nhello<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert 2 in llm.llm_engine.outputs.chat_end_ids


def test_generate_keeps_input_order_and_accepts_every_prompt_form(llm):
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    forms = ["a story", {"prompt": "a story"}, {"prompt_token_ids": llm.tokenizer.encode("a story")}]
    outs = llm.generate(forms, p, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].prompt == "a story"


def test_cli_generate_json_and_stats(tiny_gqa, capsys):
    rc = cli_main(["generate", "Once upon a time", "--model", str(tiny_gqa.path), "--max-tokens", "5", "--temperature",
                   "0", "--exit-threshold", "0.8", "--json", "--stats", "--device", "cpu"])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(lines[0]["token_ids"]) == 5 and len(lines[0]["exit_depths"]) == 5
    assert lines[1]["stats"]["steps"] > 0 and 1 <= lines[1]["stats"]["mean_exit_depth"] <= 4
    rc = cli_main(["generate", "x", "--model", str(tiny_gqa.path), "--max-loops", "9", "--device", "cpu"])
    assert rc == 2 and "max_loops" in capsys.readouterr().err


def test_stats_are_logged_when_enabled(tiny_gqa, caplog):
    def logged(**kw) -> list[str]:
        """The stats lines of a short run (every step is past the interval)."""
        engine = LLMEngine(EngineArgs(model=str(tiny_gqa.path), dtype="float32", device="cpu", skip_tokenizer_init=True,
                                      log_stats_interval=1e-9, **kw))
        engine.add_request("a", ids(5), SamplingParams(max_tokens=3, ignore_eos=True))
        caplog.clear()
        with caplog.at_level("INFO", logger="loopline"):
            while engine.has_unfinished_requests():
                engine.step()
        return [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()]

    lines = logged(disable_log_stats=False)
    assert lines and "rows/step" in lines[-1] and "KV usage" in lines[-1]
    assert logged()  # on by default, as in vLLM
    assert not logged(disable_log_stats=True)


@pytest.mark.parametrize("name,package", [("FLASH_ATTN", "flash_attn"), ("flash-attn", "flash_attn")])
def test_flash_backends_are_refused_with_the_reason(name, package, monkeypatch):
    # vLLM users ask for these by habit: an explicit error that says why, never a silent fallback.
    import importlib.util

    from loopline.attention import get_attention_backend

    for installed in (False, True):
        monkeypatch.setattr(importlib.util, "find_spec", lambda mod, installed=installed: object() if installed else None)
        for refuse in (lambda: EngineArgs(attention_backend=name).validate(),
                       lambda: get_attention_backend(name, torch.device("cpu"))):
            with pytest.raises(InvalidRequestError) as e:
                refuse()
            assert e.value.param == "attention_backend"
            assert f"no {package} backend" in str(e.value)
            assert ("is installed" if installed else "is not installed") in str(e.value)
    EngineArgs(attention_backend="torch").validate()  # the others still pass
