"""Host time per token of the streaming output path, at the start, middle and end of one long completion.

    python tools/stream_host_cost.py [--model tiny-ascii|demo] [--max-tokens 4096] [--window 512] [--logprobs K]
                                     [--repeats 3] [--json F]

Streams one completion (``/v1/completions``, ``stream: true``, greedy, ``ignore_eos``) through the
real HTTP app on the CPU, its engine loop on a thread of this process (``AsyncLLM(engine=...)``), each engine
message pickled and unpickled on its way as the engine process's pipe does (``runtime.core.dumps``),
and the app served in process (httpx's ASGI transport). Each token runs one loop (``max_loops=1``):
the model's time is not measured, so fewer steps only make the run shorter.

The model (written to a temporary folder: the same bytes in every checkout) is ``tiny-ascii`` by
default: a one-layer tiny checkpoint whose head can only pick ``"a"`` or ``" b"``, so its text is
plain ASCII and its KV cache stays small. Both matter here: a random model's invalid UTF-8 bytes make
the incremental detokenizer wait for characters that never complete (a cost that grows with the run
but comes from the text, not the output path), and a model whose KV grows to tens of MB (``demo``: the
bundled model with more positions allowed) evicts the host's caches at every step, which slows every
part of the output path alike towards the end of the run (the ``transport`` part, a message of fixed
size, shows how much). The engine thread waits
after each message until its tokens went out in an SSE chunk (waiting costs no CPU time): every token
gets a chunk of its own, as when the engine is slower than the server (a reader that falls behind
gets one chunk for several tokens, which would hide a per-chunk cost that grows).

Timers (thread CPU time, so that the other threads and other processes on a small shared host do
not count) sit on the parts of the output path that exist in every checkout:

* ``engine``: the output processor's per-token booking (``OutputProcessor.on_token``) and the
  step's output collection (``LLMEngine._collect``), plus ``DeltaEncoder.encode`` where it exists
  (the engine loop's encoding before deltas came from the output processor);
* ``transport``: pickling and unpickling each engine message;
* ``client``: ``EngineClient._on_message`` (routing each message to its stream);
* ``event loop``: the API process's event-loop thread between two SSE chunks (the stream's
  ``get``, building the output, formatting the chunk, the ASGI plumbing), read at every chunk and
  shared among the chunk's tokens.

For each window of ``--window`` tokens at the start, middle and end it prints host microseconds per
token of each part and in all (the window's mean; the median over ``--repeats`` completions), the
median token's total (robust to bursts on a shared host: another process, a garbage collection),
and the end/start ratios: an output path whose per-token cost does not grow with the output has
ratios near 1. ``control`` is a fixed piece of work (a small pickle round trip) timed on the
event-loop thread at every chunk and left out of the totals: on a shared host it reads slower when
the host was slower, so each run's total end/start ratio is also printed divided by the control's. Run it in two checkouts (``PYTHONPATH`` at each) for an A/B; ``--json`` keeps the
numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from functools import wraps
from pathlib import Path

PARTS = ("engine", "transport", "client", "event loop")
# A fixed piece of work timed on the event-loop thread at every chunk: it costs the same all through a
# run, so when it reads slower the host was slower (a busy neighbour, a clock change), not the code.
_CONTROL = {f"k{i}": [i, str(i), float(i)] for i in range(40)}


class Meter:
    """Thread CPU seconds per part, attributed to the index of the token being generated."""

    def __init__(self) -> None:
        self.tokens = 0  # tokens booked by the engine so far (its thread's view)
        self.sent = 0  # tokens that went out in SSE chunks (the event loop's view)
        self.chunks = 0
        self.cost: dict[str, dict[int, float]] = {p: defaultdict(float) for p in (*PARTS, "control")}
        self._loop_mark: float | None = None
        self._cond = threading.Condition()

    def add(self, part: str, seconds: float, token: int) -> None:
        self.cost[part][token] += seconds

    def chunk(self, tokens: int) -> None:
        """The event loop formatted a chunk of ``tokens`` tokens: its CPU since the previous chunk goes
        to them."""
        now = time.thread_time()
        if self._loop_mark is not None and tokens:
            for t in range(self.sent, self.sent + tokens):
                self.add("event loop", (now - self._loop_mark) / tokens, t)
        t0 = time.thread_time()
        pickle.loads(pickle.dumps(_CONTROL))
        self.add("control", time.thread_time() - t0, self.sent)
        self._loop_mark = time.thread_time()
        self.chunks += 1
        with self._cond:
            self.sent += tokens
            self._cond.notify_all()

    def wait_sent(self, timeout: float = 10.0) -> None:
        """On the engine thread: until the tokens booked went out (or ``timeout``: a token without a chunk)."""
        with self._cond:
            self._cond.wait_for(lambda: self.sent >= self.tokens, timeout)

    def reset(self) -> None:
        self.__init__()


METER = Meter()


def timed(owner, name: str, part: str, count_token: bool = False) -> bool:
    fn = getattr(owner, name, None)
    if fn is None:
        return False

    @wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            METER.add(part, time.thread_time() - t0, METER.tokens)
            if count_token:
                METER.tokens += 1

    setattr(owner, name, wrapper)
    return True


def instrument() -> list[str]:
    """Puts the timers in place; returns what was timed (it differs between checkouts)."""
    from loopline.engine.llm_engine import LLMEngine
    from loopline.engine.output_processor import OutputProcessor
    from loopline.entrypoints.openai import serving_completion
    from loopline.runtime.client import EngineClient

    found = []
    for owner, name, part, count in ((OutputProcessor, "on_token", "engine", True), (LLMEngine, "_collect", "engine", False),
                                     (EngineClient, "_on_message", "client", False)):
        if timed(owner, name, part, count):
            found.append(f"{owner.__name__}.{name}")
    try:
        from loopline.runtime.deltas import DeltaEncoder  # the encoder of the checkouts that had one
    except ImportError:
        pass
    else:
        timed(DeltaEncoder, "encode", "engine")
        found.append("DeltaEncoder.encode")
    sse_model = serving_completion.sse_model

    def chunk(model):
        out = sse_model(model)
        METER.chunk(sum(len(c.exit_depths) for c in model.choices))  # one depth per token, in every checkout
        return out

    serving_completion.sse_model = chunk
    found.append("serving_completion.sse_model (chunk marks)")
    return found


def pipe(client) -> None:
    """Each engine message crosses a pickle round trip before the client routes it, as over the pipe;
    then the engine thread waits for its tokens to go out."""
    from loopline.runtime.core import dumps

    core = client._thread._target.__self__  # the EngineCore the client's thread runs
    route = core.emit

    def through_pipe(msg):
        t0 = time.thread_time()
        msg = pickle.loads(dumps(msg))
        METER.add("transport", time.thread_time() - t0, METER.tokens)
        route(msg)
        if msg.outputs:
            METER.wait_sent()

    core.emit = through_pipe


async def stream_once(app, max_tokens: int, logprobs: int | None) -> int:
    import httpx

    body = {"model": "m", "prompt": "def main():\n", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "max_loops": 1, "stream": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=3600) as client:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text[:300]
        chunks = [line for line in r.text.split("\n\n") if line.startswith("data: {")]
    return len(chunks)


def windows(n: int, w: int) -> dict[str, tuple[int, int]]:
    mid = n // 2
    return {"start": (0, w), "middle": (mid - w // 2, mid + w // 2), "end": (n - w, n)}


def tiny_ascii(path: Path, positions: int) -> None:
    """A one-layer tiny checkpoint whose greedy text is ASCII: the final norm keeps one hidden unit and
    the head maps it to ``"a"`` (positive) or ``" b"`` (negative), every other logit 0."""
    from safetensors.torch import load_file, save_file

    from loopline.models.loader import load_tokenizer
    from loopline.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(path, max_position_embeddings=positions, num_hidden_layers=1, num_key_value_heads=1)
    tok = load_tokenizer(str(path))
    (a,), (b,) = tok.encode("a", add_special_tokens=False), tok.encode(" b", add_special_tokens=False)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"].zero_()[0] = 1.0
    weights["lm_head.weight"].zero_()
    weights["lm_head.weight"][a, 0], weights["lm_head.weight"][b, 0] = 1.0, -1.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def demo(path: Path, positions: int) -> None:
    """The bundled demo model, its files linked, its config allowing ``positions`` positions."""
    from loopline.models.tiny import DEMO_CHECKPOINT

    for f in DEMO_CHECKPOINT.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f)
    config = json.loads((DEMO_CHECKPOINT / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], positions)
    (path / "config.json").write_text(json.dumps(config))


def measure(ns: argparse.Namespace) -> dict:
    import torch

    from loopline import AsyncLLM, EngineArgs
    from loopline.engine import LLMEngine
    from loopline.entrypoints.openai.api_server import build_app

    torch.set_num_threads(1)
    timed_parts = instrument()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        {"tiny-ascii": tiny_ascii, "demo": demo}[ns.model](path, ns.max_tokens + 64)
        args = EngineArgs(model=str(path), dtype="float32", device="cpu", max_num_seqs=1,
                          max_model_len=ns.max_tokens + 32, disable_log_stats=True)
        llm = AsyncLLM(engine=LLMEngine(args))
        pipe(llm._client)
        app = build_app(llm, "m", shutdown_engine=False)
        try:
            for _ in range(ns.repeats):
                METER.reset()
                t0 = time.perf_counter()
                chunks = asyncio.run(stream_once(app, ns.max_tokens, ns.logprobs))
                wall = time.perf_counter() - t0
                run = {"chunks": chunks, "tokens": METER.tokens, "wall_s": wall, "windows": {}}
                for name, (a, b) in windows(ns.max_tokens, ns.window).items():
                    per = {p: sum(v for t, v in METER.cost[p].items() if a <= t < b) / (b - a) * 1e6
                           for p in (*PARTS, "control")}
                    per["total"] = sum(per[p] for p in PARTS)
                    per["median token"] = statistics.median(
                        sum(METER.cost[p].get(t, 0.0) for p in PARTS) for t in range(a, b)) * 1e6
                    run["windows"][name] = per
                runs.append(run)
                print(f"  run: {chunks} chunks, {wall:.1f} s, total us/token "
                      + ", ".join(f"{k} {v['total']:.1f}" for k, v in run["windows"].items()), flush=True)
        finally:
            llm.shutdown()
    median = {w: {p: statistics.median(r["windows"][w][p] for r in runs)
                  for p in (*PARTS, "total", "median token", "control")} for w in ("start", "middle", "end")}
    best = {w: {p: min(r["windows"][w][p] for r in runs) for p in (*PARTS, "total", "median token", "control")}
            for w in ("start", "middle", "end")}
    return {"timed": timed_parts, "runs": runs, "median": median, "best": best}


def _commit() -> str:
    import loopline

    root = Path(loopline.__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "loopline"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["tiny-ascii", "demo"], default="tiny-ascii")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--logprobs", type=int, default=None, help="ask for the top K logprobs of every token")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the numbers here")
    ns = p.parse_args()
    if ns.window * 3 > ns.max_tokens:
        p.error("--window must be at most a third of --max-tokens")
    import loopline

    where = Path(loopline.__file__).resolve().parents[1]
    print(f"loopline at {where}, commit {_commit()}; {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    result = measure(ns)
    print("timed: " + ", ".join(result["timed"]))
    med = result["median"]
    print(f"host us per token (median of {ns.repeats}), windows of {ns.window} tokens:")
    print(f"  {'part':<13}" + "".join(f"{w:>10}" for w in med) + f"{'end/start':>11}")
    for part in (*PARTS, "total", "median token", "control"):
        row = [med[w][part] for w in med]
        ratio = row[-1] / row[0] if row[0] else float("nan")
        print(f"  {part:<13}" + "".join(f"{v:>10.1f}" for v in row) + f"{ratio:>11.2f}")
    best = result["best"]
    print(f"  best of {ns.repeats} (noise on a shared host only adds):")
    for part in ("total", "median token", "control"):
        row = [best[w][part] for w in best]
        print(f"  {part:<13}" + "".join(f"{v:>10.1f}" for v in row) + f"{row[-1] / row[0]:>11.2f}")
    growth = [r["windows"]["end"]["total"] / r["windows"]["start"]["total"]
              / (r["windows"]["end"]["control"] / r["windows"]["start"]["control"]) for r in result["runs"]]
    print(f"  total end/start over the control's end/start, per run: {', '.join(f'{g:.2f}' for g in growth)}"
          f" (median {statistics.median(growth):.2f})")
    if ns.json:
        result.update(commit=_commit(), loopline=str(where), args=vars(ns), python=platform.python_version(),
                      machine=platform.machine())
        Path(ns.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
