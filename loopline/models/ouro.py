"""The Ouro looped language model: pure math, no requests, pages or policies.

Ouro runs one shared stack of decoder layers ``total_ut_steps`` times per token
(docs/design.md, 'The model: loops and exits'). The model exposes the three stages an engine schedules
separately, all on *flattened* token rows (``[N, hidden]``):

* :meth:`OuroForCausalLM.embed` -- the prelude (token ids -> hidden),
* :meth:`OuroForCausalLM.loop` -- one traversal of every layer, the final norm
  and the exit gate,
* :meth:`OuroForCausalLM.head` -- the coda (``lm_head``).

Attention is delegated to an :class:`Attention` object passed into ``loop``: the
engine passes a paged backend that knows each row's KV plane, the dense forward
passes a causal attention over ``[batch, seq]``. Modules never hold a cache,
because the same module runs at every loop.

Parameter names are the Hugging Face names (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``, ...), so ``state_dict()`` round-trips real checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol

import torch
from torch import Tensor, nn

from loopline.models.ops import TORCH_OPS, Rope, TorchOps, upcast


@dataclass(frozen=True)
class OuroConfig:
    """Architecture of an Ouro checkpoint (the fields of its ``config.json``)."""

    model_type: ClassVar[str] = "ouro"
    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    max_position_embeddings: int = 65536
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (0,)
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_loops(self) -> int:
        return self.total_ut_steps

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def parameter_count(shape) -> int:
    """Parameters of :class:`OuroForCausalLM` with ``shape``'s sizes (an :class:`OuroConfig` or any object with
    its size fields): embeddings and ``lm_head``, per layer q/k/v/o, gate/up/down and four norms, the final
    norm and the exit gate."""
    q, kv, h = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim, shape.hidden_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * shape.intermediate_size + 4 * h
    return 2 * shape.vocab_size * h + shape.num_hidden_layers * per_layer + 2 * h + 1


class Attention(Protocol):
    """Attention for one layer of one loop over flattened rows.

    ``q``: ``[N, num_heads, head_dim]``; ``k``, ``v``: ``[N, num_kv_heads, head_dim]``,
    before rotary: the object applies ``rope`` to q and k first (``q, k = rope(q, k)``),
    or fuses it with storing K/V. Returns ``[N, num_heads, head_dim]``. The object
    knows where each row's keys live (its KV plane, its positions); ``layer``
    is the index inside the shared stack.
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return TORCH_OPS.rms_norm(x, self.weight, self.eps)


class OuroAttention(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.q_proj = nn.Linear(h, config.q_size, bias=False)
        self.k_proj = nn.Linear(h, config.kv_size, bias=False)
        self.v_proj = nn.Linear(h, config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, h, bias=False)

    def forward(self, qkv: tuple[Tensor, Tensor, Tensor], rope: Rope, layer: int, attn: Attention,
                ops: TorchOps) -> Tensor:
        """Attention of projected ``q, k, v`` (``ops.project_qkv`` of the normed input), then ``o_proj``."""
        q, k, v = qkv
        n = q.shape[0]
        c = self.config
        q = q.view(n, c.num_attention_heads, c.head_dim)
        k = k.view(n, c.num_key_value_heads, c.head_dim)
        v = v.view(n, c.num_key_value_heads, c.head_dim)
        o = attn(layer, q, k, v, rope)
        return ops.linear(self.o_proj, o.reshape(n, c.q_size))


class OuroMLP(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, ops: TorchOps = TORCH_OPS) -> Tensor:
        return ops.swiglu_down(self, *ops.project_gate_up(self, x))


class OuroDecoderLayer(nn.Module):
    """Sandwich-norm decoder layer: a norm before and after both branches."""

    def __init__(self, config: OuroConfig, index: int) -> None:
        super().__init__()
        self.index = index
        eps = config.rms_norm_eps
        self.self_attn = OuroAttention(config)
        self.mlp = OuroMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)

    def forward(self, x: Tensor, branch: Tensor | None, branch_weight: Tensor | None, rope: Rope, attn: Attention,
                ops: TorchOps) -> tuple[Tensor, Tensor]:
        """x: the residual stream, still without ``branch`` (the previous layer's MLP output, None in the
        first layer), which adds as ``rms_norm(branch) * branch_weight``. Returns the new residual stream
        and this layer's MLP output, likewise not yet added: each residual add, the norm after it and
        the projection that reads the norm are one op (``ops.norm_project_*``), fused where one row runs."""
        eps = self.input_layernorm.eps
        x, qkv = ops.norm_project_qkv(self.self_attn, x, branch, branch_weight, self.input_layernorm.weight, eps)
        a = self.self_attn(qkv, rope, self.index, attn, ops)
        x, gate_up = ops.norm_project_gate_up(self.mlp, x, a, self.input_layernorm_2.weight,
                                              self.post_attention_layernorm.weight, eps)
        return x, ops.swiglu_down(self.mlp, *gate_up)


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        # nn.Embedding's own N(0, 1) init, skipped on the meta device (load_model builds there): on meta it
        # runs through torch._refs, whose first use imports torch._dynamo (~1.4 s of every process's start).
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)


@dataclass
class DenseOutput:
    """All loops of a dense forward. Shapes use R = loops, B = batch, T = sequence."""

    hidden_states: Tensor  # [R, B, T, hidden], post-norm h_r of every loop
    gate_logits: Tensor  # [R, B, T], fp32 logits of the exit gate
    logits: Tensor | None  # [R, B, T, vocab] fp32, when requested

    @property
    def exit_lambdas(self) -> Tensor:
        return torch.sigmoid(self.gate_logits)


class DenseCausalAttention:
    """Plain causal attention over ``[batch, seq]`` rows flattened batch-major.

    ``history(layer, k, v)`` may rewrite the keys/values each query sees (the
    replay of an engine's KV history uses it); by default keys are this loop's.
    """

    def __init__(self, batch: int, seq: int, history: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None) -> None:
        self.batch, self.seq = batch, seq
        self.history = history

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor:
        b, t = self.batch, self.seq
        q, k = rope(q, k)
        if self.history is not None:
            k, v = self.history(layer, k, v)
        # [B, heads, T, D]
        qd = q.view(b, t, *q.shape[1:]).transpose(1, 2)
        kd = k.view(b, t, *k.shape[1:]).transpose(1, 2)
        vd = v.view(b, t, *v.shape[1:]).transpose(1, 2)
        groups = qd.shape[1] // kd.shape[1]
        if groups > 1:
            kd = kd.repeat_interleave(groups, dim=1)
            vd = vd.repeat_interleave(groups, dim=1)
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(upcast(qd), upcast(kd).transpose(-1, -2)) * scale
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1), upcast(vd)).to(q.dtype)
        return out.transpose(1, 2).reshape(b * t, *q.shape[1:])


class OuroForCausalLM(nn.Module):
    """Ouro with Hugging Face parameter names and engine-facing stages."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.ops: TorchOps = TORCH_OPS  # inference kernels; the dense forward always uses the reference

    def use_ops(self, ops: TorchOps) -> "OuroForCausalLM":
        """Selects the implementation of the layer math used by :meth:`loop` (e.g. fused GPU kernels).

        Call it once the weights are on their device; ``ops.prepare`` may re-lay them out
        (keeping every parameter's name, shape and values)."""
        self.ops.release(self)
        self.ops = ops
        ops.prepare(self)
        return self

    # --- stages -----------------------------------------------------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        """Prelude: ``[N]`` token ids -> ``[N, hidden]``."""
        return self.model.embed_tokens(input_ids)

    def loop(self, hidden: Tensor, positions: Tensor, attn: Attention, ops: TorchOps | None = None) -> tuple[Tensor, Tensor]:
        """One traversal of the shared stack, the final norm and the exit gate.

        hidden: ``[N, hidden]``; positions: ``[N]``. Returns the post-norm hidden
        state ``h_r`` ``[N, hidden]`` (the next loop's input) and the fp32 gate
        logit ``[N]`` (``lambda_r = sigmoid(logit)``).
        """
        ops = ops or self.ops
        # NOTE: the RoPE gather is a plain (non-PDL) launch after the step's metadata is written; the fused
        # decode attention relies on that to read the history K/V before its grid-dependency wait.
        rope = Rope(*ops.cos_sin(positions, self.config.head_dim, self.config.rope_theta, hidden.dtype), ops)
        x, branch, branch_weight = hidden, None, None
        for layer in self.model.layers:
            x, branch = layer(x, branch, branch_weight, rope, attn, ops)
            branch_weight = layer.post_attention_layernorm_2.weight
        # The last residual add and the final norm (the next loop's input), and the exit gate on it.
        return ops.norm_exit_gate(self.model.early_exit_gate, x, branch, branch_weight, self.model.norm.weight,
                                  self.config.rms_norm_eps)

    def head(self, hidden: Tensor, needed: Tensor | None = None) -> Tensor:
        """Coda: ``[M, hidden]`` -> fp32 logits ``[M, vocab]``.

        ``needed`` (``[M]`` bool on the device): rows whose logits are used; the others may come back
        as zeros (the inference ops then skip reading ``lm_head`` for a step where nothing exits)."""
        return self.ops.logits(self.lm_head, hidden, needed)

    # --- the family seam (loopline.models.family): the stages above under the seam's names ----------------
    def prelude(self, input_ids: Tensor, positions: Tensor, attn: Attention) -> Tensor:
        """The seam's prelude: the embedding (Ouro's prelude has no attention)."""
        return self.embed(input_ids)

    def initial_state(self, injected: Tensor, positions: Tensor, seeds: Tensor) -> Tensor:
        """Loop 1 reads the embedding itself (nothing random; ``seeds`` unused)."""
        return injected

    def core(self, state: Tensor, injected: Tensor, positions: Tensor, attn: Attention) -> tuple[Tensor, Tensor]:
        """:meth:`loop` (Ouro injects nothing); the signal is the exit gate's logit."""
        return self.loop(state, positions, attn)

    def coda(self, state: Tensor, positions: Tensor, attn: Attention) -> Tensor:
        """:meth:`head` (Ouro's coda has no attention)."""
        return self.head(state)

    # --- dense, differentiable forward -----------------------------------------------
    def forward_dense(
        self,
        input_ids: Tensor,
        num_loops: int | None = None,
        *,
        compute_logits: bool = True,
        attention: Callable[[int], Attention] | None = None,
    ) -> DenseOutput:
        """Every loop over ``[B, T]`` token ids with causal attention, autograd-friendly.

        ``attention(r)`` may supply the attention object of loop ``r`` (1-based);
        the default is plain causal attention over this loop's keys, which is
        exactly the reference model.
        """
        b, t = input_ids.shape
        loops = num_loops or self.config.total_ut_steps
        positions = torch.arange(t, device=input_ids.device).repeat(b)
        h = self.embed(input_ids.reshape(-1))
        hiddens, gates = [], []
        for r in range(1, loops + 1):
            attn = attention(r) if attention is not None else DenseCausalAttention(b, t)
            h, g = self.loop(h, positions, attn, TORCH_OPS)
            hiddens.append(h.view(b, t, -1))
            gates.append(g.view(b, t))
        hidden_states = torch.stack(hiddens)
        logits = self.head(hidden_states) if compute_logits else None
        return DenseOutput(hidden_states, torch.stack(gates), logits)

    def forward(self, input_ids: Tensor, num_loops: int | None = None) -> DenseOutput:
        return self.forward_dense(input_ids, num_loops)
