"""The seeded trainer of the demo model: data, two stages, exact save/resume, export (docs/training.md).

One :class:`TrainConfig` describes a whole run. Training is a fixed sequence of
global steps: ``stage1_steps`` of the full objective, then ``stage2_steps`` in
which only the exit gate trains (its own AdamW and schedule). Each step's batch
is a pure function of ``(seed, step)`` -- the training token stream is cut into
``seq_len + 1`` windows and every epoch visits them in a seeded permutation --
so a resumed run reads exactly the batches the uninterrupted one would.

A training checkpoint (:meth:`Trainer.save`) holds the model, the optimizer and
scheduler of the current stage, the step and every RNG state; :meth:`Trainer.resume`
continues bit-for-bit on the CPU (tested). NOTE: on CUDA some backward kernels (the
embedding's scatter-add) are non-deterministic, so there a resumed run matches the
uninterrupted one only to rounding unless ``torch.use_deterministic_algorithms(True)`` is set. :meth:`Trainer.export` writes a
loopline / Hugging Face checkpoint directory that ``loopline.LLM(path)`` loads.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from loopline.errors import InvalidRequestError
from loopline.models.ouro import OuroConfig, OuroForCausalLM, parameter_count
from loopline.train.corpus import CorpusSpec, corpus_info, split
from loopline.train.objective import (continue_targets, exit_log_probs, loop_outputs, per_loop_token_loss,
                                      stage_one_loss, stage_two_loss)
from loopline.train.tokenizer import encode_documents, train_tokenizer, write_tokenizer

CHECKPOINT_FILE = "train_state.pt"
STATE_VERSION = 1


#: Request defaults written to the export's generation_config.json (the engine applies them where a
#: request leaves the field unset, as vLLM does): T = 1 samples garbled code from a 5.5M-parameter
#: model and greedy decoding loops (`os.path.join(os.path.join(...`); these read as Python.
DEMO_SAMPLING_DEFAULTS = {"temperature": 0.5, "top_k": 20, "repetition_penalty": 1.15, "max_new_tokens": 48}


@dataclass(frozen=True)
class ModelShape:
    """The architecture fields a run chooses (the rest are Ouro's)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 64
    total_ut_steps: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0

    def check(self) -> None:
        """Every size >= 1, heads in whole groups, an even head_dim, and at most MAX_TRAIN_PARAMETERS
        parameters; InvalidRequestError names the field."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "rope_theta" and value < 1:
                raise InvalidRequestError(f"TrainConfig.model.{f.name}={value}; allowed: >= 1")
        if self.rope_theta <= 0:
            raise InvalidRequestError(f"TrainConfig.model.rope_theta={self.rope_theta}; allowed: > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidRequestError(f"TrainConfig.model.num_attention_heads={self.num_attention_heads}; allowed: a "
                                      f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise InvalidRequestError(f"TrainConfig.model.head_dim={self.head_dim}; allowed: even (rotate-half RoPE)")
        params = parameter_count(self)
        if params > MAX_TRAIN_PARAMETERS:
            sizes = {f: getattr(self, f) for f in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "vocab_size", "num_attention_heads", "head_dim")}
            raise InvalidRequestError(
                f"TrainConfig.model: {params:,} parameters ({', '.join(f'{k}={v:,}' for k, v in sizes.items())}) "
                f"need {params * 16 / 2**30:,.0f} GiB for weights, gradients and Adam state; allowed: at most "
                f"{MAX_TRAIN_PARAMETERS:,} parameters")


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_field_types(cls, values: dict, prefix: str) -> None:
    """Each of ``values`` has its dataclass field's type (int, float, bool or str), else InvalidRequestError
    naming ``prefix + field``. An int is a float; a bool is neither (JSON's true is not 1 here)."""
    hints = typing.get_type_hints(cls)
    checks = {int: lambda v: isinstance(v, int) and not isinstance(v, bool), float: _is_real,
              bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str)}
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    for name, value in values.items():
        kind = hints.get(name)
        if kind in checks and not checks[kind](value):
            raise InvalidRequestError(f"TrainConfig.{prefix}{name}={value!r:.60}; allowed: {names[kind]}")


# The most parameters a training run may ask for: its fp32 weights, gradients and Adam state take 16 bytes each,
# so 2**33 (8.6 B) parameters need 128 GiB before activations. A shape beyond it is a typo, not a run.
MAX_TRAIN_PARAMETERS = 2**33


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a run (and therefore its weights, on one device type)."""

    model: ModelShape = ModelShape()
    corpus: CorpusSpec = CorpusSpec()
    seed: int = 0
    seq_len: int = 512
    batch_size: int = 32
    stage1_steps: int = 1200
    stage2_steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    entropy_beta: float = 0.1  # stage 1 entropy bonus (paper: 0.1, later 0.05); 0.05 left loop 4 0.15 nats worse than loop 2
    # lambda of the untrained gate (its bias is logit(lambda), its weight zero). 0.2 starts deep-first:
    # p = (0.2, 0.16, 0.13, 0.51), like Ouro's trained exit mass (0.53 on the last loop). A zero gate
    # (lambda 1/2, p_1 = 1/2) trained the first loop most and left the last loop the worst.
    gate_init_exit: float = 0.2
    # Stage-1 steps during which the gate keeps its initial exit distribution while the LM trains under it
    # (0: the gate trains from the first step). A gate that moves while the deep loops are still worse than
    # the shallow ones shifts mass away from them, and a loop given less weight trains less.
    gate_freeze_steps: int = 0
    # Stage 1 adds this times the last loop's loss to Ouro's objective (0: the paper's objective exactly).
    # The expected loss trains a loop only where the gate puts mass, so the last loop learns little on the
    # tokens that exit early. Tried (0.25-1) against loop 4 ending behind loop 3: every loop got worse.
    final_loop_weight: float = 0.0
    stage2_lr: float = 1e-3
    stage2_warmup_steps: int = 20
    gate_k: float = 50.0  # stage 2 target sharpness (paper: 50)
    gate_gamma: float = 0.005  # stage 2 minimum worthwhile improvement (paper: 0.005)
    early_exit_threshold: float = 1.0  # written to the exported config.json (chosen from the trade-off curve)
    export_dtype: str = "float32"
    autocast_bf16: bool = True  # on CUDA only: bf16 matmuls; master weights and optimizer stay fp32
    eval_batches: int = 8
    # torch.compile backend of the training loss ("" = eager; "inductor" fuses the small model's ~1,600
    # operator calls per step on a GPU; "aot_eager" traces without code generation, for CPU tests)
    compile: str = ""

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("seq_len", self.seq_len >= 2, ">= 2"), ("batch_size", self.batch_size >= 1, ">= 1"),
            ("stage1_steps", self.stage1_steps >= 0, ">= 0"), ("stage2_steps", self.stage2_steps >= 0, ">= 0"),
            ("lr", self.lr > 0, "> 0"), ("stage2_lr", self.stage2_lr > 0, "> 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "[0, 1]"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"), ("stage2_warmup_steps", self.stage2_warmup_steps >= 0, ">= 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"), ("grad_clip", self.grad_clip > 0, "> 0"),
            ("entropy_beta", self.entropy_beta >= 0, ">= 0"), ("gate_k", self.gate_k > 0, "> 0"),
            ("gate_init_exit", 0 < self.gate_init_exit < 1, "(0, 1)"),
            ("final_loop_weight", self.final_loop_weight >= 0, ">= 0"),
            ("gate_freeze_steps", 0 <= self.gate_freeze_steps <= self.stage1_steps, f"[0, stage1_steps={self.stage1_steps}]"),
            ("early_exit_threshold", 0 < self.early_exit_threshold <= 1, "(0, 1]"),
            ("export_dtype", self.export_dtype in ("float32", "bfloat16"), "float32, bfloat16"),
            ("eval_batches", self.eval_batches >= 1, ">= 1"),
            ("compile", self.compile in ("", "inductor", "aot_eager", "eager"), "'', inductor, aot_eager, eager"),
            ("model.total_ut_steps", self.model.total_ut_steps >= 2, ">= 2 (stage 2 compares consecutive loops)"),
            ("seq_len", self.seq_len <= self.model.max_position_embeddings, "<= model.max_position_embeddings"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                value = self.model.total_ut_steps if name == "model.total_ut_steps" else getattr(self, name)
                raise InvalidRequestError(f"TrainConfig.{name}={value!r}; allowed: {allowed}")

    @property
    def total_steps(self) -> int:
        return self.stage1_steps + self.stage2_steps

    def ouro_config(self) -> OuroConfig:
        m = self.model
        return OuroConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                          num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                          num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim, rope_theta=m.rope_theta,
                          total_ut_steps=m.total_ut_steps, early_exit_threshold=self.early_exit_threshold,
                          max_position_embeddings=m.max_position_embeddings, bos_token_id=0, eos_token_ids=(0,),
                          torch_dtype=self.export_dtype)

    def to_dict(self) -> dict:
        return {**asdict(self), "corpus": self.corpus.to_dict()}

    @classmethod
    def from_dict(cls, raw: dict) -> "TrainConfig":
        """From JSON-like data (a preset, ``--config-file``, ``--set``): unknown fields and values of the wrong
        type are refused naming the field (``model.num_hidden_layers='abc'``), as are impossible shapes."""
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"TrainConfig must be an object of fields, got {type(raw).__name__}")
        raw = dict(raw)
        model_raw, corpus_raw = raw.pop("model", {}), raw.pop("corpus", {})
        for name, value in (("model", model_raw), ("corpus", corpus_raw)):
            if not isinstance(value, dict):
                raise InvalidRequestError(f"TrainConfig.{name} must be an object of fields, got {value!r:.60}")
        _check_field_types(ModelShape, model_raw, "model.")
        model = ModelShape(**model_raw)
        model.check()
        corpus = CorpusSpec(**corpus_raw)
        if "betas" in raw:
            betas = raw["betas"]
            if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_is_real(b) for b in betas)):
                raise InvalidRequestError(f"TrainConfig.betas={betas!r}; allowed: two numbers")
            raw["betas"] = tuple(float(b) for b in betas)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequestError(f"TrainConfig: unknown field(s) {unknown}; allowed: {sorted(known)}")
        _check_field_types(cls, raw, "")
        return cls(model=model, corpus=corpus, **raw)


def stage_one_flops_per_token(config: TrainConfig) -> float:
    """Matmul FLOPs of one stage-1 training token (forward + backward = 3 x forward), for run-time estimates.

    Per loop: the layer stack (2 FLOPs per weight), ``lm_head`` (the loss is taken at every loop) and
    attention over the full ``seq_len`` x ``seq_len`` score matrix (the dense forward masks, it does not skip).
    """
    m = config.model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
    attention = 2 * 2 * config.seq_len * q  # q.k and p.v per token per layer
    per_loop = 2 * layer * m.num_hidden_layers + attention * m.num_hidden_layers + 2 * m.hidden_size * m.vocab_size
    return 3.0 * per_loop * m.total_ut_steps


def init_weights(model: OuroForCausalLM, config: OuroConfig, generator: torch.Generator, gate_exit: float = 0.5) -> None:
    """GPT-style init: N(0, initializer_range) matrices, unit norms, a constant gate (lambda = ``gate_exit``)."""
    std = config.initializer_range
    # Residual-branch outputs scaled down by depth (loops x layers) so the stream does not grow with the loop.
    out_std = std / math.sqrt(2 * config.num_hidden_layers * config.total_ut_steps)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "early_exit_gate" in name:
                p.fill_(math.log(gate_exit / (1 - gate_exit)) if name.endswith("bias") else 0.0)
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=generator) * s)


DEFAULT_THRESHOLDS = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def exit_depths(gate_logits: Tensor, threshold: float, min_loops: int = 1) -> Tensor:
    """The engine's exit rule (docs/design.md, exit rule) on dense gate logits ``[R, ...]``: 1-based depths ``[...]``.

    First loop r >= ``min_loops`` with ``F_r = 1 - prod_{i<=r}(1 - lambda_i) >= threshold``; the last loop
    otherwise, and always at threshold 1 (fixed depth).
    """
    r = gate_logits.shape[0]
    cdf = 1.0 - torch.cumprod(1.0 - torch.sigmoid(gate_logits.float()), 0)
    loops = torch.arange(1, r + 1, device=cdf.device).view(-1, *([1] * (cdf.dim() - 1)))
    fire = (cdf >= threshold) & (loops >= min_loops) if threshold < 1.0 else torch.zeros_like(cdf, dtype=torch.bool)
    fire[-1] = True
    return fire.float().argmax(0) + 1  # argmax returns the first True


def choose_threshold(curve: list[dict], tolerance: float) -> float:
    """The threshold of least mean depth whose held-out loss is within ``tolerance`` nats of full depth."""
    full = next((p["loss"] for p in curve if p["threshold"] >= 1.0), None)
    if full is None:
        raise ValueError("choose_threshold: the curve needs the full-depth point (threshold 1.0)")
    if not tolerance >= 0:
        raise ValueError(f"tolerance={tolerance}; allowed: >= 0")
    ok = [p for p in curve if p["loss"] <= full + tolerance]
    return min(ok, key=lambda p: (p["mean_depth"], -p["threshold"]))["threshold"]


def _lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total`` steps."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


class TokenWindows:
    """Packed ``seq_len + 1`` windows of one token stream, visited in a seeded permutation per epoch."""

    def __init__(self, stream: Tensor, seq_len: int, seed: int) -> None:
        self.seq_len, self.seed = seq_len, seed
        n = (stream.numel() - 1) // seq_len
        if n < 1:
            raise InvalidRequestError(f"the token stream ({stream.numel()} tokens) is shorter than seq_len + 1 = "
                                      f"{seq_len + 1}")
        # window i covers tokens [i*seq_len, (i+1)*seq_len]: consecutive windows share one token, none is skipped
        self.windows = stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)  # [n, seq_len + 1]
        self._perm: tuple[int, Tensor] | None = None

    def __len__(self) -> int:
        return self.windows.shape[0]

    def _permutation(self, epoch: int) -> Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self), generator=g))
        return self._perm[1]

    def rows(self, step: int, batch_size: int) -> Tensor:
        """The ``[B, seq_len + 1]`` windows of global step ``step`` (a contiguous copy)."""
        rows = []
        for j in range(step * batch_size, (step + 1) * batch_size):
            epoch, i = divmod(j, len(self))
            rows.append(self._permutation(epoch)[i])
        return self.windows[torch.stack(rows)]

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """``(input_ids, targets)`` ``[B, seq_len]`` of global step ``step``: views of :meth:`rows`."""
        w = self.rows(step, batch_size)
        return w[:, :-1], w[:, 1:]


@dataclass
class Data:
    """The tokenizer and the two token streams of a run."""

    tokenizer: object
    train: Tensor  # int64 [N]
    heldout: Tensor  # int64 [M]
    info: dict = field(default_factory=dict)


def build_data(config: TrainConfig) -> Data:
    """Corpus split -> tokenizer trained on the training split -> token streams of both splits."""
    info = corpus_info(config.corpus).to_dict()
    train_docs, heldout_docs = split(config.corpus)
    tokenizer = train_tokenizer((d.text for d in train_docs), config.model.vocab_size)
    assert tokenizer.get_vocab_size() <= config.model.vocab_size, (tokenizer.get_vocab_size(), config.model.vocab_size)
    train = torch.tensor(encode_documents(tokenizer, [d.text for d in train_docs]), dtype=torch.long)
    heldout = torch.tensor(encode_documents(tokenizer, [d.text for d in heldout_docs]), dtype=torch.long)
    # Checked here, not at the first evaluation: a run would otherwise train until then and fail.
    if heldout.numel() < config.seq_len + 1:
        c = config.corpus
        raise InvalidRequestError(f"the held-out split has {len(heldout_docs)} files and {heldout.numel()} tokens, "
                                  f"fewer than seq_len + 1 = {config.seq_len + 1}; raise corpus.heldout_per_mille="
                                  f"{c.heldout_per_mille} or corpus.max_bytes={c.max_bytes}")
    info.update(train_tokens=train.numel(), heldout_tokens=heldout.numel())
    return Data(tokenizer, train, heldout, info)


@dataclass(frozen=True)
class StepMetrics:
    """One step's numbers. The tensors stay on the device until ``as_dict`` reads them: reading is a
    host sync, so a run reads only the steps it logs and the GPU never waits for the host."""

    stage: int
    lr: float
    tensors: dict[str, Tensor]

    def as_dict(self) -> dict:
        out: dict = {"stage": self.stage, "lr": self.lr}
        for k, v in self.tensors.items():
            out[k] = [round(float(x), 4) for x in v.tolist()] if v.dim() else float(v)
        return out


class Trainer:
    """Runs :class:`TrainConfig` step by step; ``log(step, metrics)`` receives each step's numbers."""

    def __init__(self, config: TrainConfig, data: Data | None = None, device: str | torch.device = "cpu",
                 log: Callable[[int, StepMetrics], None] | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.data = data if data is not None else build_data(config)
        self.log = log or (lambda step, metrics: None)
        self.windows = TokenWindows(self.data.train, config.seq_len, config.seed)
        # Nothing in the step draws from the global RNGs today (no dropout); they are seeded, saved and
        # restored anyway, so a future random op keeps runs reproducible and resumes exact.
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.model = OuroForCausalLM(config.ouro_config())
        init_weights(self.model, self.model.config, torch.Generator().manual_seed(config.seed), config.gate_init_exit)
        self.model.to(self.device).train()
        self._stage_one, self._stage_two = stage_one_loss, stage_two_loss
        if config.compile:  # the loss functions, not the module: state dicts keep their names
            self._stage_one = torch.compile(stage_one_loss, backend=config.compile)
            self._stage_two = torch.compile(stage_two_loss, backend=config.compile)
        self.step = 0
        self._build_stage()

    # --- stages ----------------------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return 1 if self.step < self.config.stage1_steps else 2

    def _build_stage(self) -> None:
        c = self.config
        gate = self.model.model.early_exit_gate
        if self.stage == 1:
            # Decay the matrices only; norms, the gate (a 1 x hidden probe of h_r) and its bias keep their scale.
            gate_ids = {id(p) for p in gate.parameters()}
            decay = [p for p in self.model.parameters() if p.dim() >= 2 and id(p) not in gate_ids]
            no_decay = [p for p in self.model.parameters() if p.dim() < 2 or id(p) in gate_ids]
            groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
            lr, warmup, steps = c.lr, c.warmup_steps, c.stage1_steps
        else:
            for p in self.model.parameters():
                p.requires_grad_(False)
            for p in gate.parameters():
                p.requires_grad_(True)
            groups = [{"params": list(gate.parameters()), "weight_decay": 0.0}]
            lr, warmup, steps = c.stage2_lr, c.stage2_warmup_steps, c.stage2_steps
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=c.betas, eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(warmup, steps, c.min_lr_ratio))
        self._built_for = self.stage

    def _autocast(self):
        enabled = self.device.type == "cuda" and self.config.autocast_bf16
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    # --- one step --------------------------------------------------------------------------------
    def device_batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Step ``step``'s ``(input_ids, targets)`` on the training device.

        On CUDA the windows go over in one copy from pinned memory, so it queues behind the step in
        flight instead of waiting for it (a pageable copy would: the GPU would idle while the host
        launches the next step), and are split into inputs and targets there. The copy must be of
        the contiguous windows: a strided pinned tensor (``ids = w[:, :-1]`` pinned) is first copied
        into a pageable temporary by ``Tensor.to``, which defeats the pinning. The pinned tensor is
        not reused before its copy has run: the caching host allocator records the copy's event
        (tests/train/test_trainer.py checks it under load).
        """
        w = self.windows.rows(step, self.config.batch_size)
        if self.device.type == "cuda":
            w = w.pin_memory().to(self.device, non_blocking=True)
        else:
            w = w.to(self.device)
        return w[:, :-1], w[:, 1:]

    def train_step(self) -> StepMetrics:
        """Runs global step ``self.step`` and advances it; returns its metrics (still on the device)."""
        c = self.config
        if self.step >= c.total_steps:
            raise RuntimeError(f"the run is complete ({c.total_steps} steps)")
        assert self._built_for == self.stage
        ids, targets = self.device_batch(self.step)
        with self._autocast():
            if self.stage == 1:
                out = self._stage_one(self.model, ids, targets, c.entropy_beta, c.final_loop_weight)
                metrics = {"loss": out.loss, "expected_loss": out.expected_loss, "entropy": out.entropy}
            else:
                out = self._stage_two(self.model, ids, targets, c.gate_k, c.gate_gamma)
                metrics = {"gate_loss": out.loss}
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if self.stage == 1 and self.step < c.gate_freeze_steps:
            for p in self.model.model.early_exit_gate.parameters():
                p.grad = None  # AdamW skips a parameter without a gradient: no update, no moment
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        metrics.update(mean_depth=out.mean_depth, grad_norm=grad_norm, loop_losses=out.loop_losses)
        result = StepMetrics(self.stage, self.optimizer.param_groups[0]["lr"],
                             {k: v.detach() for k, v in metrics.items()})
        self.log(self.step, result)
        self.step += 1
        if self.stage != self._built_for:
            self._build_stage()  # now, not lazily: a checkpoint saved at the switch holds stage 2's optimizer
        return result

    def train(self, until: int | None = None, save_every: int = 0, checkpoint_dir: str | Path | None = None) -> None:
        """Steps until ``until`` (default: the end of the run), saving every ``save_every`` steps."""
        end = self.config.total_steps if until is None else min(until, self.config.total_steps)
        while self.step < end:
            self.train_step()
            if save_every and checkpoint_dir is not None and self.step % save_every == 0:
                self.save(checkpoint_dir)

    # --- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, stream: Tensor | None = None, batches: int | None = None,
                 thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS) -> dict:
        """Held-out loss of every loop, the expected loss under the gate, its mean exit depth and the stage-2 gate loss."""
        c = self.config
        stream = self.data.heldout if stream is None else stream
        windows = TokenWindows(stream, c.seq_len, seed=0)
        n = min(len(windows), (batches or c.eval_batches) * c.batch_size)
        was_training = self.model.training
        self.model.eval()
        sums, expected, depth, gate, count = None, 0.0, 0.0, 0.0, 0
        curve = torch.zeros(len(thresholds), 2, dtype=torch.float64)  # per threshold: sum of depth, sum of loss
        for start in range(0, n, c.batch_size):
            w = windows.windows[start:min(n, start + c.batch_size)].to(self.device)
            with self._autocast():
                out = loop_outputs(self.model, w[:, :-1])
                loss = per_loop_token_loss(self.model, out.hidden, w[:, 1:])  # [R, B, T]
            p = exit_log_probs(out.gate_logits).exp()
            loops = torch.arange(1, p.shape[0] + 1, device=p.device).view(-1, 1, 1)
            tokens = loss[0].numel()
            exit_target = 1.0 - continue_targets(loss.float(), c.gate_k, c.gate_gamma)
            gate += float(F.binary_cross_entropy_with_logits(out.gate_logits[:-1], exit_target, reduction="sum")) / (p.shape[0] - 1)
            for i, q in enumerate(thresholds):
                d = exit_depths(out.gate_logits, q)  # [B, T], 1-based
                curve[i, 0] += float(d.sum())
                curve[i, 1] += float(loss.float().gather(0, (d - 1)[None]).sum())
            sums = loss.sum((1, 2)) if sums is None else sums + loss.sum((1, 2))
            expected += float((p * loss).sum())
            depth += float((p * loops).sum())
            count += tokens
        self.model.train(was_training)
        return {"heldout_tokens": count, "loop_losses": [float(x) / count for x in sums],
                "expected_loss": expected / count, "mean_depth": depth / count, "gate_loss": gate / count,
                "uniform_loss": math.log(c.model.vocab_size),
                "curve": [{"threshold": q, "mean_depth": float(curve[i, 0]) / count, "loss": float(curve[i, 1]) / count}
                          for i, q in enumerate(thresholds)]}

    # --- save / resume ---------------------------------------------------------------------------
    def save(self, checkpoint_dir: str | Path) -> Path:
        """Writes the full training state to ``checkpoint_dir/train_state.pt`` (atomically)."""
        path = Path(checkpoint_dir)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "step": self.step,
            "built_for": self._built_for,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }
        tmp = path / (CHECKPOINT_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path / CHECKPOINT_FILE)
        return path / CHECKPOINT_FILE

    @classmethod
    def resume(cls, checkpoint_dir: str | Path, data: Data | None = None, device: str | torch.device = "cpu",
               log: Callable[[int, StepMetrics], None] | None = None) -> "Trainer":
        """A trainer that continues the run saved in ``checkpoint_dir`` exactly where it stopped."""
        file = Path(checkpoint_dir) / CHECKPOINT_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no training checkpoint (Trainer.save writes it)")
        state = torch.load(file, map_location="cpu", weights_only=False)
        if state.get("version") != STATE_VERSION:
            raise InvalidRequestError(f"{file}: version={state.get('version')!r}; allowed: {STATE_VERSION}")
        trainer = cls(TrainConfig.from_dict(state["config"]), data, device, log)
        trainer.model.load_state_dict(state["model"])
        trainer.step = state["step"]
        trainer._build_stage()  # the optimizer of the stage the checkpoint was in, with its frozen parameters
        if trainer._built_for != state["built_for"]:
            raise InvalidRequestError(f"{file}: stage mismatch (saved {state['built_for']}, step {state['step']})")
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        return trainer

    # --- export ----------------------------------------------------------------------------------
    def export(self, out_dir: str | Path, early_exit_threshold: float | None = None, metrics: dict | None = None) -> Path:
        """Writes a checkpoint directory (config.json, safetensors, tokenizer, training_info.json, MODEL_CARD.md)
        for ``loopline.LLM``."""
        from safetensors.torch import save_file

        from loopline.models.tiny import _HF_ONLY_DEFAULTS, _config_json  # the one config.json writer

        threshold = self.config.early_exit_threshold if early_exit_threshold is None else early_exit_threshold
        if not 0 < threshold <= 1:
            raise InvalidRequestError(f"early_exit_threshold={threshold}; allowed: (0, 1]")
        config = dataclasses.replace(self.model.config, early_exit_threshold=float(threshold),
                                     torch_dtype=self.config.export_dtype)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.config.export_dtype]
        weights = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.model.state_dict().items()}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        raw = {**_config_json(config, dict(_HF_ONLY_DEFAULTS)), "_name_or_path": "loopline-demo-ouro"}
        _dump(out / "config.json", raw)
        _dump(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [0, 2], **DEMO_SAMPLING_DEFAULTS})
        write_tokenizer(self.data.tokenizer, out, config.max_position_embeddings)
        info = {"train_config": self.config.to_dict(), "step": self.step, "corpus": self.data.info,
                "early_exit_threshold": float(threshold),
                "parameters": sum(p.numel() for p in self.model.parameters()), "metrics": metrics or {}}
        _dump(out / "training_info.json", info)
        from loopline.train.model_card import write_model_card

        write_model_card(out)
        return out


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")

