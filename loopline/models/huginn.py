"""Huginn-0125 ("recurrent depth", ``model_type "huginn_raven"``): pure math, no requests, pages or policies.

Huginn runs a *prelude* of a few decoder layers once per token, then a *core block* of 4 layers ``r`` times
(``mean_recurrence`` = 32 by default), then a *coda* of a few layers (docs/model-families.md). Each core
iteration first injects the prelude's output ``e`` into the latent state ``s`` through the adapter,
``s <- adapter(concat(s, e))``. The latent state starts random (:meth:`HuginnForCausalLM.initial_state`).
Logits of a state: ``lm_head(ln_f(coda(ln_f(s))))`` (``ln_f`` is used twice, as upstream).

Every layer is a sandwich block: ``x = norm_2(x + attn(norm_1(x)))``, ``x = norm_4(x + mlp(norm_3(x)))``
with a fused ``Wqkv``, an optional per-head ``qk_bias`` added before RoPE, and *interleaved* RoPE (pairs
``(2i, 2i+1)``, angles and products in fp32). The MLP is SwiGLU with a fused ``fc`` (gate half first).

The stages are the family seam (:mod:`loopline.models.family`): :meth:`~HuginnForCausalLM.prelude`,
:meth:`~HuginnForCausalLM.initial_state`, :meth:`~HuginnForCausalLM.core` (one iteration),
:meth:`~HuginnForCausalLM.coda`, each on flattened rows ``[N, hidden]`` with an explicit attention object
per stage (and per iteration for the core), as in :mod:`loopline.models.ouro`. Parameter names are the
upstream ones (``transformer.core_block.0.attn.Wqkv.weight``, ``lm_head.weight``, ...).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopline.models.ops import Rope
from loopline.models.ouro import Attention, RMSNorm


@dataclass(frozen=True)
class HuginnConfig:
    """Architecture of a Huginn checkpoint (the fields of its ``config.json``; defaults: Huginn-0125)."""

    model_type: ClassVar[str] = "huginn_raven"
    vocab_size: int = 65536
    padded_vocab_size: int = 65536
    hidden_size: int = 5280  # config.json: n_embd
    intermediate_size: int = 17920
    num_attention_heads: int = 55  # config.json: num_attention_heads or n_heads
    num_key_value_heads: int = 55
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    mean_recurrence: int = 32
    rope_base: float = 50000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    bias: bool = False  # the adapter's bias
    tie_embeddings: bool = True
    init_std: float = 0.008703882797784892  # config.json: init_values.std, the latent state's std
    embed_scale: float = 72.6636084983398  # config.json: init_values.embed_scale
    block_size: int = 4096  # the context the model was trained for (RoPE table length upstream)
    bos_token_id: int | None = 65504
    eos_token_ids: tuple[int, ...] = (65505,)
    pad_token_id: int | None = 65509
    torch_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_loops(self) -> int:
        """Default number of core iterations (the family seam's name for ``mean_recurrence``)."""
        return self.mean_recurrence

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def max_position_embeddings(self) -> int:
        """The longest context the engine serves by default (``block_size``, the trained context)."""
        return self.block_size


# --- config.json --------------------------------------------------------------------------------------

# Upstream class names (config.json) of the one architecture implemented here.
_FIXED = {"injection_type": "linear", "state_init": "like-init", "block_class_name": "SandwichBlock",
          "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "norm_class_name": "RMSNorm_llama"}
_POSITIVE_INTS = ("vocab_size", "intermediate_size", "num_key_value_heads", "n_layers_in_prelude",
                  "n_layers_in_recurrent_block", "n_layers_in_coda", "mean_recurrence", "block_size")


def config_from_dict(raw: dict, where: str, generation_eos: list[int] = ()) -> HuginnConfig:
    """Validated :class:`HuginnConfig` of a ``config.json`` object (``where`` names the file in errors).

    Raises ``ValueError`` naming the field, its value and what is allowed. Keys not modelled here are
    kept in ``extra``."""
    def fail(key: str, value: Any, allowed: str) -> ValueError:
        return ValueError(f"{where}: {key}={value!r} is not supported; allowed: {allowed}")

    if raw.get("model_type") != "huginn_raven":
        raise fail("model_type", raw.get("model_type"), '"huginn_raven"')
    for key, expected in _FIXED.items():
        if raw.get(key, expected) != expected:
            raise fail(key, raw[key], repr(expected))
    if raw.get("test_time_noise", 0) not in (0, 0.0):
        raise fail("test_time_noise", raw["test_time_noise"], "0 (noise injected at test time is not supported)")

    def positive_int(key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise fail(key, value, "a positive integer")
        return value

    def positive_float(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise fail(key, value, "a positive number")
        return float(value)

    def flag(key: str, default: bool) -> bool:
        value = raw.get(key, default)
        if not isinstance(value, bool):
            raise fail(key, value, "true or false")
        return value

    hidden = positive_int("n_embd", raw.get("n_embd"))
    heads_key = "num_attention_heads" if "num_attention_heads" in raw else "n_heads"
    heads = positive_int(heads_key, raw.get(heads_key))
    ints = {key: positive_int(key, raw[key]) for key in _POSITIVE_INTS if key in raw}
    for key in ("vocab_size", "intermediate_size"):
        if key not in ints:
            raise ValueError(f"{where}: missing required field {key}")
    kv_heads = ints.setdefault("num_key_value_heads", heads)
    if hidden % heads:
        raise fail("n_embd", hidden, f"a multiple of {heads_key}={heads}")
    if (hidden // heads) % 2:
        raise fail("n_embd", hidden, f"n_embd / {heads_key} even (RoPE rotates pairs of channels)")
    if heads % kv_heads:
        raise fail("num_key_value_heads", kv_heads, f"a divisor of {heads_key}={heads}")
    qk_bias = flag("qk_bias", False)
    if qk_bias and kv_heads != heads:
        raise fail("num_key_value_heads", kv_heads, f"{heads} (= {heads_key}) when qk_bias is true: the key bias is per query head")
    multiple = positive_int("padding_multiple", raw.get("padding_multiple", 1))
    vocab = ints["vocab_size"]
    padded = raw.get("padded_vocab_size")
    padded = -(-vocab // multiple) * multiple if padded is None else positive_int("padded_vocab_size", padded)
    if padded < vocab:
        raise fail("padded_vocab_size", padded, f"at least vocab_size={vocab}")
    layers = (ints.get("n_layers_in_prelude", 2), ints.get("n_layers_in_recurrent_block", 4), ints.get("n_layers_in_coda", 2))
    if "n_layers" in raw and raw["n_layers"] != sum(layers):
        raise fail("n_layers", raw["n_layers"], f"{sum(layers)} (prelude + recurrent block + coda layers)")
    init_values = raw.get("init_values", {})
    if not isinstance(init_values, dict):
        raise fail("init_values", init_values, '{"std": ..., "embed_scale": ...}')
    std = positive_float("init_values.std", init_values.get("std", HuginnConfig.init_std))
    embed_scale = positive_float("init_values.embed_scale", init_values.get("embed_scale", 1.0))
    dtype_key = "torch_dtype" if "torch_dtype" in raw else "dtype"
    torch_dtype = raw.get(dtype_key) or "float32"
    if torch_dtype not in ("float32", "float16", "bfloat16"):
        raise fail(dtype_key, torch_dtype, "float32, float16, bfloat16")

    def token_id(key: str, value: Any) -> int | None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < padded):
            raise fail(key, value, f"null or an integer in [0, {padded})")
        return value

    eos = raw.get("eos_token_id")
    eos_list = [] if eos is None else eos if isinstance(eos, list) else [eos]
    for value in (*eos_list, *generation_eos):
        token_id("eos_token_id", value)
    consumed = {"n_embd", heads_key, *_POSITIVE_INTS, "padding_multiple", "padded_vocab_size", "n_layers",
                "init_values", "rope_base", "norm_eps", "qk_bias", "bias", "tie_embeddings", dtype_key,
                "bos_token_id", "eos_token_id", "pad_token_id"}
    return HuginnConfig(
        vocab_size=vocab, padded_vocab_size=padded, hidden_size=hidden,
        intermediate_size=ints["intermediate_size"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        n_layers_in_prelude=layers[0], n_layers_in_recurrent_block=layers[1], n_layers_in_coda=layers[2],
        mean_recurrence=ints.get("mean_recurrence", 32),
        rope_base=positive_float("rope_base", raw.get("rope_base", 50000.0)),
        norm_eps=positive_float("norm_eps", raw.get("norm_eps", 1e-6)),
        qk_bias=qk_bias, bias=flag("bias", False), tie_embeddings=flag("tie_embeddings", True),
        init_std=std, embed_scale=embed_scale, block_size=ints.get("block_size", 4096),
        bos_token_id=token_id("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys([*eos_list, *generation_eos])),
        pad_token_id=token_id("pad_token_id", raw.get("pad_token_id")),
        torch_dtype=torch_dtype, extra={k: v for k, v in raw.items() if k not in consumed})


def config_to_dict(config: HuginnConfig) -> dict:
    """The ``config.json`` object of ``config`` (upstream key names); :func:`config_from_dict` reads it back."""
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
        "vocab_size": config.vocab_size, "padded_vocab_size": config.padded_vocab_size, "n_embd": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "n_layers_in_prelude": config.n_layers_in_prelude,
        "n_layers_in_recurrent_block": config.n_layers_in_recurrent_block, "n_layers_in_coda": config.n_layers_in_coda,
        "n_layers": config.n_layers_in_prelude + config.n_layers_in_recurrent_block + config.n_layers_in_coda,
        "mean_recurrence": config.mean_recurrence, "rope_base": config.rope_base, "norm_eps": config.norm_eps,
        "qk_bias": config.qk_bias, "bias": config.bias, "tie_embeddings": config.tie_embeddings,
        "init_values": {"std": config.init_std, "embed_scale": config.embed_scale}, "block_size": config.block_size,
        "injection_type": "linear", "state_init": "like-init", "bos_token_id": config.bos_token_id,
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None, "pad_token_id": config.pad_token_id,
        "torch_dtype": config.torch_dtype,
    }


def tie_checkpoint_weights(config: HuginnConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """``weights`` with ``lm_head.weight`` filled from ``transformer.wte.weight`` when the config ties them and
    the checkpoint stores only the embedding; a tied checkpoint storing both must store equal tensors."""
    head, wte = weights.get("lm_head.weight"), weights.get("transformer.wte.weight")
    if not config.tie_embeddings or wte is None:
        return weights
    if head is None:
        return {**weights, "lm_head.weight": wte}
    if head.shape != wte.shape or not torch.equal(head, wte):
        raise ValueError("tie_embeddings=true but lm_head.weight differs from transformer.wte.weight; "
                         "allowed: equal tensors, or lm_head.weight absent")
    return weights


# --- layers -------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class InterleavedRope(Rope):
    """Huginn's RoPE: channel pairs ``(2i, 2i+1)`` rotated by ``position * base^(-2i/D)``; ``cos``/``sin``
    are fp32 ``[N, D/2]`` and the rotation runs in fp32, cast back to q's dtype (as upstream)."""

    def __call__(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos[:, None, :], self.sin[:, None, :]

        def rot(x: Tensor) -> Tensor:
            pairs = x.float().unflatten(-1, (-1, 2))
            a, b = pairs[..., 0], pairs[..., 1]
            return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2).to(q.dtype)

        return rot(q), rot(k)


def interleaved_rope(positions: Tensor, head_dim: int, base: float) -> InterleavedRope:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return InterleavedRope(angles.cos(), angles.sin())


class HuginnAttention(nn.Module):
    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.Wqkv = nn.Linear(h, h + 2 * config.kv_size, bias=False)
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, config.num_attention_heads, d))
        self.proj = nn.Linear(h, h, bias=False)

    def forward(self, x: Tensor, rope: Rope, layer: int, attn: Attention) -> Tensor:
        c, n = self.config, x.shape[0]
        q, k, v = self.Wqkv(x).split([c.hidden_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(n, c.num_attention_heads, c.head_dim)
        k = k.view(n, c.num_key_value_heads, c.head_dim)
        v = v.view(n, c.num_key_value_heads, c.head_dim)
        if c.qk_bias:
            q, k = (q + self.qk_bias[0]).to(q.dtype), (k + self.qk_bias[1]).to(k.dtype)
        return self.proj(attn(layer, q, k, v, rope).reshape(n, c.hidden_size))


class GatedMLP(nn.Module):
    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        eps = config.norm_eps
        self.norm_1 = RMSNorm(config.hidden_size, eps)
        self.attn = HuginnAttention(config)
        self.norm_2 = RMSNorm(config.hidden_size, eps)
        self.mlp = GatedMLP(config)
        self.norm_3 = RMSNorm(config.hidden_size, eps)
        self.norm_4 = RMSNorm(config.hidden_size, eps)

    def forward(self, x: Tensor, rope: Rope, layer: int, attn: Attention) -> Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), rope, layer, attn))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class HuginnForCausalLM(nn.Module):
    """Huginn with upstream parameter names and the family seam's stages."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, h),
            prelude=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_prelude)),
            adapter=nn.Linear(2 * h, h, bias=config.bias),
            core_block=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block)),
            coda=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_coda)),
            ln_f=RMSNorm(h, config.norm_eps),
        ))
        # NOTE: a separate parameter even when tied: the loader fills it from wte when the checkpoint has
        # only one of them, and a tied checkpoint that carries both must carry equal tensors (checked there).
        self.lm_head = nn.Linear(h, config.padded_vocab_size, bias=False)

    def _rope(self, positions: Tensor) -> InterleavedRope:
        return interleaved_rope(positions, self.config.head_dim, self.config.rope_base)

    @staticmethod
    def _blocks(blocks: nn.ModuleList, x: Tensor, rope: Rope, attn: Attention) -> Tensor:
        for layer, block in enumerate(blocks):
            x = block(x, rope, layer, attn)
        return x

    # --- stages (the family seam) --------------------------------------------------------------------
    def prelude(self, input_ids: Tensor, positions: Tensor, attn: Attention) -> Tensor:
        """``[N]`` token ids -> the injected embedding ``e`` ``[N, hidden]`` (scaled embedding, prelude
        layers). ``attn`` is the prelude's attention (layers ``0..n_layers_in_prelude-1``)."""
        e = self.transformer.wte(input_ids)
        if self.config.embed_scale != 1.0:
            e = e * self.config.embed_scale
        return self._blocks(self.transformer.prelude, e, self._rope(positions), attn)

    def initial_state(self, injected: Tensor, positions: Tensor, seeds: Tensor) -> Tensor:
        """The random latent state ``s_0`` ``[N, hidden]`` of each row: upstream's distribution (a normal
        of std ``init_std`` truncated to +-3 std, times ``embed_scale``) drawn from a counter-based hash of
        ``(seeds[i], positions[i], channel)``, so a token's state depends only on its request's seed and
        its position -- never on batching, the device's RNG or the step it runs in."""
        c = self.config
        z = truncated_normal_hash(seeds, positions, c.hidden_size)
        return (z * (c.init_std * c.embed_scale)).to(device=injected.device, dtype=injected.dtype)

    def core(self, state: Tensor, injected: Tensor, positions: Tensor, attn: Attention) -> tuple[Tensor, None]:
        """One core iteration: ``adapter(concat(s, e))``, then the core block's layers. Returns the new
        raw latent state and no exit signal (the convergence exit reads the coda's logits)."""
        x = self.transformer.adapter(torch.cat([state, injected], dim=-1))
        return self._blocks(self.transformer.core_block, x, self._rope(positions), attn), None

    def coda(self, state: Tensor, positions: Tensor, attn: Attention) -> Tensor:
        """fp32 logits ``[N, padded_vocab]`` of latent states: ``lm_head(ln_f(coda(ln_f(s))))``. ``attn``
        is the coda's attention; running the coda writes the rows' coda K/V."""
        return self.head(self.coda_hidden(state, positions, attn))

    def coda_hidden(self, state: Tensor, positions: Tensor, attn: Attention) -> Tensor:
        """The coda without ``lm_head``: ``ln_f(coda(ln_f(s)))`` ``[N, hidden]`` (the engine keeps this per
        row and runs :meth:`head` only on rows it samples)."""
        ln_f = self.transformer.ln_f
        return ln_f(self._blocks(self.transformer.coda, ln_f(state), self._rope(positions), attn))

    def head(self, hidden: Tensor, needed: Tensor | None = None) -> Tensor:
        """fp32 logits of :meth:`coda_hidden` rows (``needed`` is accepted for the engine's call and unused:
        every row's logits are computed)."""
        return self.lm_head(hidden).float()

    def use_ops(self, ops: Any) -> HuginnForCausalLM:
        """Huginn runs its layers in plain torch; the engine's fused layer ops (Ouro's) are not used."""
        return self


# --- the latent initial state ---------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2**32. The
    products wrap in int64 on every device; the low 32 bits kept are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def truncated_normal_hash(seeds: Tensor, positions: Tensor, width: int) -> Tensor:
    """fp32 ``[N, width]`` standard normals truncated to [-3, 3], a pure function of ``(seed, position,
    channel)``: the hash gives a uniform in (0, 1) (24 bits), the inverse normal CDF maps it into the
    truncated range."""
    device = positions.device
    seeds = seeds.to(device=device, dtype=torch.int64) & _MASK32
    pos = positions.to(torch.int64) & _MASK32
    channels = torch.arange(width, device=device, dtype=torch.int64)
    h = _mix32(_mix32(_mix32(seeds) ^ pos)[:, None] ^ channels[None, :])
    u = ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)
    lo = 0.5 * math.erfc(3.0 / math.sqrt(2.0))  # Phi(-3)
    return torch.special.ndtri(lo + u * (1.0 - 2.0 * lo)).float()


def parameter_count(config: HuginnConfig) -> int:
    """Parameters of :class:`HuginnForCausalLM` (``lm_head`` counted once when tied)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    per_layer = h * (h + 2 * config.kv_size) + h * h + 3 * h * i + 4 * h + (2 * config.num_attention_heads * d if config.qk_bias else 0)
    layers = config.n_layers_in_prelude + config.n_layers_in_recurrent_block + config.n_layers_in_coda
    embeddings = config.padded_vocab_size * h * (1 if config.tie_embeddings else 2)
    return embeddings + layers * per_layer + 2 * h * h + (h if config.bias else 0) + h
