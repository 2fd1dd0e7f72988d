"""An independent, dense reference of Ouro and a serial generation oracle.

Written straight from docs/design.md's equations (exit rule, KV layouts) in plain PyTorch. It shares no code
with ``loopline`` (it never imports it): weights come as a plain
``dict[str, Tensor]`` with the Hugging Face names and the architecture as a
plain ``dict`` with the ``config.json`` keys ``vocab_size``, ``hidden_size``,
``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim`` (default ``hidden_size //
num_attention_heads``), ``rope_theta``, ``rms_norm_eps``, ``total_ut_steps``.
Everything is computed in the state dict's dtype except where noted; tests use
fp32. Speed is not a goal: the K/V each query reads is gathered explicitly
from a table of (query position, loop, key position) -> key loop.

Model math (one position, loops r = 1..R, shared weights every loop)
-----------------------------------------------------------------------
* ``h_0 = embed_tokens[token]``.
* Loop r, layer i, input x::

      a = attn(input_layernorm(x));   x = x + input_layernorm_2(a)
      m = mlp(post_attention_layernorm(x));   x = x + post_attention_layernorm_2(m)

  then ``h_r = norm(x)`` (``model.norm`` is inside every loop; ``h_r`` is the
  input of loop r+1). ``mlp(x) = down(silu(gate(x)) * up(x))``.
* RMSNorm: ``weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype)`` with
  ``xf = x.float()``.
* Attention: q/k/v/o projections without bias; rotate-half RoPE on q and k with
  angles ``position * theta^(-2i/head_dim)`` in fp32 (cos/sin cast to the
  dtype); the position is the token index, the same in every loop. GQA: query
  head h uses kv head ``h // (heads / kv_heads)``. Scores ``q.k / sqrt(head_dim)``
  and softmax in fp32, output cast back to the dtype. Causal.
* Gate: ``gate_logit_r = early_exit_gate(h_r)`` computed in fp32 (weights and
  input upcast); ``lambda_r = sigmoid(gate_logit_r)``.
* Logits: ``lm_head(h_r)`` in the dtype, returned as fp32.

Which K/V a query reads (``reference_forward``'s ``kv_depths`` / ``layout``)
-----------------------------------------------------------------------------
A query at position i and loop d attends to positions j <= i. Its own position
(j == i) always contributes its loop-d K/V. For an earlier position j < i it
reads the K/V of loop ``L(i, d, j)``:

* ``kv_depths=None`` (the plain reference model, = HF with every loop
  computed): ``L = d``.
* ``kv_depths[j] = e_j`` (the loop at which position j exited; prompt positions
  have ``e_j = R``), layout ``"last_exited"``: ``L = min(d, e_j)`` -- the
  engine copies a token's loop-e K/V into planes e+1..R when it exits.
* layout ``"shared"`` (one plane): ``L = e_j``, the final K/V of j, except that
  the first ``prompt_len`` positions form a depth-major prefill: a prompt query
  reads the other prompt positions at its own loop, ``L = d`` when both i and j
  are ``< prompt_len``. With ``prompt_len = 0`` every earlier position is read
  at its final loop.

Position i's loops deeper than ``e_i`` are still computed (all R loops are
returned) but no query ever reads their K/V (``L <= e_j`` always), so they
are meaningless for the engine and only rows ``r <= e_i`` should be compared.

Generation oracle (``reference_generate``)
------------------------------------------
Greedy, one sequence, recomputing the whole sequence with ``reference_forward``
at every step (no cache). ``R = total_ut_steps`` is also the number of KV planes.

* Exit rule at a position, from its fp32 gate logits: ``lambda_r =
  sigmoid(gate_r)``, ``F_r = 1 - prod_{i<=r}(1 - lambda_i)`` (running product
  in fp32; the threshold is compared in fp32). The exit depth is the first r
  with ``r == max_loops`` or (``exit_threshold < 1`` and ``r >= min_loops`` and
  ``F_r >= exit_threshold``). With ``trace_depths`` the k-th token's depth is
  ``trace_depths[k]`` instead (any value in 1..R, the rule is not consulted).
* Prefill: every prompt position runs all R loops, so prompt ``e_j = R``
  (``shared``: the prompt is exactly the plain reference, ``prompt_len = P``).
* Token 0 = argmax of the logits at the last prompt position P-1 at the depth
  the rule picks from that position's gates (``exit_depths[0]``). The depth
  picked there does not change that position's KV (it is a prompt position).
* Token k >= 1: the previous token sits at position ``c = P+k-1`` and runs
  loops 1..e until the rule fires at e (its own K/V at loop d is always its
  loop-d K/V, so computing all R loops and picking e afterwards is the same
  thing); ``exit_depths[k] = e = e_c``; token k = argmax ``lm_head(h_e)`` at c.
  Later positions read c's K/V as described above with ``e_c = e``.
* ``logprobs[k] = log_softmax(fp32 logits used to pick token k)[token k]``.
  Argmax ties go to the lowest token id (``torch.argmax``).
* Stops after ``max_tokens`` tokens or right after an id in ``eos_ids``
  (which is included in the output).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

LAYOUTS = ("last_exited", "shared")


# --- building blocks ---------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_tables(num_positions: int, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin ``[T, head_dim]`` for rotate-half RoPE (angles in fp32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (float(theta) ** exponents)  # [head_dim / 2]
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x ``[..., heads, D]``; cos, sin broadcastable to it (``[..., 1, D]``)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def _dims(cfg: dict) -> dict:
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    assert heads % kv_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads"
    return dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, layers=cfg["num_hidden_layers"], eps=cfg["rms_norm_eps"])


def key_loops(num_positions: int, num_loops: int, kv_depths: Sequence[int] | None, layout: str, prompt_len: int) -> Tensor:
    """``L[d-1, i, j]``: the (1-based) loop whose K/V of position j the query (i, loop d) reads.

    Only ``j <= i`` is meaningful; the diagonal is always d (a query's own K/V).
    """
    t, r = num_positions, num_loops
    d = torch.arange(1, r + 1).view(r, 1, 1).expand(r, t, t)
    if kv_depths is None:
        return d.clone()
    e = torch.tensor(list(kv_depths), dtype=torch.long).view(1, 1, t).expand(r, t, t)
    if layout == "last_exited":
        loops = torch.minimum(d, e)
    else:  # shared
        loops = e.clone()
        p = min(prompt_len, t)
        loops[:, :p, :p] = d[:, :p, :p]
    own = torch.eye(t, dtype=torch.bool).expand(r, t, t)
    return torch.where(own, d, loops)


# --- dense forward -------------------------------------------------------------------
@torch.no_grad()
def reference_forward(
    state_dict: dict[str, Tensor],
    cfg: dict,
    input_ids: Tensor,
    num_loops: int,
    kv_depths: Sequence[int] | None = None,
    layout: str = "last_exited",
    *,
    prompt_len: int = 0,
    kv_scales: tuple[Tensor, Tensor] | None = None,
    read_loops: Tensor | None = None,
) -> dict[str, Tensor]:
    """All loops of one sequence. See the module docstring for the exact math.

    ``read_loops``: ``L[d-1, i, j]`` given explicitly (``[R, T, T]``, 1-based; the diagonal is ignored: a query
    reads its own loop), for schedules no layout describes (speculative rounds over the shared plane,
    :func:`reference_speculative_shared`). The first ``prompt_len`` positions then run as one depth-major
    block and every later position on its own, as for ``shared``.

    ``kv_scales = (k_scale, v_scale)`` (``[layers, kv_heads]``): every K/V is stored as FP8 E4M3 would
    store it -- ``clamp(x / scale, -448, 448)`` rounded to E4M3, times the scale -- before any query reads it.

    input_ids: ``[T]``. Returns ``hidden`` ``[R, T, H]`` (post-norm ``h_r``, the
    dtype of the weights), ``gate_logits`` ``[R, T]`` fp32 and ``logits``
    ``[R, T, V]`` fp32, R = ``num_loops``. ``kv_depths`` (``[T]`` ints in
    1..R) and ``layout`` select which loop's K/V each query reads;
    ``prompt_len`` only matters for ``layout="shared"``.
    """
    sd = state_dict
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    t, r = ids.numel(), int(num_loops)
    if t == 0:
        raise ValueError("input_ids must not be empty")
    if r < 1:
        raise ValueError(f"num_loops must be >= 1, got {r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if kv_depths is not None:
        kv_depths = [int(e) for e in kv_depths]
        if len(kv_depths) != t or any(not 1 <= e <= r for e in kv_depths):
            raise ValueError(f"kv_depths must hold {t} ints in 1..{r}, got {kv_depths}")
    dm = _dims(cfg)
    heads, kv_heads, hd, n_layers, eps = dm["heads"], dm["kv_heads"], dm["head_dim"], dm["layers"], dm["eps"]
    groups = heads // kv_heads
    embed = sd["model.embed_tokens.weight"]
    dtype = embed.dtype
    hidden_size = embed.shape[1]

    if read_loops is None:
        loops_of = key_loops(t, r, kv_depths, layout, prompt_len)  # [R, T, T], 1-based
    else:
        if tuple(read_loops.shape) != (r, t, t):
            raise ValueError(f"read_loops must be [{r}, {t}, {t}], got {tuple(read_loops.shape)}")
        own = torch.eye(t, dtype=torch.bool).expand(r, t, t)
        loops_of = torch.where(own, torch.arange(1, r + 1).view(r, 1, 1), read_loops.long())
    cos, sin = rope_tables(t, hd, cfg["rope_theta"], dtype)
    layer_w = [{name: sd[f"model.layers.{i}.{name}.weight"] for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2",
    )} for i in range(n_layers)]

    # K/V of every (layer, loop, position): [layers, R, T, kv_heads, D]
    keys = torch.zeros(n_layers, r, t, kv_heads, hd, dtype=dtype)
    values = torch.zeros_like(keys)
    hidden = torch.zeros(r, t, hidden_size, dtype=dtype)
    gate_logits = torch.zeros(r, t, dtype=torch.float32)
    gate_w = sd["model.early_exit_gate.weight"].float()
    gate_b = sd["model.early_exit_gate.bias"].float()
    scale = 1.0 / math.sqrt(hd)

    # Positions are computed in blocks, block after block; inside a block all
    # positions advance loop by loop together. A query may read (a) any loop of
    # a position in an earlier block (finished) or (b) loop <= d of a position
    # in its own block (computed at this or an earlier loop). plain and
    # last_exited read loops <= d only: one block. shared reads final K/V
    # (loop e_j, maybe > d): the depth-major prompt is one block, every later
    # position its own block (= serial decode).
    if read_loops is None and (kv_depths is None or layout == "last_exited"):
        blocks = [range(t)]
    else:
        p = min(max(prompt_len, 1), t)
        blocks = [range(p)] + [range(i, i + 1) for i in range(p, t)]
    for block in blocks:
        rows = torch.tensor(list(block))  # [n] positions of this block
        ctx = int(rows[-1]) + 1  # keys are positions 0..ctx-1
        causal = torch.arange(ctx)[None, :] <= rows[:, None]  # [n, ctx]
        same_block = (torch.arange(ctx)[None, :] >= int(rows[0])) & causal
        pos = torch.arange(ctx).expand(len(rows), ctx)
        h = embed[ids[rows]]  # [n, H]
        for d in range(1, r + 1):
            src = loops_of[d - 1][rows][:, :ctx]  # [n, ctx] 1-based loops each query reads
            assert bool((src[same_block] <= d).all()), "a query reads a loop its block has not computed"
            src = torch.where(causal, src, torch.ones_like(src)) - 1  # masked keys: any valid index
            x = h
            for li, w in enumerate(layer_w):
                a_in = rms_norm(x, w["input_layernorm"], eps)
                q = (a_in @ w["self_attn.q_proj"].t()).view(-1, heads, hd)
                k = (a_in @ w["self_attn.k_proj"].t()).view(-1, kv_heads, hd)
                v = (a_in @ w["self_attn.v_proj"].t()).view(-1, kv_heads, hd)
                q = rotate(q, cos[rows][:, None, :], sin[rows][:, None, :])
                k = rotate(k, cos[rows][:, None, :], sin[rows][:, None, :])
                if kv_scales is not None:
                    k, v = fp8_round_trip(k, kv_scales[0][li]), fp8_round_trip(v, kv_scales[1][li])
                keys[li, d - 1, rows] = k
                values[li, d - 1, rows] = v
                kk = keys[li][src, pos].repeat_interleave(groups, dim=2)  # [n, ctx, heads, D]
                vv = values[li][src, pos].repeat_interleave(groups, dim=2)
                scores = torch.einsum("nhd,njhd->nhj", q.float(), kk.float()) * scale
                scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
                o = torch.einsum("nhj,njhd->nhd", scores.softmax(dim=-1), vv.float()).to(dtype)
                a = o.reshape(-1, heads * hd) @ w["self_attn.o_proj"].t()
                x = x + rms_norm(a, w["input_layernorm_2"], eps)
                m_in = rms_norm(x, w["post_attention_layernorm"], eps)
                m = (F.silu(m_in @ w["mlp.gate_proj"].t()) * (m_in @ w["mlp.up_proj"].t())) @ w["mlp.down_proj"].t()
                x = x + rms_norm(m, w["post_attention_layernorm_2"], eps)
            h = rms_norm(x, sd["model.norm.weight"], eps)
            hidden[d - 1, rows] = h
            gate_logits[d - 1, rows] = h.float() @ gate_w[0] + gate_b[0]
    logits = torch.matmul(hidden, sd["lm_head.weight"].t()).float()
    return {"hidden": hidden, "gate_logits": gate_logits, "logits": logits}


def fp8_round_trip(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` ``[n, kv_heads, D]`` through an FP8 E4M3 store with per-head ``scale`` ``[kv_heads]`` and back."""
    s = scale.float()[None, :, None]
    return ((x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


# --- exit rule and generation oracle -------------------------------------------------------
def exit_depth(gate_logits: Tensor, *, min_loops: int, max_loops: int, exit_threshold: float) -> int:
    """First loop r (1-based) at which the exit rule fires, from one position's ``[R]`` gate logits."""
    lambdas = torch.sigmoid(gate_logits.float())
    survival = torch.ones((), dtype=torch.float32)
    threshold = torch.tensor(exit_threshold, dtype=torch.float32)
    for r in range(1, max_loops + 1):
        survival = survival * (1.0 - lambdas[r - 1])
        cdf = 1.0 - survival
        if r == max_loops:
            return r
        if exit_threshold < 1.0 and r >= min_loops and bool(cdf >= threshold):
            return r
    raise AssertionError("unreachable: max_loops >= 1")


@torch.no_grad()
def reference_generate(
    state_dict: dict[str, Tensor],
    cfg: dict,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    min_loops: int = 1,
    max_loops: int | None = None,
    exit_threshold: float = 1.0,
    layout: str = "last_exited",
    trace_depths: Sequence[int] | None = None,
    eos_ids: Sequence[int] = (),
    kv_scales: tuple[Tensor, Tensor] | None = None,
) -> tuple[list[int], list[int], list[float]]:
    """Serial greedy oracle: returns ``(tokens, exit_depths, logprobs)``, one entry per token.

    Semantics are in the module docstring. No cache: each step reruns
    :func:`reference_forward` on prompt + tokens so far with the exit history
    as ``kv_depths``.
    """
    total = int(cfg["total_ut_steps"])
    max_loops = total if max_loops is None else int(max_loops)
    if not 1 <= max_loops <= total:
        raise ValueError(f"max_loops must be in 1..{total}, got {max_loops}")
    if min_loops < 1:
        raise ValueError(f"min_loops must be >= 1, got {min_loops}")
    if not 0.0 < exit_threshold <= 1.0:
        raise ValueError(f"exit_threshold must be in (0, 1], got {exit_threshold}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    prompt = [int(x) for x in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids must not be empty")
    eos = {int(x) for x in eos_ids}

    tokens: list[int] = []
    depths: list[int] = []
    logprobs: list[float] = []
    while len(tokens) < max_tokens:
        seq = prompt + tokens  # the last position (the last prompt token, then the last token) is run
        n = len(seq)
        # prompt: R; generated positions P..n-2: their exit depths (depths[1:]);
        # the position being run (n-1) reads only its own loop-d K/V, so its entry is unused.
        kv_depths = ([total] * len(prompt) + depths[1:] + [total])[:n]
        out = reference_forward(state_dict, cfg, torch.tensor(seq), total, kv_depths, layout, prompt_len=len(prompt),
                                kv_scales=kv_scales)
        k = len(tokens)
        if trace_depths is not None:
            if k >= len(trace_depths):
                raise ValueError(f"trace_depths has {len(trace_depths)} entries, token {k} needs one more")
            e = int(trace_depths[k])
            if not 1 <= e <= total:
                raise ValueError(f"trace_depths[{k}] must be in 1..{total}, got {e}")
        else:
            e = exit_depth(out["gate_logits"][:, n - 1], min_loops=min_loops, max_loops=max_loops, exit_threshold=exit_threshold)
        logits = out["logits"][e - 1, n - 1]
        token = int(torch.argmax(logits))
        tokens.append(token)
        depths.append(e)
        logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
        if token in eos:
            break
    return tokens, depths, logprobs


@torch.no_grad()
def reference_speculative_shared(
    state_dict: dict[str, Tensor],
    cfg: dict,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    k: int,
    d: int,
    min_loops: int = 1,
    max_loops: int | None = None,
    exit_threshold: float = 1.0,
    eos_ids: Sequence[int] = (),
) -> tuple[list[int], list[int], list[float]]:
    """Greedy draft-then-verify self-speculation (K drafts from loops ``1..d`` a round) over the ``shared`` layout's
    one plane: ``(tokens, exit_depths, logprobs)``, like :func:`reference_generate`.

    One plane holds each position's last written K/V, so what a query reads follows the round schedule
    (docs/speculation.md, "Exits, draft depth and KV layouts"). A round starts at the last committed token's
    position ``c`` and runs positions ``c..c+K``: each drafts alone through loops ``1..d`` (or to an earlier exit),
    proposing the next position's token from the head of its last loop; then the positions still looping run
    loops ``d+1..`` together to their own exits. The query of round position ``i`` at loop ``l`` reads:

    * prompt positions at loop R (the depth-major prefill's last loop), earlier committed positions at
      their exit loop (their final K/V), as plain ``shared`` decoding does;
    * earlier positions of its own round at ``min(d, e_j)`` while ``l <= d`` (where they stopped drafting)
      and at ``min(l, e_j)`` in the verify (every row writes its loop before any reads; exited rows keep
      their exit loop's K/V).

    Tokens: each position's target is the argmax at its own exit loop; the drafts agreeing with the targets
    commit, then the first disagreeing target (the correction) or, after K agreements, position ``c+K``'s
    target (the bonus). A committed position keeps the reads it was computed with; the next round starts at
    the last committed token. With ``d`` = R every draft is its target and this is plain ``shared``
    decoding (:func:`reference_generate`), which tests check. Positions are recomputed densely with
    :func:`reference_forward`'s ``read_loops`` (no cache)."""
    total = int(cfg["total_ut_steps"])
    max_loops = total if max_loops is None else int(max_loops)
    if k < 1 or not 1 <= d <= total:
        raise ValueError(f"k must be >= 1 and d in 1..{total}, got k={k}, d={d}")
    prompt = [int(x) for x in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids must not be empty")
    n_prompt, eos = len(prompt), {int(x) for x in eos_ids}
    rule = dict(min_loops=min_loops, max_loops=max_loops, exit_threshold=exit_threshold)
    # rows[i]: ``[R, i]`` the loops position i read of positions 0..i-1, fixed once it is computed
    loops = torch.arange(1, total + 1).view(total, 1)
    rows: list[Tensor] = [loops.expand(total, i).clone() for i in range(n_prompt)]  # depth-major prompt block

    def run(seq: list[int]) -> dict[str, Tensor]:
        t = len(seq)
        table = torch.ones(total, t, t, dtype=torch.long)
        for i, row in enumerate(rows[:t]):
            table[:, i, :i] = row
        return reference_forward(state_dict, cfg, torch.tensor(seq), total, layout="shared", prompt_len=n_prompt,
                                 read_loops=table)

    out = run(prompt)
    e = exit_depth(out["gate_logits"][:, n_prompt - 1], **rule)
    logits = out["logits"][e - 1, n_prompt - 1]
    tokens, depths = [int(torch.argmax(logits))], [e]
    logprobs = [float(torch.log_softmax(logits, -1)[tokens[0]])]
    final = {j: total for j in range(n_prompt)}  # position -> the loop of its K/V after its token committed
    while len(tokens) < max_tokens and tokens[-1] not in eos:
        c = n_prompt + len(tokens) - 1  # the last committed token's position (not run yet)
        fed, exits, heads = [tokens[-1]], [], []
        for i in range(k + 1):
            earlier = torch.tensor([final[j] for j in range(c)], dtype=torch.long).expand(total, c)
            ours = torch.tensor(exits, dtype=torch.long)
            drafting = torch.minimum(torch.full_like(ours, d), ours).expand(total, i)
            verifying = torch.minimum(loops.expand(total, i), ours.expand(total, i))
            round_reads = torch.where(loops <= d, drafting, verifying)
            rows[c + i:] = [torch.cat([earlier, round_reads], dim=1)]
            out = run(prompt + tokens[:-1] + fed)
            e = exit_depth(out["gate_logits"][:, c + i], **rule)
            exits.append(e)
            heads.append(out["logits"][:, c + i])
            if i < k:
                fed.append(int(torch.argmax(heads[i][min(e, d) - 1])))
        for i in range(k + 1):
            logits = heads[i][exits[i] - 1]
            token = int(torch.argmax(logits))
            tokens.append(token), depths.append(exits[i])
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            final[c + i] = exits[i]
            if token in eos or len(tokens) >= max_tokens or i == k or fed[i + 1] != token:
                break
        del rows[n_prompt + len(tokens) - 1:]  # the rejected positions' reads (the next round recomputes them)
    return tokens, depths, logprobs
