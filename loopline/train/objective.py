"""Ouro's training objective on the dense forward (shared/reference/ouro.md §3; docs/training.md).

Shapes: R = loops, B = batch, T = sequence. Per token position the exit gate gives
``lambda_r = sigmoid(g_r)`` after every loop and the exit distribution

    p_r = lambda_r * prod_{i<r} (1 - lambda_i)   (r < R),   p_R = prod_{i<R} (1 - lambda_i)

(the last loop takes the remaining mass; ``lambda_R`` is unused), the same
distribution whose CDF the engine's exit rule thresholds (docs/design.md, 'The model: loops and exits').

* **Stage 1** (everything trains): ``sum_r p_r * L_r - beta * H(p)``, the
  expected next-token loss over the exit distribution minus an entropy bonus
  that keeps the gate from collapsing onto one loop early (the paper's beta:
  0.1, later 0.05). An optional final-loop term ``+ w * L_R`` (``w`` = 0:
  Ouro's objective exactly) gives the last loop weight on every token, also
  where the gate exits early. Tried against a small model's last loop ending
  slightly behind the one before; it narrowed that gap only by making every
  loop worse, so no preset uses it (docs/training.md, "What remains").
* **Stage 2** (only the gate trains): the LM is frozen and each gate learns
  whether one more loop still pays. With the detached per-token losses ``L_r``,
  the improvement of loop r+1 is ``I_r = max(0, L_r - L_{r+1})``, the ideal
  probability of continuing after loop r is ``w_r = sigmoid(k (I_r - gamma))``
  (paper: k = 50, gamma = 0.005) and the loss is the binary cross-entropy of
  ``lambda_r`` against the exit target ``1 - w_r``, for r = 1..R-1. NOTE: the
  gate after loop r decides whether loop r+1 runs, so its target compares
  loops r and r+1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from loopline.models.ops import TORCH_OPS
from loopline.models.ouro import OuroForCausalLM


@dataclass
class LoopOutputs:
    """Every loop of a dense forward: post-norm hidden states and fp32 gate logits."""

    hidden: Tensor  # [R, B, T, hidden]
    gate_logits: Tensor  # [R, B, T] fp32


def loop_outputs(model: OuroForCausalLM, input_ids: Tensor, num_loops: int | None = None) -> LoopOutputs:
    """Each loop's normed hidden ``h_r`` and gate logit ``g_r`` over ``[B, T]`` ids (autograd-friendly).

    The model's own dense forward without the coda: the same ``embed`` / ``loop`` math the engine runs.
    """
    out = model.forward_dense(input_ids, num_loops, compute_logits=False)
    return LoopOutputs(out.hidden_states, out.gate_logits)


def exit_log_probs(gate_logits: Tensor) -> Tensor:
    """``log p_r`` ``[R, ...]`` of the exit distribution from gate logits ``[R, ...]`` (fp32, stable)."""
    g = gate_logits.float()
    log_exit = F.logsigmoid(g)  # log lambda_r
    log_stay = F.logsigmoid(-g)  # log (1 - lambda_r)
    # log prod_{i<r} (1 - lambda_i): an exclusive cumulative sum
    survive_before = torch.cumsum(log_stay, 0) - log_stay
    log_p = survive_before + log_exit
    # The last loop takes the remaining mass: p_R = prod_{i<R} (1 - lambda_i).
    return torch.cat([log_p[:-1], survive_before[-1:]], 0)


def per_loop_token_loss(model: OuroForCausalLM, hidden: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross-entropy ``[R, B, T]`` (fp32) of every loop's hidden ``[R, B, T, H]`` vs ``targets`` ``[B, T]``."""
    losses = []
    for h in hidden:  # one loop at a time: never more than one [B, T, V] logits tensor built at once
        logits = model.lm_head(h).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), reduction="none").view(targets.shape))
    return torch.stack(losses)


@dataclass
class StageOneLoss:
    loss: Tensor  # scalar to minimise
    expected_loss: Tensor  # sum_r p_r L_r, mean over tokens
    entropy: Tensor  # H(p), mean over tokens
    loop_losses: Tensor  # [R] mean L_r (detached)
    mean_depth: Tensor  # E_p[r], mean over tokens (detached)


def stage_one_loss(model: OuroForCausalLM, input_ids: Tensor, targets: Tensor, beta: float,
                   final_loop_weight: float = 0.0) -> StageOneLoss:
    """Expected LM loss over the exit distribution minus ``beta`` times its entropy, plus
    ``final_loop_weight`` times the last loop's loss."""
    if not beta >= 0.0:
        raise ValueError(f"beta={beta}; allowed: >= 0")
    if not final_loop_weight >= 0.0:
        raise ValueError(f"final_loop_weight={final_loop_weight}; allowed: >= 0")
    out = loop_outputs(model, input_ids)
    token_loss = per_loop_token_loss(model, out.hidden, targets)  # [R, B, T]
    log_p = exit_log_probs(out.gate_logits)
    p = log_p.exp()
    expected = (p * token_loss).sum(0).mean()
    entropy = -(p * log_p).sum(0).mean()
    loops = torch.arange(1, p.shape[0] + 1, device=p.device, dtype=p.dtype).view(-1, 1, 1)
    loss = expected - beta * entropy
    if final_loop_weight:
        loss = loss + final_loop_weight * token_loss[-1].mean()
    return StageOneLoss(loss, expected.detach(), entropy.detach(),
                        token_loss.detach().mean((1, 2)), (p * loops).sum(0).mean().detach())


def continue_targets(token_loss: Tensor, k: float, gamma: float) -> Tensor:
    """``w_r = sigmoid(k (max(0, L_r - L_{r+1}) - gamma))`` ``[R-1, ...]``: whether loop r+1 is worth running."""
    improvement = (token_loss[:-1] - token_loss[1:]).clamp(min=0.0)
    return torch.sigmoid(k * (improvement - gamma))


@dataclass
class StageTwoLoss:
    loss: Tensor  # the gate's BCE, mean over loops 1..R-1 and tokens
    loop_losses: Tensor  # [R] mean L_r of the frozen LM
    exit_target: Tensor  # mean 1 - w_r over tokens, [R-1]
    mean_depth: Tensor  # E_p[r] under the current gate


def stage_two_loss(model: OuroForCausalLM, input_ids: Tensor, targets: Tensor, k: float = 50.0,
                   gamma: float = 0.005) -> StageTwoLoss:
    """Gate-only loss: BCE of ``lambda_r`` against the exit target ``1 - w_r`` (module docstring)."""
    if not k > 0.0:
        raise ValueError(f"k={k}; allowed: > 0")
    with torch.no_grad():  # the LM is frozen in stage 2: no graph through the layers
        out = loop_outputs(model, input_ids)
        token_loss = per_loop_token_loss(model, out.hidden, targets)
        exit_target = 1.0 - continue_targets(token_loss, k, gamma)  # [R-1, B, T]
    gate = model.model.early_exit_gate
    logits = torch.stack([TORCH_OPS.exit_gate(gate, h.reshape(-1, h.shape[-1])).view(targets.shape) for h in out.hidden])
    loss = F.binary_cross_entropy_with_logits(logits[:-1], exit_target)
    with torch.no_grad():
        p = exit_log_probs(logits).exp()
        loops = torch.arange(1, p.shape[0] + 1, device=p.device, dtype=p.dtype).view(-1, 1, 1)
        depth = (p * loops).sum(0).mean()
    return StageTwoLoss(loss, token_loss.mean((1, 2)), exit_target.mean((1, 2)), depth)
