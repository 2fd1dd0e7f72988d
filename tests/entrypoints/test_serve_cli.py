"""``loopline serve`` as a real process: flags, readiness, graceful SIGTERM."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx


def test_serve_parser_has_server_and_engine_flags():
    from loopline.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["serve", "--port", "9", "--served-model-name", "a", "b", "--api-key", "k",
                                    "--max-concurrent-requests", "3", "--max-num-seqs", "2", "--kv-layout", "shared"])
    assert (ns.port, ns.served_model_name, ns.api_key, ns.max_concurrent_requests) == (9, ["a", "b"], "k", 3)
    assert (ns.max_num_seqs, ns.kv_layout, ns.host, ns.model) == (2, "shared", "127.0.0.1", None)


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


def test_sigterm_lets_short_requests_finish_and_aborts_long_ones(tiny_gqa, free_port):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "loopline.entrypoints.cli", "serve", "--model", str(tiny_gqa.path),
                             "--port", str(port), "--dtype", "float32", "--device", "cpu", "--max-model-len", "2048",
                             "--served-model-name", "t", "--shutdown-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
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
    assert long_.get("tokens", 0) < 2000 and long_.get("finish") != "length"
    assert "finish=abort" in log and "server stopped" in log


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
