"""Ouro for a Hugging Face-based RL trainer's actor and reference: logits at the rollout's exit depths.

:class:`OuroActorForCausalLM` is :class:`~loopline.models.hf_compat.OuroHFForCausalLM` (same weights,
names and full-depth forward) whose ``forward`` also takes the depths a rollout recorded:

* ``exit_depths``: one integer per token, the loop whose hidden state at that position sampled the
  *next* token (the rollout's ``exit_depths[k]`` sits at the position before generated token ``k``);
  0 where the next token was not generated (the prompt before its last position, and a sequence's
  last position). Shaped like ``input_ids``, or flat with one entry per real token in row-major
  order (how verl concatenates per-sample inputs).
* ``kv_layout``: the rollout engine's KV layout, ``"last_exited"`` or ``"shared"`` (or a tensor of
  :data:`KV_LAYOUTS` indices, one per sequence, all equal), which fixes the K/V each query reads
  (:mod:`loopline.rl.replay`, docs/design.md).

With them, a generated token's logits are recomputed exactly as the engine sampled it
(:func:`loopline.rl.replay.replay_hidden_batch`, with autograd); the logits of the other positions
are those of a zero hidden state (all zeros: a trainer masks them out). A sequence is the prompt
followed by generated tokens only (one turn). Without ``exit_depths`` the forward is the full-depth
one of the parent class.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.modeling_outputs import CausalLMOutputWithPast

from loopline.models.hf_compat import OuroHFForCausalLM
from loopline.models.ouro import OuroForCausalLM
from loopline.rl.replay import LAYOUTS, replay_hidden_batch

#: ``kv_layout`` codes when it travels as a tensor (index into this tuple).
KV_LAYOUTS = LAYOUTS


class OuroActorForCausalLM(OuroHFForCausalLM):
    """:class:`OuroHFForCausalLM` whose forward recomputes generated tokens at their exit depths."""

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, exit_depths: Tensor | None = None,
                kv_layout: str | Tensor | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """The parent's forward, or with ``exit_depths`` the logits at the rollout's depths (module docstring)."""
        if exit_depths is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   **kwargs)
        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("exit_depths needs input_ids (not inputs_embeds)")
        if kwargs.get("labels") is not None or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("exit_depths recomputes a rollout: labels and a KV cache are not supported with it")
        layout = _layout(kv_layout)
        b, t = input_ids.shape
        # NOTE: the sequences are cut on the host (the replay takes token lists), one copy per input
        seqs = _sequences(*(None if x is None else x.cpu() for x in (input_ids, attention_mask, position_ids)))
        depths = _per_position(exit_depths, input_ids, attention_mask)
        ids = input_ids.reshape(-1).cpu()
        prompts, outputs, exits, at = [], [], [], []
        for idx in seqs:
            split = _split(ids[idx].tolist(), depths[idx].tolist(), self.config.total_ut_steps)
            if split is not None:
                prompt, output, ds = split
                prompts.append(prompt)
                outputs.append(output)
                exits.append(ds)
                at.append(idx[len(prompt) - 1:len(prompt) - 1 + len(output)])

        if not prompts:  # nothing generated in this batch: the plain forward
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   **kwargs)

        def replay(core: OuroForCausalLM) -> Tensor:
            # NOTE: on the inputs' device: an offloaded reference's resting parameters are on the host
            return torch.cat(replay_hidden_batch(core, prompts, outputs, exits, layout=layout, device=input_ids.device))

        hidden = self.model.layers(replay)  # NOTE: inside the layer stack's call (its FSDP unit)
        full = hidden.new_zeros(b * t, hidden.shape[-1]).index_put((torch.cat(at).to(hidden.device),), hidden)
        return CausalLMOutputWithPast(logits=self._core.head(full.view(b, t, -1)))


def _layout(kv_layout: str | Tensor | None) -> str:
    if kv_layout is None:
        return "last_exited"
    if isinstance(kv_layout, str):
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {list(KV_LAYOUTS)}, got {kv_layout!r}")
        return kv_layout
    codes = set(torch.as_tensor(kv_layout).reshape(-1).tolist())
    if len(codes) != 1 or not 0 <= next(iter(codes)) < len(KV_LAYOUTS):
        raise ValueError(f"kv_layout: one code in 0..{len(KV_LAYOUTS) - 1} ({list(KV_LAYOUTS)}) for the whole batch, "
                         f"got {sorted(codes)}")
    return KV_LAYOUTS[int(next(iter(codes)))]


def _sequences(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None) -> list[Tensor]:
    """Flat indices (into ``input_ids.reshape(-1)``) of each sequence's tokens, in order."""
    b, t = input_ids.shape
    flat = torch.arange(b * t, device=input_ids.device).view(b, t)
    if attention_mask is not None:
        return [row[mask.bool()] for row, mask in zip(flat, attention_mask)]
    if position_ids is None:
        return list(flat)
    seqs = []
    for row, pos in zip(flat, position_ids.reshape(b, t)):
        starts = torch.nonzero(pos == 0).reshape(-1).tolist()
        starts = ([0] if not starts or starts[0] != 0 else []) + starts + [t]
        seqs += [row[s:e] for s, e in zip(starts, starts[1:]) if e > s]
    return seqs


def _per_position(exit_depths: Tensor, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """``exit_depths`` as one entry per position of ``input_ids.reshape(-1)`` (0 at padding)."""
    depths = torch.as_tensor(exit_depths).reshape(-1).to(torch.long).cpu()
    if depths.numel() == input_ids.numel():
        return depths
    real = attention_mask.bool().reshape(-1).cpu() if attention_mask is not None else None
    if real is None or depths.numel() != int(real.sum()):
        raise ValueError(f"exit_depths has {depths.numel()} entries; expected one per position of input_ids "
                         f"({input_ids.numel()}) or one per real token (the attention mask's "
                         f"{None if real is None else int(real.sum())})")
    full = torch.zeros(input_ids.numel(), dtype=torch.long)
    full[real] = depths
    return full


def _split(ids: list[int], depths: list[int], loops: int) -> tuple[list[int], list[int], list[int]] | None:
    """``(prompt, generated tokens, their exit depths)`` of one sequence, or None when nothing was generated."""
    marked = [i for i, d in enumerate(depths) if d != 0]
    if not marked:
        return None
    first, n = marked[0], len(ids) - marked[0] - 1
    if marked != list(range(first, first + n)) or n < 1:
        raise ValueError(f"exit_depths of a sequence must be nonzero on one run of positions, from the last prompt "
                         f"position to the one before the last token (single-turn rollouts); got {depths}")
    if any(not 1 <= d <= loops for d in depths[first:first + n]):
        raise ValueError(f"exit_depths must be in 1..{loops} (total_ut_steps) where nonzero, got {depths}")
    return ids[:first + 1], ids[first + 1:], depths[first:first + n]


def rollout_depth_inputs(prompt_len: int, exit_depths: list[int], kv_layout: str = "last_exited") -> dict[str, Tensor]:
    """One sample's extra model inputs for :meth:`OuroActorForCausalLM.forward` (one entry per real token).

    ``prompt_len`` prompt tokens followed by ``len(exit_depths)`` generated tokens, the ``k``-th sampled
    after ``exit_depths[k]`` loops. Returns ``exit_depths`` ``[prompt_len + len(exit_depths)]`` (0 except
    at positions ``prompt_len - 1 ..``, the one before each generated token) and ``kv_layout`` ``[1]``
    (its index in :data:`KV_LAYOUTS`); per-sample tensors concatenate along dim 0 into a packed batch's.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {list(KV_LAYOUTS)}, got {kv_layout!r}")
    depths = torch.zeros(prompt_len + len(exit_depths), dtype=torch.long)
    depths[prompt_len - 1:prompt_len - 1 + len(exit_depths)] = torch.tensor([int(d) for d in exit_depths], dtype=torch.long)
    return {"exit_depths": depths, "kv_layout": torch.tensor([KV_LAYOUTS.index(kv_layout)])}
