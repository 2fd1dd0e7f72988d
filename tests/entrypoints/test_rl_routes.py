"""Trainer-facing HTTP routes: /generate (SGLang-shaped, token ids in) and the RL control routes."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loopline import AsyncLLM, SamplingParams

KEY = "rl-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 17, 42, 99, 123, 7, 300]


@pytest.fixture(scope="module")
def llm(make_engine_args):
    llm = AsyncLLM(make_engine_args(max_num_batched_tokens=16))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def srv(llm, serve_app):
    from loopline.entrypoints.openai.api_server import build_app

    return serve_app(build_app(llm, "tiny-rl", api_key=KEY, shutdown_engine=False, enable_rl_api=True))


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(8) as ex:
        yield ex


def post(srv, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, headers=AUTH, timeout=60, **kw)


def get(srv, path: str) -> httpx.Response:
    return httpx.get(srv.base_url + path, headers=AUTH, timeout=60)


def generate(srv, **body) -> httpx.Response:
    return post(srv, "/generate", body)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def running(llm, n: int = 1) -> bool:
    """At least n requests are in the engine and each has produced a token (the engine's snapshot
    after its latest step)."""
    snap = llm.snapshot
    return snap.num_generating >= n and snap.num_generating == snap.num_running


# --- /generate ---------------------------------------------------------------------------------
def test_generate_token_ids_with_logprobs_matches_the_engine(srv, tiny_gqa):
    r = generate(srv, input_ids=PROMPT, return_logprob=True,
                 sampling_params={"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, dict) and out["finish_reason"] == "length" and out["seed"] == 11
    ids, lps = out["output_ids"], out["output_token_logprobs"]
    assert len(ids) == len(lps) == len(out["exit_depths"]) == 6 and all(isinstance(x, float) for x in lps)
    assert out["weight_version"] == 0 and out["weight_versions"] == [0] * 6 and out["index"] == 0
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["id"] == out["rid"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 6 and meta["weight_version"] == "0"
    assert meta["output_token_logprobs"] == [[lp, t, None] for lp, t in zip(lps, ids)]  # slime reads [logprob, id]
    offline = tiny_gqa.llm(max_num_seqs=4, max_model_len=256).generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=6, seed=11, ignore_eos=True, logprobs=0),
        use_tqdm=False)[0].outputs[0]
    assert ids == offline.token_ids and lps == pytest.approx(offline.token_logprobs, abs=1e-6)
    # without return_logprob: no logprobs
    plain = generate(srv, input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "seed": 11, "ignore_eos": True}).json()
    assert plain["output_ids"] == ids and plain["output_token_logprobs"] is None
    assert "output_token_logprobs" not in plain["meta_info"]


def test_generate_batch_n_rids_and_per_prompt_params(srv):
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:]]
    params = [{"max_tokens": 2 + i, "n": 2, "seed": 100 + i, "ignore_eos": True, "logprobs": 0} for i in range(3)]
    r = generate(srv, input_ids=prompts, sampling_params=params, rid=["a", "b", "c"])
    assert r.status_code == 200, r.text
    items = r.json()
    assert [(o["rid"], o["index"], len(o["output_ids"])) for o in items] == [
        ("a", 0, 2), ("a", 1, 2), ("b", 0, 3), ("b", 1, 3), ("c", 0, 4), ("c", 1, 4)]
    assert [o["seed"] for o in items] == [100, 101, 101, 102, 102, 103]  # completion i of n uses seed + i
    assert all(len(o["output_token_logprobs"]) == len(o["output_ids"]) for o in items)
    single_n = generate(srv, input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "n": 2}).json()
    assert isinstance(single_n, list) and len(single_n) == 2


def test_generate_logprobs_mode_and_top_logprobs(srv):
    sp = {"max_new_tokens": 4, "temperature": 0.7, "top_k": 10, "seed": 3, "ignore_eos": True}
    raw = generate(srv, input_ids=PROMPT, return_logprob=True, top_logprobs_num=3, sampling_params=sp).json()
    proc = generate(srv, input_ids=PROMPT, return_logprob=True, sampling_params={**sp, "logprobs_mode": "processed"}).json()
    assert raw["output_ids"] == proc["output_ids"] and raw["output_token_logprobs"] != proc["output_token_logprobs"]
    cmpl = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.7, "top_k": 10, "seed": 3,
                                         "ignore_eos": True, "logprobs": 0, "logprobs_mode": "processed"}).json()
    assert cmpl["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(proc["output_token_logprobs"])
    top = raw["meta_info"]["output_top_logprobs"]
    assert len(top) == 4 and all(len(step) == 3 for step in top)
    assert all(step[0][0] >= step[1][0] >= step[2][0] for step in top)


def test_generate_text_prompt(srv):
    out = generate(srv, text="The river town", sampling_params={"max_new_tokens": 3, "ignore_eos": True}).json()
    assert len(out["output_ids"]) == 3 and isinstance(out["text"], str)


@pytest.mark.parametrize("body,param", [
    ({"input_ids": PROMPT, "text": "x"}, "input_ids"),
    ({}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids"),
    ({"input_ids": [10**9]}, "prompt_token_ids"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "max_tokens": 5}}, "sampling_params.max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": PROMPT, "sampling_params": {"structural_tag": {"type": "x"}}}, "sampling_params.structural_tag"),
    ({"input_ids": PROMPT, "sampling_params": {"logprobs_mode": "final"}}, "sampling_params.logprobs_mode"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000}}, "max_tokens"),
    ({"input_ids": [PROMPT, PROMPT], "rid": "one"}, "rid"),
    ({"input_ids": [PROMPT, PROMPT], "sampling_params": [{}, {}, {}]}, "sampling_params"),
    ({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
])
def test_generate_bad_input_is_400_and_the_server_keeps_serving(srv, body, param):
    err = error(post(srv, "/generate", body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] is not None and err["param"].startswith(param)
    assert generate(srv, input_ids=PROMPT, sampling_params={"max_new_tokens": 1}).status_code == 200


def test_a_duplicate_rid_is_refused_without_touching_the_live_request(srv, llm, pool):
    live = pool.submit(generate, srv, input_ids=PROMPT, rid="dup",  # (48 tokens: still running when the other comes)
                       sampling_params={"max_new_tokens": 48, "ignore_eos": True})
    wait_for(lambda: running(llm))
    assert error(generate(srv, input_ids=PROMPT, rid="dup"), 400)["param"] == "rid"
    out = live.result(60).json()
    assert out["finish_reason"] == "length" and len(out["output_ids"]) == 48


def test_a_rid_never_collides_with_the_choice_ids_of_another_request(srv, llm, pool):
    """The engine names choices ``rid#i`` for every request, so a rid that looks like one is its own request."""
    live = pool.submit(generate, srv, input_ids=PROMPT, rid="x",  # (48 tokens: still running when the other comes)
                       sampling_params={"max_new_tokens": 48, "ignore_eos": True, "n": 2})
    wait_for(lambda: running(llm))
    beside = generate(srv, input_ids=PROMPT, rid="x#0", sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert beside.status_code == 200 and len(beside.json()["output_ids"]) == 2
    outs = live.result(60).json()
    assert [len(o["output_ids"]) for o in outs] == [48, 48]


def test_generate_stream_ends_with_the_whole_completion(srv):
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "seed": 8, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", srv.base_url + "/generate", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and chunks[-1]["finish_reason"] == "length"
    whole = generate(srv, **{k: v for k, v in body.items() if k != "stream"}).json()
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["output_token_logprobs"] == whole["output_token_logprobs"]


def test_routes_need_the_api_key(srv):
    for path in ("/generate", "/pause_generation", "/resume_generation", "/abort_request", "/update_weights_from_disk",
                 "/reset_prefix_cache", "/sleep", "/wake_up"):
        assert httpx.post(srv.base_url + path, json={}).status_code == 401, path
    assert httpx.get(srv.base_url + "/get_weight_version").status_code == 401
    assert httpx.get(srv.base_url + "/health").status_code == 200


# --- control routes ----------------------------------------------------------------------------
def test_pause_abort_hold_and_resume(srv, llm, pool):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}, "return_logprob": True}
    inflight = [pool.submit(post, srv, "/generate", body) for _ in range(2)]
    wait_for(lambda: running(llm, 2))
    r = post(srv, "/pause_generation", {"mode": "abort"})
    assert r.status_code == 200 and r.json() == {"success": True, "mode": "abort"}
    for f in inflight:
        out = f.result(60).json()
        assert out["finish_reason"] == "abort" and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) == len(out["output_token_logprobs"]) < 150
    assert get(srv, "/is_paused").json() == {"is_paused": True}
    held = pool.submit(generate, srv, input_ids=PROMPT, sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    time.sleep(0.3)
    assert not held.done()
    assert post(srv, "/continue_generation").status_code == 200  # SGLang's name for resume
    assert held.result(60).json()["finish_reason"] == "length"
    assert get(srv, "/is_paused").json() == {"is_paused": False}


def test_pause_keep_via_query_string_and_bad_mode(srv, llm, pool):
    assert error(post(srv, "/pause_generation", {"mode": "soon"}), 400)["param"] == "mode"
    assert error(post(srv, "/sleep", {"level": True}), 400)["param"] == "level"
    r = httpx.post(srv.base_url + "/pause_generation", content=b"{not json",
                   headers={**AUTH, "Content-Type": "application/json"})
    assert error(r, 400)["code"] == "invalid_json"
    assert error(post(srv, "/pause_generation", content=b"{not json"), 415)["code"] == "unsupported_media_type"
    # 48 tokens: the request still runs when the pause lands (each token takes several steps); 120 took 2.5x longer
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 48, "seed": 5, "ignore_eos": True}}
    reference = generate(srv, **body).json()["output_ids"]
    kept = pool.submit(post, srv, "/generate", body)
    wait_for(lambda: running(llm))
    assert httpx.post(srv.base_url + "/pause?mode=keep", headers=AUTH).status_code == 200
    time.sleep(0.2)
    assert not kept.done()
    assert post(srv, "/resume").status_code == 200
    assert kept.result(60).json()["output_ids"] == reference


def test_abort_request_by_rid_and_all(srv, llm, pool):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}
    one = pool.submit(post, srv, "/generate", {**body, "rid": "victim"})
    other = pool.submit(post, srv, "/generate", {**body, "rid": "other"})
    wait_for(lambda: running(llm, 2))
    assert post(srv, "/abort_request", {"rid": "victim"}).json() == {"success": True}
    assert one.result(60).json()["finish_reason"] == "abort"
    assert not other.done()
    r = post(srv, "/abort_request", {"abort_all": True})
    assert r.json() == {"success": True, "aborted": ["other"]}
    assert other.result(60).json()["finish_reason"] == "abort"
    assert error(post(srv, "/abort_request", {}), 400)["param"] == "rid"
    assert error(post(srv, "/abort_request", {"rid": "x", "abort_all": True}), 400)["param"] == "rid"


def test_update_weights_from_disk_rejects_bad_input_and_keeps_serving(srv, llm, pool, tiny_factory, tiny_mha):
    sp = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    before = generate(srv, input_ids=PROMPT, sampling_params=sp).json()["output_ids"]
    new = tiny_factory(3)
    # not paused and generating: the checkpoint is read beside the request (a bad one is a 400 while it goes on)
    busy = pool.submit(generate, srv, input_ids=PROMPT, rid="busy",
                       sampling_params={"max_new_tokens": 240, "ignore_eos": True})
    wait_for(lambda: running(llm))
    err = error(post(srv, "/update_weights_from_disk", {"model_path": str(tiny_mha.path), "version": 1}), 400)
    assert err["param"] == "model_path" and not busy.done()
    post(srv, "/abort_request", {"rid": "busy"})
    assert busy.result(60).json()["finish_reason"] == "abort"
    bad = [({"model_path": str(new.path)}, "version"),
           ({"model_path": str(new.path), "version": "one"}, "version"),
           ({"model_path": str(new.path), "version": -1}, "version"),
           ({"model_path": str(new.path), "version": 1, "weight_version": 2}, "version"),
           ({"model_path": str(new.path / "nope"), "version": 1}, "model_path"),
           ({"model_path": str(tiny_mha.path), "version": 1}, "model_path"),
           ({"model_path": str(new.path), "version": "\uff11"}, "version"),  # a full-width digit one
           ({"model_path": str(new.path), "version": "\u0661"}, "version"),  # an Arabic-Indic one
           ({"model_path": str(new.path), "version": " 1"}, "version"),
           ({"model_path": str(new.path), "version": 2**63}, "version"),
           ({"model_path": str(new.path), "version": True}, "version"),
           ({"version": 1}, "model_path")]
    for body, param in bad:
        err = error(post(srv, "/update_weights_from_disk", body), 400)
        assert err["param"] == param, body
        if param == "model_path" and "model_path" in body:  # says "not loadable", no config values or file names
            assert "not a loadable checkpoint" in err["message"] and "total_ut_steps" not in err["message"]
            assert "nope" not in err["message"] and "error id" in err["message"]
    assert get(srv, "/get_weight_version").json() == {"weight_version": 0, "weights": "committed"}
    assert generate(srv, input_ids=PROMPT, sampling_params=sp).json()["output_ids"] == before  # old weights serve

    assert post(srv, "/pause_generation", {"mode": "abort"}).status_code == 200
    r = post(srv, "/update_weights_from_disk", {"model_path": str(new.path), "weight_version": "1"})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == 1
    assert post(srv, "/flush_cache").status_code == 200 and post(srv, "/reset_prefix_cache").status_code == 200
    assert post(srv, "/resume_generation").status_code == 200
    after = generate(srv, input_ids=PROMPT, sampling_params=sp).json()
    assert after["weight_version"] == 1 and after["meta_info"]["weight_version"] == "1"
    expected = new.llm(max_num_seqs=4, max_model_len=256).generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    assert after["output_ids"] == expected != before
    assert error(post(srv, "/update_weights_from_disk", {"model_path": str(new.path), "version": 0}), 400)["param"] \
        == "version"  # versions never go back
    assert get(srv, "/get_weight_version").json() == {"weight_version": 1, "weights": "committed"}


def test_sleep_and_wake_up(srv):
    assert post(srv, "/sleep", {"level": 2}).json() == {"success": True, "is_sleeping": True}
    err = error(generate(srv, input_ids=PROMPT), 503)  # asleep and not paused: refused, not held
    assert "asleep" in err["message"]
    assert post(srv, "/wake_up").json() == {"success": True, "is_sleeping": False}
    assert generate(srv, input_ids=PROMPT, sampling_params={"max_new_tokens": 2}).status_code == 200
    assert post(srv, "/pause_generation", {"mode": "abort"}).status_code == 200
    assert post(srv, "/sleep", {"level": 1}).json() == {"success": True, "is_sleeping": True}
    assert get(srv, "/is_sleeping").json() == {"is_sleeping": True}
    assert error(post(srv, "/resume_generation"), 409)["code"] == "conflict"  # asleep
    assert error(post(srv, "/sleep", {"level": 3}), 400)["param"] == "level"
    assert error(post(srv, "/wake_up", {"tags": ["gpu"]}), 400)["param"] == "tags"
    r = httpx.post(srv.base_url + "/wake_up?tags=kv_cache", headers=AUTH)
    assert r.json() == {"success": True, "is_sleeping": False}
    assert post(srv, "/resume_generation").status_code == 200
    assert generate(srv, input_ids=PROMPT, sampling_params={"max_new_tokens": 2}).status_code == 200


def test_a_half_failed_update_is_reported_on_health_and_the_rl_routes(srv, llm, tiny_factory):
    import asyncio

    from loopline.errors import WeightUpdateError

    new = tiny_factory(3).state_dict
    assert post(srv, "/pause_generation", {"mode": "abort"}).status_code == 200

    async def half_failed():
        await llm.start_weight_update(10)
        await llm.update_weights({n: new[n] for n in sorted(new)[:2]})
        with pytest.raises(WeightUpdateError):
            await llm.finish_weight_update()

    asyncio.run(half_failed())
    health = httpx.get(srv.base_url + "/health")
    assert health.status_code == 503 and "partially updated" in health.json()["error"]["message"]
    assert get(srv, "/get_weight_version").json()["weights"] == "partially_updated"
    assert error(post(srv, "/resume_generation"), 409)["code"] == "conflict"  # fails closed, and says so

    async def repair():
        await llm.start_weight_update(11)
        await llm.update_weights(new)
        await llm.finish_weight_update()

    asyncio.run(repair())
    assert httpx.get(srv.base_url + "/health").status_code == 200
    assert get(srv, "/get_weight_version").json() == {"weight_version": 11, "weights": "committed"}
    assert post(srv, "/resume_generation").status_code == 200
    assert generate(srv, input_ids=PROMPT, sampling_params={"max_new_tokens": 2}).json()["weight_version"] == 11
