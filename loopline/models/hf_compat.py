"""A transformers-compatible Ouro (``model_type "ouro"``) on loopline's model math.

For users who want ``transformers`` APIs -- ``from_pretrained``, ``generate``,
training with a loss -- and for the Hugging Face baseline of ``loopline bench``.

* :class:`OuroHFConfig` is a ``PretrainedConfig`` with the fields of Ouro's
  ``config.json``.
* :class:`OuroHFForCausalLM` wraps :class:`~loopline.models.ouro.OuroForCausalLM`
  (the same ``embed`` / ``loop`` / ``head`` code the engine runs) and registers its
  ``model`` and ``lm_head`` modules directly, so parameter names are the Hugging
  Face ones (``model.embed_tokens.weight``, ``lm_head.weight``, ...) and real
  checkpoints load with ``from_pretrained``.

It always runs the full depth (``total_ut_steps`` loops) and returns the last
loop's logits -- Ouro's default ``early_exit_threshold`` of 1.0. The KV cache
keeps one entry per (loop, layer): a ``transformers.DynamicCache`` with
``num_hidden_layers * total_ut_steps`` layers, entry ``loop * L + layer`` (the
layout of the upstream remote code). Left padding works through the usual 2-D
``attention_mask``: positions come from its cumulative sum and padded keys are
masked. Packed sequences (``position_ids`` restarting at 0 at each sequence start
and no ``attention_mask``, as RL trainers pass them) attend within their sequence.

NOTE: transformers 5.x renamed the cache argument and output field from
``past_key_values`` to ``cache`` (5.24 uses ``cache``); ``forward`` accepts both
and fills whichever field the installed ``CausalLMOutputWithPast`` has.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from loopline.models.ops import Rope
from loopline.models.ouro import OuroConfig, OuroForCausalLM

_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


# Fields with the same name and meaning in OuroConfig and the Hugging Face config.
_SHARED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "total_ut_steps",
                  "early_exit_threshold", "max_position_embeddings", "bos_token_id", "pad_token_id",
                  "initializer_range")


class OuroHFConfig(PretrainedConfig):
    """Ouro's ``config.json`` as a transformers config (defaults: Ouro-1.4B)."""

    model_type = "ouro"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(self, vocab_size: int = 49152, hidden_size: int = 2048, intermediate_size: int = 5632,
                 num_hidden_layers: int = 24, num_attention_heads: int = 16, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, hidden_act: str = "silu", max_position_embeddings: int = 65536,
                 initializer_range: float = 0.02, rms_norm_eps: float = 1e-6, use_cache: bool = True,
                 rope_theta: float | None = None, rope_scaling: dict | None = None, total_ut_steps: int = 4,
                 early_exit_threshold: float = 1.0, bos_token_id: int | None = 0, eos_token_id: int | list[int] | None = 0,
                 pad_token_id: int | None = None, tie_word_embeddings: bool = False, **kwargs: Any) -> None:
        # transformers >= 5 may write rope_parameters instead of rope_theta.
        rope_parameters = kwargs.pop("rope_parameters", None) or {}
        if rope_scaling is not None or rope_parameters.get("rope_type", "default") != "default":
            raise ValueError(f"OuroHFConfig: RoPE scaling is not supported (rope_scaling={rope_scaling!r}, "
                             f"rope_parameters={rope_parameters!r})")
        if kwargs.get("use_sliding_window"):
            raise ValueError("OuroHFConfig: use_sliding_window=True is not supported")
        kwargs["sliding_window"] = None  # as upstream when use_sliding_window is false
        layer_types = kwargs.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"OuroHFConfig: layer_types must all be 'full_attention', got {sorted(set(layer_types))}")
        if hidden_act != "silu":
            raise ValueError(f"OuroHFConfig: hidden_act={hidden_act!r} is not supported; allowed: 'silu'")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = float(rope_theta if rope_theta is not None else rope_parameters.get("rope_theta", 1_000_000.0))
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def to_ouro_config(self) -> OuroConfig:
        """The loopline :class:`OuroConfig` of the same architecture."""
        eos = self.eos_token_id
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        dtype = getattr(self, "dtype", None) or "float32"
        return OuroConfig(**{k: getattr(self, k) for k in _SHARED_FIELDS}, eos_token_ids=eos_ids,
                          torch_dtype=str(dtype).removeprefix("torch."))

    @classmethod
    def from_ouro_config(cls, config: OuroConfig) -> "OuroHFConfig":
        eos = list(config.eos_token_ids)
        return cls(**{k: getattr(config, k) for k in _SHARED_FIELDS},
                   eos_token_id=(eos[0] if len(eos) == 1 else eos) if eos else None)


class _CachedLoopAttention:
    """Attention of one loop over ``[B, T]`` rows, reading and appending its (loop, layer) cache entries.

    ``allowed``: ``[B, 1, T, S]`` bool, True where a query may attend a key
    (causal, not padding); S = cached + new tokens.
    """

    def __init__(self, cache: Cache | None, first_entry: int, batch: int, seq: int, allowed: Tensor) -> None:
        self.cache, self.first_entry = cache, first_entry
        self.batch, self.seq, self.allowed = batch, seq, allowed

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor:
        b, t = self.batch, self.seq
        q, k = rope(q, k)
        # [N, heads, D] -> [B, heads, T, D]
        q = q.view(b, t, *q.shape[1:]).transpose(1, 2)
        k = k.view(b, t, *k.shape[1:]).transpose(1, 2)
        v = v.view(b, t, *v.shape[1:]).transpose(1, 2)
        if self.cache is not None:
            k, v = self.cache.update(k, v, self.first_entry + layer)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed)
        return out.transpose(1, 2).reshape(b * t, out.shape[1], out.shape[-1])


def _positions_and_mask(attention_mask: Tensor | None, past: int, batch: int, seq: int,
                        device: torch.device) -> tuple[Tensor, Tensor]:
    """Token positions ``[B, T]`` and the attention mask ``[B, 1, T, past + T]`` (bool)."""
    total = past + seq
    if attention_mask is None:
        valid = torch.ones(batch, total, dtype=torch.bool, device=device)
    else:
        if attention_mask.dim() != 2 or attention_mask.shape[1] != total:
            raise ValueError(f"attention_mask must be [batch, past + new tokens] = [{batch}, {total}], "
                             f"got {list(attention_mask.shape)}")
        valid = attention_mask.to(device=device, dtype=torch.bool)
    # Left padding does not shift positions: a token's position counts the real tokens before it.
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    query_pos = torch.arange(past, total, device=device)
    causal = torch.arange(total, device=device)[None, :] <= query_pos[:, None]  # [T, S]
    allowed = causal[None] & valid[:, None, :]
    # NOTE: a padding query has no key to attend; let it see every key so its (ignored) output is finite.
    # NaN there would leak into real rows through 0 * NaN in the next loop's attention.
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return positions, allowed[:, None]


def _same_sequence(position_ids: Tensor) -> Tensor:
    """``[B, 1, T, T]`` bool: True where query and key belong to the same packed sequence.

    Packed rows (trainers' "remove padding" layout: ``[1, total tokens]``, no attention mask) restart
    their positions at 0 at each sequence start, as flash-attention's varlen path reads them.
    """
    seq = (position_ids == 0).long().cumsum(-1)  # [B, T]
    return (seq[:, :, None] == seq[:, None, :])[:, None]


class OuroLayerStack(nn.Module):
    """The shared decoder layers (``model.layers.{i}``), called once per forward to run every loop.

    It holds the loopline model's own layers (no copies). Its call runs a computation on the
    loopline model, so every layer parameter is read inside one call of this module: a wrapper
    that gathers parameters around a module's call (an FSDP unit) takes the stack as one unit.
    Per-layer units would not work: the layer math reads a layer's last norm inside the next
    layer's call (fused add + norm), and every layer runs once per loop. A plain module that
    indexes like a list, not an ``nn.ModuleList``: torch 2.11's ``fully_shard`` refuses every
    ``ModuleList``, also one that implements ``forward``.
    """

    def __init__(self, core: OuroForCausalLM) -> None:
        super().__init__()
        for i, layer in enumerate(core.model.layers):
            self.add_module(str(i), layer)
        object.__setattr__(self, "_core", core)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> nn.Module:
        return list(self._modules.values())[index]

    def forward(self, compute: Callable[[OuroForCausalLM], Any]) -> Any:
        """``compute(loopline model)``, inside this module's call."""
        return compute(self._core)


class OuroHFModel(nn.Module):
    """The trunk's modules under the Hugging Face names (``model.embed_tokens``, ``model.layers``, ...)."""

    def __init__(self, core: OuroForCausalLM) -> None:
        super().__init__()
        self.embed_tokens = core.model.embed_tokens
        self.layers = OuroLayerStack(core)
        self.norm, self.early_exit_gate = core.model.norm, core.model.early_exit_gate


class OuroHFForCausalLM(PreTrainedModel, GenerationMixin):
    """Ouro for ``transformers``: full depth, last loop's logits, a (loop, layer) KV cache."""

    config_class = OuroHFConfig
    base_model_prefix = "model"
    # NOTE: the layer stack is one wrapping unit (OuroLayerStack's docstring says why)
    _no_split_modules = ["OuroLayerStack"]
    _supports_sdpa = True

    def __init__(self, config: OuroHFConfig) -> None:
        super().__init__(config)
        self._attach(OuroForCausalLM(config.to_ouro_config()))
        self.post_init()

    def _attach(self, core: OuroForCausalLM) -> None:
        # NOTE: register the core's modules under the HF names; keep the core itself
        # out of the module tree so no parameter appears twice or under "core.".
        self.model = OuroHFModel(core)
        self.lm_head = core.lm_head
        object.__setattr__(self, "_core", core)

    @classmethod
    def from_ouro(cls, core: OuroForCausalLM) -> "OuroHFForCausalLM":
        """Wraps an existing loopline model; the weights are shared, not copied."""
        config = OuroHFConfig.from_ouro_config(core.config)
        with torch.device("meta"):
            hf = cls(config)
        hf._attach(core)
        return hf

    @property
    def ouro(self) -> OuroForCausalLM:
        """The wrapped loopline model (same parameters)."""
        return self._core

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Cache | None = None, past_key_values: Cache | None = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        """Runs all ``total_ut_steps`` loops over ``[B, T]`` new tokens; logits of the last loop (fp32)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        cfg = self.config
        b, t = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        device = (input_ids if inputs_embeds is None else inputs_embeds).device
        past = 0
        if cache is not None:
            _ensure_cache_entries(cache, cfg.num_hidden_layers * cfg.total_ut_steps)
            past = cache.get_seq_length(0)
        positions, allowed = _positions_and_mask(attention_mask, past, b, t, device)
        if position_ids is not None:
            positions = position_ids
            if attention_mask is None and past == 0:
                allowed = allowed & _same_sequence(position_ids)

        def trunk(core: OuroForCausalLM) -> Tensor:
            h = core.embed(input_ids) if inputs_embeds is None else inputs_embeds
            h, flat_pos = h.reshape(b * t, -1), positions.reshape(-1)
            for loop in range(cfg.total_ut_steps):
                h, _ = core.loop(h, flat_pos, _CachedLoopAttention(cache, loop * cfg.num_hidden_layers, b, t, allowed))
            return h.view(b, t, -1)

        h = self.model.layers(trunk)
        logits = self._core.head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})


def _ensure_cache_entries(cache: Cache, entries: int) -> None:
    """Grows a cache built from the config (one entry per layer) to one entry per (loop, layer)."""
    if isinstance(cache, DynamicCache) and len(cache.layers) < entries and getattr(cache, "layer_class_to_replicate", None) is None:
        cache.layers.extend(DynamicLayer() for _ in range(entries - len(cache.layers)))
