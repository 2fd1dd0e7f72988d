"""Vectorized, batch-invariant token sampler.

One call samples the B rows whose token exits this step. Per row, in vLLM's
order (v0 order for min-p):

    allowed_token_ids -> bad_words -> min_tokens -> logit_bias -> penalties
    -> temperature -> top-k -> top-p -> min-p -> sample

The per-request logits fields (``allowed_token_ids``, ``bad_words``,
``min_tokens``, ``logit_bias``) come as sparse (row, token) lists and act on
the device; ``min_tokens`` and multi-token bad words read the rows' token index
and recent tokens on the device, never host counts (which may lag a step).

Filters mask with ``-inf``. Greedy rows (``temperature < SAMPLING_EPS``) take
the argmax of the penalized logits (lowest index on ties); the other rows use
the Gumbel-max trick, ``argmax(z - log(-log u))``, which draws exactly from
``softmax(z)``.

Randomness is counter-based: ``u`` for row ``b`` and vocab entry ``v`` is an
integer hash of ``(seeds[b], token_index[b], v)``. It does not depend on the
batch composition, on a global RNG or on the device, so a seeded request gives
the same tokens whatever else is in the batch, on CPU and on CUDA. On CUDA the
draw (hash, temperature, noise, argmax) runs as one Triton reduction
(``loopline.kernels.sampling.sample_rows``): in torch the hash alone is ~120
small launches, milliseconds of host time in every step that samples.

NOTE: ``__call__`` never syncs with the host (no ``.item()``/``.tolist()``, no
``if tensor:``); work is skipped only through the host-side flags that the
model runner puts in ``SamplingTensors``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

SAMPLING_EPS = 1e-5  # temperature below this means greedy (vLLM's _SAMPLING_EPS)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

_MASK32 = 0xFFFFFFFF
_U23 = 1.0 / (1 << 23)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device, one row per sequence sampled.

    Built by the model runner. The host-side flags summarize the tensors so the
    sampler can skip work without syncing; they must be consistent with them
    (a flag may be True when no row needs the feature, never the reverse).
    """

    temperature: Tensor  # [B] f32, < SAMPLING_EPS => greedy
    top_k: Tensor  # [B] int64, <= 0 => off
    top_p: Tensor  # [B] f32, >= 1.0 => off
    min_p: Tensor  # [B] f32, 0.0 => off
    presence_penalty: Tensor  # [B] f32
    frequency_penalty: Tensor  # [B] f32
    repetition_penalty: Tensor  # [B] f32, 1.0 => off
    seeds: Tensor  # [B] int64, non-negative, < 2**63
    token_index: Tensor  # [B] int64, index of the token being sampled within its completion
    output_counts: Tensor | None  # [B, V] int32/float counts of generated tokens; None if unused
    seen_mask: Tensor | None  # [B, V] bool, tokens in prompt or output; None if unused
    all_greedy: bool
    any_penalties: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_num_logprobs: int | None  # max k of "logprobs=k" over rows; -1/None => none requested
    max_top_k: int = 0  # the largest top_k over rows, never less; 0 => unknown (top-k then sorts whole rows)
    # which penalties some row uses (host; True when unknown): with any_penalties, the caller supplies seen_mask
    # only for the repetition penalty and output_counts only for the frequency and presence ones
    any_repetition: bool = True
    any_count_penalties: bool = True
    # Per-request logprobs modes (SamplingParams.logprobs_mode), set only when a row differs from
    # the sampler's default: one mode for every row, or a per-row choice for a mixed batch.
    logprobs_mode: str | None = None  # overrides the sampler's logprobs_mode for every row
    processed_rows: Tensor | None = None  # [B] bool, mixed batches: True => processed, False => raw
    # Per-request logits fields, as sparse (row, token) entries; each flag False => its tensors unused.
    any_allowed: bool = False  # allowed_token_ids: only these tokens of a restricted row
    allowed_rows: Tensor | None = None  # [A] int64 row of each allowed entry
    allowed_ids: Tensor | None = None  # [A] int64 token
    restricted: Tensor | None = None  # [B] bool, the row has allowed_token_ids
    any_logit_bias: bool = False
    bias_rows: Tensor | None = None  # [L] int64
    bias_ids: Tensor | None = None  # [L] int64 (unique per row)
    bias_values: Tensor | None = None  # [L] f32
    any_min_tokens: bool = False  # min_tokens: these ids are -inf while token_index < min_tokens
    min_tokens: Tensor | None = None  # [B] int64, 0 => off
    min_rows: Tensor | None = None  # [M] int64
    min_ids: Tensor | None = None  # [M] int64
    any_bad_words: bool = False  # each bad word's last token is -inf when its prefix was just generated
    bad_rows: Tensor | None = None  # [E] int64
    bad_last: Tensor | None = None  # [E] int64, the token banned
    bad_prefix: Tensor | None = None  # [E, W] int64, the tokens before it, right-aligned (W = recent's width)
    bad_prefix_len: Tensor | None = None  # [E] int64, 0 => banned always
    recent: Tensor | None = None  # [B, W] int64, the row's last W generated tokens (oldest first); None: no prefix
    # logprob_token_ids: these ids' logprobs replace a row's top-k columns
    custom_ids: Tensor | None = None  # [B, K] int64 (K = max_num_logprobs)
    custom_mask: Tensor | None = None  # [B, K] bool, True => the column holds a custom id
    # the rows whose token is used ([B] bool on the device; None: all): the others may skip the filters (a decode
    # row that does not exit this step; its token is drawn anyway, never read)
    active: Tensor | None = None

    @property
    def any_filters(self) -> bool:
        """Whether some row cuts its distribution: top-k, top-p or min-p."""
        return self.any_top_k or self.any_top_p or self.any_min_p


@dataclass
class SamplerOutput:
    """What the sampler returns for B rows (K = max_num_logprobs)."""

    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] f32, logprob of the sampled token; None if not requested
    ranks: Tensor | None  # [B] int64, 1 + number of tokens with a strictly greater logprob
    top_ids: Tensor | None  # [B, K] int64; None if K == 0 or not requested
    top_logprobs: Tensor | None  # [B, K] f32


# --------------------------------------------------------------------------
# Counter-based randomness


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for ``x`` in [0, 2**32) held in int64, ``c`` < 2**32.

    NOTE: the constant is split into 16-bit halves so that no product reaches
    2**63 (signed int64 overflow is undefined behaviour, and CPU and CUDA need
    not agree on it): both partial products and their sum stay below 2**49.
    """
    lo = x * (c & 0xFFFF)
    hi = (x * (c >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection of [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _row_keys(seeds: Tensor, token_index: Tensor) -> Tensor:
    """Two 32-bit keys per row from both halves of the seed and the token index. -> [2, B].

    Each key chains ``h = fmix32(h ^ word)`` from its own start constant. The
    chain is injective in any single word, so two rows that differ only in the
    seed's low half, only in its high half or only in the token index never
    share a key. Both keys run as one [2, B] tensor to halve the launches.
    """
    seeds = seeds.to(torch.int64)
    token_index = token_index.to(torch.int64)
    words = (seeds & _MASK32, (seeds >> 32) & _MASK32, token_index & _MASK32, (token_index >> 32) & _MASK32)
    h = seeds.new_full((2, seeds.shape[0]), 0x243F6A88)
    h[1].fill_(0x85A308D3)
    for w in words:
        h = _fmix32(h ^ w)
    return h


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    """:func:`_fmix32` on uint32 arrays (numpy's unsigned products wrap mod 2**32: no splitting needed)."""
    h ^= h >> 16
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> 13
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> 16
    return h


def _counter_uniform_np(seeds: np.ndarray, token_index: np.ndarray, vocab_size: int) -> np.ndarray:
    """:func:`counter_uniform` in numpy's uint32, bit for bit: on the CPU ~30 array ops instead of ~120 torch ops
    of int64 halves (a sampling step of the bundled model on the CPU spent about a millisecond there)."""
    words = [x.astype(np.uint32) for w in (seeds, token_index) for x in (w & _MASK32, w >> 32)]
    h = np.empty((2, len(seeds)), dtype=np.uint32)
    h[0], h[1] = 0x243F6A88, 0x85A308D3
    for w in words:
        h = _fmix32_np(h ^ w)
    a, b = h[:, :, None]  # [B, 1] each
    g = np.arange(vocab_size, dtype=np.uint32) * np.uint32(0x9E3779B9)
    h = _fmix32_np(_fmix32_np(a ^ g) ^ b)  # [B, V]
    return ((h >> 9).astype(np.float32) + np.float32(0.5)) * np.float32(_U23)


def counter_uniform(seeds: Tensor, token_index: Tensor, vocab_size: int) -> Tensor:
    """Uniform numbers in (0, 1) keyed by (seed, token index, vocab index).

    seeds: [B] int64, token_index: [B] int64 -> [B, vocab_size] f32 on seeds' device.
    Values are ``(k + 0.5) / 2**23`` for a 23-bit hash ``k``: exact in float32,
    strictly inside (0, 1), and bit-identical on every device (on the CPU computed in numpy's uint32, on
    CUDA in torch's int64; the sampler's CUDA draw hashes inside its Triton kernel).
    """
    if seeds.device.type == "cpu" and token_index.device.type == "cpu":
        u = _counter_uniform_np(seeds.to(torch.int64).numpy(), token_index.to(torch.int64).numpy(), vocab_size)
        return torch.from_numpy(u)
    return _counter_uniform_torch(seeds, token_index, vocab_size)


def _counter_uniform_torch(seeds: Tensor, token_index: Tensor, vocab_size: int) -> Tensor:
    """:func:`counter_uniform` in torch's int64 (32-bit words, products split in halves), on any device."""
    a, b = _row_keys(seeds, token_index)[:, :, None]  # [B, 1] each
    v = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    g = _mul32(v, 0x9E3779B9)  # [V], spreads consecutive ids over 32 bits
    h = _fmix32(a ^ g)  # [B, V]
    h = _fmix32(h ^ b)  # second round mixes in the other 32 bits of row key
    return ((h >> 9).to(torch.float32) + 0.5) * _U23


# --------------------------------------------------------------------------
# Logit processing


# The chunked Triton argmax pays where a row is long: torch's one reduction over Ouro's 49,152 logits took
# 12.8 us of the GPU at one row (H200), the two short launches less. Over a short row (the bundled model's
# 4,096) the reduction is short too, and a step of such a small model waits on the host, where a Triton launch
# costs more than torch's.
_TRITON_ARGMAX_MIN_VOCAB = 16384


def _argmax(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` of fp32 ``[B, V]``; on CUDA with a long row the chunked Triton argmax (same result,
    two short launches instead of one long reduction: ``loopline.kernels.sampling``)."""
    if (x.is_cuda and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1
            and x.shape[1] >= _TRITON_ARGMAX_MIN_VOCAB):
        from loopline.kernels import sampling  # NOTE: lazily, as the other Triton kernels (TRITON_INTERPRET)

        if sampling.available():
            return sampling.argmax_rows(x)
    return x.argmax(dim=-1)


def _sample_kernel(x: Tensor) -> bool:
    """Whether a batch with sampled rows draws in the Triton kernel: on CUDA, at any vocabulary (the torch draw
    is ~120 launches of the uniforms' hash)."""
    if not x.is_cuda:
        return False
    from loopline.kernels import sampling  # NOTE: lazily, as the other Triton kernels (TRITON_INTERPRET)

    return sampling.available()


def apply_penalties(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Repetition, then frequency and presence penalties (vLLM semantics). [B, V] -> [B, V].

    Neutral values (repetition 1.0, frequency/presence 0.0) leave a row's logits
    bit-identical, which keeps a row's result independent of its batch-mates.
    """
    x = logits
    if t.seen_mask is not None:
        pen = torch.where(t.seen_mask, t.repetition_penalty[:, None], 1.0)  # [B, V]
        x = torch.where(x > 0, x / pen, x * pen)
    if t.output_counts is not None:
        counts = t.output_counts.to(x.dtype)
        x = x - t.frequency_penalty[:, None] * counts
        x = x - t.presence_penalty[:, None] * (counts > 0).to(x.dtype)
    return x


def apply_logits_fields(logits: Tensor, t: SamplingTensors) -> Tensor:
    """allowed_token_ids, bad_words, min_tokens, then logit_bias (vLLM's order). [B, V] -> [B, V], a new tensor.

    Rows without a field are bit-identical; masked tokens are ``-inf`` (added: ``x + -inf``), so the
    result never depends on the order entries are applied nor on the row's batch-mates."""
    x = logits
    B, V = x.shape
    neg_inf = float("-inf")
    if t.any_allowed:
        keep = torch.zeros(B, V, dtype=torch.bool, device=x.device)
        # (a device tensor of values: a Python scalar through a tensor index is a pageable copy, which waits)
        keep.index_put_((t.allowed_rows, t.allowed_ids), torch.ones_like(t.allowed_rows, dtype=torch.bool))
        x = x.masked_fill(~(keep | ~t.restricted[:, None]), neg_inf)
    if t.any_bad_words:
        ban = torch.ones_like(t.bad_rows, dtype=torch.bool)
        if t.recent is not None:
            W = t.recent.shape[1]
            hist = t.recent[t.bad_rows]  # [E, W]
            in_prefix = torch.arange(W, device=x.device)[None, :] >= (W - t.bad_prefix_len)[:, None]
            same = ((hist == t.bad_prefix) | ~in_prefix).all(dim=1)
            # the prefix must be generated tokens: the row has at least that many
            ban = same & (t.bad_prefix_len <= t.token_index[t.bad_rows])
        else:
            ban = t.bad_prefix_len == 0
        add = torch.where(ban, neg_inf, 0.0).to(x.dtype)
        x = x.index_put((t.bad_rows, t.bad_last), add, accumulate=True)
    if t.any_min_tokens:
        early = t.token_index[t.min_rows] < t.min_tokens[t.min_rows]
        add = torch.where(early, neg_inf, 0.0).to(x.dtype)
        x = x.index_put((t.min_rows, t.min_ids), add, accumulate=True)
    if t.any_logit_bias:
        x = x.index_put((t.bias_rows, t.bias_ids), t.bias_values.to(x.dtype), accumulate=True)
    return x


def _apply_top_k_top_p(z: Tensor, top_k: Tensor, top_p: Tensor, use_k: bool, use_p: bool,
                       max_k: int = 0) -> Tensor:
    """Mask with -inf outside the top-k, then outside the nucleus of what is left. [B, V].

    Both cuts become a per-row value threshold (``z < thr`` is dropped), so ties
    at the boundary are all kept and the result never depends on how the sort
    orders equal values. ``max_k``: the rows' largest ``top_k`` when the host
    knows it; top-k alone then selects that many values a row instead of sorting
    the row (the same threshold: the k-th largest value).
    """
    B, V = z.shape
    if use_k and not use_p and 0 < max_k < V:
        kth = z.topk(max_k, dim=-1).values  # [B, max_k], descending
        on = top_k > 0
        thr = kth.gather(1, (torch.where(on, top_k.clamp(max=max_k), max_k) - 1)[:, None])
        return z.masked_fill((z < thr) & on[:, None], float("-inf"))
    sorted_z = z.sort(dim=-1, descending=True).values  # [B, V]
    thr = sorted_z[:, -1:]  # keep-all threshold
    if use_k:
        k = torch.where(top_k > 0, top_k.clamp(max=V), V)  # [B]
        thr = sorted_z.gather(1, (k - 1)[:, None])  # [B, 1]
        sorted_z = sorted_z.masked_fill(sorted_z < thr, float("-inf"))
    if use_p:
        probs = sorted_z.softmax(dim=-1)
        # Mass strictly above each position; keep while it is < top_p. This is
        # the smallest prefix whose mass reaches top_p, and never empty.
        above = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
        n_keep = (above < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [B]
        # NOTE: top_p >= 1 must keep all: the float cumsum can reach 1.0 early.
        n_keep = torch.where(top_p >= 1.0, V, n_keep)
        thr_p = sorted_z.gather(1, (n_keep - 1)[:, None])
        thr = torch.maximum(thr, thr_p)
    return z.masked_fill(z < thr, float("-inf"))


def _apply_min_p(z: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = z.softmax(dim=-1)
    cut = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return z.masked_fill(probs < cut, float("-inf"))


def process_logits(x: Tensor, t: SamplingTensors) -> Tensor:
    """Temperature and filters on penalized logits; greedy rows use temperature 1. [B, V]."""
    temp = torch.where(t.temperature < SAMPLING_EPS, 1.0, t.temperature)
    z = x / temp[:, None]
    if t.any_top_k or t.any_top_p:
        z = _apply_top_k_top_p(z, t.top_k, t.top_p, t.any_top_k, t.any_top_p, t.max_top_k)
    if t.any_min_p:
        z = _apply_min_p(z, t.min_p)
    return z


# --------------------------------------------------------------------------
# Sampler


class Sampler:
    """Samples one token per row and reports logprobs in vLLM's two modes.

    ``raw_logprobs``: log_softmax of the model's logits. ``processed_logprobs``:
    log_softmax of the logits actually sampled from (after penalties,
    temperature, top-k/top-p, min-p; masked tokens are -inf; greedy rows at
    temperature 1). ``logprobs_mode`` is the default; ``SamplingTensors`` may
    override it for the whole batch or per row.
    """

    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r} is not supported; allowed: {', '.join(LOGPROBS_MODES)}")
        self.logprobs_mode = logprobs_mode

    def warm(self, vocab_size: int, device: torch.device) -> None:
        """Runs the token choice once on ``[1, vocab_size]`` logits, greedy and sampled (plain, with filtered
        logits, with the filters' cuts), so that its kernels (on CUDA the Triton reductions) compile at start-up rather than in
        a server's first request (0.38 s of its first token on an H100, ``tools/jit_misses.py``)."""
        x = torch.zeros((1, vocab_size), dtype=torch.float32, device=device)
        _argmax(x)
        if _sample_kernel(x):
            from loopline.kernels import sampling

            one, zero = torch.ones(1, device=device), torch.zeros(1, dtype=torch.int64, device=device)
            for z in (None, x):
                sampling.sample_rows(x, one, zero, zero, SAMPLING_EPS, z)
            for active in (None, one > 0):  # (the runner says which rows it reads; a draft's sampling does not)
                cut = sampling.filter_cut(x, one, zero + 1, one / 2, one / 2, SAMPLING_EPS, active)
            sampling.sample_rows(x, one, zero, zero, SAMPLING_EPS, cut=cut)

    def __call__(self, logits: Tensor, t: SamplingTensors) -> SamplerOutput:
        logits = logits.float()  # [B, V]
        num_logprobs = -1 if t.max_num_logprobs is None else t.max_num_logprobs
        want_logprobs = num_logprobs >= 0
        mixed = t.processed_rows is not None
        processed = want_logprobs and (mixed or (t.logprobs_mode or self.logprobs_mode) == "processed_logprobs")

        fields = t.any_allowed or t.any_bad_words or t.any_min_tokens or t.any_logit_bias
        x = apply_logits_fields(logits, t) if fields else logits
        x = apply_penalties(x, t) if t.any_penalties else x
        kernel = not t.all_greedy and _sample_kernel(x)
        filters = t.any_filters
        # (the kernel tempers and filters the logits itself: z only where processed logprobs need it)
        z = process_logits(x, t) if (processed or (not t.all_greedy and not kernel)) else None

        if t.all_greedy:
            token_ids = _argmax(x)  # [B]
        elif kernel:  # the draw below in two launches, the filters' cuts in one more (loopline.kernels.sampling)
            from loopline.kernels import sampling

            x, temp = x.contiguous(), t.temperature.float()
            cut = None
            if filters and z is None:
                cut = sampling.filter_cut(x, temp, t.top_k.long(), t.top_p.float(), t.min_p.float(), SAMPLING_EPS,
                                          t.active)
            token_ids = sampling.sample_rows(x, temp, t.seeds.long(), t.token_index.long(), SAMPLING_EPS,
                                             z.contiguous() if (filters and z is not None) else None, cut)
        else:
            u = counter_uniform(t.seeds, t.token_index, x.shape[-1])  # [B, V]
            # Gumbel-max: argmax(z + Gumbel) ~ softmax(z); masked -inf never wins.
            sampled = _argmax(z - torch.log(-torch.log(u)))
            token_ids = torch.where(t.temperature < SAMPLING_EPS, _argmax(x), sampled)

        if not want_logprobs:
            return SamplerOutput(token_ids, None, None, None, None)
        if mixed:  # both distributions, each row takes its own (only when a batch mixes modes)
            lp = torch.where(t.processed_rows[:, None], torch.log_softmax(z, dim=-1), torch.log_softmax(logits, dim=-1))
        else:
            lp = torch.log_softmax(z if processed else logits, dim=-1)  # [B, V]
        token_lp = lp.gather(1, token_ids[:, None])  # [B, 1]
        ranks = (lp > token_lp).sum(dim=-1) + 1
        top_ids = top_lp = None
        if num_logprobs > 0:
            top_lp, top_ids = lp.topk(min(num_logprobs, lp.shape[-1]), dim=-1)
            if t.custom_ids is not None:  # logprob_token_ids: those ids' logprobs in their rows' columns
                k = top_ids.shape[1]
                custom, mask = t.custom_ids[:, :k], t.custom_mask[:, :k]
                top_ids = torch.where(mask, custom, top_ids)
                top_lp = torch.where(mask, lp.gather(1, custom), top_lp)
        return SamplerOutput(token_ids, token_lp.squeeze(1), ranks, top_ids, top_lp)
