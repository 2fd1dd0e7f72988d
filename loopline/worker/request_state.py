"""The device-side state the model runner keeps per running request (its own module so that
the page export/import in ``kv_pages.py`` can build and move it without importing the runner)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch import Tensor

from loopline.core.contracts import ExitParams
from loopline.sampling_params import SamplingParams


@dataclass
class RequestState:
    """Device-side state of one running request."""

    params: SamplingParams
    seed: int
    prompt: Tensor  # [T] int64
    block_arrays: list[np.ndarray]  # per plane: physical blocks, int32 (host side; step inputs are built from them)
    prompt_exit: ExitParams
    hidden: Tensor  # [T, H] prefill hidden between loops
    survival: Tensor  # [T] f32 prod(1 - lambda) so far
    sel_hidden: Tensor  # [T, H] hidden at the depth the exit rule picked
    sel_depth: Tensor  # [T] int64, 0 = not yet exited
    max_len: int = 0  # prompt + max_tokens + 1: bounds the decode rows' sequence length
    slot: int = -1
    exit_target: Tensor | None = None  # [T] int64: each prompt position's exit fixed by the lookahead rule (0: none)
    prefill_loops: int = 0  # loops the prompt runs (Family.prefill_loops of the request's max_loops)
    injected: Tensor | None = None  # [T, H] the prompt's prelude output (families that inject it: Huginn)

    def to(self, device: torch.device) -> RequestState:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})
