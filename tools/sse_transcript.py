"""The exact bytes the HTTP server answers to a fixed set of generation requests, to compare two checkouts.

    python tools/sse_transcript.py --out /tmp/new.json [--layout single|dp|pd]
    python tools/sse_transcript.py --compare /tmp/old.json /tmp/new.json

Serves a tiny checkpoint (written to a temporary folder; the same bytes in every checkout) on the
CPU, in engine processes as ``loopline serve`` does (``--layout dp``: two data-parallel replicas;
``pd``: one prefill and one decode worker), and sends it, one at a time, completions, chat and
``/generate`` requests, streamed and not: greedy and seeded, ``n > 1``, logprobs, ``echo`` (with
``max_tokens=0`` too), stop strings (short, long enough to hold text back, kept in the output),
usage in the stream, token ids. Every body is stored as bytes after replacing what differs from
run to run (response ids, ``created``, ``e2e_latency``). Run it in each checkout (``PYTHONPATH``
at that checkout) and ``--compare`` the files: it prints the first differing request of each
kind, or that all are identical.

NOTE: a stream's chunking depends on timing (a reader that falls behind gets one chunk for
several engine steps); requests run one at a time so that this stays rare, and a differing
chunking with equal concatenated content is reported as such.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile

COMPLETIONS = [
    dict(prompt="Once upon a time", max_tokens=24, temperature=0, ignore_eos=True),
    dict(prompt="The river town woke slowly.", max_tokens=16, temperature=1.0, seed=7, n=2, ignore_eos=True),
    dict(prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
    dict(prompt="A list of numbers: 1, 2,", max_tokens=10, temperature=0, logprobs=1, echo=True, ignore_eos=True),
    dict(prompt="A list of numbers: 1, 2,", max_tokens=0, logprobs=1, echo=True),
    dict(prompt="Once upon a time", max_tokens=40, temperature=1.0, seed=5, stop=["e", "th"], ignore_eos=True),
    dict(prompt="Once upon a time", max_tokens=40, temperature=1.0, seed=5, stop=["the time", "zzzzzzzz"],
         include_stop_str_in_output=True, ignore_eos=True),
    dict(prompt="Once upon a time", max_tokens=30, temperature=0, stop=["\x00" * 9], ignore_eos=True),
    dict(prompt=["Once upon", "The cat sat"], max_tokens=8, temperature=0.8, seed=3, n=2, logprobs=1,
         return_token_ids=True, ignore_eos=True, stream_options={"include_usage": True}),
]
CHATS = [
    dict(messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20, temperature=0, ignore_eos=True),
    dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=1.0, seed=9, n=2, logprobs=True,
         top_logprobs=2, ignore_eos=True, return_token_ids=True, stream_options={"include_usage": True}),
    dict(messages=[{"role": "user", "content": "Count"}], max_tokens=30, temperature=1.0, seed=2, stop=["e ", "an"],
         ignore_eos=True),
]
GENERATES = [
    dict(text="Once upon a time", sampling_params=dict(max_new_tokens=12, temperature=0, ignore_eos=True)),
    dict(input_ids=[[5, 17, 42], [9, 8, 7, 6]], return_logprob=True, top_logprobs_num=2, rid=["g-a", "g-b"],
         sampling_params=dict(max_new_tokens=8, temperature=1.0, seed=4, n=2, ignore_eos=True)),
]
_VOLATILE = [(re.compile(rb'"(cmpl|chatcmpl|gen)-[0-9a-f]{32}(-\d+)?'), rb'"\1-ID\2'),
             (re.compile(rb'"created":\d+'), rb'"created":0'),
             (re.compile(rb'"e2e_latency":[-0-9.e]+'), rb'"e2e_latency":0')]


def _requests(layout: str) -> list[tuple[str, dict]]:
    out = []
    for route, bodies in (("/v1/completions", COMPLETIONS), ("/v1/chat/completions", CHATS), ("/generate", GENERATES)):
        for body in bodies:
            if layout == "pd" and (body.get("n", 1) > 1 or body.get("sampling_params", {}).get("n", 1) > 1):
                continue  # prefill/decode disaggregation refuses n > 1
            for stream in (False, True):
                b = {**body, "stream": stream}
                if not stream:
                    b.pop("stream_options", None)
                out.append((route, b))
    return out


async def _run(llm, layout: str) -> list[dict]:
    import httpx

    from loopline.entrypoints.openai.api_server import build_app

    app = build_app(llm, "m", shutdown_engine=False, enable_rl_api=True)
    transcript = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as client:
        for route, body in _requests(layout):
            r = await client.post(route, json={"model": "m", **body} if route != "/generate" else body)
            data = r.content
            for pattern, repl in _VOLATILE:
                data = pattern.sub(repl, data)
            transcript.append({"route": route, "request": body, "status": r.status_code,
                               "body": data.decode("utf-8")})
    return transcript


def record(out: str, layout: str) -> None:
    from loopline import AsyncLLM, EngineArgs
    from loopline.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(tmp)
        extra = {"single": {}, "dp": {"data_parallel_size": 2},
                 "pd": {"prefill_workers": 1, "decode_workers": 1, "max_num_batched_tokens": 8, "block_size": 4}}[layout]
        args = dict(model=str(path), dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=256,
                    max_model_len=256)
        llm = AsyncLLM(EngineArgs(**{**args, **extra}))
        try:
            transcript = asyncio.run(_run(llm, layout))
        finally:
            llm.shutdown()
    with open(out, "w") as f:
        json.dump(transcript, f, indent=1, ensure_ascii=False)
    print(f"{len(transcript)} responses -> {out}")


def _content(body: str) -> str:
    """A stream's chunks merged (text and token lists concatenated per choice): equal for two chunkings."""
    merged: dict = {}
    for line in body.split("\n\n"):
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        for c in chunk.get("choices", []):
            slot = merged.setdefault((c.get("index"),), {})
            for k, v in c.items():
                if isinstance(v, (str, list)) and k != "index":
                    slot[k] = slot.get(k, type(v)()) + v
                elif isinstance(v, dict):  # a chat delta, chat logprobs: merged field by field
                    sub = slot.setdefault(k, {})
                    for kk, vv in v.items():
                        if isinstance(vv, (str, list)):
                            sub[kk] = sub.get(kk, type(vv)()) + vv
                        elif vv is not None:
                            sub[kk] = vv
                elif v is not None:
                    slot[k] = v
    return json.dumps(sorted((list(k), v) for k, v in merged.items()), sort_keys=True)


def compare(a: str, b: str) -> int:
    with open(a) as f:
        left = json.load(f)
    with open(b) as f:
        right = json.load(f)
    if [(x["route"], x["request"]) for x in left] != [(x["route"], x["request"]) for x in right]:
        print("the two transcripts hold different requests")
        return 2
    same = rechunked = 0
    for x, y in zip(left, right):
        if (x["status"], x["body"]) == (y["status"], y["body"]):
            same += 1
        elif x["request"].get("stream") and x["status"] == y["status"] and _content(x["body"]) == _content(y["body"]):
            rechunked += 1
            print(f"same content, other chunking: {x['route']} {json.dumps(x['request'])}")
        else:
            print(f"DIFFERENT: {x['route']} {json.dumps(x['request'])}\n  {a}: {x['body'][:600]}\n  {b}: {y['body'][:600]}")
    print(f"{same} of {len(left)} responses byte-identical, {rechunked} equal but chunked differently, "
          f"{len(left) - same - rechunked} different")
    return 0 if same + rechunked == len(left) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the transcript here")
    p.add_argument("--layout", choices=["single", "dp", "pd"], default="single")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two transcripts")
    ns = p.parse_args()
    if ns.compare:
        return compare(*ns.compare)
    if not ns.out:
        p.error("give --out or --compare")
    record(ns.out, ns.layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
