"""An independent, dense reference of Huginn-0125 ("recurrent depth") and a serial generation oracle.

Written from the semantics of the public modelling code (``recpre/raven_modeling_minimal.py`` in
seal-rg/recurrent-pretraining), in plain PyTorch. It never imports ``loopline``: weights come as a
``dict[str, Tensor]`` with upstream names, the architecture as the ``config.json`` dict (``n_embd``,
``num_attention_heads``, ``num_key_value_heads``, ``n_layers_in_prelude``, ``n_layers_in_recurrent_block``,
``n_layers_in_coda``, ``rope_base``, ``norm_eps``, ``qk_bias``, ``init_values.embed_scale``,
``tie_embeddings``). Speed is not a goal: every step recomputes the whole sequence.

Model math (rows are positions, fp32 in the tests)
--------------------------------------------------
* RMSNorm: ``(xf * rsqrt(mean(xf^2) + eps)).to(dtype) * weight``, ``xf = x.float()``.
* Sandwich block: ``x = n2(x + attn(n1(x)))``; ``x = n4(x + mlp(n3(x)))``; ``mlp(x) = proj(silu(a) * b)``
  with ``a, b = fc(x).chunk(2)``.
* Attention: ``q, k, v = Wqkv(x).split([n_embd, kv, kv])``; with ``qk_bias`` add ``qk_bias[0]`` to q and
  ``qk_bias[1]`` to k (per head); RoPE as a complex product on channel pairs ``(2i, 2i+1)`` with angle
  ``position * rope_base^(-2i/head_dim)`` (fp32); softmax attention with scale ``1/sqrt(head_dim)``
  (scores in fp32 here); ``proj``.
* ``e = prelude(wte[ids] * embed_scale)``; iteration: ``s = core(adapter(cat(s, e)))``; logits of a state
  ``s``: ``lm_head(ln_f(coda(ln_f(s))))`` (``lm_head = wte`` when tied and absent).
* The initial latent state of each position is an input (``init_states[position]``).

Which K/V a query reads (generation)
------------------------------------
Prelude and coda: one K/V per position (the coda's from the position's exit state). Core iteration ``r``,
layer ``l``: a query at position i reads its own iteration-r K/V and, for an earlier position j, the K/V
of iteration ``min(r, e_j)`` (``e_j`` = j's exit iteration; prompt positions ``e_j = max_steps``): the
latest available recurrence step.

Generation oracle (greedy, one sequence)
----------------------------------------
The prompt runs ``max_steps`` iterations; token 0 = argmax of its last position's logits (no exit in
prefill). Token k >= 1: the previous token runs iterations r = 1.. and after each computes its logits and
``kl_r = sum(p_{r-1} * (log p_{r-1} - log p_r))`` (``p_0`` uniform over the logits' width); it exits at
the first r with ``r == max_steps`` or (``threshold < 1`` and ``r >= min_steps`` and ``kl_r < threshold``).
``logprobs[k]`` is the log-softmax of the exit logits at the token. Stops after ``max_tokens`` or an eos id.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from reference import fp8_round_trip  # (tests/reference.py: Ouro's oracle, the same FP8 store)


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """x ``[n, heads, D]``, complex product on channel pairs."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    rot = torch.polar(torch.ones(len(positions), d // 2), positions.float()[:, None] * freqs[None, :])
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot[:, None, :]).reshape(x.shape).to(x.dtype)


class _Layer:
    def __init__(self, sd: dict[str, Tensor], prefix: str, cfg: dict,
                 kv_scales: tuple[Tensor, Tensor] | None = None) -> None:
        self.kv_scales = kv_scales  # this layer's (k [kv_heads], v [kv_heads]): its K/V stored as FP8
        self.w = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        self.cfg = cfg
        self.h = cfg["n_embd"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads", self.heads)
        self.d = self.h // self.heads
        self.eps = cfg["norm_eps"]

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated q ``[n, heads, D]``, k and v ``[n, kv_heads, D]`` of the normed input."""
        n, kvs = x.shape[0], self.kv_heads * self.d
        qkv = _rms(x, self.w["norm_1.weight"], self.eps) @ self.w["attn.Wqkv.weight"].T
        q = qkv[:, : self.h].reshape(n, self.heads, self.d)
        k = qkv[:, self.h: self.h + kvs].reshape(n, self.kv_heads, self.d)
        v = qkv[:, self.h + kvs:].reshape(n, self.kv_heads, self.d)
        if self.cfg.get("qk_bias"):
            q = q + self.w["attn.qk_bias"][0, 0]
            k = k + self.w["attn.qk_bias"][1, 0]
        base = self.cfg["rope_base"]
        q, k = _rope(q, positions, base), _rope(k, positions, base)
        if self.kv_scales is not None:  # every key and value a query reads was stored (its own too)
            k, v = fp8_round_trip(k, self.kv_scales[0]), fp8_round_trip(v, self.kv_scales[1])
        return q, k, v

    def finish(self, x: Tensor, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """The block's output given each query's keys/values ``[n_q, n_k, kv_heads, D]`` (query i sees
        keys ``j <= i``; the others are masked)."""
        group = self.heads // self.kv_heads
        k = keys.repeat_interleave(group, 2).float()
        v = values.repeat_interleave(group, 2).float()
        scores = torch.einsum("qhd,qkhd->qhk", q.float(), k) / math.sqrt(self.d)
        n_q, n_k = keys.shape[:2]
        causal = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None]
        probs = scores.masked_fill(~causal[:, None, :], float("-inf")).softmax(-1)
        rows = torch.einsum("qhk,qkhd->qhd", probs, v).to(x.dtype).reshape(n_q, -1)
        a = rows @ self.w["attn.proj.weight"].T
        x = _rms(x + a, self.w["norm_2.weight"], self.eps)
        gate, up = (_rms(x, self.w["norm_3.weight"], self.eps) @ self.w["mlp.fc.weight"].T).chunk(2, -1)
        m = (F.silu(gate) * up) @ self.w["mlp.proj.weight"].T
        return _rms(x + m, self.w["norm_4.weight"], self.eps)

    def causal(self, x: Tensor, positions: Tensor) -> Tensor:
        q, k, v = self.qkv(x, positions)
        n = len(x)
        return self.finish(x, q, k[None].expand(n, *k.shape), v[None].expand(n, *v.shape))


class HuginnReference:
    """The reference model of one state dict and config (module docstring)."""

    def __init__(self, sd: dict[str, Tensor], cfg: dict, kv_scales: tuple[Tensor, Tensor] | None = None) -> None:
        """``kv_scales = (k, v)`` ``[layers, kv_heads]``: K/V are stored as FP8 E4M3 with row ``i`` the
        scales of layer ``i`` of every stage (an engine's cache layer ``i`` holds all three)."""
        self.sd, self.cfg = sd, cfg
        self.eps = cfg["norm_eps"]
        t = "transformer."

        def layers(name: str, count: int) -> list[_Layer]:
            return [_Layer(sd, f"{t}{name}.{i}.", cfg, None if kv_scales is None else (kv_scales[0][i], kv_scales[1][i]))
                    for i in range(count)]

        self.prelude = layers("prelude", cfg["n_layers_in_prelude"])
        self.core = layers("core_block", cfg["n_layers_in_recurrent_block"])
        self.coda_layers = layers("coda", cfg["n_layers_in_coda"])
        self.head = sd.get("lm_head.weight", sd[f"{t}wte.weight"])

    def embed(self, ids: Tensor) -> Tensor:
        positions = torch.arange(len(ids))
        x = self.sd["transformer.wte.weight"][ids] * self.cfg.get("init_values", {}).get("embed_scale", 1.0)
        for layer in self.prelude:
            x = layer.causal(x, positions)
        return x

    def inject(self, s: Tensor, e: Tensor) -> Tensor:
        out = torch.cat([s, e], -1) @ self.sd["transformer.adapter.weight"].T
        bias = self.sd.get("transformer.adapter.bias")
        return out if bias is None else out + bias

    def logits(self, states: Tensor) -> Tensor:
        """fp32 logits of every position's latent state, the coda causal over the positions."""
        positions = torch.arange(len(states))
        x = _rms(states, self.sd["transformer.ln_f.weight"], self.eps)
        for layer in self.coda_layers:
            x = layer.causal(x, positions)
        return (_rms(x, self.sd["transformer.ln_f.weight"], self.eps) @ self.head.T).float()

    def iterate(self, s: Tensor, e: Tensor, r: int, exits: Sequence[int | None], kv: dict) -> Tensor:
        """Core iteration ``r`` over all positions; ``exits[j]`` None: j reads its own iteration. ``kv``
        keeps every (iteration, layer)'s K/V of every position."""
        positions = torch.arange(len(s))
        x = self.inject(s, e)
        for l, layer in enumerate(self.core):
            q, k, v = layer.qkv(x, positions)
            kv[(r, l)] = (k, v)
            # its[i, j]: the iteration whose K/V query i reads at position j
            its = torch.tensor([[r if j == i or exits[j] is None else min(r, exits[j]) for j in range(len(x))]
                                for i in range(len(x))])
            table_k = torch.stack([kv[(it, l)][0] if (it, l) in kv else torch.zeros_like(k) for it in range(r + 1)])
            table_v = torch.stack([kv[(it, l)][1] if (it, l) in kv else torch.zeros_like(v) for it in range(r + 1)])
            cols = torch.arange(len(x))[None, :].expand_as(its)
            keys, values = table_k[its, cols], table_v[its, cols]
            x = layer.finish(x, q, keys, values)
        return x


@torch.no_grad()
def reference_logits(sd: dict[str, Tensor], cfg: dict, ids: Sequence[int], num_steps: int, init_states: Tensor) -> Tensor:
    """fp32 logits ``[T, vocab]`` of a fixed number of iterations over ``ids`` (upstream ``forward``)."""
    ref = HuginnReference(sd, cfg)
    ids = torch.tensor(list(ids))
    e = ref.embed(ids)
    s, kv = init_states[: len(ids)].to(e.dtype), {}
    for r in range(1, num_steps + 1):
        s = ref.iterate(s, e, r, [None] * len(ids), kv)
    return ref.logits(s)


@torch.no_grad()
def reference_generate(sd: dict[str, Tensor], cfg: dict, prompt: Sequence[int], max_tokens: int, *,
                       max_steps: int, init_states: Tensor, min_steps: int = 1, threshold: float = 1.0,
                       eos_ids: Sequence[int] = (), kv_scales: tuple[Tensor, Tensor] | None = None
                       ) -> tuple[list[int], list[int], list[float]]:
    """Serial greedy oracle (module docstring): ``(tokens, exit iterations, logprobs)``; ``kv_scales``: every
    K/V stored as FP8 (:class:`HuginnReference`)."""
    ref = HuginnReference(sd, cfg, kv_scales)
    seq, tokens, depths, logprobs = list(prompt), [], [], []
    exits: list[int | None] = [max_steps] * len(prompt)
    while len(tokens) < max_tokens:
        n = len(seq)
        e = ref.embed(torch.tensor(seq))
        s, kv, states = init_states[:n].to(e.dtype), {}, []
        exits_now = exits[: n - 1] + [None]
        prev = torch.full((ref.head.shape[0],), -math.log(ref.head.shape[0]))
        for r in range(1, max_steps + 1):  # all iterations first: iteration r reads only iterations <= r
            s = ref.iterate(s, e, r, exits_now, kv)
            states.append(s)

        def logits_at(r: int, states: list[Tensor] = states, n: int = n) -> Tensor:
            """The last position's logits at its iteration r (earlier positions at their exit)."""
            mixed = torch.stack([states[(exits[j] if j < n - 1 else r) - 1][j] for j in range(n)])
            return ref.logits(mixed)[n - 1]

        depth = max_steps
        if tokens:  # a decode step: the convergence test after every iteration; the prompt runs full depth
            for r in range(1, max_steps + 1):
                cur = torch.log_softmax(logits_at(r), -1)
                kl = float((prev.exp() * (prev - cur)).sum())
                prev = cur
                if r == max_steps or (threshold < 1.0 and r >= min_steps and kl < threshold):
                    depth = r
                    break
        logits = logits_at(depth)
        if tokens:
            exits[n - 1] = depth
        token = int(torch.argmax(logits))
        tokens.append(token)
        depths.append(depth)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        seq.append(token)
        exits.append(None)
        if token in eos_ids:
            break
    return tokens, depths, logprobs
