"""Request smuggling: a request whose body length is ambiguous gets a 400 and the connection closes,
so the bytes after it (here a ``/pause_generation`` a front proxy would have taken for body) never run.

Each case sends raw bytes over one TCP connection to a real uvicorn server (the parser `loopline serve`
uses: ``HTTP_PROTOCOL``); the refusal comes either from the guard (``ambiguous_framing``, an OpenAI error
body) or from the HTTP parser itself (uvicorn's plain-text 400). The control test shows that the same
pipelined bytes DO pause the server when the first request is well framed, so the checks can fail.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from starlette.datastructures import Headers

from loopline.entrypoints.openai.api_server import build_app
from loopline.entrypoints.openai.security import HTTP_PROTOCOL, SecurityConfig, framing_refusal

MODEL = "tiny-framing"
SMUGGLED = (b"POST /pause_generation HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\n\r\n{}")
CHUNKED_END = b"0\r\n\r\n"


class _Server:
    def __init__(self, app) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                    access_log=False, http=HTTP_PROTOCOL))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def srv(async_llm):
    server = _Server(build_app(async_llm, MODEL, shutdown_engine=False, enable_rl_api=True,
                               security=SecurityConfig.for_bind("127.0.0.1")))
    yield server
    server.server.should_exit = True
    server.thread.join(timeout=30)


@pytest.fixture
def unpaused(srv):
    yield srv
    httpx.post(srv.base_url + "/continue_generation", json={})  # whatever a failing case left behind


def _head(headers: str, request_line: str = "POST /v1/completions HTTP/1.1") -> bytes:
    return (f"{request_line}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + headers).encode()


def _responses_until_closed(port: int, raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Sends ``raw`` on one connection and reads every response until the server closes it."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        f = sock.makefile("rb")
        while status_line := f.readline():
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            body = f.read(int(headers["content-length"])) if "content-length" in headers else f.read()
            out.append((int(status_line.split()[1]), headers, body))
    return out


def _is_paused(srv) -> bool:
    time.sleep(0.2)  # a smuggled request would have been dispatched by now
    return httpx.get(srv.base_url + "/is_paused").json()["is_paused"]


def test_control_a_well_framed_request_then_the_pause_does_pause(unpaused):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    got = _responses_until_closed(unpaused.port, _head(f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n")
                                  + body + SMUGGLED.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
    assert [s for s, _, _ in got] == [200, 200]
    assert _is_paused(unpaused)


def _cl_te(order: str) -> bytes:
    rest = CHUNKED_END + SMUGGLED  # a Content-Length proxy reads all of it as this request's body
    cl, te = f"Content-Length: {len(rest)}\r\n", "Transfer-Encoding: chunked\r\n"
    return _head(cl + te if order == "cl-te" else te + cl) + b"\r\n" + rest


# (raw bytes, who refuses: "guard" -> an ambiguous_framing error body, "parser" -> uvicorn's own 400)
CASES = {
    "content-length-and-chunked": (_cl_te("cl-te"), "guard"),
    "chunked-and-content-length": (_cl_te("te-cl"), "guard"),
    "chunked-on-http-1.0": (_head("Transfer-Encoding: chunked\r\n\r\n", "POST /v1/completions HTTP/1.0")
                            + CHUNKED_END + SMUGGLED, "guard"),
    "two-content-lengths": (_head("Content-Length: 0\r\nContent-Length: 2\r\n\r\n") + b"{}" + SMUGGLED, "parser"),
    "content-length-list": (_head("Content-Length: 0, 2\r\n\r\n") + b"{}" + SMUGGLED, "parser"),
    "signed-content-length": (_head("Content-Length: +2\r\n\r\n") + b"{}" + SMUGGLED, "parser"),
    "gzip-chunked": (_head("Transfer-Encoding: gzip, chunked\r\n\r\n") + CHUNKED_END + SMUGGLED, "parser"),
    "chunked-chunked": (_head("Transfer-Encoding: chunked, chunked\r\n\r\n") + CHUNKED_END + SMUGGLED, "parser"),
    "two-transfer-encodings": (_head("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n")
                               + CHUNKED_END + SMUGGLED, "parser"),
    "identity": (_head("Transfer-Encoding: identity\r\n\r\n") + SMUGGLED, "parser"),
    "space-before-colon": (_head("Transfer-Encoding : chunked\r\nContent-Length: 0\r\n\r\n") + CHUNKED_END + SMUGGLED,
                           "parser"),
    # obs-fold: the parser joins a continuation line to the header before it (RFC 9112 section 5.2)
    "folded-content-length": (_head("Content-Length: 0\r\n 2\r\n\r\n") + b"{}" + SMUGGLED, "parser"),
    "folded-transfer-encoding": (_head("Content-Length: 5\r\nTransfer-Encoding:\r\n chunked\r\n\r\n") + CHUNKED_END
                                 + SMUGGLED, "guard"),
    # bare LF: accepted as a header line end (RFC 9112 section 2.2), so a proxy that reads it as part of
    # a value cannot hide Transfer-Encoding from the guard; chunk lines must end in CRLF
    "bare-lf-hides-transfer-encoding": (_head("Content-Length: 5\r\nX-Pad: a\nTransfer-Encoding: chunked\r\n\r\n")
                                        + CHUNKED_END + SMUGGLED, "guard"),
    "bare-lf-chunk-lines": (_head("Transfer-Encoding: chunked\r\n\r\n") + b"0\n\n" + SMUGGLED, "parser"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_ambiguous_frame_is_a_400_the_connection_closes_and_the_smuggled_request_never_runs(unpaused, case):
    raw, refused_by = CASES[case]
    got = _responses_until_closed(unpaused.port, raw)
    assert len(got) == 1, [(s, b[:80]) for s, _, b in got]  # one answer, then the server closed
    status, headers, body = got[0]
    assert status == 400 and headers.get("connection") == "close", (status, headers, body[:200])
    if refused_by == "guard":
        err = json.loads(body)["error"]
        assert err["code"] == "ambiguous_framing" and err["param"] in ("Transfer-Encoding", "Content-Length"), err
    else:
        assert b"Invalid HTTP request" in body, body
    assert not _is_paused(unpaused)
    assert httpx.post(unpaused.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_identical_content_lengths_and_folded_headers_are_one_request(unpaused):
    """What the parser accepts is read one way only: identical Content-Length values merge (RFC 9110
    section 8.6), a folded ordinary header joins with a space; the next request then runs normally."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    n = len(body)
    raw = (_head(f"Content-Length: {n}\r\nContent-Length: {n}\r\nX-Pad: a\r\n b\r\n\r\n") + body
           + b"GET /is_paused HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    got = _responses_until_closed(unpaused.port, raw)
    assert [s for s, _, _ in got] == [200, 200]
    assert json.loads(got[0][2])["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("raw, param", [
    ([("content-length", "3"), ("transfer-encoding", "chunked")], "Transfer-Encoding"),
    ([("transfer-encoding", "gzip")], "Transfer-Encoding"),
    ([("transfer-encoding", "chunked"), ("transfer-encoding", "chunked")], "Transfer-Encoding"),
    ([("content-length", "3"), ("content-length", "4")], "Content-Length"),
    ([("content-length", "3, 4")], "Content-Length"),
    ([("content-length", "-1")], "Content-Length"),
    ([("content-length", "3, 3")], None),
    ([("transfer-encoding", "Chunked")], None),
    ([("content-length", "0")], None),
    ([], None),
])
def test_framing_refusal_without_a_parser(raw, param):
    """The guard's rule does not depend on the parser in front of it (httptools, a test client)."""
    headers = Headers(raw=[(k.encode(), v.encode()) for k, v in raw])
    err = framing_refusal({"http_version": "1.1"}, headers)
    assert (err.param if err is not None else None) == param
    if err is not None:
        assert err.status == 400 and err.code == "ambiguous_framing" and "RFC 9112" in err.message
