"""What the sampler needs from the host, and what it gives back to the host.

:func:`build_sampling_tensors` turns the sampled rows' requests into
``SamplingTensors``; :class:`SampleBatch` holds a step's sampled rows on the
device and reads them back as a :class:`HostSample`, through pinned buffers
copied while the next step runs.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopline.worker.sampler import SamplerOutput, SamplingTensors
from loopline.worker.staging import stage


_PACKED = ("exit", "depth", "ids")  # [M] each, always present: bool, int64, int64


@dataclass
class HostSample:
    """A step's sampled rows as host lists, one entry per sampled row (``SampleBatch.row_idx``)."""

    exit: list[bool]  # the token exited (decode) / the prompt finished
    depth: list[int]  # exit depth
    ids: list[int]  # sampled token
    lps: list[float] | None = None  # logprob of the sampled token (rows that asked for logprobs)
    ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None  # [M][k] top logprobs
    top_lps: list[list[float]] | None = None
    verdicts: list[int] | None = None  # pipelining target rows: their lane's draft verdict (SampleBatch.verdicts)


@dataclass
class SampleBatch:
    """A step's sampled rows on the device, and their reading back to the host."""

    row_idx: list[int]  # step row of each sampled row
    states: list[Any]  # their request states
    out: SamplerOutput
    exit_flags: Tensor  # [M] bool: the token exited (decode) / the prompt finished
    depth: Tensor  # [M] exit depth
    # [3, M] int64: exit_flags, depth and the token ids already packed on the device (the decode state's
    # advance records them, see SlotOps.advance); None: packed here, by one stack, when read back.
    packed: Tensor | None = None
    # [M] int64 or None: per sampled row, the draft verdict of a pipelining lane in this step (0: none, 1: its
    # draft rejected, 2: accepted; loopline.worker.pipe_rows), for the spec_decode counters
    verdicts: Tensor | None = None

    def _tensors(self) -> dict[str, Tensor | None]:
        o = self.out
        return {"exit": self.exit_flags, "depth": self.depth, "ids": o.token_ids, "lps": o.logprobs, "ranks": o.ranks,
                "top_ids": o.top_ids, "top_lps": o.top_logprobs, "verdicts": self.verdicts}

    def to_host_async(self) -> Callable[[], HostSample]:
        """Starts non-blocking copies to pinned memory; the returned call waits for them."""
        tensors = self._tensors()
        if self.exit_flags.device.type != "cuda":  # the CPU is the device: its results are ready
            host = HostSample(**{k: t.tolist() if t is not None else None for k, t in tensors.items()})
            return lambda: host
        # The three per-row results every step reads travel as one int64 array: one copy instead of three
        # (at one decode row each is a link of the step's chain), and no stack where they come packed.
        rest = {k: t for k, t in tensors.items() if k not in _PACKED and t is not None}
        packed = self.packed if self.packed is not None else torch.stack([tensors[k] for k in _PACKED])
        sources = {"packed": packed, **rest}
        pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in sources.items()}
        # The copies run on a stream of their own, after the step: on the step's stream a copy would sit
        # between this step's last kernel and the next step's first, a link of the chain at one row.
        main, side = torch.cuda.current_stream(packed.device), _readback_stream(packed.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for k, t in sources.items():
                pinned[k].copy_(t, non_blocking=True)
                t.record_stream(side)  # the step's stream may reuse the memory only after the copy
            done = torch.cuda.Event()
            done.record(side)

        def wait() -> HostSample:
            done.synchronize()
            exit_flags, depth, ids = pinned["packed"].tolist()
            return HostSample([bool(v) for v in exit_flags], depth, ids,
                              **{k: pinned[k].tolist() for k in rest})

        return wait


@functools.lru_cache(maxsize=None)
def _readback_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that reads a device's step results back to the host (one per device)."""
    return torch.cuda.Stream(device)


def has_penalties(p) -> bool:
    """Whether sampling params ``p`` use the presence, frequency or repetition penalty."""
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0


class ParamsStager:
    """The rows' per-request sampling parameters on the device, staged again only when they change.

    From one step to the next a decode batch usually samples the same requests, whose parameters
    are fixed: the device copy of the last step is reused then (its tensors are never written), and
    a step of an unchanged batch sends nothing (at one decode row a copy is a link of the step)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._staged: list[Tensor] = []

    def __call__(self, device: torch.device, states: list) -> list[Tensor]:
        """``temperature, top_p, min_p, presence, frequency, repetition, top_k, seeds`` ``[B]`` each."""
        rows = tuple((s.params.temperature, s.params.top_p, s.params.min_p, s.params.presence_penalty,
                      s.params.frequency_penalty, s.params.repetition_penalty, max(s.params.top_k, 0), s.seed)
                     for s in states)
        key = (device, rows)
        if key != self._key:
            f32, i64 = np.float32, np.int64
            cols = list(zip(*rows)) if rows else [()] * 8
            self._staged = stage(device, *((c, dt) for c, dt in zip(cols, (f32,) * 6 + (i64, i64))))
            self._key = key
        return self._staged


def uses_logits_fields(p) -> bool:
    """Whether sampling params ``p`` use a per-request logits field (the sampler's sparse entries)."""
    return bool(p.allowed_token_ids or p.logit_bias or p.uses_min_tokens or p._bad_words_token_ids
                or p.logprob_token_ids)


def bad_words_history(p) -> int:
    """How many of a row's last generated tokens its bad words compare (the longest prefix)."""
    return max((len(w) - 1 for w in p._bad_words_token_ids or ()), default=0)


class FieldsStager:
    """The rows' per-request logits fields (allowed_token_ids, logit_bias, min_tokens, bad_words,
    logprob_token_ids) as sparse device entries, staged again only when the rows' requests change.

    Keyed by the identity of the rows' (effective, never mutated) params, which the stager holds so that
    no id is reused while its entries are cached. A batch that uses none of the fields builds nothing."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._params: list = []
        self._fields: dict[str, Any] = {}

    def __call__(self, device: torch.device, ps: list, num_logprobs: int | None, width: int) -> dict[str, Any]:
        """SamplingTensors' field entries for rows ``ps`` (``width``: the bad words' history width)."""
        key = (device, num_logprobs, width, tuple(id(p) for p in ps))
        if key != self._key:
            self._fields = _stage_fields(device, ps, num_logprobs, width)
            self._key, self._params = key, list(ps)
        return self._fields


def _stage_fields(device: torch.device, ps: list, num_logprobs: int | None, width: int) -> dict[str, Any]:
    i64, f32 = np.int64, np.float32
    out: dict[str, Any] = {}
    arrays: list = []
    names: list[str] = []

    def add(name, values, dtype):
        names.append(name)
        arrays.append((values, dtype))

    allowed = [(b, t) for b, p in enumerate(ps) for t in (p.allowed_token_ids or ())]
    if allowed:
        out["any_allowed"] = True
        add("allowed_rows", [b for b, _ in allowed], i64)
        add("allowed_ids", [t for _, t in allowed], i64)
        add("restricted", [bool(p.allowed_token_ids) for p in ps], np.bool_)
    bias = [(b, t, v) for b, p in enumerate(ps) for t, v in (p.logit_bias or {}).items()]
    if bias:
        out["any_logit_bias"] = True
        add("bias_rows", [b for b, _, _ in bias], i64)
        add("bias_ids", [t for _, t, _ in bias], i64)
        add("bias_values", [v for _, _, v in bias], f32)
    mins = [(b, t) for b, p in enumerate(ps) if p.uses_min_tokens for t in p._stop_ids]
    if mins:
        out["any_min_tokens"] = True
        add("min_tokens", [p.min_tokens if p.uses_min_tokens else 0 for p in ps], i64)
        add("min_rows", [b for b, _ in mins], i64)
        add("min_ids", [t for _, t in mins], i64)
    bad = [(b, w) for b, p in enumerate(ps) for w in (p._bad_words_token_ids or ())]
    if bad:
        out["any_bad_words"] = True
        W = max(width, 1)
        prefix = np.full((len(bad), W), -1, dtype=i64)
        for e, (_, w) in enumerate(bad):
            if len(w) > 1:
                prefix[e, W - (len(w) - 1):] = w[:-1]
        add("bad_rows", [b for b, _ in bad], i64)
        add("bad_last", [w[-1] for _, w in bad], i64)
        add("bad_prefix", prefix, i64)
        add("bad_prefix_len", [len(w) - 1 for _, w in bad], i64)
    if num_logprobs and any(p.logprob_token_ids for p in ps):
        ids = np.zeros((len(ps), num_logprobs), dtype=i64)
        mask = np.zeros((len(ps), num_logprobs), dtype=np.bool_)
        for b, p in enumerate(ps):
            custom = p.logprob_token_ids or ()
            ids[b, :len(custom)] = custom
            mask[b, :len(custom)] = True
        add("custom_ids", ids, i64)
        add("custom_mask", mask, np.bool_)
    out.update(zip(names, stage(device, *arrays)))
    return out


def build_sampling_tensors(states: list, token_index: list[int] | Tensor, default_mode: str,
                           device: torch.device, params: ParamsStager | None = None,
                           fields: FieldsStager | None = None) -> SamplingTensors:
    """Per-row sampling parameters of the rows sampled this step (``states``: request states).

    ``token_index``: each row's index in its completion, host ints or already on the device.
    Penalties need each row's generated-token counts and seen mask: the caller supplies
    ``output_counts`` / ``seen_mask`` from the device decode state.
    ``params`` reuses the parameters' device copy across calls (see :class:`ParamsStager`), ``fields``
    the per-request logits fields' entries (:class:`FieldsStager`). Multi-token bad words need each row's
    recent generated tokens: the caller supplies ``recent`` from the device decode state (width
    :func:`bad_words_history` of the rows).
    """
    dev = device
    ps = [s.params for s in states]
    i64 = np.int64
    temperature, top_p, min_p, presence, frequency, repetition, top_k, seeds = (params or ParamsStager())(dev, states)
    index = token_index if isinstance(token_index, Tensor) else stage(dev, (token_index, i64))[0]
    any_pen = any(has_penalties(p) for p in ps)
    want = [p.logprobs for p in ps if p.logprobs is not None]
    # Per-request logprobs modes (None: the sampler's): one mode for the batch when the rows that
    # want logprobs agree; a per-row tensor (both distributions computed) only when they differ.
    modes = {p.logprobs_mode or default_mode for p in ps if p.logprobs is not None}
    processed_rows = None
    if len(modes) > 1:
        processed_rows = stage(dev, ([(p.logprobs_mode or default_mode) == "processed_logprobs" for p in ps],
                                     np.bool_))[0]
    extra = {}
    if any(uses_logits_fields(p) for p in ps):
        width = max(bad_words_history(p) for p in ps)
        extra = (fields or FieldsStager())(dev, ps, max(want) if want else None, width)
    return SamplingTensors(
        **extra,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition, seeds=seeds, token_index=index,
        output_counts=None, seen_mask=None,
        all_greedy=all(p.greedy for p in ps), any_penalties=any_pen,
        any_repetition=any(p.repetition_penalty != 1.0 for p in ps),
        any_count_penalties=any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in ps),
        any_top_k=any(p.top_k > 0 for p in ps), max_top_k=max((p.top_k for p in ps), default=0),
        any_top_p=any(p.top_p < 1.0 for p in ps),
        any_min_p=any(p.min_p > 0 for p in ps),
        max_num_logprobs=max(want) if want else None,
        logprobs_mode=modes.pop() if len(modes) == 1 else None, processed_rows=processed_rows,
    )
