"""Serve throughput of the two process layouts against the offline engine, in one run.

For each layout -- ``thread`` (the engine loop on a thread of the server process, the layout
before the engine process) and ``process`` (``loopline serve``'s engine process) -- a server of
the same engine arguments is started in a subprocess and ``loopline bench serve`` drives it;
``loopline bench`` measures the offline engine with the same workload. Prints output
throughput and serve/offline ratios (run on a quiet machine; a CPU run is only a sanity check)::

    python tools/bench_serve_layout.py --device cpu --dtype float32 --input-len 64 --output-len 32 \\
        --concurrency 4 --num-prompts 16
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

_SERVER = """
import sys, uvicorn
from loopline import AsyncLLM, EngineArgs
from loopline.engine import LLMEngine
from loopline.entrypoints.openai.api_server import build_app
layout, port, kwargs = sys.argv[1], int(sys.argv[2]), eval(sys.argv[3])
if __name__ == "__main__":
    args = EngineArgs(**kwargs)
    llm = AsyncLLM(engine=LLMEngine(args)) if layout == "thread" else AsyncLLM(args)
    uvicorn.run(build_app(llm, "m"), host="127.0.0.1", port=port, log_level="warning")
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, timeout: float) -> None:
    subprocess.run([sys.executable, "-m", "loopline.entrypoints.cli", *args], check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--layouts", default="thread,process")
    ns = p.parse_args()
    kwargs = dict(model=ns.model, device=ns.device, dtype=ns.dtype, max_num_seqs=ns.max_num_seqs,
                  max_model_len=ns.input_len + ns.output_len + 16)
    tmp = tempfile.mkdtemp()
    engine_flags = ["--device", ns.device, "--dtype", ns.dtype, "--max-num-seqs", str(ns.max_num_seqs)]
    engine_flags += ["--model", ns.model] if ns.model else []
    _cli("bench", *engine_flags, "--no-progress", "--input-len", str(ns.input_len), "--output-len",
         str(ns.output_len), "--concurrency", str(ns.concurrency), "--num-prompts", str(ns.num_prompts),
         "--output-json", f"{tmp}/offline.json", timeout=1200)
    offline = json.load(open(f"{tmp}/offline.json"))["results"][0]["variants"][0]["median"]["output_throughput"]
    print(f"offline: {offline:.1f} tok/s (C={ns.concurrency}, {ns.input_len} in / {ns.output_len} out)")
    for layout in ns.layouts.split(","):
        port = _port()
        server = subprocess.Popen([sys.executable, "-c", _SERVER, layout, str(port), repr(kwargs)], env=os.environ)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                        break
                except OSError:
                    assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                    time.sleep(0.5)
            out = f"{tmp}/serve-{layout}.json"
            with open(out, "w") as f:
                subprocess.run([sys.executable, "-m", "loopline.entrypoints.cli", "bench", "serve", "--base-url",
                                f"http://127.0.0.1:{port}", "--input-len", str(ns.input_len), "--output-len",
                                str(ns.output_len), "--num-prompts", str(ns.num_prompts), "--concurrency",
                                str(ns.concurrency), "--json", "--no-progress"], check=True, stdout=f, timeout=1200)
            res = json.load(open(out))["results"][0]  # one rate, one phase
            s = res["output_throughput"]
            print(f"serve ({layout}): {s:.1f} tok/s, TPOT p50 {res['tpot_ms']['p50']:.2f} ms, "
                  f"serve/offline {s / offline:.3f}, failed {res['failed']}")
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
