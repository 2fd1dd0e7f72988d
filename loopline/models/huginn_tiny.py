"""Tiny, deterministic Huginn (``huginn_raven``) checkpoints for tests, like :mod:`loopline.models.tiny` for Ouro.

:func:`make_tiny_huginn_checkpoint` writes a Hugging Face-style directory (``config.json`` with upstream
key names, ``generation_config.json``, ``model.safetensors`` with upstream weight names, the tiny byte-level
tokenizer) that :func:`loopline.models.loader.load_huginn_model` reads like a real Huginn-0125 directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from loopline.models.huginn import HuginnConfig, HuginnForCausalLM, config_to_dict
from loopline.models.ouro import RMSNorm
from loopline.models.tiny import _write_tokenizer

_TINY = dict(vocab_size=512, padded_vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=4, n_layers_in_prelude=2, n_layers_in_recurrent_block=4, n_layers_in_coda=2,
             mean_recurrence=6, rope_base=10000.0, norm_eps=1e-6, qk_bias=True, bias=False, tie_embeddings=True,
             init_std=0.1, embed_scale=8.0, block_size=4096, bos_token_id=0, eos_token_ids=(0,), pad_token_id=None,
             torch_dtype="float32")


def tiny_huginn_config(**overrides) -> HuginnConfig:
    """The tiny :class:`HuginnConfig` (4 heads of 16, 2 + 4 + 2 layers, 6 iterations) with ``overrides``."""
    names = {f.name for f in dataclasses.fields(HuginnConfig)} - {"extra"}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"tiny_huginn_config: unknown field(s) {unknown}; allowed: {', '.join(sorted(names))}")
    return HuginnConfig(**{**_TINY, **overrides})


def random_huginn_state_dict(config: HuginnConfig, seed: int = 0) -> dict[str, Tensor]:
    """Seeded random weights under upstream names (``lm_head.weight`` omitted when tied, as upstream
    checkpoints do). Norm weights ~ 1 + N(0, 0.1) and ``qk_bias`` ~ N(0, 0.1) so a dropped one shows;
    the embedding (= head when tied) has std ``2/sqrt(hidden)`` so output distributions are far from
    uniform and the convergence exit fires at varied iterations."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = HuginnForCausalLM(config)
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    wide = 2.0 / config.hidden_size**0.5
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        noise = torch.randn(t.shape, generator=generator)
        if name in norms:
            value = 1.0 + 0.1 * noise
        elif name.endswith("qk_bias"):
            value = 0.1 * noise
        elif name in ("transformer.wte.weight", "lm_head.weight"):
            value = wide * noise
        else:
            value = 0.05 * noise
        out[name] = value.to(getattr(torch, config.torch_dtype)).contiguous()
    return out


def make_tiny_huginn_checkpoint(path: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """Write a deterministic tiny Huginn checkpoint directory at ``path`` (``overrides``: HuginnConfig fields)."""
    from safetensors.torch import save_file

    config = tiny_huginn_config(**overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n", encoding="utf-8")
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}) + "\n",
        encoding="utf-8")
    save_file(random_huginn_state_dict(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(path, SimpleNamespace(vocab_size=config.vocab_size, max_position_embeddings=config.block_size))
    return path
