"""The control plane is closed by default; Host, Origin, Content-Type and body size are checked
before any route runs; every refusal is an OpenAI-style error; keep-alive survives every error.

Servers are real uvicorn servers on loopback ports (conftest.RunningServer); the raw-socket
tests send several requests over one TCP connection, as a keep-alive client does.
"""
from __future__ import annotations

import json
import socket

import httpx
import pytest

from loopline.entrypoints.openai.api_server import build_app, check_exposure
from loopline.entrypoints.openai.security import SecurityConfig

MODEL = "tiny-sec"
RL_GETS = ["/is_paused", "/get_weight_version", "/is_sleeping", "/flush_cache"]
RL_POSTS = ["/generate", "/pause_generation", "/pause", "/resume_generation", "/resume", "/continue_generation",
            "/abort_request", "/update_weights_from_disk", "/reset_prefix_cache", "/flush_cache", "/sleep", "/wake_up"]


@pytest.fixture(scope="module")
def closed(async_llm, serve_app):
    """The defaults: no RL API; the loopback Host allow-list that `loopline serve` uses on 127.0.0.1."""
    return serve_app(build_app(async_llm, MODEL, shutdown_engine=False, security=SecurityConfig.for_bind("127.0.0.1")))


@pytest.fixture(scope="module")
def rl(async_llm, serve_app):
    """RL API on, one allowed origin, a 4 KiB body limit."""
    security = SecurityConfig.for_bind("127.0.0.1", ["trainer.internal"], allowed_origins=("https://ui.example",),
                                       max_request_body_bytes=4096)
    return serve_app(build_app(async_llm, MODEL, shutdown_engine=False, enable_rl_api=True, security=security))


def is_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# --- the RL / control routes are opt-in -------------------------------------------------------------
def test_control_routes_are_not_mounted_by_default(closed, async_llm):
    for path in RL_POSTS:
        is_openai_error(httpx.post(closed.base_url + path, json={"mode": "keep"}), 404, "not_found")
    for path in RL_GETS:
        is_openai_error(httpx.get(closed.base_url + path), 404, "not_found")
    assert not async_llm.snapshot.is_paused  # nothing reached the engine
    for path in ("/docs", "/openapi.json", "/redoc"):  # no route list served either
        assert httpx.get(closed.base_url + path).status_code == 404
    assert httpx.post(closed.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_control_routes_are_mounted_with_enable_rl_api(rl):
    assert httpx.get(rl.base_url + "/is_paused").json() == {"is_paused": False}


@pytest.mark.parametrize("host,rl_api,key,ok", [
    ("127.0.0.1", True, None, True), ("localhost", True, None, True), ("::1", True, None, True),
    ("0.0.0.0", True, None, False), ("192.168.1.5", True, None, False), ("::", True, None, False),
    ("0.0.0.0", True, "k", True), ("0.0.0.0", False, None, True),
])
def test_rl_api_on_a_non_loopback_bind_needs_an_api_key(host, rl_api, key, ok):
    if ok:
        check_exposure(host, rl_api, key)
    else:
        with pytest.raises(SystemExit, match="--api-key"):
            check_exposure(host, rl_api, key)


# --- Host (DNS rebinding) ---------------------------------------------------------------------------
def _errors(srv) -> float:
    for line in httpx.get(srv.base_url + "/metrics").text.splitlines():
        if line.startswith("loopline:requests_total{") and 'status="error"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_host_header_allow_list(closed, rl):
    port = closed.port
    before = _errors(closed)
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", f"10.0.0.1:{port}"):
        is_openai_error(httpx.get(closed.base_url + "/v1/models", headers={"Host": host}), 400, "invalid_host")
    assert _errors(closed) == before + 4  # refusals count as errors on /metrics
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(closed.base_url + "/v1/models", headers={"Host": host}).status_code == 200, host
    assert httpx.get(rl.base_url + "/is_paused", headers={"Host": "trainer.internal:80"}).status_code == 200
    is_openai_error(httpx.get(rl.base_url + "/is_paused", headers={"Host": "evil.example"}), 400, "invalid_host")


def test_host_allow_list_for_other_binds():
    assert SecurityConfig.for_bind("0.0.0.0").host_allowed("anything.example")  # no names known: any
    cfg = SecurityConfig.for_bind("0.0.0.0", ["api.example"])
    assert cfg.host_allowed("api.example:8000") and cfg.host_allowed("localhost")
    assert not cfg.host_allowed("evil.example") and not cfg.host_allowed(None)
    assert SecurityConfig.for_bind("127.0.0.1", ["*"]).host_allowed("evil.example")


# --- cross-origin requests (CSRF) and CORS -----------------------------------------------------------
def test_cross_origin_posts_are_refused(closed, rl, async_llm):
    evil = {"Origin": "http://evil.example"}
    body = {"prompt": "hi", "max_tokens": 1}
    is_openai_error(httpx.post(closed.base_url + "/v1/completions", json=body, headers=evil), 403,
                    "cross_origin_forbidden")
    is_openai_error(httpx.post(rl.base_url + "/pause_generation", json={"mode": "keep"}, headers=evil), 403)
    is_openai_error(httpx.post(rl.base_url + "/pause?mode=keep", headers=evil), 403)  # no body, query string
    assert not async_llm.snapshot.is_paused
    # control routes refuse cross-site GETs too (an <img src> sends Sec-Fetch-Site, not Origin)
    is_openai_error(httpx.get(rl.base_url + "/flush_cache", headers={"Sec-Fetch-Site": "cross-site"}), 403)
    is_openai_error(httpx.get(rl.base_url + "/get_weight_version", headers=evil), 403)
    # same-origin (the server's own scheme://host) and non-browser clients pass
    same = {"Origin": rl.base_url, "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(rl.base_url + "/v1/completions", json=body, headers=same).status_code == 200
    assert httpx.post(closed.base_url + "/v1/completions", json=body).status_code == 200
    # a non-control GET from another origin is answered, but without CORS headers the browser hides it
    r = httpx.get(closed.base_url + "/v1/models", headers=evil)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_get_cors(rl, closed):
    ui = {"Origin": "https://ui.example"}
    r = httpx.post(rl.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=ui)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    pre = httpx.options(rl.base_url + "/pause_generation",
                        headers={**ui, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ui.example"
    assert httpx.get(rl.base_url + "/is_paused", headers=ui).status_code == 200
    # CORS is off by default: no preflight answer, no headers
    pre = httpx.options(closed.base_url + "/v1/completions",
                        headers={**ui, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


# --- JSON only ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_post_bodies_must_be_json(rl, async_llm, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"mode": "keep"}).encode()
    err = is_openai_error(httpx.post(rl.base_url + "/pause_generation", content=body, headers=headers), 415,
                          "unsupported_media_type")
    assert "application/json" in err["message"]
    assert not async_llm.snapshot.is_paused


def test_json_with_charset_and_bodyless_posts_pass(rl):
    r = httpx.post(rl.base_url + "/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 1}),
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    assert httpx.post(rl.base_url + "/resume_generation").status_code == 200  # nothing to parse


# --- body size --------------------------------------------------------------------------------------
def test_body_size_limit(rl):
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    err = is_openai_error(httpx.post(rl.base_url + "/v1/completions", json=big), 413, "request_too_large")
    assert "4096" in err["message"]

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'", "max_tokens": 1}'

    r = httpx.post(rl.base_url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    is_openai_error(r, 413, "request_too_large")
    assert httpx.post(rl.base_url + "/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1}).status_code == 200


def test_prompts_per_request_cap(async_llm, serve_app):
    srv = serve_app(build_app(async_llm, MODEL, shutdown_engine=False, enable_rl_api=True, max_prompts_per_request=3))
    err = is_openai_error(httpx.post(srv.base_url + "/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 1}),
                          400)
    assert err["param"] == "prompt" and "at most 3" in err["message"]
    err = is_openai_error(httpx.post(srv.base_url + "/generate", json={"input_ids": [[1]] * 4}), 400)
    assert err["param"] == "input_ids"
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": ["a"] * 3, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


# --- error bodies and keep-alive ------------------------------------------------------------------------
def _exchange(port: int, requests: list[bytes]) -> list[tuple[int, dict | None]]:
    """Sends each raw HTTP/1.1 request over ONE connection; returns (status, JSON body) per response."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        f = sock.makefile("rb")
        for raw in requests:
            sock.sendall(raw)
            status_line = f.readline()
            assert status_line, f"the server closed the connection before answering {raw[:60]!r}"
            status = int(status_line.split()[1])
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            assert "content-length" in headers, headers
            body = f.read(int(headers["content-length"]))
            out.append((status, json.loads(body) if body else None))
            assert headers.get("connection", "").lower() != "close", (raw[:60], status)
    return out


def _req(method: str, path: str, body: bytes = b"", content_type: str | None = "application/json",
         port: int = 0) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {len(body)}\r\n"
    if content_type:
        head += f"Content-Type: {content_type}\r\n"
    return head.encode() + b"\r\n" + body


def _chunked(method: str, path: str, body: bytes, port: int, chunk: int = 1000) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nTransfer-Encoding: chunked\r\n" \
           "Content-Type: application/json\r\n\r\n"
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)]
    return head.encode() + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_a_413_and_every_refusal_of_a_body_keep_the_connection(rl):
    """Bodies the server refuses or never reads (up to twice the 4 KiB limit) are read and discarded
    before the answer, so the same connection carries the next request."""
    p = rl.port
    good = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    big = json.dumps({"prompt": "x" * 6000, "max_tokens": 1}).encode()  # over the limit, under twice it
    some = json.dumps({"prompt": "x" * 3000}).encode()
    cases = [
        (_req("POST", "/v1/completions", big, port=p), 413, "request_too_large"),  # from Content-Length
        (_req("POST", "/v1/completions", good, port=p), 200, None),
        (_chunked("POST", "/v1/completions", big, port=p), 413, "request_too_large"),  # while it streams in
        (_req("POST", "/v1/completions", good, port=p), 200, None),
        (_req("POST", "/nope", some, port=p), 404, "not_found"),  # no route reads the body
        (_req("DELETE", "/v1/completions", some, port=p), 405, None),
        (_req("GET", "/v1/models", some, port=p), 200, None),  # a route that never reads its body
        (_req("POST", "/v1/completions", some, "text/plain", port=p), 415, "unsupported_media_type"),
        (_req("POST", "/v1/completions", some.replace(b"}", b""), port=p), 400, "invalid_json"),
        (_req("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": "x"}', port=p), 400, None),
        (_req("POST", "/v1/completions", some, port=p).replace(b"127.0.0.1", b"evil.example", 1), 400,
         "invalid_host"),
        (_req("POST", "/v1/completions", good, port=p), 200, None),
    ]
    results = _exchange(p, [c[0] for c in cases])
    for (raw, status, code), (got, body) in zip(cases, results):
        assert got == status, (raw[:80], got, body)
        if status != 200:
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], body
            assert code is None or err["code"] == code, (raw[:80], err)


def test_a_413_over_http_client_then_a_request_on_the_same_connection(rl):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", rl.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x" * 5000}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
        assert r.getheader("connection") is None and not r.will_close
        sock = conn.sock
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 1
        assert conn.sock is sock  # the same connection
    finally:
        conn.close()


def _answer_then_closed(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    """Reads one response, then asserts the server closed the connection."""
    f = sock.makefile("rb")
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = json.loads(f.read(int(headers["content-length"])))
    assert f.read() == b""  # closed by the server
    return status, headers, body


@pytest.mark.parametrize("announced", [True, False])
def test_a_body_past_twice_the_limit_is_refused_with_connection_close(rl, announced):
    """Too large to be worth reading: the 413 comes at once (announced) or once twice the limit was
    read (chunked), says ``Connection: close``, and the server closes; a new connection works."""
    p = rl.port
    with socket.create_connection(("127.0.0.1", p), timeout=30) as sock:
        if announced:
            sock.sendall(_req("POST", "/v1/completions", b"", port=p).replace(
                b"Content-Length: 0", b"Content-Length: 100000") + b'{"prompt": "')
        else:
            sock.sendall(_chunked("POST", "/v1/completions", b"x" * 9000, port=p)[:-5])  # never ends
        status, headers, body = _answer_then_closed(sock)
    assert status == 413 and headers["connection"] == "close" and body["error"]["code"] == "request_too_large"
    assert httpx.post(rl.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_a_refusal_of_an_expect_100_continue_request_comes_before_the_upload(rl):
    p = rl.port
    body = json.dumps({"prompt": "x" * 6000}).encode()
    with socket.create_connection(("127.0.0.1", p), timeout=30) as sock:
        sock.sendall(_req("POST", "/v1/completions", body, port=p)[:-len(body)].replace(
            b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))  # headers only: the client waits
        status, headers, err = _answer_then_closed(sock)  # a final answer, no "100 Continue"
    assert status == 413 and headers["connection"] == "close" and err["error"]["code"] == "request_too_large"


def test_every_error_is_an_openai_body_and_keep_alive_survives(closed):
    p = closed.port
    good = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    cases = [
        (_req("GET", "/nope", port=p), 404, None),
        (_req("DELETE", "/v1/completions", port=p), 405, None),
        (_req("GET", "/v1/completions", port=p), 405, None),
        (_req("POST", "/v1/completions", b"{not json", port=p), 400, None),
        (_req("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', port=p), 400, None),  # invalid UTF-8
        (_req("POST", "/v1/completions", b'{"prompt": "\\ud800"}', port=p), 400, "prompt"),  # a lone surrogate
        (_req("POST", "/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"]}', port=p), 400, "stop[0]"),
        (_req("POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', port=p), 400, "temperature"),
        (_req("POST", "/v1/completions", b"[1, 2]", port=p), 400, None),
        (_req("POST", "/v1/completions", b"[" * 100000, port=p), 400, None),  # too deep for the parser
        (_req("POST", "/v1/completions", good, "text/plain", port=p), 415, "Content-Type"),
        (_req("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": true}', port=p), 400, "max_tokens"),
        (_req("POST", "/v1/completions", b'{"prompt": "hi", "model": "nope"}', port=p), 404, "model"),
        (_req("POST", "/v1/chat/completions", b'{"messages": [{"role": "x", "content": "a"}]}', port=p), 400,
         "messages[0].role"),
        (_req("POST", "/tokenize", b'{"prompt": "\\ud83d"}', port=p), 400, "prompt"),
        (_req("POST", "/v1/completions", good, port=p), 200, None),
    ]
    results = _exchange(p, [c[0] for c in cases])
    for (raw, status, param), (got, body) in zip(cases, results):
        assert got == status, (raw[:80], got, body)
        if status != 200:
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], body
            assert err["param"] == param, (raw[:80], err)
            assert not (isinstance(err["param"], str) and err["param"].isdigit())  # never a byte offset


def test_an_internal_error_is_a_500_with_an_id_and_keep_alive_survives(async_llm, serve_app, caplog):
    app = build_app(async_llm, MODEL, shutdown_engine=False)
    srv = serve_app(app)

    def broken(model):
        raise RuntimeError("secret internal detail /etc/passwd")

    app.state.ctx.check_model = broken
    p = srv.port
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    with caplog.at_level("ERROR", logger="loopline.api"):
        (s1, b1), (s2, b2) = _exchange(p, [_req("POST", "/v1/completions", body, port=p),
                                           _req("GET", "/v1/models", port=p)])
    assert s1 == 500 and b1["error"]["code"] == "internal_error" and "secret" not in json.dumps(b1)
    error_id = b1["error"]["message"].split("error id ")[1].split(")")[0]
    assert any(error_id in r.getMessage() for r in caplog.records)  # the log has the id (and the traceback)
    assert s2 == 200 and b2["data"][0]["id"] == MODEL
