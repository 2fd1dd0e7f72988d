"""``loopline serve`` as a real process: flags, readiness, graceful SIGTERM."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest


def test_serve_parser_has_server_and_engine_flags():
    from loopline.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["serve", "--port", "9", "--served-model-name", "a", "b", "--api-key", "k",
                                    "--max-concurrent-requests", "3", "--max-num-seqs", "2", "--kv-layout", "shared"])
    assert (ns.port, ns.served_model_name, ns.api_key, ns.max_concurrent_requests) == (9, ["a", "b"], "k", 3)
    assert (ns.max_num_seqs, ns.kv_layout, ns.host, ns.model) == (2, "shared", "127.0.0.1", None)
    # closed by default
    assert (ns.enable_rl_api, ns.allowed_origins, ns.allowed_hosts, ns.allow_credentials) == (False, [], [], False)
    assert ns.max_request_body_bytes == 32 * 1024 * 1024 and ns.max_prompts_per_request == 1024
    ns = build_parser().parse_args(["serve", "--enable-rl-api", "--allowed-origins", '["https://a.example", "http://b"]',
                                    "--allowed-hosts", "api.example, gw.example", "--allowed-methods", '["GET","POST"]',
                                    "--allow-credentials", "--max-request-body-bytes", "1000"])
    assert ns.enable_rl_api and ns.allowed_origins == ["https://a.example", "http://b"] and ns.allow_credentials
    assert ns.allowed_hosts == ["api.example", "gw.example"] and ns.allowed_methods == ["GET", "POST"]
    assert ns.max_request_body_bytes == 1000


def test_api_key_help_lists_what_it_protects():
    from loopline.entrypoints.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (action,) = [a for a in serve._actions if "--api-key" in a.option_strings]
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/generate",
                  "--enable-rl-api", "/health", "/metrics", "/version"):
        assert route in action.help, route


def _stream(base: str, max_tokens: int, out: dict) -> None:
    body = {"model": "t", "prompt": "Hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    out["tokens"] = out.get("tokens", 0) + len(choice["exit_depths"])
                    out["finish"] = choice["finish_reason"] or out.get("finish")
                elif line == "data: [DONE]":
                    out["done"] = True
                if out.get("tokens") and "started" not in out:
                    out["started"] = time.monotonic()
    except httpx.HTTPError as e:  # the server cut the connection (shutdown timeout)
        out["error"] = type(e).__name__


def _start(tiny_gqa, port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "loopline.entrypoints.cli", "serve", "--model", str(tiny_gqa.path),
                             "--port", str(port), "--dtype", "float32", "--device", "cpu", "--max-model-len", "2048",
                             "--served-model-name", "t", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_healthy(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


@pytest.mark.slow  # a server process (~5 s on 2 cores); default run: the check it makes, in
# test_security.py::test_rl_api_on_a_non_loopback_bind_needs_an_api_key
def test_rl_api_on_a_public_bind_without_a_key_refuses_to_start(tiny_gqa, free_port):
    proc = _start(tiny_gqa, free_port(), "--host", "0.0.0.0", "--enable-rl-api")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "needs --api-key" in out


@pytest.mark.slow  # a server process (~14 s on 2 cores). Default run: test_serve_parser_has_server_and_engine_flags
# checks the closed defaults, test_security.py and test_vllm_launch_flags.py the app they build, and
# test_sigterm_lets_short_requests_finish_and_aborts_long_ones runs a real server
def test_a_real_server_is_closed_by_default(tiny_gqa, free_port):
    """Defaults of `loopline serve` on loopback: no RL routes, loopback Host names only, no CORS."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start(tiny_gqa, port)
    try:
        _wait_healthy(proc, base)
        r = httpx.post(base + "/pause_generation", json={"mode": "keep"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert httpx.post(base + "/generate", json={"input_ids": [1, 2]}).status_code == 404
        r = httpx.get(base + "/v1/models", headers={"Host": f"rebind.example:{port}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert httpx.get(base + "/v1/models", headers={"Host": f"localhost:{port}"}).status_code == 200
        r = httpx.post(base + "/v1/completions", json={"model": "t", "prompt": "hi", "max_tokens": 1},
                       headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        r = httpx.post(base + "/v1/completions", content=b'{"model": "t", "prompt": "hi"}',
                       headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
    finally:
        proc.terminate()
        proc.wait(30)


def test_sigterm_lets_short_requests_finish_and_aborts_long_ones(tiny_gqa, free_port):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start(tiny_gqa, port, "--shutdown-timeout", "2", "--enable-rl-api", "--allowed-origins", '["https://ui.example"]')
    try:
        _wait_healthy(proc, base)
        r = httpx.post(base + "/pause_generation", json={"mode": "keep"}, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403  # --enable-rl-api mounts the routes; other origins are still refused
        r = httpx.get(base + "/is_paused", headers={"Origin": "https://ui.example"})
        assert r.json() == {"is_paused": False} and r.headers["access-control-allow-origin"] == "https://ui.example"
        deadline = time.monotonic() + 60
        short, long_ = {}, {}
        threads = [threading.Thread(target=_stream, args=(base, 2000, long_)),
                   threading.Thread(target=_stream, args=(base, 20, short))]
        for t in threads:
            t.start()
        while "started" not in long_ or "started" not in short:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)  # in-flight requests get 2 s (--shutdown-timeout) to finish
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert short == {**short, "tokens": 20, "finish": "length", "done": True}
    # the long stream is aborted at the timeout and still ends properly: a final chunk, then [DONE]
    assert long_.get("tokens", 0) < 2000 and long_.get("finish") == "abort" and long_.get("done")
    assert "error" not in long_ and "finish=abort" in log and "server stopped" in log


def test_serving_docs_cover_every_extra_field_and_flag():
    from pathlib import Path

    from loopline.entrypoints.cli import build_parser
    from loopline.entrypoints.openai.protocol import ExtraSamplingFields

    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    missing = [f for f in ExtraSamplingFields.model_fields if f"`{f}`" not in text]
    assert not missing, f"document these extra request fields in docs/serving.md: {missing}"
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    groups = {g.title: g for g in serve._action_groups}
    flags = [a.option_strings[0] for a in groups["server"]._group_actions]
    assert [f for f in flags if f"`{f}" not in text] == []
