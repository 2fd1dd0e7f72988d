"""Held-out loss per loop of several trained checkpoints on one text, in nats per byte (comparable across tokenizers).

Models trained on different corpora have different tokenizers and held-out splits, so their nats/token do
not compare. This scores each model on the *same* files -- by default the standard-library held-out
split of ``CorpusSpec()`` (the bundled demo model's, which a ``demo-large`` run also holds out: a file's
split depends on its path alone and standard-library paths are not prefixed) -- and divides by bytes:

    nats/byte at loop r = (mean nats/token at loop r over the scored windows) x (tokens / bytes of the text)

Usage: python3 tools/heldout_per_byte.py [--out FILE] [--max-windows N] [--device cpu|cuda] MODEL_DIR...
(``demo`` stands for the bundled demo model.)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def score(model_dir: Path, texts: list[str], seq_len: int, max_windows: int | None, device: str, batch: int = 16) -> dict:
    from loopline.models.loader import load_model
    from loopline.train.objective import loop_outputs, per_loop_token_loss
    from loopline.train.tokenizer import encode_documents, load_trained
    from loopline.train.trainer import TokenWindows

    stream = torch.tensor(encode_documents(load_trained(model_dir), texts), dtype=torch.long)
    windows = TokenWindows(stream, seq_len, seed=0).windows
    windows = windows if max_windows is None else windows[:max_windows]
    model = load_model(model_dir, dtype=torch.float32, device=device).eval()
    sums, count = None, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch):
            w = windows[start:start + batch].to(device)
            loss = per_loop_token_loss(model, loop_outputs(model, w[:, :-1]).hidden, w[:, 1:]).double()  # [R, B, T]
            sums = loss.sum((1, 2)) if sums is None else sums + loss.sum((1, 2))
            count += loss[0].numel()
    text_bytes = sum(len(t.encode("utf-8")) for t in texts) + len(texts)  # + one <|endoftext|> per document
    tokens_per_byte = stream.numel() / text_bytes
    per_token = [float(s) / count for s in sums]
    return {"model": str(model_dir), "stream_tokens": stream.numel(), "scored_tokens": count,
            "tokens_per_byte": tokens_per_byte, "loop_nats_per_token": per_token,
            "loop_nats_per_byte": [x * tokens_per_byte for x in per_token]}


def main() -> None:
    from loopline.models.tiny import default_checkpoint
    from loopline.train.corpus import CorpusSpec, split

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per scored window")
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--max-bytes", type=int, default=None, help="the held-out text of CorpusSpec(max_bytes=...) "
                    "(default: the demo's 16 MB budget)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ns = ap.parse_args()
    spec = CorpusSpec() if ns.max_bytes is None else CorpusSpec(max_bytes=ns.max_bytes)
    _, heldout = split(spec)
    texts = [d.text for d in heldout]
    results = {"text": f"standard-library held-out split of {spec}", "files": len(texts),
               "bytes": sum(len(t.encode("utf-8")) for t in texts), "models": []}
    for m in ns.models:
        path = default_checkpoint() if m == "demo" else Path(m)
        r = score(path, texts, ns.seq_len, ns.max_windows, ns.device)
        results["models"].append(r)
        print(json.dumps({"model": m, "nats_per_byte": [round(x, 4) for x in r["loop_nats_per_byte"]],
                          "nats_per_token": [round(x, 4) for x in r["loop_nats_per_token"]],
                          "tokens_per_byte": round(r["tokens_per_byte"], 4)}), flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
