"""Serves a trained checkpoint with ``loopline serve`` and checks one completion (docs/rl.md, section 10).

Starts ``loopline serve MODEL`` on a free loopback port, waits for ``/health``, sends one greedy
``/v1/completions`` request (``logprobs=1``, ``repetition_penalty`` 1: the server would otherwise
apply the checkpoint's generation_config.json default, the offline call does not), checks that the answer holds text and that its tokens are
the ones ``loopline.LLM`` generates offline from the same directory, writes the response and the check
to ``--out`` (JSON) and stops the server. Exits non-zero when the server does not come up or the
answers differ.

    python tools/verl_serve_check.py EXPORTED_DIR --out serve.json --device cuda
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = "def add(a, b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, proc: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"loopline serve exited with {proc.returncode} before it was ready")
        try:
            _get(f"{base}/health", timeout=2.0)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            time.sleep(0.5)
    raise TimeoutError(f"loopline serve was not ready within {deadline_s:.0f} s")


def offline_tokens(model: str, device: str, dtype: str, max_tokens: int) -> list[int]:
    from loopline import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def check(model: str, device: str, dtype: str, max_tokens: int, ready_s: float, log: Path) -> dict:
    """Runs the server, asks it, compares with the offline engine; returns the record."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "loopline", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--device", device, "--dtype", dtype, "--return-tokens-as-token-ids"]
    start = time.monotonic()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            wait_ready(base, proc, ready_s)
            ready = time.monotonic() - start
            body = {"model": _get(f"{base}/v1/models")["data"][0]["id"], "prompt": PROMPT, "max_tokens": max_tokens,
                    "temperature": 0, "logprobs": 1, "repetition_penalty": 1.0}
            response = _post(f"{base}/v1/completions", body)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    choice = response["choices"][0]
    served = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    want = offline_tokens(model, device, dtype, max_tokens)
    return {"model": model, "command": " ".join(cmd), "ready_s": round(ready, 2), "prompt": PROMPT,
            "text": choice["text"], "served_tokens": served, "offline_tokens": want,
            "token_logprobs": choice["logprobs"]["token_logprobs"], "equal": served == want and bool(choice["text"]),
            "response": response}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="checkpoint directory (e.g. loopline.integrations.verl_checkpoint's export)")
    ap.add_argument("--out", required=True, help="JSON file for the response and the check")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for /health")
    args = ap.parse_args()
    out = Path(args.out)
    record = check(args.model, args.device, args.dtype, args.max_tokens, args.ready_timeout,
                   out.with_suffix(".server.log"))
    out.write_text(json.dumps(record, indent=1))
    print(f"served {args.model}: ready in {record['ready_s']} s, {record['text']!r}, "
          f"equal to the offline engine: {record['equal']}")
    sys.exit(0 if record["equal"] else 1)


if __name__ == "__main__":
    main()
