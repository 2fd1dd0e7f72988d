"""Full-weight updates for RL trainers (docs/rl.md): validate everything, then copy in place.

One update is ``start(version) -> update(weights)* -> finish()``:

* ``update`` may be called several times (e.g. once per shard or bucket).
  Each call is validated as a whole -- every name known and not yet sent,
  every shape equal, every dtype floating point, every value finite after the
  cast to the parameter's dtype -- before any of its tensors is copied, so a
  rejected call changes nothing. Pass shards to bound the memory a call holds.
* Tensors are copied with ``Tensor.copy_`` into the existing parameters, so
  parameter addresses (and CUDA graphs captured on them) stay valid.
* ``finish`` fails unless every parameter was received exactly once. A parameter the model family
  ties to another (``Family.tied_weights``: Huginn's ``lm_head.weight`` with tied embeddings, which
  checkpoints leave out) may be left out: ``finish`` copies its source into it. Sent, it must equal its
  source, as the loader requires of a checkpoint (the call that would set them apart is refused). Names the family
  recomputes (``Family.ignored_weights``: Huginn's ``freqs_cis``) are skipped.
* A failure after something was copied (a later rejected call, a copy error,
  an incomplete ``finish``) leaves the weights *partially new*: ``broken``
  stays True, and the engine refuses to generate, until a complete update
  lands. A failure before any copy leaves the old weights serving.
* Re-publishing the committed version is a no-op when the tensors equal the
  current weights and an error (with nothing changed) when they differ.
* From disk, :func:`check_checkpoint_files` keeps every file an index names
  inside the checkpoint directory, and :meth:`WeightUpdater.check_complete`
  refuses an incomplete set before the first copy (both change nothing).

The engine owns the committed version and what a commit implies (prefix cache
reset, cache salt); this module owns validation, copying and the
partially-updated state.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch import Tensor, nn

from loopline.errors import EngineStateError, WeightUpdateError
from loopline.models.family import family_of
from loopline.models.loader import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    read_checkpoint_json,
)

# Buffers some exporters persist although the model recomputes them (as the loader ignores them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
MAX_VERSION = 2**63 - 1  # versions are int64 (SGLang clients read them back as strings of digits)


def _summary(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return f"{shown} ({len(items)} in all)" if len(items) > limit else shown


@dataclass
class _Session:
    version: int
    verify: bool  # re-publishing the committed version: compare, never copy
    seen: set[str] = field(default_factory=set)
    copied: bool = False  # some parameter already holds a new value


class WeightUpdater:
    """Validates weight updates for one model and copies them into its parameters in place."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # name -> parameter (or buffer) object; the objects stay the same for the model's life.
        self._targets: dict[str, Tensor] = dict(model.state_dict(keep_vars=True))
        self._shapes = {n: tuple(t.shape) for n, t in self._targets.items()}
        self._dtypes = {n: t.dtype for n, t in self._targets.items()}
        family = family_of(model)
        self._ignored = frozenset(family.ignored_weights)
        self._tied = family.tied_weights(model.config)  # parameter -> the parameter it equals when not sent
        self.session: _Session | None = None
        self.broken = False  # a failed update left some parameters new and others old

    @property
    def names(self) -> list[str]:
        return list(self._targets)

    @property
    def tied(self) -> dict[str, str]:
        """Parameter -> the parameter the model's config ties it to (it follows its source when not sent, and
        must equal it when sent)."""
        return dict(self._tied)

    @property
    def in_progress(self) -> bool:
        return self.session is not None

    @property
    def pending_version(self) -> int | None:
        return self.session.version if self.session is not None else None

    # --- protocol ---------------------------------------------------------------------
    def check_start(self, version: Any, committed: int) -> None:
        """Raises what :meth:`start` would raise for ``version`` now, opening nothing."""
        if self.session is not None:
            raise EngineStateError(f"a weight update to version {self.session.version} is in progress; "
                                   "finish_weight_update() or abort_weight_update() first")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
            raise WeightUpdateError(f"version must be an integer in [0, 2**63 - 1], got {version!r}", param="version")
        if version < committed:
            raise WeightUpdateError(f"versions must increase: version {committed} is committed, got {version}",
                                    param="version")

    def start(self, version: Any, committed: int) -> None:
        self.check_start(version, committed)
        # A broken engine may re-publish the committed version: that is a repair, not a no-op.
        self.session = _Session(version, verify=version == committed and not self.broken)

    def update(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Validates then applies one batch of ``(name, tensor)``; returns how many tensors it held."""
        s = self._require_session()
        try:
            items = self.validate(weights, already_seen=s.seen)
        except Exception:
            self._fail()
            raise
        return self.apply(items)

    def apply(self, items: list[tuple[str, Tensor, Tensor]]) -> int:
        """Applies entries that :meth:`validate` returned (e.g. validated on another thread) to the open
        update, all or none as :meth:`update`; returns how many there were."""
        s = self._require_session()
        try:
            again = [n for n, _, _ in items if n in s.seen]
            if again:
                raise WeightUpdateError(f"parameter {again[0]!r} was sent twice in one update", param=again[0])
            untied = self._untied(s, items)
            if untied is not None:
                name, source = untied
                raise WeightUpdateError(
                    f"{name} differs from {source}, which the model's config ties it to (as the loader, which "
                    f"refuses such a checkpoint); allowed: equal tensors, or {name} left out (it then follows "
                    f"{source})", param=name)
            if s.verify:
                differ = [n for n, target, src in items if not torch.equal(target.detach(), src.to(target.device))]
                if differ:
                    raise WeightUpdateError(
                        f"version {s.version} is already committed with different weights ({_summary(differ)}); "
                        "publish them under a newer version", param=differ[0])
        except Exception:
            self._fail()
            raise
        if not s.verify:
            self._copy(s, items)
        s.seen.update(n for n, _, _ in items)
        return len(items)

    def finish(self) -> tuple[int, bool]:
        """Checks completeness; returns ``(version, changed)``. ``changed`` is False for a verified re-publish."""
        s = self._require_session()
        missing = self._missing(s.seen)
        if missing:
            self._fail()
            raise WeightUpdateError(f"the update to version {s.version} is incomplete: {len(missing)} parameter(s) were "
                                    f"never sent: {_summary(missing)}", param=missing[0])
        tied = [(n, self._targets[n], self._targets[src]) for n, src in self._tied.items() if n not in s.seen]
        if tied:
            self.apply(tied)  # (compared, not copied, when re-publishing the committed version)
        device = next(iter(self._targets.values())).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # every copy has landed before the version is committed
        self.session = None
        if not s.verify:
            self.broken = False
        return s.version, not s.verify

    def abort(self) -> None:
        """Drops the open update; the weights are broken if some were already copied."""
        self._fail()

    def check_complete(self, names: set[str] | frozenset[str], source: str = "the update") -> None:
        """Refuses (``WeightUpdateError``, nothing changed) a set of validated names that misses a
        parameter. Call it with every name a whole update will send, before its first copy:
        :meth:`finish` would find the gap only after the other tensors were copied."""
        missing = self._missing(set(names))
        if missing:
            raise WeightUpdateError(f"{source} is incomplete: {len(missing)} parameter(s) are missing: "
                                    f"{_summary(missing)}", param=missing[0])

    def _missing(self, seen: set[str]) -> list[str]:
        """Parameters an update that sent ``seen`` lacks (a tied one is not, once its source is sent)."""
        return sorted(n for n in self._targets.keys() - seen if self._tied.get(n) not in seen)

    # --- validation -------------------------------------------------------------------
    def validate(self, weights: Iterable[tuple[str, Tensor]], already_seen: set[str] | frozenset[str] = frozenset()
                 ) -> list[tuple[str, Tensor, Tensor]]:
        """``(name, target parameter, source cast to its dtype)`` for each entry, or a ``WeightUpdateError``."""
        if isinstance(weights, dict):
            weights = weights.items()
        elif isinstance(weights, (str, bytes, Tensor)) or not isinstance(weights, Iterable):
            raise WeightUpdateError(f"weights must be an iterable of (name, tensor) pairs, got {type(weights).__name__}",
                                    param="weights")
        items: list[tuple[str, Tensor, Tensor]] = []
        in_call: set[str] = set()
        for entry in weights:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise WeightUpdateError(f"weights must be (name, tensor) pairs, got {type(entry).__name__}", param="weights")
            name, tensor = entry
            if not isinstance(name, str):
                raise WeightUpdateError(f"parameter names must be strings, got {name!r}", param="weights")
            if name.endswith(IGNORED_SUFFIXES) or name in self._ignored:
                continue
            target = self._targets.get(name)
            if target is None:
                raise WeightUpdateError(f"unknown parameter {name!r} (names are the Hugging Face checkpoint names, "
                                        "e.g. 'model.layers.0.self_attn.q_proj.weight')", param=name)
            if name in in_call or name in already_seen:
                raise WeightUpdateError(f"parameter {name!r} was sent twice in one update", param=name)
            if not isinstance(tensor, Tensor):
                raise WeightUpdateError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}", param=name)
            if tensor.is_meta or tensor.layout != torch.strided:  # no values to copy, or not a dense array of them
                raise WeightUpdateError(f"{name}: a {'meta' if tensor.is_meta else str(tensor.layout)} tensor; "
                                        "expected a dense tensor with values (torch.strided)", param=name)
            if tuple(tensor.shape) != self._shapes[name]:
                raise WeightUpdateError(f"{name}: shape {tuple(tensor.shape)} does not match the model's "
                                        f"{self._shapes[name]}", param=name)
            if not tensor.is_floating_point():
                raise WeightUpdateError(f"{name}: dtype {tensor.dtype} is not floating point", param=name)
            in_call.add(name)
            items.append((name, target, tensor.detach().to(dtype=self._dtypes[name])))
        if items:
            # NOTE: one flag per tensor, stacked on its own device: one host sync per device, not per tensor
            by_device: dict[torch.device, list[int]] = {}
            for i, (_, _, src) in enumerate(items):
                by_device.setdefault(src.device, []).append(i)
            finite = [True] * len(items)
            for idx in by_device.values():
                for i, ok in zip(idx, torch.stack([torch.isfinite(items[i][2]).all() for i in idx]).tolist()):
                    finite[i] = ok
            bad = [n for (n, _, _), ok in zip(items, finite) if not ok]
            if bad:
                raise WeightUpdateError(f"tensor(s) with non-finite values (NaN/Inf) as the model's dtype: {_summary(bad)}",
                                        param=bad[0])
        return items

    # --- internals --------------------------------------------------------------------
    def _copy(self, s: _Session, items: list[tuple[str, Tensor, Tensor]]) -> None:
        name = None
        try:
            with torch.no_grad():
                for name, target, src in items:
                    s.copied = True  # NOTE: set before the copy: a copy that fails half way may have written
                    target.copy_(src)
                    s.seen.add(name)
        except Exception as e:
            self._fail()
            raise EngineStateError(f"copying {name} failed ({type(e).__name__}: {e}); the weights are partially updated "
                                   "and the engine refuses to generate until a complete update lands") from e

    def _untied(self, s: _Session, items: list[tuple[str, Tensor, Tensor]]) -> tuple[str, str] | None:
        """The first tied pair ``(name, source)`` whose two values this update sets apart: one sent in
        ``items``, the other in ``items`` or earlier in the session (compared with the parameter that holds
        it), or ``None``."""
        here = {n: src for n, _, src in items}
        for name, source in self._tied.items():
            if name not in here and source not in here:
                continue
            values = [here.get(n, self._targets[n] if n in s.seen else None) for n in (name, source)]
            if None in values:
                continue  # the other one is not sent (yet): finish copies the source into a name left out
            a, b = (v.detach() for v in values)
            if not torch.equal(a, b.to(a.device)):
                return name, source
        return None

    def _require_session(self) -> _Session:
        if self.session is None:
            raise EngineStateError("no weight update in progress; call start_weight_update(version) first")
        return self.session

    def _fail(self) -> None:
        s, self.session = self.session, None
        if s is not None and s.copied:
            self.broken = True




def check_checkpoint_files(model_dir: str | os.PathLike) -> None:
    """Refuses (``CheckpointError``) a checkpoint directory with a file that leads outside it.

    A client names the directory; the files read are ``config.json``, ``model.safetensors`` or
    the shards that ``model.safetensors.index.json`` lists. Each must be a plain relative name
    (no absolute path, no ``..``) that resolves, symlinks followed, inside the directory.
    Everything else about the files (present, parseable, complete) is the loader's to check.
    """
    root = Path(model_dir)
    if not root.is_dir():
        return  # the loader says what is wrong with it
    real_root = root.resolve()
    names = [CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, GENERATION_CONFIG_FILE]
    index = root / WEIGHTS_INDEX_FILE
    if index.is_file() and _inside(real_root, index):
        try:
            weight_map = read_checkpoint_json(index, required=True).get("weight_map")
        except (CheckpointError, OSError):
            weight_map = None  # the loader reports a malformed index
        if isinstance(weight_map, dict):
            names += sorted({str(shard) for shard in weight_map.values()})
    for name in names:
        if not _plain_relative(name) or ((root / name).exists() or (root / name).is_symlink()) \
                and not _inside(real_root, root / name):
            raise CheckpointError(f"{model_dir}: {name if name in (CONFIG_FILE, WEIGHTS_FILE, GENERATION_CONFIG_FILE) else WEIGHTS_INDEX_FILE} "
                                  "names a file outside the checkpoint directory")


def _plain_relative(name: str) -> bool:
    """A relative file name without ``..``, drive or NUL (POSIX and Windows spellings)."""
    if not name or "\x00" in name:
        return False
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.is_absolute() or pure.drive or pure.root or ".." in pure.parts:
            return False
    return True


def _inside(real_root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(real_root)
    except (ValueError, OSError, RuntimeError):  # outside, unreadable, or a symlink loop
        return False
    return True
