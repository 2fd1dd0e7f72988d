"""``loopline serve`` as a real process against the issue's hostile cases (#43): a smuggled request behind
an ambiguous frame never runs (the parser `loopline serve` picks), and SIGTERM stops a server whose
tokenizer threads are both busy with spinning chat templates."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.entrypoints.test_serve_cli import _wait_healthy

SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _smuggle(port: int) -> bytes:
    """CL + TE with a /pause_generation behind the chunked end; returns all the server sent until it closed."""
    smuggled = (b"POST /pause_generation HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 2\r\n\r\n{}")
    rest = b"0\r\n\r\n" + smuggled
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(rest)}\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + rest
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        f = sock.makefile("rb")
        return f.read()  # until the server closes


@pytest.mark.slow  # ~17 s on 2 CPU cores: a server process, then a 2 s template budget and its shutdown
def test_a_real_server_refuses_smuggling_and_sigterm_beats_spinning_templates(tiny_gqa, free_port):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "loopline.entrypoints.cli", "serve", "--model", str(tiny_gqa.path),
                             "--port", str(port), "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
                             "--served-model-name", "t", "--enable-rl-api", "--trust-request-chat-template",
                             "--shutdown-timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, base)
        answer = _smuggle(port)
        assert answer.startswith(b"HTTP/1.1 400") and answer.count(b"HTTP/1.1 ") == 1, answer[:300]
        assert b"ambiguous_framing" in answer and b"connection: close" in answer.lower()
        time.sleep(0.2)
        assert httpx.get(base + "/is_paused").json() == {"is_paused": False}

        results: dict[int, object] = {}

        def spin(i: int) -> None:
            try:
                results[i] = httpx.post(base + "/v1/chat/completions", timeout=60, json={
                    "model": "t", "messages": [{"role": "user", "content": "hi"}], "chat_template": SPIN}).status_code
            except httpx.HTTPError as e:
                results[i] = type(e).__name__

        threads = [threading.Thread(target=spin, args=(i,)) for i in range(2)]  # one per tokenizer thread
        for t in threads:
            t.start()
        time.sleep(0.5)  # both renders are spinning
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        took = time.monotonic() - start
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    print(f"SIGTERM to exit: {took:.2f} s")
    assert took < 10, (took, log[-2000:])
    assert results == {0: 400, 1: 400}, (results, log[-2000:])  # the renders ran out of time and answered
