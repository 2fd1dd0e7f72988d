"""The lookahead exit head's file format and math (docs/lookahead.md), shared by the trainer and the engine.

A head saved beside a model's weights is ``lookahead.safetensors`` (its MLP weights and feature
statistics) plus ``lookahead.json`` (:class:`HeadConfig`). :func:`load_head` reads and validates both:
every problem is an :class:`~loopline.errors.InvalidRequestError` naming the file and the field. The
feature vector at loop ``n`` (0: the embedding) is, in order: the gate logit, the cumulative exit
probability ``F_n``, the loop's hidden state times the fixed seeded projection (:func:`projection`), its
change from the previous loop, ``log1p(position) / log1p(max_position)`` and a one-hot loop index.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from loopline.errors import InvalidRequestError

DISTANCE = 2  # loops between the decision and the exit it fixes
HEAD_FILE = "lookahead.safetensors"
HEAD_CONFIG = "lookahead.json"


@dataclass(frozen=True)
class TraceSpec:
    """What a trace directory holds: ``proj_dim`` random-projection channels of each loop's hidden state."""

    proj_dim: int = 32
    proj_seed: int = 0
    seq_len: int = 256
    max_position: int = 2048  # position feature: log1p(pos) / log1p(max_position)


def projection(hidden_size: int, spec: TraceSpec) -> Tensor:
    """The fixed ``[hidden, proj_dim]`` Gaussian projection (seeded, scaled to keep unit-norm rows' scale)."""
    g = torch.Generator().manual_seed(spec.proj_seed)
    return torch.randn(hidden_size, spec.proj_dim, generator=g) / math.sqrt(hidden_size)


def num_features(proj_dim: int, loops: int) -> int:
    """Length of one loop's feature vector: gate, F, projection, change, position, one-hot loop."""
    return 2 + 2 * proj_dim + 1 + loops


class LookaheadHead(nn.Module):
    """``features -> logit`` of "loop n + 2's greedy token equals the full-depth token"."""

    def __init__(self, num_features: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(num_features, hidden), nn.GELU(), nn.Linear(hidden, 1))
        self.register_buffer("mean", torch.zeros(num_features))
        self.register_buffer("std", torch.ones(num_features))

    def forward(self, x: Tensor) -> Tensor:
        return self.net((x - self.mean) / self.std).squeeze(-1)


@dataclass
class HeadConfig:
    """``lookahead.json``: how the head was made and how to read its inputs. ``hidden_size``: the model's,
    recorded by the trainer (None in files written before it was)."""

    threshold: float
    distance: int = DISTANCE
    loops: int = 4
    hidden: int = 64
    spec: dict = field(default_factory=lambda: asdict(TraceSpec()))
    label: str = "greedy token at loop n+2 == greedy token at the last loop"
    file: str = HEAD_FILE
    metrics: dict = field(default_factory=dict)
    hidden_size: int | None = None

    @property
    def trace_spec(self) -> TraceSpec:
        return TraceSpec(**self.spec)


def save_head(head: LookaheadHead, config: HeadConfig, out_dir: str | Path) -> Path:
    """Writes ``lookahead.safetensors`` and ``lookahead.json`` into ``out_dir`` (beside a model's weights)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / config.file))
    (out / HEAD_CONFIG).write_text(json.dumps(asdict(config), indent=1) + "\n", encoding="utf-8")
    return out


def _int_field(where: Path, name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidRequestError(f"{where}: {name}={value!r}; allowed: an integer >= {lo}", param=name)


def _read_config(path: Path, hidden_size: int | None, loops: int | None) -> HeadConfig:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"{path}: not a readable JSON file ({type(e).__name__})", param=HEAD_CONFIG) from None
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{path}: a JSON object expected", param=HEAD_CONFIG)
    known = {f.name for f in fields(HeadConfig)}
    unknown = sorted(set(raw) - known)
    if unknown or "threshold" not in raw:
        bad = f"unknown field {unknown[0]!r}" if unknown else "missing field 'threshold'"
        raise InvalidRequestError(f"{path}: {bad}; fields: {sorted(known)}", param=unknown[0] if unknown else "threshold")
    config = HeadConfig(**raw)
    q = config.threshold
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
        raise InvalidRequestError(f"{path}: threshold={q!r}; allowed: a number in [0, 1]", param="threshold")
    if config.distance != DISTANCE:
        raise InvalidRequestError(f"{path}: distance={config.distance!r}; allowed: {DISTANCE}", param="distance")
    _int_field(path, "loops", config.loops, DISTANCE + 1)
    _int_field(path, "hidden", config.hidden, 1)
    if loops is not None and config.loops != loops:
        raise InvalidRequestError(f"{path}: loops={config.loops}, but the model runs {loops} loops", param="loops")
    if not isinstance(config.spec, dict) or set(config.spec) - {f.name for f in fields(TraceSpec)}:
        raise InvalidRequestError(f"{path}: spec={config.spec!r}; allowed keys: proj_dim, proj_seed, seq_len, "
                                  f"max_position", param="spec")
    spec = config.trace_spec
    for name in ("proj_dim", "max_position"):
        _int_field(path, f"spec.{name}", getattr(spec, name), 1)
    _int_field(path, "spec.proj_seed", spec.proj_seed, 0)
    if config.hidden_size is not None:
        _int_field(path, "hidden_size", config.hidden_size, 1)
        if hidden_size is not None and config.hidden_size != hidden_size:
            raise InvalidRequestError(f"{path}: hidden_size={config.hidden_size}, but the model's hidden size is "
                                      f"{hidden_size}", param="hidden_size")
    if not isinstance(config.file, str) or Path(config.file).name != config.file or not config.file:
        raise InvalidRequestError(f"{path}: file={config.file!r}; allowed: a file name in the same directory",
                                  param="file")
    return config


def _expected_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    f, h = num_features(config.trace_spec.proj_dim, config.loops), config.hidden
    return {"mean": (f,), "std": (f,), "net.0.weight": (h, f), "net.0.bias": (h,), "net.2.weight": (1, h),
            "net.2.bias": (1,)}


def load_head(model_dir: str | Path, *, hidden_size: int | None = None,
              loops: int | None = None) -> tuple[LookaheadHead, HeadConfig] | None:
    """The head saved beside ``model_dir``'s weights, or None when it has none (no ``lookahead.json``).

    ``hidden_size`` / ``loops``: the model's, checked against the config where given. A malformed head
    (config values, missing or extra tensors, shapes, non-finite values) raises InvalidRequestError naming
    the file and the field."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(model_dir)
    if not (d / HEAD_CONFIG).is_file():
        return None
    config = _read_config(d / HEAD_CONFIG, hidden_size, loops)
    weights = d / config.file
    if not weights.is_file():
        raise FileNotFoundError(f"{d / HEAD_CONFIG} names {config.file}, which does not exist in {d}")
    try:
        state = load_file(str(weights))
    except (OSError, SafetensorError) as e:
        raise InvalidRequestError(f"{weights}: not a readable safetensors file ({type(e).__name__})",
                                  param=config.file) from None
    want = _expected_shapes(config)
    for name in sorted(set(state) | set(want)):
        if name not in want:
            raise InvalidRequestError(f"{weights}: unexpected tensor {name!r}; expected {sorted(want)}", param=name)
        if name not in state:
            raise InvalidRequestError(f"{weights}: tensor {name!r} is missing", param=name)
        t = state[name]
        if tuple(t.shape) != want[name]:
            raise InvalidRequestError(f"{weights}: {name} has shape {list(t.shape)}; expected {list(want[name])} "
                                      f"(proj_dim {config.trace_spec.proj_dim}, loops {config.loops}, hidden "
                                      f"{config.hidden} in {HEAD_CONFIG})", param=name)
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise InvalidRequestError(f"{weights}: {name} must hold finite floating-point values", param=name)
    if not bool((state["std"] > 0).all()):
        raise InvalidRequestError(f"{weights}: std must be > 0 everywhere", param="std")
    head = LookaheadHead(want["mean"][0], config.hidden)
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head.eval(), config
