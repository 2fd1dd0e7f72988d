"""Trained draft adapters (issue #41): a small map applied to a draft's loop-``d`` hidden state before
the shared head, so that the draft's distribution moves towards the full-depth one.

For each draft depth ``d`` it holds a per-channel scale ``g_d`` ``[H]`` and a low-rank residual
``B_d A_d`` (``A_d`` ``[r, H]``, ``B_d`` ``[H, r]``)::

    h'_d = g_d * h_d + B_d (A_d h_d)        logits_draft = lm_head(h'_d)

``g = 1, B = 0`` is the identity (the plain coda). The base model is frozen: the adapter only ever
changes drafts, never a target token, so speculative outputs stay exactly the target's.

On disk, beside the model's weights: ``draft_adapter.safetensors`` (tensors ``d{d}.scale``, ``d{d}.down``,
``d{d}.up``) and ``draft_adapter.json`` (:class:`AdapterConfig`: format version, shapes, depths and the
SHA-256 of the base weight files it was trained on). :func:`load_adapter` validates both and names the
file and field on any mismatch; :func:`find_adapter` is the engine's ``"auto"`` lookup.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from loopline.models.loader import CheckpointError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_FILE",
    "ADAPTER_FORMAT",
    "AdapterConfig",
    "DraftAdapter",
    "base_weights_sha256",
    "find_adapter",
    "load_adapter",
    "resolve_adapter",
    "save_adapter",
]

ADAPTER_FILE = "draft_adapter.safetensors"
ADAPTER_CONFIG = "draft_adapter.json"
ADAPTER_FORMAT = "loopline-draft-adapter/1"
_WEIGHTS_FILE, _WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"  # (models/loader.py's names)

logger = logging.getLogger(__name__)


@dataclass
class AdapterConfig:
    """``draft_adapter.json``: what the adapter is and which base weights it belongs to."""

    hidden_size: int
    rank: int
    depths: list[int]
    total_ut_steps: int
    base_weights_sha256: str
    format: str = ADAPTER_FORMAT
    file: str = ADAPTER_FILE
    base_model: str = ""
    training: dict = field(default_factory=dict)


class DraftAdapter(nn.Module):
    """One scale and low-rank residual per draft depth (module docstring); starts as the identity."""

    def __init__(self, hidden_size: int, rank: int, depths: list[int]) -> None:
        super().__init__()
        self.hidden_size, self.rank, self.depths = hidden_size, rank, sorted(depths)
        self.scale = nn.ParameterDict({str(d): nn.Parameter(torch.ones(hidden_size)) for d in self.depths})
        self.down = nn.ParameterDict({str(d): nn.Parameter(torch.randn(rank, hidden_size) / hidden_size ** 0.5)
                                      for d in self.depths})
        self.up = nn.ParameterDict({str(d): nn.Parameter(torch.zeros(hidden_size, rank)) for d in self.depths})

    def forward(self, hidden: Tensor, depth: int) -> Tensor:
        """``[N, H]`` loop-``depth`` hidden states -> the adapted ones (same dtype)."""
        key = str(depth)
        return hidden * self.scale[key] + (hidden @ self.down[key].T) @ self.up[key].T

    def tensors(self) -> dict[str, Tensor]:
        """The on-disk names: ``d{d}.scale``, ``d{d}.down``, ``d{d}.up``."""
        out = {}
        for d in self.depths:
            k = str(d)
            out |= {f"d{d}.scale": self.scale[k], f"d{d}.down": self.down[k], f"d{d}.up": self.up[k]}
        return {n: t.detach().float().contiguous().cpu() for n, t in out.items()}


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / _WEIGHTS_INDEX
    if index.is_file():
        shards = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()
        return [model_dir / name for name in sorted(set(shards))]
    return [model_dir / _WEIGHTS_FILE]


def base_weights_sha256(model_dir: str | Path) -> str:
    """SHA-256 over the checkpoint's weight files (``model.safetensors`` or the index's shards), streamed."""
    digest = hashlib.sha256()
    for path in _weight_files(Path(model_dir)):
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def save_adapter(adapter: DraftAdapter, config: AdapterConfig, out_dir: str | Path) -> Path:
    """Writes ``draft_adapter.safetensors`` and ``draft_adapter.json`` into ``out_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter.tensors(), str(out / config.file))
    (out / ADAPTER_CONFIG).write_text(json.dumps(asdict(config), indent=1) + "\n", encoding="utf-8")
    return out


def _fail(path: Path, field_name: str, value, allowed: str) -> CheckpointError:
    return CheckpointError(f"{path}: {field_name}={value!r}; allowed: {allowed}")


def _read_config(path: Path, hidden_size: int, total_loops: int) -> AdapterConfig:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable JSON file ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise _fail(path, "(top level)", type(raw).__name__, "a JSON object")
    if raw.get("format") != ADAPTER_FORMAT:
        raise _fail(path, "format", raw.get("format"), repr(ADAPTER_FORMAT))
    known = set(AdapterConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise _fail(path, unknown[0], raw[unknown[0]], f"the fields {', '.join(sorted(known))}")
    try:
        config = AdapterConfig(**raw)
    except TypeError:
        missing = sorted(f for f in ("hidden_size", "rank", "depths", "total_ut_steps", "base_weights_sha256") if f not in raw)
        raise _fail(path, missing[0] if missing else "(fields)", None, "present") from None
    if config.hidden_size != hidden_size:
        raise _fail(path, "hidden_size", config.hidden_size, f"{hidden_size} (the model's hidden_size)")
    if config.total_ut_steps != total_loops:
        raise _fail(path, "total_ut_steps", config.total_ut_steps, f"{total_loops} (the model's total_ut_steps)")
    if isinstance(config.rank, bool) or not isinstance(config.rank, int) or not 1 <= config.rank <= hidden_size:
        raise _fail(path, "rank", config.rank, f"an integer in 1..{hidden_size}")
    depths = config.depths
    if not isinstance(depths, list) or not depths or any(
            isinstance(d, bool) or not isinstance(d, int) or not 1 <= d < total_loops for d in depths) \
            or len(set(depths)) != len(depths):
        raise _fail(path, "depths", depths, f"a non-empty list of distinct integers in 1..{total_loops - 1}")
    if not isinstance(config.file, str) or Path(config.file).name != config.file or not config.file:
        raise _fail(path, "file", config.file, "a file name in the same directory")
    return config


def _check_inside(root: Path, path: Path) -> None:
    """A client names the directory: the adapter's files (symlinks followed) must stay inside it."""
    if path.exists() and not path.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"{root}: {path.name} leads outside the directory")


def load_adapter(adapter_dir: str | Path, hidden_size: int, total_loops: int, *,
                 base_sha256: str | None = None) -> tuple[DraftAdapter, AdapterConfig]:
    """The adapter saved in ``adapter_dir``, validated against the model's ``hidden_size`` and loop count
    (and the base weights' hash when ``base_sha256`` is given). Raises ``CheckpointError`` naming the file
    and the field."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(adapter_dir)
    cfg_path = d / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path} does not exist (a directory written by `loopline train draft`)")
    _check_inside(d, cfg_path)
    config = _read_config(cfg_path, hidden_size, total_loops)
    if base_sha256 is not None and config.base_weights_sha256 != base_sha256:
        raise _fail(cfg_path, "base_weights_sha256", config.base_weights_sha256,
                    f"{base_sha256!r} (the served weights': the adapter was trained on other weights)")
    weights = d / config.file
    _check_inside(d, weights)
    try:
        state = load_file(str(weights))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{weights}: missing, corrupt or truncated safetensors file ({type(e).__name__})") from None
    adapter = DraftAdapter(hidden_size, config.rank, config.depths)
    expected = {n: tuple(t.shape) for n, t in adapter.tensors().items()}
    for name in sorted(set(state) | set(expected)):
        if name not in expected:
            raise _fail(weights, name, "(a tensor)", f"the tensors {', '.join(sorted(expected))}")
        if name not in state:
            raise _fail(weights, name, None, f"a tensor of shape {list(expected[name])}")
        t = state[name]
        if tuple(t.shape) != expected[name] or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise _fail(weights, name, f"{t.dtype} {list(t.shape)}", f"finite floats of shape {list(expected[name])}")
    with torch.no_grad():
        for dd in config.depths:
            adapter.scale[str(dd)].copy_(state[f"d{dd}.scale"])
            adapter.down[str(dd)].copy_(state[f"d{dd}.down"])
            adapter.up[str(dd)].copy_(state[f"d{dd}.up"])
    return adapter.eval().requires_grad_(False), config


def find_adapter(model_dir: str | Path, hidden_size: int, total_loops: int, depth: int
                 ) -> tuple[DraftAdapter, AdapterConfig] | None:
    """The ``"auto"`` lookup: the adapter beside ``model_dir``'s weights when there is one, it holds
    ``depth`` and it was trained on exactly these weight files; otherwise ``None`` (logged). A malformed
    adapter raises, as any corrupt checkpoint file does."""
    d = Path(model_dir)
    if not (d / ADAPTER_CONFIG).is_file():
        return None
    adapter, config = load_adapter(d, hidden_size, total_loops)
    if depth not in config.depths:
        logger.info("draft adapter %s has depths %s, not draft_loops=%d: drafting with the plain coda",
                    d / ADAPTER_CONFIG, config.depths, depth)
        return None
    if config.base_weights_sha256 != base_weights_sha256(d):
        logger.warning("draft adapter %s was trained on other weights (base_weights_sha256 differs): drafting with "
                       "the plain coda", d / ADAPTER_CONFIG)
        return None
    return adapter, config


def resolve_adapter(setting: str, model_dir: str | Path | None, hidden_size: int, total_loops: int, depth: int
                    ) -> tuple[DraftAdapter, AdapterConfig, str] | None:
    """``speculative_config.draft_adapter`` for an engine serving ``model_dir``'s weight files
    (``None``: weights that did not come from a checkpoint directory, e.g. a model object or
    ``load_format='dummy'``): ``(adapter, config, source directory)`` or ``None`` (drafts use the plain
    coda). ``"auto"`` is :func:`find_adapter`; an explicit directory must hold ``depth`` and match the
    served weights' hash, else ``CheckpointError`` names the file and the field."""
    if setting == "none":
        return None
    if setting == "auto":
        found = None if model_dir is None else find_adapter(model_dir, hidden_size, total_loops, depth)
        return None if found is None else (*found, str(model_dir))
    if model_dir is None:
        raise CheckpointError(f"speculative_config.draft_adapter={setting!r}: an adapter is checked against the served "
                              "checkpoint's weight files, and this engine's weights come from no checkpoint directory")
    adapter, config = load_adapter(setting, hidden_size, total_loops, base_sha256=base_weights_sha256(model_dir))
    if depth not in config.depths:
        raise _fail(Path(setting) / ADAPTER_CONFIG, "depths", config.depths,
                    f"a list holding speculative_config.draft_loops={depth}")
    return adapter, config, str(setting)
