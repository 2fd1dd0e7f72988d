"""The KV cache's stored dtype, and the scales of an FP8 cache.

``kv_cache_dtype`` (vLLM's option and names): ``auto`` stores K/V in the model's
dtype; ``bfloat16`` / ``float16`` store them in that dtype; ``fp8`` /
``fp8_e4m3`` store FP8 E4M3 (``torch.float8_e4m3fn``, 1 byte per value: twice
the tokens of a bf16 pool, half the bytes read per decode step).

An FP8 value is ``stored * scale`` with one fp32 scale per (layer, KV head) for
K and for V: stored = ``clamp(x / scale, -448, 448)`` rounded to nearest even.
Scales are per layer and head, never per loop plane or page, so the exit copy,
the prefix cache, preemption snapshots and the PD handoff move pages as raw
bytes, unchanged. They come from the checkpoint when it carries
``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (a scalar or one per KV
head; Ouro checkpoints); otherwise from a calibration pass at engine start: the
dense model runs a fixed prompt (:data:`CALIBRATION_TEXT` when a tokenizer is
loaded, else fixed pseudo-random ids) through every stage and every loop a
prompt runs, and each cache layer and head's largest |K| and |V| over all of
them is mapped to half the FP8 range, rounded up to a power of two. A cache
layer of a family with several stages (Huginn: prelude, core and coda) holds
layer ``i`` of each, so its scale covers all three. Why this way:

* fixed, not taken from the first user prompt, so a request's tokens never
  depend on which request came first, and two processes (a prefill and a
  decode worker, replicas) compute the same scales from the same weights;
* E4M3 is floating point: its relative precision (3 mantissa bits) is the
  same over its whole range, so a scale only has to keep values inside the
  range: headroom (2x to 4x above the calibrated maximum) costs no precision
  and keeps unseen activations from saturating;
* powers of two: dividing and multiplying by them is exact, and a tiny
  difference in a measured maximum almost never changes the scale.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from loopline.attention.base import FP8_KV_DTYPE, FP8_MAX
from loopline.errors import InvalidRequestError
from loopline.models.plain import PlaneKV

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")
HEADROOM = 2.0  # the calibrated maximum maps to at most FP8_MAX / HEADROOM
CALIBRATION_TOKENS = 512

# Built-in calibration prompt (prose, code, numbers and markup: the kinds of text a served model sees).
CALIBRATION_TEXT = """\
The river had been rising for three days when the ferry stopped running. Mara packed the notebooks first,
then the lamp, then the jar of seeds her grandmother had labelled in a careful, slanted hand: beans, 1961.
Across the water the town kept its lights on late, as if to say it was not worried, and nobody believed it.

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    \"\"\"Merge overlapping closed intervals; the result is sorted by start.\"\"\"
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out

Q: A train leaves at 14:05 and travels 312 km at an average of 78 km/h. When does it arrive?
A: 312 / 78 = 4 hours, so it arrives at 18:05.

<table><tr><th>year</th><th>rainfall (mm)</th></tr><tr><td>2019</td><td>812.4</td></tr>
<tr><td>2020</td><td>1,043.0</td></tr></table>

SELECT name, COUNT(*) AS n FROM orders WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY n DESC;

Die Versammlung beschloss, die Brücke im Frühjahr zu erneuern. La réunion a duré deux heures.
1. Preheat the oven to 200 C. 2. Mix flour, salt and water. 3. Rest the dough for 30 minutes.
"""


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The stored dtype of ``kv_cache_dtype`` ``name`` for a model computing in ``model_dtype``."""
    if name == "auto":
        return model_dtype
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float16":
        return torch.float16
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    if isinstance(name, str) and name.startswith("fp8"):
        raise InvalidRequestError(f"kv_cache_dtype {name!r} is not supported: loopline stores FP8 KV as E4M3 "
                                  f"('fp8' or 'fp8_e4m3'); allowed: {list(KV_CACHE_DTYPES)}", param="kv_cache_dtype")
    raise InvalidRequestError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}",
                              param="kv_cache_dtype")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def stored_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype pages have while they are copied, snapshotted or sent (``attention.base.kv_bytes``)."""
    return torch.uint8 if is_fp8(kv_dtype) else kv_dtype


@dataclass(frozen=True)
class KVScales:
    """Per-(layer, KV head) fp32 scales of an FP8 cache: ``k``, ``v`` ``[layers, kv_heads]``."""

    k: Tensor
    v: Tensor
    source: str  # where they came from (logged; docs/configuration.md)

    def to(self, device: torch.device) -> KVScales:
        return KVScales(self.k.to(device=device, dtype=torch.float32), self.v.to(device=device, dtype=torch.float32),
                        self.source)

    def same_as(self, other: KVScales) -> bool:
        return (self.k.shape == other.k.shape and self.v.shape == other.v.shape
                and bool(torch.equal(self.k.cpu(), other.k.cpu())) and bool(torch.equal(self.v.cpu(), other.v.cpu())))


def power_of_two_scales(amax: Tensor, headroom: float = HEADROOM) -> Tensor:
    """The smallest power of two ``s`` with ``amax * headroom / s <= FP8_MAX`` (1 where ``amax`` is 0)."""
    amax = amax.float()
    wanted = torch.where(amax > 0, amax * headroom / FP8_MAX, torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(wanted)))


def calibration_token_ids(vocab_size: int, tokenizer=None, length: int = CALIBRATION_TOKENS) -> Tensor:
    """The calibration prompt: :data:`CALIBRATION_TEXT` through ``tokenizer`` (repeated to ``length``), or
    ``length`` fixed pseudo-random ids below ``vocab_size`` without one."""
    ids: list[int] = []
    if tokenizer is not None:
        ids = [i for i in tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False) if 0 <= i < vocab_size]
    if not ids:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (length,), generator=gen)
    reps = math.ceil(length / len(ids))
    return torch.tensor((ids * reps)[:length], dtype=torch.long)


class _AmaxKV(PlaneKV):
    """A prompt pass's K/V (:func:`~loopline.models.plain.dense_prompt`) that keeps each cache layer's largest
    |K| and |V| per KV head. A prompt's loop ``r`` reads only what loop ``r`` wrote, so every plane of a
    stage shares one buffer (one plane's memory, whatever the depth)."""

    def __init__(self, capacity: int, layers: int, kv_heads: int, device: torch.device) -> None:
        super().__init__(capacity)
        self.k_amax = torch.zeros(layers, kv_heads, device=device)
        self.v_amax = torch.zeros_like(self.k_amax)

    def write(self, key: tuple[str, int, int], start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        stage, _, layer = key
        self.k_amax[layer] = torch.maximum(self.k_amax[layer], k.detach().abs().float().amax(dim=(0, 2)))
        self.v_amax[layer] = torch.maximum(self.v_amax[layer], v.detach().abs().float().amax(dim=(0, 2)))
        return super().write((stage, 0, layer), start, k, v)


@torch.inference_mode()
def kv_amax(model, token_ids: Tensor, max_loops: int | None = None) -> tuple[Tensor, Tensor]:
    """The largest |K| (after rotary) and |V| ``[cache layers, kv_heads]`` fp32 of a dense prompt pass of
    ``token_ids`` (``[T]``) over every stage and every loop a prompt runs for ``max_loops`` (default: the
    checkpoint's depth). A cache layer holds layer ``i`` of every stage (Huginn: prelude, core and coda layer
    ``i``; Ouro: its one loop stage), so its maximum is taken over all of them."""
    from loopline.models.family import family_of
    from loopline.models.plain import dense_prompt

    cfg = model.config
    device = next(model.parameters()).device
    kv = _AmaxKV(token_ids.shape[0], family_of(model).kv_layers(cfg), cfg.num_key_value_heads, device)
    dense_prompt(model, token_ids, kv, max_loops)
    return kv.k_amax, kv.v_amax


def calibrate_kv_scales(model, token_ids: Tensor, max_len: int | None = None, max_loops: int | None = None
                        ) -> KVScales:
    """Scales from :func:`kv_amax` of ``token_ids`` (cut to ``max_len``), mapped by :func:`power_of_two_scales`.
    One scale per cache layer serves every stage it holds: E4M3's relative precision is the same across its
    range, so a stage with smaller values loses nothing to another's larger scale."""
    if max_len is not None:
        token_ids = token_ids[:max_len]
    k_amax, v_amax = kv_amax(model, token_ids, max_loops)
    if k_amax.device.type == "cuda":
        torch.cuda.empty_cache()  # the pool is allocated next, in one piece
    return KVScales(power_of_two_scales(k_amax), power_of_two_scales(v_amax),
                    f"calibration ({token_ids.shape[0]} tokens, every stage and loop)")


def checkpoint_scales(model) -> KVScales | None:
    """The scales a checkpoint carried (``load_model`` keeps them on the model), or None."""
    found = getattr(model, "checkpoint_kv_scales", None)
    if found is None:
        return None
    k, v = found
    return KVScales(k, v, "checkpoint (k_scale / v_scale)")


def kv_scales_for(model, kv_dtype: torch.dtype, tokenizer=None, max_len: int | None = None,
                  max_loops: int | None = None) -> KVScales | None:
    """The scales an engine with a ``kv_dtype`` cache uses: None unless FP8; the checkpoint's, else calibrated
    (over the loops a prompt runs for the engine's ``max_loops``)."""
    if not is_fp8(kv_dtype):
        return None
    found = checkpoint_scales(model)
    if found is not None:
        return found
    ids = calibration_token_ids(model.config.vocab_size, tokenizer)
    return calibrate_kv_scales(model, ids, max_len, max_loops)


__all__ = ["KV_CACHE_DTYPES", "KVScales", "calibrate_kv_scales", "calibration_token_ids", "checkpoint_scales",
           "is_fp8", "kv_amax", "kv_scales_for", "power_of_two_scales", "resolve_kv_cache_dtype", "stored_dtype"]
