"""Differentiable replay of rollout logprobs on the dense model (train/inference consistency).

Given what the engine returned for a completion -- prompt ids, generated ids
and each generated token's exit depth -- and the KV layout the engine ran,
:func:`replay_logprobs` recomputes every generated token's logprob with
autograd, on any :class:`~loopline.models.ouro.OuroForCausalLM` (a trainer's
copy of the weights):

    logprob[k] = log_softmax(lm_head(h_{e_k}(P - 1 + k)) / T)[output[k]]

``h_e(p)`` is the post-norm hidden state of position ``p`` after loop ``e``;
``e_k = exit_depths[k]``; the sequence is ``prompt + output[:-1]`` (the last
generated token is never fed back). Position ``p``'s K/V depth is
``R = total_ut_steps`` for prompt positions and ``exit_depths[p - P + 1]`` for
generated ones. Which K/V a query reads (docs/rl.md, tests/reference.py):

* ``last_exited``: a query at loop ``d`` reads position ``j``'s loop
  ``min(d, e_j)`` K/V. Keys come from loops ``<= d``, so one dense forward
  over all positions, running loops ``1..max(e)`` in order, is exact: a
  history function swaps in, per key position, the K/V its exit loop left.
* ``shared``: the prompt runs depth-major (a prompt query reads the other
  prompt positions at its own loop: the plain dense model over the prompt);
  a generated position at loop ``d`` reads every earlier position's *final*
  K/V (loop ``e_j``, possibly deeper than ``d``) and its own loop-``d`` K/V.
  Position ``p`` thus depends on the finished loops of every earlier
  generated position: positions after the prompt are computed one at a time
  (as the engine decodes them), batched over sequences.

``T`` is the sampling temperature for ``processed_logprobs`` (1 for
``raw_logprobs`` and for greedy requests). Top-k / top-p / min-p truncation
and penalties are not replayed: with them the engine's processed logprobs
are renormalised over the surviving tokens and differ from this value.

Huginn (``huginn_raven``, docs/model-families.md) replays through its own stages, in ``last_exited``
only (the one layout the engine serves it in): the prelude once per position, the latent initial state
drawn from the completion's ``latent_seed``, core iterations ``1..`` with the same per-key history
(prompt positions run the request's ``max_loops``, generated ones their exit iteration), then the coda
once, over each position's state at its own depth -- a token reads every earlier token's coda K/V of the
iteration it exited at, as the engine's coda plane holds. ``h_e(p)`` is the coda's output (before
``lm_head``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from loopline.errors import InvalidRequestError
from loopline.models.family import family_of
from loopline.models.ops import Rope
from loopline.models.ouro import DenseCausalAttention, OuroForCausalLM

LAYOUTS = ("last_exited", "shared")
_GREEDY_EPS = 1e-5  # the sampler's SAMPLING_EPS: below it a request is greedy (temperature 1 for logprobs)


PerCompletion = int | Sequence[int] | None


def replay_logprobs(model: OuroForCausalLM, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    exit_depths: Sequence[int], *, layout: str = "last_exited", temperature: float = 1.0,
                    max_loops: int | None = None, latent_seed: int = 0) -> Tensor:
    """Per-token logprobs ``[len(output_ids)]`` (fp32, with autograd) of one completion."""
    return replay_logprobs_batch(model, [prompt_ids], [output_ids], [exit_depths], layout=layout,
                                 temperature=temperature, max_loops=max_loops, latent_seed=latent_seed)[0]


def replay_logprobs_batch(model: OuroForCausalLM, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                          exit_depths: Sequence[Sequence[int]], *, layout: str = "last_exited",
                          temperature: float | Sequence[float] = 1.0, max_loops: PerCompletion = None,
                          latent_seed: PerCompletion = 0) -> list[Tensor]:
    """Per-token logprobs of several completions (right-padded into one batch); one ``[N_b]`` tensor each.

    ``temperature`` is one value or one per completion. ``max_loops`` and ``latent_seed`` (one value or one
    per completion: the rollout's effective ``SamplingParams``) matter for Huginn, whose prompts run
    ``max_loops`` iterations (default: the checkpoint's ``mean_recurrence``) from a latent state seeded by
    ``latent_seed``; for Ouro ``max_loops`` only bounds the exit depths and ``latent_seed`` is unused.
    """
    batch = _Batch.build(model, prompts, outputs, exit_depths, layout, temperature, max_loops, latent_seed)
    logits = model.head(_hidden(model, batch)) / batch.temperatures[:, None]  # [M, V] fp32
    logp = torch.log_softmax(logits, dim=-1).gather(1, batch.targets[:, None]).squeeze(1)
    return list(logp.split(batch.num_outputs))


def replay_hidden_batch(model: OuroForCausalLM, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                        exit_depths: Sequence[Sequence[int]], *, layout: str = "last_exited",
                        max_loops: PerCompletion = None, latent_seed: PerCompletion = 0,
                        device: torch.device | None = None) -> list[Tensor]:
    """The hidden states each generated token was sampled from (with autograd); one ``[N_b, hidden]`` each.

    ``model.head`` of row ``k`` gives the logits of ``outputs[b][k]`` (what a trainer that computes
    its own log-softmax, entropy or temperature needs). ``device``: where the replay runs (default: the
    model's first parameter's; a trainer whose parameters rest offloaded between calls passes its inputs').
    """
    batch = _Batch.build(model, prompts, outputs, exit_depths, layout, 1.0, max_loops, latent_seed, device)
    return list(_hidden(model, batch).split(batch.num_outputs))


def _hidden(model: OuroForCausalLM, batch: _Batch) -> Tensor:
    return _REPLAYS[batch.model_type][batch.layout](model, batch)


class _Batch:
    """Right-padded sequences ``prompt + output[:-1]`` and what each token's logprob needs."""

    def __init__(self, ids: Tensor, kv_depth: Tensor, prompt_lens: list[int], lengths: list[int],
                 depths: list[list[int]], targets: Tensor, temperatures: Tensor, layout: str,
                 model_type: str = "ouro", latent_seeds: Tensor | None = None) -> None:
        self.layout, self.model_type = layout, model_type
        self.latent_seeds = latent_seeds  # [B] int64: each completion's latent seed (Huginn)
        self.ids = ids  # [B, T] int64 (pad 0)
        self.kv_depth = kv_depth  # [B, T] int64: loop whose K/V later positions read (pad: R)
        self.prompt_lens = prompt_lens
        self.lengths = lengths  # T_b = P_b + N_b - 1 positions are run
        self.depths = depths  # per completion, per token: its exit depth
        self.targets = targets  # [M] the generated ids, completion after completion
        self.temperatures = temperatures  # [M] fp32
        self.num_outputs = [len(d) for d in depths]

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    def token_positions(self) -> list[tuple[int, int, int]]:
        """``(completion b, position, exit depth)`` of every generated token, in order."""
        return [(b, p - 1 + k, e) for b, (p, ds) in enumerate(zip(self.prompt_lens, self.depths)) for k, e in enumerate(ds)]

    @staticmethod
    def build(model: OuroForCausalLM, prompts, outputs, exit_depths, layout: str, temperature,
              max_loops: PerCompletion = None, latent_seed: PerCompletion = 0,
              device: torch.device | None = None) -> _Batch:
        cfg = model.config
        family = family_of(model)
        layouts = tuple(_REPLAYS[family.model_type])
        if layout not in layouts:
            why = ""
            if layout in LAYOUTS:
                why = f" for {family.model_type} models (the engine serves them in {', '.join(layouts)} only)"
            raise InvalidRequestError(f"layout must be one of {list(layouts)}{why}, got {layout!r}", param="layout")
        if not (len(prompts) == len(outputs) == len(exit_depths)) or not prompts:
            raise InvalidRequestError(f"prompts, outputs and exit_depths must be non-empty and equally long, got "
                                      f"{len(prompts)}, {len(outputs)}, {len(exit_depths)}", param="prompts")
        temps = _per_completion(temperature, len(prompts), "temperature")
        bounds = [_max_loops(cfg, family, m, i) for i, m in enumerate(_per_completion(max_loops, len(prompts), "max_loops"))]
        seeds = _per_completion(latent_seed, len(prompts), "latent_seed")
        if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**32 for s in seeds):
            raise InvalidRequestError(f"latent_seed must hold integers in [0, 2**32), got {latent_seed!r:.80}",
                                      param="latent_seed")
        seqs, kv_depths, prompt_lens, depths, targets, token_temps = [], [], [], [], [], []
        for i, (prompt, out, ds) in enumerate(zip(prompts, outputs, exit_depths)):
            prompt, out, ds = _ids(prompt, cfg.vocab_size, f"prompts[{i}]"), _ids(out, cfg.vocab_size, f"outputs[{i}]"), list(ds)
            r, bound = family.prefill_loops(cfg, bounds[i]), bounds[i]
            if len(ds) != len(out):
                raise InvalidRequestError(f"exit_depths[{i}] has {len(ds)} entries for {len(out)} tokens", param="exit_depths")
            if any(isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= bound for e in ds):
                raise InvalidRequestError(f"exit_depths[{i}] must hold integers in [1, {bound}], got {ds}", param="exit_depths")
            if not family.exit_criterion.exits_in_prefill and ds[0] != r:
                raise InvalidRequestError(f"exit_depths[{i}][0] must be {r}: a {family.model_type} prompt runs max_loops "
                                          f"({r}) iterations and its first token comes from the last one, got {ds[0]} "
                                          "(pass the rollout's max_loops)", param="exit_depths")
            t = float(temps[i])
            if not math.isfinite(t) or t < 0:
                raise InvalidRequestError(f"temperature must be a finite number >= 0, got {temps[i]!r}", param="temperature")
            seqs.append(prompt + out[:-1])
            kv_depths.append([r] * len(prompt) + ds[1:])
            prompt_lens.append(len(prompt))
            depths.append(ds)
            targets += out
            token_temps += [t if t >= _GREEDY_EPS else 1.0] * len(out)
        dev = device if device is not None else next(model.parameters()).device
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        kv = torch.full((len(seqs), width), family.prefill_loops(cfg, max(bounds)), dtype=torch.long)
        for b, (s, e) in enumerate(zip(seqs, kv_depths)):
            ids[b, :len(s)] = torch.tensor(s)
            kv[b, :len(e)] = torch.tensor(e)
        return _Batch(ids.to(dev), kv.to(dev), prompt_lens, [len(s) for s in seqs], depths,
                      torch.tensor(targets, dtype=torch.long, device=dev),
                      torch.tensor(token_temps, dtype=torch.float32, device=dev), layout, family.model_type,
                      torch.tensor(seeds, dtype=torch.long, device=dev))


def _per_completion(value, n: int, name: str) -> list:
    """One value per completion from one value (or None) or a sequence of ``n``."""
    values = [value] * n if value is None or isinstance(value, (int, float)) else list(value)
    if len(values) != n:
        raise InvalidRequestError(f"got {len(values)} values of {name} for {n} completions", param=name)
    return values


def _max_loops(cfg, family, value, i: int) -> int:
    """A completion's max_loops: its exit depths' bound (Huginn: also its prompt's depth)."""
    if value is None:
        return cfg.num_loops
    limit = family.loop_limit(cfg)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= (limit or value):
        allowed = f"an integer in [1, {limit}]" if limit else "an integer >= 1"
        raise InvalidRequestError(f"max_loops[{i}] must be {allowed}, got {value!r}", param="max_loops")
    return value


def _ids(ids, vocab: int, name: str) -> list[int]:
    ids = list(ids)
    if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise InvalidRequestError(f"{name} must be a non-empty list of token ids in [0, {vocab})", param=name)
    return ids


# --- last_exited: one dense forward with a per-key loop history ----------------------------------


class _LastExitedHistory:
    """Every loop's K/V per layer; loop ``d`` reads key ``j`` at loop ``min(d, e_j)``.

    Keys are per position only (all queries of a forward run the same loop), so the
    plain causal attention applies once each key holds the K/V of the right loop.
    A query's own position reads its loop-``d`` K/V whenever ``d <= e`` -- the only
    loops whose results are used.
    """

    def __init__(self, batch: int, seq: int, kv_depth: Tensor) -> None:
        self.batch, self.seq = batch, seq
        self.e = kv_depth.reshape(-1)  # [B*T]
        self.kv: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (layer, loop) -> [B*T, kv_heads, D] each
        self.exited_at = {}  # loop l -> mask [B*T, 1, 1] of keys whose K/V stays at loop l

    def attention(self, loop: int) -> DenseCausalAttention:
        def history(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            self.kv[layer, loop] = (k, v)
            for l in range(1, loop):
                mask = self._exited_at(l)
                if mask is not None:
                    kl, vl = self.kv[layer, l]
                    k, v = torch.where(mask, kl, k), torch.where(mask, vl, v)
            return k, v

        return DenseCausalAttention(self.batch, self.seq, history)

    def _exited_at(self, loop: int) -> Tensor | None:
        if loop not in self.exited_at:
            mask = (self.e == loop)[:, None, None]
            self.exited_at[loop] = mask if bool(mask.any()) else None
        return self.exited_at[loop]


def _last_exited_hidden(model: OuroForCausalLM, batch: _Batch) -> Tensor:
    """Hidden state ``[M, H]`` each generated token was sampled from."""
    b, t = batch.ids.shape
    loops = max(max(d) for d in batch.depths)  # no query reads a loop deeper than the deepest exit
    history = _LastExitedHistory(b, t, batch.kv_depth)
    out = model.forward_dense(batch.ids, loops, compute_logits=False, attention=history.attention)
    where = torch.tensor(batch.token_positions(), dtype=torch.long, device=batch.ids.device)  # [M, 3]
    return out.hidden_states[where[:, 2] - 1, where[:, 0], where[:, 1]]


# --- shared: depth-major prompt, then generated positions in order ----------------------------------


class _PrefixAttention:
    """One new position per sequence: attends fixed prefix keys plus its own current K/V.

    ``prefix_k[layer]``: ``[B, p, kv_heads, D]`` (the final K/V of positions ``0..p-1``).
    Records each layer's own K/V of the loop just run in ``own``.
    """

    def __init__(self, prefix_k: list[Tensor], prefix_v: list[Tensor]) -> None:
        self.prefix_k, self.prefix_v = prefix_k, prefix_v
        self.own: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope) -> Tensor:
        # q: [B, heads, D]; k, v: [B, kv_heads, D]
        q, k = rope(q, k)
        self.own[layer] = (k, v)
        keys = torch.cat([self.prefix_k[layer], k[:, None]], dim=1)  # [B, p+1, kv_heads, D]
        values = torch.cat([self.prefix_v[layer], v[:, None]], dim=1)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=2)
            values = values.repeat_interleave(groups, dim=2)
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bhd,bjhd->bhj", q.float(), keys.float()) * scale
        return torch.einsum("bhj,bjhd->bhd", scores.softmax(-1), values.float()).to(q.dtype)


def _shared_hidden(model: OuroForCausalLM, batch: _Batch) -> Tensor:
    cfg = model.config
    r, n_layers = cfg.total_ut_steps, cfg.num_hidden_layers
    bsz = batch.size
    dev = batch.ids.device
    p_max, p_min = max(batch.prompt_lens), min(batch.prompt_lens)

    # 1. The prompt block: the plain dense model over [B, P_max] (rows whose prompt is shorter
    #    compute junk past it, which no real position reads and step 2 overwrites).
    finals: dict[int, tuple[Tensor, Tensor]] = {}

    def prompt_attention(loop: int) -> DenseCausalAttention:
        def capture(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            if loop == r:
                finals[layer] = (k, v)  # a prompt position's final K/V is its loop-R K/V
            return k, v

        return DenseCausalAttention(bsz, p_max, capture)

    prompt_out = model.forward_dense(batch.ids[:, :p_max], r, compute_logits=False, attention=prompt_attention)
    # Final K/V per layer, one [B, kv_heads, D] entry per position (extended as positions are computed).
    fk = [list(finals[l][0].view(bsz, p_max, *finals[l][0].shape[1:]).unbind(1)) for l in range(n_layers)]
    fv = [list(finals[l][1].view(bsz, p_max, *finals[l][1].shape[1:]).unbind(1)) for l in range(n_layers)]

    hidden: dict[tuple[int, int], Tensor] = {}  # (b, token index) -> [H]
    for b, (p, ds) in enumerate(zip(batch.prompt_lens, batch.depths)):
        hidden[b, 0] = prompt_out.hidden_states[ds[0] - 1, b, p - 1]

    # 2. Generated positions in order, all sequences at once: row b is active at p when P_b <= p < T_b.
    for pos in range(p_min, max(batch.lengths)):
        active = [batch.prompt_lens[b] <= pos < batch.lengths[b] for b in range(bsz)]
        if not any(active):
            continue
        act = torch.tensor(active, device=dev)
        depth = torch.where(act, batch.kv_depth[:, pos], torch.ones_like(batch.kv_depth[:, pos]))  # [B]
        attn = _PrefixAttention([torch.stack(fk[l][:pos], 1) for l in range(n_layers)],
                                [torch.stack(fv[l][:pos], 1) for l in range(n_layers)])
        x = model.embed(batch.ids[:, pos])
        positions = torch.full((bsz,), pos, dtype=torch.long, device=dev)
        h_exit = x
        new_k: list[Tensor | None] = [None] * n_layers
        new_v: list[Tensor | None] = [None] * n_layers
        for d in range(1, int(depth.max()) + 1):
            x, _ = model.loop(x, positions, attn)
            at = depth == d  # rows whose position exits after this loop
            h_exit = torch.where(at[:, None], x, h_exit)
            for l in range(n_layers):
                k, v = attn.own[l]
                new_k[l] = torch.where(at[:, None, None], k, k if new_k[l] is None else new_k[l])
                new_v[l] = torch.where(at[:, None, None], v, v if new_v[l] is None else new_v[l])
        for l in range(n_layers):
            keep = act[:, None, None]
            if pos < len(fk[l]):  # replaces the prompt block's junk for rows whose prompt ended earlier
                fk[l][pos] = torch.where(keep, new_k[l], fk[l][pos])
                fv[l][pos] = torch.where(keep, new_v[l], fv[l][pos])
            else:
                fk[l].append(new_k[l])
                fv[l].append(new_v[l])
        for b in range(bsz):
            if active[b]:
                hidden[b, pos - batch.prompt_lens[b] + 1] = h_exit[b]
    return torch.stack([hidden[b, k] for b, n in enumerate(batch.num_outputs) for k in range(n)])


# --- Huginn: its stages, last_exited ---------------------------------------------------------------


def _huginn_hidden(model, batch: _Batch) -> Tensor:
    """Coda outputs ``[M, H]`` each generated token was sampled from (module docstring): the prelude (dense
    causal), the seeded latent state, core iterations with the per-key history, then the coda over each
    position's state at its own depth."""
    b, t = batch.ids.shape
    dev = batch.ids.device
    ids = batch.ids.reshape(-1)
    pos = torch.arange(t, device=dev).repeat(b)
    depth = batch.kv_depth.reshape(-1)  # [B*T]: prompt positions max_loops, generated ones their exit
    e = model.prelude(ids, pos, DenseCausalAttention(b, t))
    state = model.initial_state(e, pos, batch.latent_seeds.repeat_interleave(t))
    history = _LastExitedHistory(b, t, batch.kv_depth)
    final = state
    for loop in range(1, int(depth.max()) + 1):
        state, _ = model.core(state, e, pos, history.attention(loop))
        final = torch.where((depth == loop)[:, None], state, final)
    out = model.coda_hidden(final, pos, DenseCausalAttention(b, t)).view(b, t, -1)
    where = torch.tensor(batch.token_positions(), dtype=torch.long, device=dev)  # [M, 3]
    return out[where[:, 0], where[:, 1]]


#: Per family, per KV layout: the hidden states a batch's generated tokens were sampled from.
_REPLAYS = {"ouro": {"last_exited": _last_exited_hidden, "shared": _shared_hidden},
            "huginn_raven": {"last_exited": _huginn_hidden}}
