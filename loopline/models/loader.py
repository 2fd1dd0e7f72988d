"""Load Ouro checkpoints (Hugging Face layout) with strict validation.

A checkpoint directory holds ``config.json``, optionally
``generation_config.json``, weights as ``model.safetensors`` or as shards
listed in ``model.safetensors.index.json``, and tokenizer files. Real
Ouro-1.4B / 2.6B / -Thinking directories and :mod:`loopline.models.tiny`
checkpoints load the same way.

Every problem a user can cause raises :class:`CheckpointError` with a
message that names the file, the field or tensor, the value and what is
allowed (docs/security.md). Nothing here touches the network.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loopline.errors import InvalidRequestError, LooplineError
from loopline.models.huginn import HuginnConfig, HuginnForCausalLM, tie_checkpoint_weights
from loopline.models.huginn import config_from_dict as huginn_config_from_dict
from loopline.models.ouro import OuroConfig, OuroForCausalLM

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Buffers some exporters persist although the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# config.json fields without which the architecture is unknown.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Optional fields and the defaults of the upstream config class.
_DEFAULTS = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
}


class CheckpointError(LooplineError, ValueError):
    """A checkpoint directory that loopline cannot load (missing, corrupt or unsupported)."""


PathLike = str | os.PathLike


# --- config -------------------------------------------------------------------------


def load_config(model_dir: PathLike) -> OuroConfig:
    """Read and validate ``config.json`` (and ``generation_config.json`` for eos ids).

    Keys OuroConfig does not model (``tie_word_embeddings``, ``architectures``,
    ...) are kept in ``OuroConfig.extra``.
    """
    model_dir = _existing_dir(model_dir)
    path = model_dir / CONFIG_FILE
    raw = read_checkpoint_json(path, required=True)
    return _config_from_dict(raw, path, _generation_eos(model_dir, raw.get("vocab_size")))


def _config_from_dict(raw: dict, path: Path, generation_eos: list[int]) -> OuroConfig:
    def fail(field: str, value: Any, allowed: str) -> CheckpointError:
        return CheckpointError(f"{path}: {field}={value!r} is not supported; allowed: {allowed}")

    model_type = raw.get("model_type")
    if model_type != "ouro":
        # NOTE: the engine and the plain path read any family through load_looped_config / load_looped_model.
        hint = " (a huginn_raven directory loads through load_looped_config / load_looped_model)" \
            if model_type == "huginn_raven" else ""
        raise fail("model_type", model_type, '"ouro"' + hint)
    if raw.get("use_sliding_window"):
        raise fail("use_sliding_window", raw["use_sliding_window"], "false (sliding-window attention is not supported)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise fail("layer_types", layer_types, 'null or a list of "full_attention"')
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise fail("layer_types", bad, '"full_attention" only')
    if raw.get("rope_scaling") is not None:
        raise fail("rope_scaling", raw["rope_scaling"], "null (RoPE scaling is not supported)")
    # transformers >= 5 writes rope_parameters instead of rope_theta / rope_scaling.
    rope_parameters = raw.get("rope_parameters")
    if rope_parameters is not None:
        if not isinstance(rope_parameters, dict) or rope_parameters.get("rope_type", "default") != "default":
            raise fail("rope_parameters", rope_parameters, 'null or {"rope_type": "default", "rope_theta": ...}')
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise fail("hidden_act", hidden_act, '"silu"')
    if raw.get("attention_bias"):
        raise fail("attention_bias", raw["attention_bias"], "false (Ouro's projections have no bias)")

    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise CheckpointError(f"{path}: missing required field(s) {', '.join(missing)}")
    ints: dict[str, int] = {}
    for key in (*_REQUIRED, "num_key_value_heads", "head_dim", "total_ut_steps", "max_position_embeddings"):
        value = raw.get(key)
        if value is None and key not in _REQUIRED:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise fail(key, value, "a positive integer")
        ints[key] = value
    heads = ints["num_attention_heads"]
    kv_heads = ints.setdefault("num_key_value_heads", heads)
    if heads % kv_heads != 0:
        raise CheckpointError(
            f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    if "head_dim" not in ints:
        if ints["hidden_size"] % heads != 0:
            raise CheckpointError(
                f"{path}: hidden_size={ints['hidden_size']} is not divisible by num_attention_heads={heads} "
                "and head_dim is not given"
            )
        ints["head_dim"] = ints["hidden_size"] // heads
    if ints["head_dim"] % 2 != 0:
        raise fail("head_dim", ints["head_dim"], "an even integer (rotate-half RoPE)")

    floats: dict[str, float] = {}
    rope_theta = raw.get("rope_theta")
    if rope_theta is None and rope_parameters is not None:
        rope_theta = rope_parameters.get("rope_theta")
    for key, value in (("rope_theta", rope_theta), ("rms_norm_eps", raw.get("rms_norm_eps")),
                       ("initializer_range", raw.get("initializer_range"))):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise fail(key, value, "a positive number")
        floats[key] = float(value)
    threshold = raw.get("early_exit_threshold", _DEFAULTS["early_exit_threshold"])
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise fail("early_exit_threshold", threshold, "a number in [0, 1]")

    # transformers >= 5 writes "dtype" instead of "torch_dtype".
    dtype_key = "torch_dtype" if "torch_dtype" in raw else "dtype"
    torch_dtype = raw.get(dtype_key) or "float32"
    if not isinstance(torch_dtype, str) or torch_dtype not in DTYPES:
        raise fail(dtype_key, torch_dtype, ", ".join(DTYPES))

    vocab = ints["vocab_size"]
    token_ids = {k: raw.get(k) for k in ("bos_token_id", "pad_token_id")}
    for key, value in token_ids.items():
        if value is not None and not _is_token_id(value, vocab):
            raise fail(key, value, f"null or an integer in [0, {vocab})")
    eos = raw.get("eos_token_id")
    eos_list = [] if eos is None else eos if isinstance(eos, list) else [eos]
    for value in eos_list:
        if not _is_token_id(value, vocab):
            raise fail("eos_token_id", eos, f"null, or an integer or list of integers in [0, {vocab})")
    eos_ids = tuple(dict.fromkeys([*eos_list, *generation_eos]))

    consumed = {
        *_REQUIRED, "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "total_ut_steps",
        "early_exit_threshold", "max_position_embeddings", "initializer_range", "bos_token_id",
        "eos_token_id", "pad_token_id", dtype_key,
    }
    return OuroConfig(
        vocab_size=vocab,
        hidden_size=ints["hidden_size"],
        intermediate_size=ints["intermediate_size"],
        num_hidden_layers=ints["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=ints["head_dim"],
        rope_theta=floats.get("rope_theta", _DEFAULTS["rope_theta"]),
        rms_norm_eps=floats.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"]),
        total_ut_steps=ints.get("total_ut_steps", _DEFAULTS["total_ut_steps"]),
        early_exit_threshold=float(threshold),
        max_position_embeddings=ints.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"]),
        bos_token_id=token_ids["bos_token_id"],
        eos_token_ids=eos_ids,
        pad_token_id=token_ids["pad_token_id"],
        torch_dtype=torch_dtype,
        initializer_range=floats.get("initializer_range", _DEFAULTS["initializer_range"]),
        extra={k: v for k, v in raw.items() if k not in consumed},
    )


def _generation_eos(model_dir: Path, vocab: Any) -> list[int]:
    path = model_dir / GENERATION_CONFIG_FILE
    raw = read_checkpoint_json(path, required=False)
    if raw is None or raw.get("eos_token_id") is None:
        return []
    eos = raw["eos_token_id"]
    ids = eos if isinstance(eos, list) else [eos]
    limit = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    if not all(_is_token_id(i, limit) for i in ids):
        bound = f" in [0, {limit})" if limit else ""
        raise CheckpointError(f"{path}: eos_token_id={eos!r} is not supported; allowed: an integer or list of integers{bound}")
    return ids


#: generation_config.json keys that become request defaults, and the SamplingParams field each
#: sets (vLLM's ``--generation-config auto``); other keys (do_sample, bos ids, ...) are ignored.
SAMPLING_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_sampling_defaults(model_dir: PathLike) -> dict[str, Any]:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, as SamplingParams
    fields (``{}`` without the file). Each value is checked as SamplingParams checks it."""
    from loopline.sampling_params import SamplingParams

    path = _existing_dir(model_dir) / GENERATION_CONFIG_FILE
    raw = read_checkpoint_json(path, required=False) or {}
    defaults = {}
    for key, field in SAMPLING_DEFAULT_KEYS.items():
        if raw.get(key) is None:
            continue
        try:
            SamplingParams(**{field: raw[key]})
        except (LooplineError, ValueError, TypeError) as e:
            raise CheckpointError(f"{path}: {key}={raw[key]!r} is not a valid request default: {e}") from None
        defaults[field] = raw[key]
    return defaults


def check_sampling_defaults(defaults: dict[str, Any], vocab_size: int, max_model_len: int,
                            source: str = GENERATION_CONFIG_FILE) -> dict[str, Any]:
    """Request defaults checked against the model they serve, at start: a ``top_k`` above the vocabulary
    is refused (every request that omits top_k would fail); a ``max_new_tokens`` that leaves no room for a
    prompt within ``max_model_len`` is dropped with a warning (requests then generate up to the context,
    as without the file)."""
    top_k = defaults.get("top_k")
    if top_k is not None and top_k > vocab_size:
        raise CheckpointError(f"{source}: top_k={top_k} is above the model's vocabulary ({vocab_size} tokens); "
                              f"allowed: -1 or 0 (off) or 1..{vocab_size}")
    out = dict(defaults)
    max_tokens = out.get("max_tokens")
    if max_tokens is not None and max_tokens >= max_model_len:
        logging.getLogger("loopline").warning(
            "%s: max_new_tokens=%d leaves no room for a prompt within max_model_len=%d: ignored (requests without "
            "max_tokens generate up to max_model_len)", source, max_tokens, max_model_len)
        del out["max_tokens"]
    return out


def override_sampling_defaults(defaults: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``defaults`` with vLLM's ``override_generation_config`` merged over them: generation_config.json keys
    (``max_new_tokens``, not ``max_tokens``), each value checked as a generation_config.json value is."""
    from loopline.sampling_params import SamplingParams

    out = dict(defaults)
    for key, value in (overrides or {}).items():
        field = SAMPLING_DEFAULT_KEYS.get(key)
        if field is None:
            raise InvalidRequestError(f"override_generation_config: unknown key {key!r} (allowed: "
                                      f"{sorted(SAMPLING_DEFAULT_KEYS)})", param="override_generation_config")
        try:
            SamplingParams(**{field: value})
        except (LooplineError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"override_generation_config: {key}={value!r} is not a valid request default: "
                                      f"{e}", param="override_generation_config") from None
        out[field] = value
    return out


def sampling_defaults(source: str, model_dir: PathLike | None) -> dict[str, Any]:
    """Request defaults by ``EngineArgs.generation_config``: ``"auto"``: the model's
    generation_config.json; ``"vllm"``: none; else that folder's generation_config.json."""
    if source == "vllm" or (source == "auto" and model_dir is None):
        return {}
    return load_sampling_defaults(model_dir if source == "auto" else source)


def _is_token_id(value: Any, vocab: int | None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (vocab is None or value < vocab)


# --- weights ------------------------------------------------------------------------


def load_weights(model_dir: PathLike) -> dict[str, Tensor]:
    """All tensors of ``model.safetensors`` or of the shards its index lists, on the CPU."""
    weights: dict[str, Tensor] = {}
    for shard in iter_checkpoint(model_dir):
        weights.update(shard)
    return weights


def iter_checkpoint(model_dir: PathLike) -> Iterator[dict[str, Tensor]]:
    """The tensors of a checkpoint one shard at a time (CPU), each shard checked against the index.

    Missing shard files are reported before any shard is read.
    """
    for path, names in _checkpoint_shards(_existing_dir(model_dir)):
        tensors = _read_safetensors(path)
        if names is not None:
            absent = sorted(names - tensors.keys())
            if absent:
                raise CheckpointError(f"{path}: tensor(s) that {WEIGHTS_INDEX_FILE} places in this shard are absent: "
                                      f"{_summary(absent)}")
            stray = sorted(tensors.keys() - names)
            if stray:
                raise CheckpointError(f"{path}: tensor(s) not listed for this shard in {WEIGHTS_INDEX_FILE}: "
                                      f"{_summary(stray)}")
        yield tensors


def iter_checkpoint_tensors(model_dir: PathLike) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors one at a time as ``(name, tensor)`` (CPU), with :func:`iter_checkpoint`'s
    checks; each shard's names are checked against the index before its first tensor is read.

    Only one tensor is in memory at a time (safetensors maps the file and copies out just that tensor):
    a weight update from disk holds one tensor, not one shard or the whole checkpoint."""
    for path, names in _checkpoint_shards(_existing_dir(model_dir)):
        yield from _stream_safetensors(path, names)


def _checkpoint_shards(model_dir: Path) -> list[tuple[Path, set[str] | None]]:
    """``(shard file, the names the index places in it)`` for each shard (None: no index to compare with);
    a missing or malformed index, or a missing shard file, is a ``CheckpointError`` before any read."""
    single, index = model_dir / WEIGHTS_FILE, model_dir / WEIGHTS_INDEX_FILE
    if single.is_file():
        return [(single, None)]
    if not index.is_file():
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(others)}; only safetensors is supported)" if others else ""
        raise CheckpointError(f"{model_dir}: no weights: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} exists{hint}")
    raw = read_checkpoint_json(index, required=True)
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: weight_map is missing or empty; expected {{tensor name: shard file}}")
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: weight_map[{name!r}] is {shard!r}; expected a shard file name (a string)")
        by_shard.setdefault(shard, set()).add(name)
    missing = [s for s in by_shard if not (index.parent / s).is_file()]
    if missing:
        raise CheckpointError(f"{index}: missing shard file(s) listed in weight_map: {_summary(sorted(missing))}")
    return [(index.parent / shard, names) for shard, names in by_shard.items()]


def _stream_safetensors(path: Path, expected: set[str] | None) -> Iterator[tuple[str, Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            if expected is not None:
                _check_shard_names(path, expected, set(keys))
            for name in keys:
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e


def _check_shard_names(path: Path, expected: set[str], found: set[str]) -> None:
    absent = sorted(expected - found)
    if absent:
        raise CheckpointError(f"{path}: tensor(s) that {WEIGHTS_INDEX_FILE} places in this shard are absent: "
                              f"{_summary(absent)}")
    stray = sorted(found - expected)
    if stray:
        raise CheckpointError(f"{path}: tensor(s) not listed for this shard in {WEIGHTS_INDEX_FILE}: {_summary(stray)}")


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e


# --- model --------------------------------------------------------------------------


def load_model(model_dir: PathLike, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu") -> OuroForCausalLM:
    """Build :class:`OuroForCausalLM` from a checkpoint directory, validated, in eval mode.

    ``dtype`` None means the config's ``torch_dtype``. The model is built on
    the meta device and the loaded tensors are assigned into it (cast and
    moved one at a time), so a big model is never held twice.
    """
    config = load_config(model_dir)
    target = _resolve_dtype(dtype if dtype is not None else config.torch_dtype)
    weights = load_weights(model_dir)
    with torch.device("meta"):
        model = OuroForCausalLM(config)
    weights = {k: v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}
    where = Path(model_dir)
    kv_scales = _pop_kv_scales(weights, config, where)

    if config.extra.get("tie_word_embeddings") and "lm_head.weight" not in weights:
        raise CheckpointError(
            f"{where / CONFIG_FILE}: tie_word_embeddings=true but the weights have no lm_head.weight; "
            "allowed: tied configs only with lm_head.weight present in the weights"
        )
    assign_checkpoint(model, weights, where, device, target)
    model.checkpoint_kv_scales = kv_scales  # an FP8 KV cache's scales (loopline.kv.quant), when it carried them
    return model.eval()


def assign_checkpoint(model: torch.nn.Module, weights: dict[str, Tensor], where: Path, device: str | torch.device,
                      target: torch.dtype) -> None:
    """Checks ``weights`` against ``model``'s state dict (names, shapes, floating point, finite once cast) and
    assigns them into it (built on the meta device), cast to ``target`` on ``device``; consumes ``weights``."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise CheckpointError(f"{where}: tensor(s) missing from the weights: {_summary(missing)}")
    unexpected = sorted(weights.keys() - expected.keys())
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor(s) in the weights: {_summary(unexpected)}")
    wrong = [f"{n} {tuple(weights[n].shape)} (expected {expected[n]})" for n in expected if tuple(weights[n].shape) != expected[n]]
    if wrong:
        raise CheckpointError(f"{where}: tensor(s) with the wrong shape: {_summary(wrong)}")
    not_float = [f"{n} ({weights[n].dtype})" for n in expected if not weights[n].is_floating_point()]
    if not_float:
        raise CheckpointError(f"{where}: tensor(s) that are not floating point: {_summary(not_float)}")

    state: dict[str, Tensor] = {}
    for name in expected:
        # pop so the source tensor can be freed as soon as its copy exists. NOTE: copy even without a cast or
        # move: the loaded tensor is a view of the file's buffer at the header's offset, unaligned for SIMD, and
        # CPU matmuls on it rounded differently from (and ran slower than) the same values in a fresh tensor.
        state[name] = weights.pop(name).to(device=device, dtype=target, copy=True)
    non_finite = [n for n, t in state.items() if not bool(torch.isfinite(t).all())]
    if non_finite:
        raise CheckpointError(
            f"{where}: tensor(s) with non-finite values (NaN/Inf) as {_dtype_name(target)}: {_summary(non_finite)}"
        )
    model.load_state_dict(state, strict=True, assign=True)


def load_looped_config(model_dir: PathLike) -> Any:
    """The validated config of a checkpoint of any looped family (``loopline.models.family``), by its
    ``model_type``: an :class:`OuroConfig` or a :class:`~loopline.models.huginn.HuginnConfig`."""
    model_dir = _existing_dir(model_dir)
    path = model_dir / CONFIG_FILE
    raw = read_checkpoint_json(path, required=True)
    parse = _CONFIG_PARSERS.get(raw.get("model_type"))
    if parse is None:
        raise CheckpointError(f"{path}: model_type={raw.get('model_type')!r} is not supported; allowed: "
                              f"{', '.join(map(repr, _CONFIG_PARSERS))}")
    return parse(raw, path, _generation_eos(model_dir, raw.get("vocab_size")))


def load_looped_model(model_dir: PathLike, dtype: torch.dtype | str | None = None,
                      device: str | torch.device = "cpu") -> torch.nn.Module:
    """The model of a checkpoint of any looped family, validated, in eval mode (Ouro: :func:`load_model`)."""
    return _MODEL_LOADERS[load_looped_config(model_dir).model_type](model_dir, dtype, device)


def load_huginn_model(model_dir: PathLike, dtype: torch.dtype | str | None = None,
                      device: str | torch.device = "cpu") -> torch.nn.Module:
    """:class:`~loopline.models.huginn.HuginnForCausalLM` from a local ``huginn_raven`` directory (no remote
    code): upstream weight names; ``freqs_cis`` (a persisted RoPE table) is recomputed, not read; with
    ``tie_embeddings`` a missing ``lm_head.weight`` is ``transformer.wte.weight``."""
    config = load_looped_config(model_dir)
    if not isinstance(config, HuginnConfig):
        raise CheckpointError(f"{Path(model_dir) / CONFIG_FILE}: model_type is not \"huginn_raven\"")
    target = _resolve_dtype(dtype if dtype is not None else config.torch_dtype)
    weights = {k: v for k, v in load_weights(model_dir).items() if k != "freqs_cis"}
    where = Path(model_dir)
    try:
        weights = tie_checkpoint_weights(config, weights)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    with torch.device("meta"):
        model = HuginnForCausalLM(config)
    assign_checkpoint(model, weights, where, device, target)
    return model.eval()


def dummy_looped_model(model_dir: PathLike, seed: int, dtype: torch.dtype | str | None = None,
                       device: str | torch.device = "cpu") -> torch.nn.Module:
    """The model of ``model_dir``'s config.json (any looped family) with seeded random weights, none read
    (vLLM's ``load_format="dummy"``: benchmarks and smoke tests)."""
    from loopline.models.huginn_tiny import random_huginn_state_dict
    from loopline.models.tiny import random_state_dict

    config = load_looped_config(model_dir)
    target = _resolve_dtype(dtype if dtype is not None else config.torch_dtype)
    build, weights = {"ouro": (OuroForCausalLM, random_state_dict),
                      "huginn_raven": (HuginnForCausalLM, random_huginn_state_dict)}[config.model_type]
    with torch.device("meta"):
        model = build(config)
    state = weights(config, seed=seed)
    if isinstance(config, HuginnConfig):
        state = tie_checkpoint_weights(config, state)
    assign_checkpoint(model, state, Path(model_dir), device, target)
    return model.eval()


def _huginn_config(raw: dict, path: Path, generation_eos: list[int]) -> HuginnConfig:
    try:
        return huginn_config_from_dict(raw, str(path), generation_eos)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


# Each looped family's config parser and model loader, by config.json's model_type.
_CONFIG_PARSERS = {"ouro": _config_from_dict, "huginn_raven": _huginn_config}
_MODEL_LOADERS = {"ouro": load_model, "huginn_raven": load_huginn_model}


_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def _pop_kv_scales(weights: dict[str, Tensor], config: OuroConfig, where: Path) -> tuple[Tensor, Tensor] | None:
    """Takes ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (FP8 KV scales: a scalar or one per KV
    head, every layer, positive and finite) out of ``weights``: ``([layers, kv_heads], [layers, kv_heads])``
    fp32, or None when the checkpoint has none."""
    found = {m.groups(): weights.pop(name) for name in list(weights) if (m := _KV_SCALE.fullmatch(name))}
    if not found:
        return None
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    out = torch.ones(2, layers, heads)
    for (layer, kind), t in found.items():
        name = f"model.layers.{layer}.self_attn.{kind}_scale"
        i = int(layer)
        if i >= layers:
            raise CheckpointError(f"{where}: {name}: the model has {layers} layers")
        if t.numel() not in (1, heads):
            raise CheckpointError(f"{where}: {name} has {t.numel()} values; allowed: 1 or one per KV head ({heads})")
        t = t.float().reshape(-1)
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise CheckpointError(f"{where}: {name} must be positive and finite, got {t.tolist()}")
        out[0 if kind == "k" else 1, i] = t.expand(heads)
    absent = [f"model.layers.{i}.self_attn.{kind}_scale" for i in range(layers) for kind in "kv"
              if (str(i), kind) not in found]
    if absent:
        raise CheckpointError(f"{where}: the checkpoint carries KV scales for some layers but not for "
                              f"{_summary(absent)}; allowed: k_scale and v_scale for every layer, or none")
    return out[0].contiguous(), out[1].contiguous()


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype={dtype} is not supported; allowed: {', '.join(DTYPES)}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- tokenizer ----------------------------------------------------------------------


def load_tokenizer(path: PathLike, chat_template: str | None = None):
    """A transformers fast tokenizer from local files only (a directory or a ``tokenizer.json``);
    ``chat_template`` (``EngineArgs.chat_template``: a file or the template) replaces the checkpoint's.

    The directory's ``tokenizer_config.json`` (special tokens, chat template)
    is used when present. Built as the generic fast tokenizer straight from
    ``tokenizer.json``, so no model class lookup or remote code is involved.
    """
    tokenizer = _load_tokenizer(Path(path))
    if chat_template is not None:
        from loopline.vllm_flags import read_chat_template

        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def _load_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    if path.is_file():
        if path.name != TOKENIZER_FILE:
            raise CheckpointError(f"{path}: not a {TOKENIZER_FILE} file; pass a directory or a {TOKENIZER_FILE}")
        _check_tokenizer_sizes([path])
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    model_dir = _existing_dir(path)
    if not (model_dir / TOKENIZER_FILE).is_file():
        raise CheckpointError(f"{model_dir}: no tokenizer: {TOKENIZER_FILE} is missing (fast tokenizers only)")
    _check_tokenizer_sizes([model_dir / name for name in (TOKENIZER_FILE, *_TOKENIZER_SIDE_FILES)])
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers/tokenizers raise KeyError, Exception, ... on malformed files
        raise CheckpointError(f"{model_dir / TOKENIZER_FILE}: cannot load the tokenizer ({type(e).__name__}: {e})") from e


# The largest real tokenizer.json files (vocabularies of 256k tokens) hold ~35 MB; the files beside it (special
# tokens, added tokens, the chat template) are the JSON files' size at most. Checked before transformers parses
# any of them, as the checkpoint's JSON files are (a sparse file of gigabytes costs nothing to make).
MAX_TOKENIZER_BYTES = 64 * 2**20
_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                         "chat_template.json")


def _check_tokenizer_sizes(files: list[Path]) -> None:
    """Refuses (``CheckpointError`` naming the file and the limit) a tokenizer file larger than its limit."""
    for f in files:
        limit = MAX_TOKENIZER_BYTES if f.name == TOKENIZER_FILE else MAX_JSON_BYTES
        size = f.stat().st_size if f.is_file() else 0
        if size > limit:
            raise CheckpointError(f"{f}: {size:,} bytes; a tokenizer's {f.name} may hold at most {limit:,}")


def chat_end_token_ids(tokenizer) -> list[int]:
    """Ids that end a chat turn: ``<|im_end|>`` when the vocabulary has it (Ouro's ChatML)."""
    token_id = tokenizer.get_vocab().get("<|im_end|>")
    return [] if token_id is None else [token_id]


# --- helpers ------------------------------------------------------------------------


# "owner/name" with the characters the Hugging Face Hub allows: what a vLLM user passes as --model.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _existing_dir(model_dir: PathLike) -> Path:
    path = Path(model_dir)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"model directory {path} is not a directory")
    # NOTE: loopline never downloads (docs/security.md: paths stay local), so say how to get the files here.
    if _HUB_ID.match(str(model_dir)):
        local = "./" + str(model_dir).split("/")[1]
        raise CheckpointError(
            f"model {str(model_dir)!r} is not a local directory; loopline loads local checkpoint directories only "
            f"and never downloads: fetch it first, e.g. `hf download {model_dir} --local-dir {local}` "
            f"(huggingface_hub), then pass {local}")
    raise CheckpointError(f"model directory {path} does not exist (loopline loads local checkpoint directories only; "
                          "download the weights first, e.g. with `hf download <repo> --local-dir <dir>`)")


# The most a checkpoint's JSON file (config, index, generation config) may hold: the largest real ones are a few
# hundred KB (a 1,000-shard index); a file claiming more is refused before a byte of it is read (a sparse
# 1.5 GB config.json otherwise cost 3 GB of memory on the engine thread).
MAX_JSON_BYTES = 16 * 2**20


def read_checkpoint_json(path: Path, *, required: bool) -> dict | None:
    """A checkpoint's JSON file as an object (None when absent and not ``required``), read within
    :data:`MAX_JSON_BYTES`; anything else is a :class:`CheckpointError` naming the file."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: file not found")
        return None
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: {size:,} bytes; a checkpoint's JSON files may hold at most {MAX_JSON_BYTES:,}")
    try:
        with path.open("rb") as f:
            text = f.read(MAX_JSON_BYTES + 1).decode("utf-8")  # (the file may grow after the stat)
        if len(text) > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: more than {MAX_JSON_BYTES:,} bytes")
        raw = json.loads(text)
    except RecursionError as e:  # e.g. arrays nested 100,000 deep
        raise CheckpointError(f"{path}: invalid JSON (nested too deeply)") from e
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and ints of more than 4,300 digits
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    return raw


def _summary(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return f"{shown} ({len(items)} in all)" if len(items) > limit else shown
