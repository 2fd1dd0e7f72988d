"""The depth-vs-loss trade-off of a checkpoint, measured through the engine (``loopline train curve``).

For each exit threshold, the held-out token stream goes through the engine (``LLMEngine``) as prompts with
``prompt_logprobs``: the engine picks every position's depth with its own exit rule
(``RequestOutput.prompt_exit_depths``) and scores the next token from that depth's hidden state. The
loss is the mean negative log-probability of the true next token; the mean depth and the depth
histogram come from the same positions. The same windows through the dense model (fp32, the exit
rule applied to its gate values) give the training code's view for comparison.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Sequence

import torch

from loopline.train.trainer import DEFAULT_THRESHOLDS, TokenWindows, exit_depths

__all__ = ["heldout_stream", "engine_curve", "dense_curve"]


def heldout_stream(model_dir: str | Path, corpus=None) -> list[int]:
    """The held-out split (never trained on) encoded by ``model_dir``'s tokenizer, documents joined
    with ``<|endoftext|>`` as in training.

    ``corpus`` (a :class:`~loopline.train.corpus.CorpusSpec`) defaults to the one the model was trained on,
    read from its ``training_info.json`` (the default spec when there is none).
    """
    import json

    from loopline.train.corpus import CorpusSpec, split
    from loopline.train.tokenizer import encode_documents, load_trained

    if corpus is None:
        info = Path(model_dir) / "training_info.json"
        spec = json.loads(info.read_text(encoding="utf-8"))["corpus"]["spec"] if info.is_file() else {}
        corpus = CorpusSpec(**spec)
    _, heldout = split(corpus)
    return encode_documents(load_trained(model_dir), [d.text for d in heldout])


def _windows(stream: Sequence[int], seq_len: int, max_windows: int | None) -> torch.Tensor:
    """The training evaluation's ``seq_len + 1`` windows of ``stream`` (at most ``max_windows``)."""
    windows = TokenWindows(torch.as_tensor(list(stream), dtype=torch.long), seq_len, seed=0).windows
    return windows if max_windows is None else windows[:max_windows]


def _point(threshold: float, depths: list[int], nll: list[float]) -> dict:
    hist = Counter(depths)
    return {"threshold": threshold, "mean_depth": sum(depths) / len(depths), "loss": sum(nll) / len(nll),
            "tokens": len(depths), "depth_histogram": {str(d): hist[d] for d in sorted(hist)}}


def engine_curve(model_dir: str | Path, stream: Sequence[int], *, seq_len: int = 512, max_windows: int | None = None,
                 thresholds: Sequence[float] = DEFAULT_THRESHOLDS, kv_layout: str = "last_exited",
                 device: str = "cpu", dtype: str = "float32", kv_cache_dtype: str = "auto") -> list[dict]:
    """Per threshold: mean depth, held-out loss and depth histogram of ``stream`` through the engine
    (``kv_cache_dtype``: the engine option of that name, e.g. ``fp8`` to measure what FP8 KV costs)."""
    from loopline.config import EngineArgs
    from loopline.engine import LLMEngine
    from loopline.sampling_params import SamplingParams

    windows = _windows(stream, seq_len, max_windows).tolist()
    engine = LLMEngine(EngineArgs(model=str(model_dir), dtype=dtype, device=device, kv_layout=kv_layout,
                                  disable_log_stats=True, max_model_len=seq_len + 2, kv_cache_dtype=kv_cache_dtype))
    points = []
    for q in thresholds:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, exit_threshold=q, detokenize=False)
        for i, w in enumerate(windows):
            engine.add_request(f"{q}-{i}", {"prompt_token_ids": w}, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        outs = [done[f"{q}-{i}"] for i in range(len(windows))]
        depths, nll = [], []
        for w, out in zip(windows, outs):
            for pos in range(1, len(w)):
                depths.append(out.prompt_exit_depths[pos])
                nll.append(-out.prompt_logprobs[pos][w[pos]].logprob)
        points.append(_point(q, depths, nll))
    return points


@torch.no_grad()
def dense_curve(model_dir: str | Path, stream: Sequence[int], *, seq_len: int = 512, max_windows: int | None = None,
                thresholds: Sequence[float] = DEFAULT_THRESHOLDS, device: str = "cpu", batch: int = 16) -> list[dict]:
    """The same points from the dense model in fp32 (the training code's evaluation, without autocast)."""
    from loopline.models.loader import load_model
    from loopline.train.objective import loop_outputs, per_loop_token_loss

    model = load_model(model_dir, dtype=torch.float32, device=device).eval()
    windows = _windows(stream, seq_len, max_windows)
    per_q: dict[float, tuple[list[int], list[float]]] = {q: ([], []) for q in thresholds}
    for start in range(0, len(windows), batch):
        w = windows[start:start + batch].to(device)
        out = loop_outputs(model, w[:, :-1])
        loss = per_loop_token_loss(model, out.hidden, w[:, 1:])  # [R, B, T]
        for q in thresholds:
            d = exit_depths(out.gate_logits, q)  # [B, T]
            per_q[q][0].extend(d.flatten().tolist())
            per_q[q][1].extend(loss.gather(0, (d - 1)[None])[0].flatten().tolist())
    return [_point(q, *per_q[q]) for q in thresholds]
