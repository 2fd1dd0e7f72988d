"""The one place that decides which kernels run: attention, layer math and decode-slot ops.

``auto`` picks the fused Triton kernels on CUDA and the torch reference on the
CPU; an explicit choice never falls back silently. The three go together:
the decode-slot ops follow the layer ops (Triton kernels only where the layer
math runs Triton, so a torch run is all reference).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from loopline.attention import AttentionBackend, get_attention_backend
from loopline.errors import InvalidRequestError
from loopline.models.ops import TORCH_OPS, TorchOps
from loopline.worker.decode_state import SlotOps


@dataclass(frozen=True)
class Backends:
    """The kernels one engine runs (``select_backends`` picks them; ``LLMEngine(..., backends=...)`` takes others)."""

    attention: AttentionBackend
    layer_ops: TorchOps  # norms, rotary, SwiGLU, projections (the model's ``ops``)
    slot_ops: SlotOps  # the decode state's per-step ops


def select_backends(attention: str, kernels: str, device: torch.device) -> Backends:
    """Backends for ``attention_backend`` / ``kernel_backend`` (``auto``, ``torch`` or ``triton``) on ``device``."""
    attn = get_attention_backend(attention, device)
    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" else "torch"
    if kernels == "torch":
        return Backends(attn, TORCH_OPS, SlotOps())
    if kernels != "triton":
        raise InvalidRequestError(f"kernel_backend must be 'auto', 'torch' or 'triton', got {kernels!r}",
                                  param="kernel_backend")
    # NOTE: imported only here: Triton reads TRITON_INTERPRET when it decorates a kernel, and the
    # CPU-interpreted tests set it after the engine modules are imported.
    from loopline.kernels.fused import TritonOps, triton

    if triton is None or (device.type != "cuda" and not os.environ.get("TRITON_INTERPRET")):
        raise InvalidRequestError("kernel_backend='triton' needs the triton package and CUDA (or TRITON_INTERPRET=1)",
                                  param="kernel_backend")
    from loopline.worker.triton_slot_ops import TritonSlotOps

    return Backends(attn, TritonOps(), TritonSlotOps())
