"""The model-family seam: what the engine needs from a looped language model (docs/model-families.md).

A looped family is a model with four stages on flattened token rows (``[N, hidden]``) and an exit criterion:

* ``prelude(input_ids, positions, attn) -> injected``: once per token (Ouro: the embedding; Huginn: the
  scaled embedding and the prelude layers);
* ``initial_state(injected, positions, seeds) -> state``: the state loop 1 reads (Ouro: the embedding
  itself; Huginn: a random latent seeded per request);
* ``core(state, injected, positions, attn) -> (state, signal)``: one loop of the shared stack (Huginn
  injects ``injected`` first); ``signal`` is what the exit criterion reads when it does not read logits
  (Ouro: the exit gate's fp32 logit), else None;
* ``coda(state, positions, attn) -> logits``: fp32 logits of a state (Ouro: ``lm_head``; Huginn: the coda
  layers between two final norms and ``lm_head``).

Attention is an object passed to each stage (``attn(layer, q, k, v, rope)``, ``layer`` counted inside the
stage), so the caller decides which KV *plane* each stage reads and writes. :class:`KVStage` says what the
planes are: a stage with ``per_loop`` has one plane per loop (loop ``r`` reads and writes plane ``r``); the
others have one plane, written each time the stage runs on a token. Both families share one rule for
tokens that stop early: a query at loop ``d`` reads an earlier token's loop ``min(d, e)`` K/V, ``e`` that
token's exit loop (upstream Huginn calls this reusing the latest available recurrence step).

:class:`Family` ties a ``model_type`` to its KV stages and :class:`ExitCriterion`;
:func:`family_of` finds it (``loopline.models.loader`` reads each family's files). Nothing outside a family's model module and its exit
criterion branches on the family.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopline.models.ouro import Attention

#: The threshold that turns early exits off in every family (SamplingParams.exit_threshold's 1.0).
FIXED_DEPTH = 1.0


class LoopedModel(Protocol):
    """The stages every looped family's model implements (module docstring)."""

    config: Any

    def prelude(self, input_ids: Tensor, positions: Tensor, attn: Attention) -> Tensor: ...

    def initial_state(self, injected: Tensor, positions: Tensor, seeds: Tensor) -> Tensor: ...

    def core(self, state: Tensor, injected: Tensor, positions: Tensor, attn: Attention) -> tuple[Tensor, Tensor | None]: ...

    def coda(self, state: Tensor, positions: Tensor, attn: Attention) -> Tensor: ...


@dataclass(frozen=True)
class KVStage:
    """One stage's KV: ``num_layers`` attention layers, one plane per loop when ``per_loop`` (else one)."""

    name: str
    num_layers: int
    per_loop: bool


# --- exit criteria -----------------------------------------------------------------------------------------


class ExitCriterion(ABC):
    """When a token stops looping, applied to B rows at once after loop ``loop`` (1-based).

    ``carry`` is the per-row state the criterion keeps between loops (:meth:`initial_carry`). Every
    criterion exits at ``max_loops`` and never early with ``threshold >= 1`` (:data:`FIXED_DEPTH`)."""

    name: str
    #: The rule in words, for a threshold (``loopline generate``'s settings line).
    rule: str
    #: True: ``decide`` reads each loop's fp32 logits (the caller runs the coda every loop), else the
    #: loop's own signal.
    reads_logits: bool
    #: True: the last prompt position may exit early (the first token's depth); False: prefill always runs
    #: the full depth and the first token comes from its last loop.
    exits_in_prefill: bool

    @abstractmethod
    def initial_carry(self, rows: int, vocab: int, device: torch.device) -> Tensor: ...

    @abstractmethod
    def decide(self, loop: int, carry: Tensor, signal: Tensor, min_loops: int, max_loops: int,
               threshold: float) -> tuple[Tensor, Tensor]:
        """``(exit [B] bool, carry after this loop)``."""


class GateExit(ExitCriterion):
    """Ouro's learned exit gate: exit once ``F_r = 1 - prod_{i<=r}(1 - sigmoid(gate_i)) >= threshold``
    (docs/design.md, exit rule; the engine's device rule is ``loopline.worker.exit_rule``). Carry: the survival
    ``prod(1 - lambda)`` ``[B]`` fp32."""

    name = "gate"
    rule = "a token exits after the first loop where its cumulative exit probability reaches {}"
    reads_logits = False
    exits_in_prefill = True

    def initial_carry(self, rows: int, vocab: int, device: torch.device) -> Tensor:
        return torch.ones(rows, dtype=torch.float32, device=device)

    def decide(self, loop: int, carry: Tensor, signal: Tensor, min_loops: int, max_loops: int,
               threshold: float) -> tuple[Tensor, Tensor]:
        survival = carry * (1.0 - torch.sigmoid(signal.float()))
        early = (threshold < FIXED_DEPTH) & (loop >= min_loops) & (1.0 - survival >= threshold)
        return (loop >= max_loops) | early, survival


class ConvergenceExit(ExitCriterion):
    """Huginn's convergence test: exit once ``KL(p_{r-1} || p_r) < threshold``, ``p_r`` the output
    distribution of loop ``r`` (``p_0`` uniform over the padded vocabulary), summed over the vocabulary
    in fp32 (upstream's ``kl`` criterion; its suggested threshold is 5e-4). Carry: ``log p_{r-1}``
    ``[B, vocab]`` fp32."""

    name = "kl"
    rule = "a token exits after the first iteration whose output distribution's KL from the previous one is below {}"
    reads_logits = True
    exits_in_prefill = False

    def initial_carry(self, rows: int, vocab: int, device: torch.device) -> Tensor:
        return torch.full((rows, vocab), -math.log(vocab), device=device)

    def decide(self, loop: int, carry: Tensor, signal: Tensor, min_loops: int, max_loops: int,
               threshold: float) -> tuple[Tensor, Tensor]:
        logp = F.log_softmax(signal.float(), dim=-1)
        kl = (carry.exp() * (carry - logp)).sum(-1)
        early = (threshold < FIXED_DEPTH) & (loop >= min_loops) & (kl < threshold)
        return (loop >= max_loops) | early, logp


# --- families ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One looped architecture behind the seam."""

    model_type: str
    kv_stages: Callable[[Any], tuple[KVStage, ...]]
    exit_criterion: ExitCriterion
    logits_size: Callable[[Any], int]  # the width of the coda's logits
    #: Loops a prompt runs, from the request's max_loops (Ouro: always the checkpoint's depth).
    prefill_loops: Callable[[Any, int], int]
    #: The most loops a request may ask for (None: no bound but memory).
    loop_limit: Callable[[Any], int | None]
    #: The exit threshold of a request that sets none.
    default_threshold: Callable[[Any], float]
    #: The config.json fields of the default depth and of the default threshold (None: the family's own).
    depth_field: str = "total_ut_steps"
    threshold_field: str | None = "early_exit_threshold"
    #: Parameters of a config's model (lm_head counted once when tied).
    parameter_count: Callable[[Any], int] = lambda c: 0
    #: What one engine loop reads, in values: ``(body weights, head weights, K/V values per position)``
    #: (the bench's memory-traffic model, ``loopline.bench.metrics.ByteModel``).
    loop_reads: Callable[[Any], tuple[int, int, int]] = lambda c: (0, 0, 0)
    #: Engine options the engine does not serve for this family yet: ``(option, allowed values, why)``; an
    #: ``"auto"`` backend among the allowed values resolves to the first other allowed one.
    engine_limits: tuple[tuple[str, tuple, str], ...] = ()
    #: What besides its tokens a prompt's KV depends on, ``(config, max_loops, latent_seed) -> str | None``:
    #: it joins the prefix-cache key (None: nothing; Ouro).
    prompt_kv_key: Callable[[Any, int, int], str | None] = lambda c, max_loops, seed: None
    #: config.json fields a checkpoint published as a weight update must share with the served model.
    architecture_fields: tuple[str, ...] = ()
    #: Weight names a checkpoint may carry that the model recomputes (a weight update skips them).
    ignored_weights: tuple[str, ...] = ()
    #: ``config -> {parameter: source parameter}``: parameters a checkpoint may leave out because they equal
    #: another (tied embeddings); a weight update that does not send one copies its source into it.
    tied_weights: Callable[[Any], dict[str, str]] = lambda c: {}

    def kv_layers(self, config: Any) -> int:
        """Layers of a paged KV plane: the largest stage's (every plane has that many)."""
        return max(stage.num_layers for stage in self.kv_stages(config))

    def once_planes(self, config: Any, num_loops: int) -> dict[str, int]:
        """The plane of each stage written once per token, after the ``num_loops`` per-loop planes (Huginn:
        ``{"prelude": R, "coda": R + 1}``; Ouro: none)."""
        once = [stage.name for stage in self.kv_stages(config) if not stage.per_loop]
        return {name: num_loops + i for i, name in enumerate(once)}


OURO = Family(
    model_type="ouro",
    kv_stages=lambda c: (KVStage("loop", c.num_hidden_layers, per_loop=True),),
    exit_criterion=GateExit(),
    logits_size=lambda c: c.vocab_size,
    prefill_loops=lambda c, max_loops: c.total_ut_steps,
    loop_limit=lambda c: c.total_ut_steps,
    default_threshold=lambda c: c.early_exit_threshold,
    parameter_count=lambda c: _ouro_parameters(c),
    loop_reads=lambda c: _ouro_loop_reads(c),
    architecture_fields=("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "total_ut_steps"),
)

HUGINN = Family(
    model_type="huginn_raven",
    kv_stages=lambda c: (KVStage("prelude", c.n_layers_in_prelude, per_loop=False),
                         KVStage("core", c.n_layers_in_recurrent_block, per_loop=True),
                         KVStage("coda", c.n_layers_in_coda, per_loop=False)),
    exit_criterion=ConvergenceExit(),
    logits_size=lambda c: c.padded_vocab_size,
    # Upstream's adaptive generation runs the prompt for the request's number of steps.
    prefill_loops=lambda c, max_loops: max_loops,
    depth_field="mean_recurrence",
    threshold_field=None,
    loop_limit=lambda c: None,
    default_threshold=lambda c: FIXED_DEPTH,  # upstream's generate() without an exit criterion
    parameter_count=lambda c: _huginn_parameters(c),
    loop_reads=lambda c: _huginn_loop_reads(c),
    engine_limits=(
        ("kernel_backend", ("auto", "torch"), "Huginn's layers run in plain torch"),
        ("speculative_config", (None,), "loop self-speculation drafts with Ouro's stages"),
    ),
    # the latent seeds the prompt's states; the coda plane holds the prompt's last loop (its depth)
    prompt_kv_key=lambda c, max_loops, seed: f"latent_seed={seed};prefill_loops={max_loops}",
    architecture_fields=("vocab_size", "padded_vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                         "num_key_value_heads", "n_layers_in_prelude", "n_layers_in_recurrent_block",
                         "n_layers_in_coda", "mean_recurrence", "rope_base", "norm_eps", "qk_bias", "bias",
                         "tie_embeddings", "init_std", "embed_scale"),
    ignored_weights=("freqs_cis",),  # a persisted RoPE table (the loader recomputes it too)
    tied_weights=lambda c: {"lm_head.weight": "transformer.wte.weight"} if c.tie_embeddings else {},
)

FAMILIES = {f.model_type: f for f in (OURO, HUGINN)}


def _ouro_parameters(config: Any) -> int:
    from loopline.models.ouro import parameter_count

    return parameter_count(config)


def _ouro_loop_reads(c: Any) -> tuple[int, int, int]:
    """Every decoder layer, the final norm and the exit gate; ``lm_head``; K/V of every layer."""
    h = c.hidden_size
    layer = h * c.q_size * 2 + h * c.kv_size * 2 + 3 * h * c.intermediate_size + 4 * h
    return c.num_hidden_layers * layer + h + h + 1, c.vocab_size * h, 2 * c.num_hidden_layers * c.kv_size


def _huginn_loop_reads(c: Any) -> tuple[int, int, int]:
    """Every loop runs the adapter and the core block; the coda and ``lm_head`` run in a step where a token
    exits, the prelude in the step that starts the next one (as many at refill), so they count as the head
    (docs/model-families.md, 'Cost'; at the convergence exit every step runs them: a lower bound there).
    K/V: every stage's layers, per position and loop."""
    h = c.hidden_size
    layer = h * (h + 2 * c.kv_size) + h * h + 3 * h * c.intermediate_size + 4 * h
    ends = c.n_layers_in_prelude + c.n_layers_in_coda
    layers = ends + c.n_layers_in_recurrent_block
    return (c.n_layers_in_recurrent_block * layer + 2 * h * h + h, ends * layer + c.padded_vocab_size * h,
            2 * layers * c.kv_size)


def _huginn_parameters(config: Any) -> int:
    from loopline.models.huginn import parameter_count

    return parameter_count(config)


def family_of(config_or_model_type: Any) -> Family:
    """The family of a ``model_type`` string, a config or a model."""
    key = config_or_model_type
    if isinstance(key, nn.Module):
        key = key.config
    if not isinstance(key, str):
        key = key.model_type
    if key not in FAMILIES:
        raise ValueError(f"model_type={key!r} is not supported; allowed: {', '.join(map(repr, FAMILIES))}")
    return FAMILIES[key]
