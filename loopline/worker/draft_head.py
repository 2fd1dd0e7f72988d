"""The drafts' coda: the model's head, after a trained draft adapter when one is installed (docs/speculation.md).

Only drafts go through it; the target rows of a round use the model's head directly, so an adapter can
change which drafts are accepted but never a committed token, an exit depth or a logprob.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from loopline.models.ouro import OuroForCausalLM
from loopline.spec.adapter import AdapterConfig, DraftAdapter


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine reports about the adapter in use."""

    source: str  # the directory it was read from
    depth: int
    rank: int
    base_weights_sha256: str


class DraftHead:
    """``logits = head(adapter_d(h))`` for draft rows still looping at the draft depth ``d``; the plain
    head for rows that already exited (their head output is the target's own token). Owns the adapter:
    :meth:`install` and :meth:`drop` (a weight update drops it)."""

    def __init__(self, model: OuroForCausalLM, depth: int, setting: str = "auto") -> None:
        """``setting``: ``speculative_config.draft_adapter`` (``"none"``: weight updates bring none either)."""
        self.model, self.depth, self.setting = model, depth, setting
        self.adapter: DraftAdapter | None = None
        self.info: AdapterInfo | None = None

    def install(self, adapter: DraftAdapter, config: AdapterConfig, source: str) -> None:
        """Moves ``adapter`` to the model's device and dtype and drafts through it from the next draft."""
        weight = self.model.lm_head.weight
        self.adapter = adapter.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)
        self.info = AdapterInfo(source, self.depth, config.rank, config.base_weights_sha256)

    def drop(self) -> None:
        """Drafts with the plain head again (the adapter belonged to other weights)."""
        self.adapter, self.info = None, None

    def __call__(self, hidden: Tensor, live: Tensor) -> Tensor:
        """``hidden`` ``[M, H]``, ``live`` ``[M]`` bool (still looping at the draft depth) -> fp32 logits ``[M, V]``."""
        if self.adapter is not None:  # (a host attribute: no device read)
            with torch.no_grad():
                hidden = torch.where(live[:, None], self.adapter(hidden, self.depth), hidden)
        return self.model.head(hidden).float()
