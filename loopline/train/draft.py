"""``loopline train draft``: a draft adapter distilled from the full-depth distribution (issue #41).

The base model is frozen. :func:`collect_states` runs it over token windows (dense, teacher-forced) and
keeps every loop's hidden state; :func:`train_adapter` fits a :class:`~loopline.spec.adapter.DraftAdapter`
per draft depth ``d`` to minimise ``KL(p_R || softmax(lm_head(adapter_d(h_d))))`` (``p_R`` the last loop's
distribution) on the training split; :func:`evaluate` reports, on the held-out split (never fitted on),
the greedy agreement of the draft with the full-depth token and the overlap ``sum(min(p_d, p_R))`` per
depth, with and without the adapter. Each depth keeps the epoch of least KL on calibration windows of
the training split (epoch 0, the plain coda, when fitting does not carry over). :func:`run` is the whole
recipe; the adapter is saved beside the model (``loopline.spec.adapter``'s format, with the base
weights' hash).

Memory is bounded by the windows kept: ``windows * seq_len * loops * hidden`` fp32 hidden states (the
default recipe on the bundled model: 160 windows of 256 tokens, 160 MiB); logits exist one batch at a time.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from loopline.errors import InvalidRequestError
from loopline.spec.adapter import (
    AdapterConfig,
    DraftAdapter,
    base_weights_sha256,
    save_adapter,
)

__all__ = ["collect_states", "evaluate", "run", "train_adapter"]


@torch.no_grad()
def collect_states(model: nn.Module, stream: Sequence[int], seq_len: int, windows: int, batch: int = 8) -> Tensor:
    """``[N, R, H]`` fp32 hidden states of every loop (post-norm ``h_r``) at every position of the first
    ``windows`` non-overlapping windows of ``seq_len`` tokens of ``stream``."""
    n = min(windows, len(stream) // seq_len)
    if n < 1:
        raise InvalidRequestError(f"the token stream ({len(stream)} tokens) is shorter than seq_len = {seq_len}")
    ids = torch.as_tensor(list(stream[:n * seq_len]), dtype=torch.long).view(n, seq_len)
    out = []
    for start in range(0, n, batch):
        h = model.forward_dense(ids[start:start + batch], compute_logits=False).hidden_states  # [R, B, T, H]
        out.append(h.float().permute(1, 2, 0, 3).reshape(-1, h.shape[0], h.shape[-1]))
    return torch.cat(out)


def _kl(target_logp: Tensor, draft_logits: Tensor) -> Tensor:
    """Mean ``KL(p || q)`` over rows from the target's log-probabilities and the draft's logits."""
    logq = torch.log_softmax(draft_logits, -1)
    return (target_logp.exp() * (target_logp - logq)).sum(-1).mean()


def train_adapter(states: Tensor, lm_head: nn.Linear, depths: Sequence[int], *, calib: Tensor | None = None,
                  rank: int = 32, epochs: int = 6, lr: float = 1e-3, batch: int = 1024, seed: int = 0,
                  log: Callable[[dict], None] | None = None) -> tuple[DraftAdapter, list[dict]]:
    """Fits one adapter per depth on ``states`` (``[N, R, H]``, :func:`collect_states`) by KL to the last
    loop; ``lm_head`` stays frozen. Seeded: the same inputs give the same adapter.

    ``calib`` (states of other training-split windows): each depth keeps the epoch (0: the identity, the
    plain coda) of least KL there, so a depth whose adapter only fits the fitting windows stays the plain
    coda. Returns the adapter and the per-epoch curve (training KL, calibration KL per depth)."""
    torch.manual_seed(seed)
    hidden = states.shape[-1]
    adapter = DraftAdapter(hidden, rank, list(depths))
    head = lm_head.float().requires_grad_(False)
    opt = torch.optim.Adam(adapter.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    curve = [{"epoch": 0, **_calib_kl(calib, head, adapter)}]
    best = {d: (curve[0].get(f"calib_kl_d{d}", 0.0), _snapshot(adapter, d)) for d in adapter.depths}
    for epoch in range(1, epochs + 1):
        total, count = 0.0, 0
        for idx in torch.randperm(states.shape[0], generator=g).split(batch):
            h = states[idx]
            with torch.no_grad():
                target = torch.log_softmax(head(h[:, -1]), -1)
            loss = sum(_kl(target, head(adapter(h[:, d - 1], d))) for d in adapter.depths) / len(adapter.depths)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, count = total + float(loss.detach()) * len(idx), count + len(idx)
        point = {"epoch": epoch, "train_kl": round(total / count, 5), **_calib_kl(calib, head, adapter)}
        curve.append(point)
        if log is not None:
            log(point)
        for d in adapter.depths:
            if calib is None or point[f"calib_kl_d{d}"] < best[d][0]:
                best[d] = (point.get(f"calib_kl_d{d}", 0.0), _snapshot(adapter, d))
    with torch.no_grad():
        for d, (_, params) in best.items():
            for name, value in params.items():
                getattr(adapter, name)[str(d)].copy_(value)
    return adapter.eval().requires_grad_(False), curve


def _snapshot(adapter: DraftAdapter, d: int) -> dict[str, Tensor]:
    return {name: getattr(adapter, name)[str(d)].detach().clone() for name in ("scale", "down", "up")}


@torch.no_grad()
def _calib_kl(calib: Tensor | None, head: nn.Linear, adapter: DraftAdapter, batch: int = 2048) -> dict[str, float]:
    if calib is None:
        return {}
    sums = dict.fromkeys(adapter.depths, 0.0)
    for h in calib.split(batch):
        target = torch.log_softmax(head(h[:, -1]), -1)
        for d in adapter.depths:
            sums[d] += float(_kl(target, head(adapter(h[:, d - 1], d)))) * h.shape[0]
    return {f"calib_kl_d{d}": round(v / calib.shape[0], 5) for d, v in sums.items()}


@torch.no_grad()
def evaluate(states: Tensor, lm_head: nn.Linear, adapter: DraftAdapter | None, depths: Sequence[int],
             batch: int = 2048) -> dict[str, dict]:
    """Per depth on ``states``: greedy agreement with the last loop's token (``match``), the overlap
    ``sum(min(p_d, p_R))`` at T=1 and T=0.5 and ``KL(p_R || p_d)``, without (``plain``) and with
    (``adapter``) the adapter when given."""
    head = lm_head.float()
    sums: dict[str, dict[int, dict[str, float]]] = {}
    variants = {"plain": None} | ({"adapter": adapter} if adapter is not None else {})
    for name, a in variants.items():
        sums[name] = {d: {"match": 0.0, "overlap_t1": 0.0, "overlap_t05": 0.0, "kl": 0.0} for d in depths}
        for h in states.split(batch):
            target = head(h[:, -1])
            for d in depths:
                draft = head(h[:, d - 1] if a is None else a(h[:, d - 1], d))
                s = sums[name][d]
                s["match"] += float((draft.argmax(-1) == target.argmax(-1)).sum())
                for key, t in (("overlap_t1", 1.0), ("overlap_t05", 0.5)):
                    s[key] += float(torch.minimum(torch.softmax(target / t, -1), torch.softmax(draft / t, -1)).sum())
                s["kl"] += float(_kl(torch.log_softmax(target, -1), draft)) * h.shape[0]
    n = states.shape[0]
    return {name: {str(d): {k: round(v / n, 4) for k, v in s.items()} for d, s in per.items()}
            for name, per in sums.items()} | {"positions": n}


def run(model_dir: str | Path, out_dir: str | Path, *, depths: Sequence[int] | None = None, rank: int = 16,
        seq_len: int = 256, train_windows: int = 96, calib_windows: int = 32, heldout_windows: int = 32,
        epochs: int = 4, lr: float = 1e-3, batch: int = 1024, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """The recipe: hidden states of the training split's first ``train_windows`` windows (fitting), of its
    next ``calib_windows`` (each depth's stopping epoch) and of the held-out split's first
    ``heldout_windows``; the adapter fitted and stopped on the former two, evaluated on the held-out
    windows with and without it; saved as ``draft_adapter.safetensors`` + ``draft_adapter.json`` in ``out_dir``."""
    from loopline.models.loader import load_model
    from loopline.train.lookahead import split_stream

    for name, value in (("train_windows", train_windows), ("calib_windows", calib_windows),
                        ("heldout_windows", heldout_windows), ("epochs", epochs), ("seq_len", seq_len), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name}={value!r}; allowed: an integer >= 1", param=name)
    model_dir = Path(model_dir)
    model = load_model(model_dir, dtype=torch.float32, device="cpu").eval().requires_grad_(False)
    loops, hidden = model.config.total_ut_steps, model.config.hidden_size
    depths = list(range(1, loops)) if depths is None else sorted(set(depths))
    if not depths or any(not 1 <= d < loops for d in depths):
        raise InvalidRequestError(f"depths={list(depths)}; allowed: draft depths in 1..{loops - 1}", param="depths")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= hidden:
        raise InvalidRequestError(f"rank={rank!r}; allowed: an integer in 1..{hidden}", param="rank")
    t0 = time.perf_counter()
    stream = split_stream(model_dir, "train", (train_windows + calib_windows) * seq_len)
    cut = train_windows * seq_len
    train = collect_states(model, stream[:cut], seq_len, train_windows)
    calib = collect_states(model, stream[cut:], seq_len, calib_windows)
    held = collect_states(model, split_stream(model_dir, "heldout", heldout_windows * seq_len), seq_len, heldout_windows)
    log(json.dumps({"states_s": round(time.perf_counter() - t0, 1), "train_positions": train.shape[0],
                    "calib_positions": calib.shape[0], "heldout_positions": held.shape[0]}))
    t1 = time.perf_counter()
    adapter, curve = train_adapter(train, model.lm_head, depths, calib=calib, rank=rank, epochs=epochs, lr=lr,
                                   batch=batch, seed=seed, log=lambda r: log(json.dumps(r)))
    train_s = round(time.perf_counter() - t1, 1)
    report = evaluate(held, model.lm_head, adapter, depths)
    name = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("_name_or_path") or model_dir.name
    stopped = {str(d): min(curve, key=lambda p: p.get(f"calib_kl_d{d}", 0.0))["epoch"] for d in depths}
    training = {"objective": "KL(p_R || p_adapter(d)), T=1, training split", "seed": seed, "epochs": epochs, "lr": lr,
                "rank": rank, "batch": batch, "seq_len": seq_len, "train_windows": train_windows,
                "calib_windows": calib_windows, "kept_epoch": stopped, "curve": curve, "train_s": train_s,
                "heldout": report}
    config = AdapterConfig(hidden_size=hidden, rank=rank, depths=depths, total_ut_steps=loops,
                           base_weights_sha256=base_weights_sha256(model_dir), base_model=name, training=training)
    save_adapter(adapter, config, out_dir)
    result = {"out": str(out_dir), "depths": depths, "rank": rank, "kept_epoch": stopped,
              "parameters": sum(p.numel() for p in adapter.parameters()), "train_s": train_s,
              "total_s": round(time.perf_counter() - t0, 1), "heldout": report}
    log(json.dumps(result))
    return result
