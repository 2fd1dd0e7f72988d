"""Lookahead exits (issue #44): predict after loop ``n`` whether a token may exit at loop ``n + 2``.

Three parts, all on the dense model (plain PyTorch, teacher-forced text; no engine):

* :func:`collect_traces` runs the frozen model over token windows and streams, for every position and
  every loop, the features a predictor may read and the labels deeper loops give, to safetensors shards
  (format in docs/lookahead.md). Memory is bounded by one batch of windows.
* :class:`LookaheadHead` is the predictor: a two-layer MLP over one loop's features. :func:`train_head`
  fits it on training-split traces and picks its default threshold on a separate calibration part of the
  training split; the held-out split is only ever evaluated.
* :func:`lookahead_depths` is the policy on traces: the first loop ``n`` (from loop 0, the embedding)
  whose prediction clears the threshold fixes the exit at ``n + 2``; otherwise the token runs every loop.

Label: loop ``n + 2``'s greedy token equals the full-depth greedy token (``agree``). Loop 0 is the
embedding: its gate logit and exit probability are 0 and its change is 0, so exits at loop 2 can be decided
before any loop runs. An exit at loop 1 cannot be announced two loops ahead, so the policy's least depth is 2.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from loopline.errors import InvalidRequestError
from loopline.models.lookahead_head import (
    DISTANCE,
    HEAD_CONFIG,
    HEAD_FILE,
    HeadConfig,
    LookaheadHead,
    TraceSpec,
    load_head,
    projection,
    save_head,
)

__all__ = ["DISTANCE", "TraceSpec", "collect_traces", "load_traces", "features", "LookaheadHead", "train_head",
           "lookahead_depths", "stock_depths", "policy_point", "save_head", "load_head", "HEAD_FILE", "HEAD_CONFIG", "lookahead_generate", "head_decider"]

TRACE_FORMAT = "loopline-lookahead-traces/1"
DEFAULT_SPEC = TraceSpec()


def _windows(stream: Sequence[int], seq_len: int, max_windows: int | None) -> Tensor:
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise InvalidRequestError(f"the token stream ({len(stream)} tokens) is shorter than seq_len + 1 = {seq_len + 1}")
    # seq_len + 1 tokens each, consecutive windows sharing one token (the training evaluation's packing)
    w = torch.as_tensor(list(stream[: n * seq_len + 1]), dtype=torch.long).unfold(0, seq_len + 1, seq_len)
    return w if max_windows is None else w[:max_windows]


@torch.no_grad()
def _trace_batch(model, ids: Tensor, targets: Tensor, proj: Tensor) -> dict[str, Tensor]:
    """Per position (rows ``B * T``): embedding and per-loop projections, gate logits, losses, greedy tokens."""
    from loopline.models.ouro import TORCH_OPS, DenseCausalAttention

    b, t = ids.shape
    positions = torch.arange(t).repeat(b)
    h = model.embed(ids.reshape(-1))
    emb = h.float()
    hiddens, gates, losses, greedy = [], [], [], []
    for _ in range(model.config.total_ut_steps):
        h, g = model.loop(h, positions, DenseCausalAttention(b, t), TORCH_OPS)
        logits = model.lm_head(h).float()
        hiddens.append(h.float() @ proj)
        gates.append(g.float())
        losses.append(nn.functional.cross_entropy(logits, targets.reshape(-1), reduction="none"))
        greedy.append(logits.argmax(-1).to(torch.int32))
    return {"positions": positions.to(torch.int32), "embed_proj": emb @ proj, "hidden_proj": torch.stack(hiddens, 1),
            "gate_logits": torch.stack(gates, 1), "loop_loss": torch.stack(losses, 1),
            "greedy": torch.stack(greedy, 1), "targets": targets.reshape(-1).to(torch.int32)}


def collect_traces(model_dir: str | Path, stream: Sequence[int], out_dir: str | Path, *, spec: TraceSpec = DEFAULT_SPEC,
                   max_windows: int | None = None, batch: int = 8, split: str = "") -> dict:
    """Writes ``shard-NNNNN.safetensors`` (one per ``batch`` windows) and ``meta.json`` to ``out_dir``.

    Returns the meta dict. Shard tensors, ``N`` positions, ``R`` loops, ``K = spec.proj_dim``: ``positions [N]``,
    ``embed_proj [N, K]``, ``hidden_proj [N, R, K]``, ``gate_logits [N, R]``, ``loop_loss [N, R]`` (next-token
    cross-entropy of loop r's logits), ``greedy [N, R]`` (loop r's argmax token), ``targets [N]``.
    """
    from safetensors.torch import save_file

    from loopline.models.loader import load_model

    model = load_model(model_dir, dtype=torch.float32, device="cpu").eval()
    proj = projection(model.config.hidden_size, spec)
    windows = _windows(stream, spec.seq_len, max_windows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, start in enumerate(range(0, len(windows), batch)):
        w = windows[start:start + batch]
        name = f"shard-{i:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in _trace_batch(model, w[:, :-1], w[:, 1:], proj).items()}, str(out / name))
        shards.append({"file": name, "positions": int(w[:, :-1].numel())})
    meta = {"format": TRACE_FORMAT, "spec": asdict(spec), "loops": model.config.total_ut_steps,
            "hidden_size": model.config.hidden_size, "split": split, "windows": len(windows), "shards": shards}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return meta


def load_traces(trace_dir: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """``(meta, tensors)`` of a trace directory, shards concatenated along positions."""
    from safetensors.torch import load_file

    d = Path(trace_dir)
    meta_file = d / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} does not exist (a directory written by collect_traces)")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    if meta.get("format") != TRACE_FORMAT:
        raise InvalidRequestError(f"{meta_file}: format {meta.get('format')!r}; allowed: {TRACE_FORMAT!r}")
    parts = [load_file(str(d / s["file"])) for s in meta["shards"]]
    return meta, {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def features(tr: dict[str, Tensor], loop: int, loops: int, max_position: int) -> Tensor:
    """``[N, F]`` features at loop ``loop`` (0 = the embedding): gate logit, exit probability F, projected
    hidden state and its change from the previous loop, log-position, one-hot loop index (0..loops-1)."""
    n = tr["positions"].shape[0]
    if loop == 0:
        gate = torch.zeros(n)
        cdf = torch.zeros(n)
        h = tr["embed_proj"]
        delta = torch.zeros_like(h)
    else:
        g = tr["gate_logits"][:, :loop]
        gate = g[:, -1]
        cdf = 1.0 - torch.prod(1.0 - torch.sigmoid(g), 1)
        h = tr["hidden_proj"][:, loop - 1]
        prev = tr["embed_proj"] if loop == 1 else tr["hidden_proj"][:, loop - 2]
        delta = h - prev
    pos = torch.log1p(tr["positions"].float()) / math.log1p(max_position)
    onehot = nn.functional.one_hot(torch.full((n,), loop), loops).float()
    return torch.cat([gate[:, None], cdf[:, None], h, delta, pos[:, None], onehot], 1)


def agree(tr: dict[str, Tensor]) -> Tensor:
    """``[N, R]`` bool: loop r's greedy token equals the last loop's."""
    return tr["greedy"] == tr["greedy"][:, -1:]


def decision_loops(loops: int) -> range:
    """Loops whose prediction can fix an exit earlier than the last loop: 0 .. loops - DISTANCE - 1."""
    return range(0, loops - DISTANCE)


def predictions(head: LookaheadHead, tr: dict[str, Tensor], loops: int, max_position: int) -> Tensor:
    """``[N, loops - DISTANCE]`` probabilities, column ``n``: the head after loop ``n`` about loop ``n + 2``."""
    with torch.no_grad():
        cols = [torch.sigmoid(head(features(tr, n, loops, max_position))) for n in decision_loops(loops)]
    return torch.stack(cols, 1) if cols else torch.zeros(tr["positions"].shape[0], 0)


def lookahead_depths(probs: Tensor, threshold: float, loops: int) -> Tensor:
    """1-based depths ``[N]``: ``n + DISTANCE`` for the first column ``n`` of ``probs`` >= ``threshold``, else ``loops``."""
    fire = torch.cat([probs >= threshold, torch.ones(probs.shape[0], 1, dtype=torch.bool)], 1)
    return fire.float().argmax(1) + DISTANCE


def stock_depths(tr: dict[str, Tensor], threshold: float, min_loops: int = 1) -> Tensor:
    """The stock gate's depths ``[N]`` (the engine's rule, ``loopline.train.trainer.exit_depths``)."""
    from loopline.train.trainer import exit_depths

    return exit_depths(tr["gate_logits"].T, threshold, min_loops)


def policy_point(tr: dict[str, Tensor], depths: Tensor) -> dict:
    """Mean depth, mean next-token loss at the chosen depths, and how often the exit token differs from full depth."""
    idx = (depths - 1).long()[:, None]
    loss = tr["loop_loss"].gather(1, idx)[:, 0]
    wrong = ~agree(tr).gather(1, idx)[:, 0]
    early = depths < tr["loop_loss"].shape[1]
    return {"mean_depth": depths.float().mean().item(), "loss": loss.mean().item(), "tokens": int(depths.numel()),
            "early_exits": int(early.sum()), "wrong_exits": int((wrong & early).sum()),
            "wrong_exit_rate": (wrong & early).float().sum().item() / max(int(early.sum()), 1)}


def _examples(tr: dict[str, Tensor], loops: int, max_position: int) -> tuple[Tensor, Tensor]:
    ok = agree(tr)
    xs = [features(tr, n, loops, max_position) for n in decision_loops(loops)]
    ys = [ok[:, n + DISTANCE - 1].float() for n in decision_loops(loops)]
    return torch.cat(xs), torch.cat(ys)


def train_head(train: dict[str, Tensor], calib: dict[str, Tensor], loops: int, spec: TraceSpec, *,
               hidden: int = 64, epochs: int = 30, lr: float = 3e-3, batch: int = 1024, seed: int = 0,
               tolerance: float = 0.05, thresholds: Sequence[float] = (0.5, 0.7, 0.8, 0.85, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995)
               ) -> tuple[LookaheadHead, HeadConfig]:
    """Fits the head (binary cross-entropy) on ``train`` and picks its threshold on ``calib``: the one of least
    mean depth whose loss is within ``tolerance`` nats of full depth (the most conservative threshold when none is)."""
    if loops <= DISTANCE:
        raise InvalidRequestError(f"the model runs {loops} loops; lookahead needs more than {DISTANCE}")
    torch.manual_seed(seed)
    x, y = _examples(train, loops, spec.max_position)
    head = LookaheadHead(x.shape[1], hidden)
    head.mean.copy_(x.mean(0))
    head.std.copy_(x.std(0).clamp_min(1e-4))
    with torch.no_grad():  # start from the base rate, so any step away from it is learned from the features
        rate = y.mean().clamp(1e-3, 1 - 1e-3)
        head.net[-1].bias.fill_(math.log(rate / (1 - rate)))
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(batch):
            loss = nn.functional.binary_cross_entropy_with_logits(head(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    head.eval()
    probs = predictions(head, calib, loops, spec.max_position)
    full = policy_point(calib, torch.full((calib["positions"].shape[0],), loops))["loss"]
    points = [{"threshold": q, **policy_point(calib, lookahead_depths(probs, q, loops))} for q in thresholds]
    ok = [p for p in points if p["loss"] <= full + tolerance]
    chosen = min(ok, key=lambda p: (p["mean_depth"], -p["threshold"]))["threshold"] if ok else max(thresholds)
    xc, yc = _examples(calib, loops, spec.max_position)
    with torch.no_grad():
        calib_bce = nn.functional.binary_cross_entropy_with_logits(head(xc), yc).item()
    metrics = {"train_examples": len(y), "calib_examples": len(yc), "calib_bce": calib_bce,
               "calib_positive_rate": yc.mean().item(), "calib_full_depth_loss": full, "calib_curve": points,
               "parameters": sum(p.numel() for p in head.net.parameters())}
    return head, HeadConfig(threshold=chosen, loops=loops, hidden=hidden, spec=asdict(spec), metrics=metrics)


def split_stream(model_dir: str | Path, which: str, min_tokens: int, corpus=None) -> list[int]:
    """The first ``min_tokens`` (or more) tokens of the model's ``"train"`` or ``"heldout"`` split, documents in
    corpus order joined as in training (the held-out prefix equals ``engine_eval.heldout_stream``'s)."""
    from loopline.train.corpus import CorpusSpec, split
    from loopline.train.tokenizer import encode_documents, load_trained

    if which not in ("train", "heldout"):
        raise InvalidRequestError(f"split {which!r}; allowed: 'train', 'heldout'")
    if corpus is None:
        info = Path(model_dir) / "training_info.json"
        corpus = CorpusSpec(**(json.loads(info.read_text(encoding="utf-8"))["corpus"]["spec"] if info.is_file() else {}))
    docs = split(corpus)[0 if which == "train" else 1]
    tok = load_trained(model_dir)
    stream: list[int] = []
    for chunk in _chunks(docs, 64):
        stream.extend(encode_documents(tok, [d.text for d in chunk]))
        if len(stream) >= min_tokens:
            break
    return stream


def _chunks(items: list, n: int) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


STOCK_THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LOOKAHEAD_THRESHOLDS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995)


def evaluate(head: LookaheadHead, config: HeadConfig, tr: dict[str, Tensor],
             stock_thresholds: Sequence[float] = STOCK_THRESHOLDS,
             lookahead_thresholds: Sequence[float] = LOOKAHEAD_THRESHOLDS) -> dict:
    """Held-out points: the stock gate (min_loops 1, and 2 = the lookahead's least depth), the stock gate
    delayed by two loops (its decision after loop n taken as the exit at n + 2) and the lookahead head."""
    loops = config.loops
    probs = predictions(head, tr, loops, config.spec["max_position"])
    return {
        "stock": [{"threshold": q, **policy_point(tr, stock_depths(tr, q))} for q in stock_thresholds],
        "stock_min2": [{"threshold": q, **policy_point(tr, stock_depths(tr, q, min_loops=2))} for q in stock_thresholds],
        # the no-training lookahead: the stock gate firing after loop n fixes the exit at n + 2
        "stock_delayed": [{"threshold": q, **policy_point(tr, (stock_depths(tr, q) + DISTANCE).clamp_max(loops))}
                          for q in stock_thresholds],
        "lookahead": [{"threshold": q, **policy_point(tr, lookahead_depths(probs, q, loops))} for q in lookahead_thresholds],
        "lookahead_chosen": {"threshold": config.threshold,
                             **policy_point(tr, lookahead_depths(probs, config.threshold, loops))},
    }


def run(model_dir: str | Path, out_dir: str | Path, traces_dir: str | Path, *, seq_len: int = 256,
        train_windows: int = 96, calib_windows: int = 32, heldout_windows: int = 64, epochs: int = 30,
        hidden: int = 64, seed: int = 0, log=print) -> dict:
    """The whole recipe (``loopline train lookahead``): traces of the training split (fit + calibration parts,
    disjoint windows) and of the held-out split, the head, its held-out evaluation; saves the head in ``out_dir``."""
    import time

    for name, value in (("train_windows", train_windows), ("calib_windows", calib_windows),
                        ("heldout_windows", heldout_windows)):
        if value < 1:
            raise InvalidRequestError(f"{name}={value}; allowed: >= 1")
    spec = TraceSpec(seq_len=seq_len)
    traces = Path(traces_dir)
    t0 = time.perf_counter()
    stream = split_stream(model_dir, "train", (train_windows + calib_windows) * seq_len + 1)
    cut = train_windows * seq_len + 1  # the calibration windows start after the fitting windows' last token
    collect_traces(model_dir, stream[:cut], traces / "train", spec=spec, split="train (fit)")
    collect_traces(model_dir, stream[cut - 1:], traces / "calib", spec=spec, max_windows=calib_windows,
                   split="train (calibration)")
    held_stream = split_stream(model_dir, "heldout", heldout_windows * seq_len + 1)
    collect_traces(model_dir, held_stream, traces / "heldout", spec=spec, max_windows=heldout_windows, split="heldout")
    log(json.dumps({"traces_s": round(time.perf_counter() - t0, 1), "traces": str(traces)}))
    meta, train = load_traces(traces / "train")
    _, calib = load_traces(traces / "calib")
    _, held = load_traces(traces / "heldout")
    t1 = time.perf_counter()
    head, config = train_head(train, calib, meta["loops"], spec, hidden=hidden, epochs=epochs, seed=seed)
    config.hidden_size = meta["hidden_size"]
    config.metrics["train_s"] = round(time.perf_counter() - t1, 1)
    save_head(head, config, out_dir)
    result = {"out": str(out_dir), "threshold": config.threshold, "parameters": config.metrics["parameters"],
              "train_s": config.metrics["train_s"], "heldout_positions": int(held["positions"].shape[0]),
              "heldout": evaluate(head, config, held)}
    log(json.dumps(result))
    return result


Decide = Callable[[int, int, dict], bool]  # (token index, loop n, the row's trace so far) -> exit at n + 2?


@torch.no_grad()
def lookahead_generate(model, prompt_ids: Sequence[int], max_tokens: int, decide: Decide, *,
                       spec: TraceSpec = DEFAULT_SPEC):
    """Greedy generation on the plain path (:mod:`loopline.models.plain`) with the lookahead policy: after loop
    ``n`` (0: the embedding) ``decide`` may fix the token's exit at loop ``n + 2``; otherwise it runs every loop.

    ``decide`` reads a one-row trace of the token (``positions``, ``embed_proj``, ``hidden_proj`` and
    ``gate_logits`` of loops ``1..n``), the input :func:`features` takes. Ouro checkpoints only (the plain
    path's exit KV semantics: an exited token's deeper planes hold its exit loop's K/V). Returns a
    :class:`~loopline.models.plain.PlainOutput`.
    """
    from loopline.models.family import family_of
    from loopline.models.plain import (  # the plain path's KV planes, reused as they are
        _Sequence,
        greedy_emit,
    )

    family, loops = family_of(model), model.config.total_ut_steps
    if max_tokens < 1 or not prompt_ids:
        raise InvalidRequestError(f"max_tokens={max_tokens}, {len(prompt_ids)} prompt tokens; allowed: >= 1 each")
    seq = _Sequence(model, family, len(prompt_ids) + max_tokens, loops, seed=0)
    proj = projection(model.config.hidden_size, spec).to(seq.device)
    ids = torch.tensor(list(prompt_ids), device=seq.device)
    e, state, pos = seq.prelude(ids, 0)
    states, gates = [], []
    for loop in range(1, loops + 1):  # the prompt runs every loop; its last position's exit is decided as it goes
        state, g = seq.core(state, e, pos, loop)
        states.append(state)
        gates.append(g)
    exit_loop = _choose(lambda n: decide(0, n, _row(pos[-1:], e[-1:], [s[-1:] for s in states[:n]],
                                                    [g[-1:] for g in gates[:n]], proj)), loops)
    logits = seq.coda(torch.cat([state[:-1], states[exit_loop - 1][-1:]]), pos)[-1]
    first = len(prompt_ids)  # the token at position p is the (p - first + 1)-th generated one
    return greedy_emit(logits, exit_loop, first, max_tokens, (), lambda token, position: _decode_lookahead(
        seq, token, position, position - first + 1, decide, proj, loops))


def _choose(decide_at: Callable[[int], bool], loops: int) -> int:
    """The exit loop when every loop's state is known (the prompt's last position)."""
    return next((n + DISTANCE for n in decision_loops(loops) if decide_at(n)), loops)


def _row(pos: Tensor, e: Tensor, states: list[Tensor], gates: list[Tensor], proj: Tensor) -> dict:
    """A one-row trace of loops ``1..len(states)`` (the dict :func:`features` reads)."""
    hidden = torch.stack([s.float() @ proj for s in states], 1) if states else torch.zeros(1, 0, proj.shape[1])
    gate = torch.stack([g.float() for g in gates], 1) if gates else torch.zeros(1, 0)
    return {"positions": pos.cpu(), "embed_proj": (e.float() @ proj).cpu(), "hidden_proj": hidden.cpu(),
            "gate_logits": gate.cpu()}


def _decode_lookahead(seq, token: int, position: int, index: int, decide: Decide, proj: Tensor,
                      loops: int) -> tuple[int, Tensor]:
    ids = torch.tensor([token], device=seq.device)
    e, state, pos = seq.prelude(ids, position)
    states, gates = [], []
    target = DISTANCE if decide(index, 0, _row(pos, e, [], [], proj)) else None
    for loop in range(1, loops + 1):
        state, g = seq.core(state, e, pos, loop)
        states.append(state)
        gates.append(g)
        if loop == target:
            break
        if target is None and loop in decision_loops(loops) and decide(index, loop, _row(pos, e, states, gates, proj)):
            target = loop + DISTANCE
    seq.settle(loop, position)
    return loop, seq.coda(state, pos)[0]


def head_decider(head: LookaheadHead, config: HeadConfig, threshold: float | None = None) -> Decide:
    """``decide`` for :func:`lookahead_generate` from a trained head (its calibrated threshold by default)."""
    q = config.threshold if threshold is None else threshold
    max_position = config.spec["max_position"]

    def decide(index: int, n: int, row: dict) -> bool:
        return bool(torch.sigmoid(head(features(row, n, config.loops, max_position)))[0] >= q)

    return decide
