"""The engine: ``add_request`` / ``step`` / ``abort_request``, one step on one screen.

``step()``: ``scheduler.schedule() -> runner.launch() -> handle.get() ->
scheduler.update()``, then the output processor turns new tokens into
``RequestOutput``s. With ``async_scheduling`` (the default) the engine launches
step n+1 before it reads step n; without, it reads each step at once. Both are
the same calls in another order: there is one execution path.

Failures (docs/security.md): whatever is done per request in a step -- reading its
row, booking its token, detokenizing, stop checks, finishing, building its
output -- fails that request alone (its KV, slot and snapshot freed, its output
ended with ``finish_reason="abort"`` and an ``error_id``); the others go on
exactly as without it. A failure of the step itself (the forward) fails the
step's requests the same way. Only a device fault stops the engine.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from loopline.config import EngineArgs, EngineConfig, resolve_device, resolve_dtype
from loopline.core.contracts import RunnerOutput, SchedulerOutput
from loopline.core.exit_policy import make_exit_policy
from loopline.core.exit_trace import ExitTraceConfig
from loopline.core.queue import make_queue
from loopline.core.request import Request, RequestStatus
from loopline.core.scheduler import Preemption, Scheduler, make_allocation
from loopline.core.speculation import make_speculation
from loopline.engine.control import EngineControl
from loopline.engine.handoff import HandoffPort
from loopline.engine.input_processor import InputProcessor, PromptType
from loopline.engine.deltas import OutputBuilder, OutputDelta
from loopline.engine.output_processor import OutputProcessor
from loopline.engine.stat_logger import StatLogger
from loopline.engine.verbs import VERBS, verb_mixin
from loopline.errors import EngineDeadError, InvalidRequestError, new_error_id
from loopline.kv.layout import make_layout
from loopline.kv.manager import KVCacheManager
from loopline.kv.quant import kv_scales_for
from loopline.models.family import family_of
from loopline.models.loader import (check_sampling_defaults, dummy_looped_model, load_looped_config, load_looped_model,
                                    load_tokenizer, override_sampling_defaults, sampling_defaults)
from loopline.models.ouro import OuroForCausalLM
from loopline.outputs import RequestOutput
from loopline.sampling_params import SamplingParams
from loopline.spec.adapter import resolve_adapter
from loopline.structured.manager import StructuredOutputs
from loopline.worker.backends import Backends, select_backends
from loopline.worker.draft_head import AdapterInfo
from loopline.worker.memory_profile import check_fits, footprint, kv_bytes_per_block, num_kv_blocks
from loopline.worker.model_runner import ModelRunner, RowFailure, StepHandle
from loopline.worker.sampler import Sampler

logger = logging.getLogger("loopline")

__all__ = ["LLMEngine", "EngineStats", "PromptType", "is_device_fault"]


@dataclass
class EngineStats:
    """Counters since start (benchmarks and /metrics read them)."""

    steps: int = 0
    rows: int = 0
    scheduled_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # vLLM's iteration tokens: a generated token once, when it is sampled; a prompt's tokens once,
    # when its prefill finishes (its first token is sampled)
    iteration_tokens: int = 0
    loops_of_generated: int = 0  # sum of exit depths
    finished_requests: int = 0
    failed_requests: int = 0  # failed by an error while being served (the engine went on)
    step_time_s: float = 0.0
    prefill_steps: int = 0  # steps with at least one prefill chunk, and their host time
    prefill_step_time_s: float = 0.0
    exit_depth_counts: dict[int, int] = field(default_factory=dict)
    # loop self-speculation, vLLM's spec_decode counters: verify rounds, drafts proposed and accepted,
    # and accepted drafts by their position in the round
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def rows_per_step(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens committed per speculative round (accepted drafts + the correction or bonus), vLLM's
        "mean acceptance length"; ``None`` before the first round."""
        if not self.spec_num_drafts:
            return None
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts

    def spec_decode_metrics(self) -> dict[str, Any]:
        """The speculation counters under vLLM's Prometheus names (``..._per_pos``: position -> count)."""
        return {"vllm:spec_decode_num_drafts": self.spec_num_drafts,
                "vllm:spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
                "vllm:spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens,
                "vllm:spec_decode_num_accepted_tokens_per_pos": dict(enumerate(self.spec_accepted_per_pos))}

    @property
    def mean_exit_depth(self) -> float:
        return self.loops_of_generated / self.generated_tokens if self.generated_tokens else 0.0

    def count_step(self, sched: SchedulerOutput, elapsed: float) -> None:
        self.steps += 1 if sched.rows else 0
        self.rows += len(sched.rows)
        self.scheduled_tokens += sched.num_tokens
        self.step_time_s += elapsed
        if any(r.is_prefill for r in sched.rows):
            self.prefill_steps += 1
            self.prefill_step_time_s += elapsed

    def count_round(self, drafts: int, accepted: int) -> None:
        """One speculative round that proposed ``drafts`` tokens and had its first ``accepted`` accepted."""
        if len(self.spec_accepted_per_pos) < drafts:
            self.spec_accepted_per_pos += [0] * (drafts - len(self.spec_accepted_per_pos))
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += drafts
        self.spec_num_accepted_tokens += accepted
        for pos in range(accepted):
            self.spec_accepted_per_pos[pos] += 1

    def count_token(self, exit_depth: int, prompt_tokens: int = 0) -> None:
        self.generated_tokens += 1
        self.iteration_tokens += 1 + prompt_tokens
        self.loops_of_generated += exit_depth
        self.exit_depth_counts[exit_depth] = self.exit_depth_counts.get(exit_depth, 0) + 1


# Substrings of device faults (the CUDA context is unusable afterwards): never recovered from.
_DEVICE_FAULTS = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS", "cuDNN error",
                  "NCCL error", "unspecified launch failure")


def is_device_fault(error: BaseException) -> bool:
    """A fault of the device itself (the engine cannot go on), as opposed to one request's failure."""
    if isinstance(error, EngineDeadError):  # the engine already stopped after one
        return True
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False  # recoverable: the requests that needed the memory fail
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _DEVICE_FAULTS)


# The control verbs as LLMEngine methods (``engine.sleep(2)``; ``engine.is_paused`` a property), from engine/verbs.py.
EngineVerbs = verb_mixin("EngineVerbs", state_properties=True)


def _load_weights(args: EngineArgs, model_path: str, dtype: torch.dtype, device: torch.device) -> OuroForCausalLM:
    """The checkpoint's model; with ``load_format='dummy'`` its config.json's model with seeded random weights
    (vLLM's dummy format: benchmarks and smoke tests without reading the weights)."""
    if args.load_format != "dummy":
        return load_looped_model(model_path, dtype, device)
    return dummy_looped_model(model_path, args.seed, dtype, device)


def _check_family_features(args: EngineArgs, family: Any) -> EngineArgs:
    """``args`` with the model family's limits applied (``Family.engine_limits``): an option set to a value the
    engine does not serve for the family is refused, naming it and what is allowed; ``"auto"`` resolves to
    the family's first other allowed value, where it allows another."""
    changes = {}
    for option, allowed, why in family.engine_limits:
        value = getattr(args, option)
        if value not in allowed:
            raise InvalidRequestError(f"{option}={value!r} is not served for {family.model_type} models ({why}); "
                                      f"allowed: {', '.join(map(repr, allowed))}", param=option)
        if value == "auto" and len(allowed) > 1:
            changes[option] = next(a for a in allowed if a != "auto")
    return dataclasses.replace(args, **changes) if changes else args


def _num_loops(args: EngineArgs, model_cfg: Any) -> int:
    """``max_num_loops`` resolved: the most loops a request may run (the checkpoint's depth by default; a
    family with a fixed depth allows only that)."""
    family = family_of(model_cfg)
    limit, value = family.loop_limit(model_cfg), args.max_num_loops
    if value is None:
        return model_cfg.num_loops
    if limit is not None and value != limit:
        raise InvalidRequestError(f"max_num_loops={value} for a {model_cfg.model_type} model; allowed: {limit} (its "
                                  f"depth is fixed: every prompt runs all of its loops)", param="max_num_loops")
    return value


def _exit_trace(args: EngineArgs, model_cfg: Any) -> ExitTraceConfig | None:
    """``exit_trace`` parsed, for a family whose exit is the gate (the recorder records gate logits)."""
    config = ExitTraceConfig.from_value(args.exit_trace)
    family = family_of(model_cfg)
    if config is not None and family.exit_criterion.name != "gate":
        raise InvalidRequestError(f"exit_trace records the exit gate's logits; model_type {family.model_type!r} "
                                  f"has no gate (its exit: {family.exit_criterion.name!r})", param="exit_trace")
    return config


def _lookahead_head(args: EngineArgs, model_cfg: Any):
    """The lookahead exit head in the ``--model`` directory (``lookahead.json``: docs/lookahead.md), validated
    against the model, or None (none there, no directory named, or dummy weights). A model given in memory
    with ``args.model`` (the bench's) reads the head beside the weights it was loaded from."""
    if args.model is None or args.load_format == "dummy":
        return None
    from loopline.models.lookahead_head import load_head

    return load_head(args.model, hidden_size=model_cfg.hidden_size, loops=getattr(model_cfg, "total_ut_steps", None))


class LLMEngine(EngineVerbs):
    """Lower-level streaming engine (vLLM names): ``add_request``, ``step``, ``abort_request``, and one
    control port, :meth:`control_call`, behind the control verbs it inherits (``engine/verbs.py``:
    ``pause_generation``, ``update_weights``, ``sleep``, ...)."""

    def __init__(self, args: EngineArgs, model: OuroForCausalLM | None = None, *, prefill_only: bool = False,
                 backends: Backends | None = None) -> None:
        """``prefill_only``: a prefill worker (``loopline.distributed.pd``): a request stops after its
        first token and waits for ``handoff.take`` instead of decoding here. ``backends``: the kernels to run
        (e.g. an attention backend with another split rule, tools/profile_step.py); ``None`` selects them by
        ``attention_backend`` and ``kernel_backend``."""
        args.validate()
        for name, one in (("data_parallel_size", 1), ("distributed_executor_backend", "mp")):
            if getattr(args, name) != one:  # NOTE: replicas are AsyncLLM's (loopline.distributed), never a silent no-op
                raise InvalidRequestError(f"{name} {getattr(args, name)!r} needs AsyncLLM or loopline serve, which run one "
                                          f"engine per replica; LLM and LLMEngine run one engine ({name}={one!r})",
                                          param=name)
        model_path = args.model
        if model_path is None and (model is None or not args.skip_tokenizer_init):
            from loopline.models.tiny import default_checkpoint  # the bundled model (or its tokenizer)
            model_path = str(default_checkpoint())
        model_cfg = load_looped_config(model_path) if model is None else model.config
        family = family_of(model_cfg)
        args = _check_family_features(args, family)
        # the request defaults of LLM.generate(..., None) and of unset HTTP fields (vLLM's generation_config)
        self.sampling_defaults: dict[str, Any] = override_sampling_defaults(
            sampling_defaults(args.generation_config, model_path), args.override_generation_config)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, model_cfg.torch_dtype, device)
        max_len = args.max_model_len or model_cfg.max_position_embeddings
        if max_len > model_cfg.max_position_embeddings:
            raise InvalidRequestError(
                f"max_model_len must be <= the model's max_position_embeddings ({model_cfg.max_position_embeddings}), got {max_len}",
                param="max_model_len")
        num_loops = _num_loops(args, model_cfg)
        self.config = cfg = EngineConfig(args, model_path, device, dtype, max_len, num_loops)
        self.model_config = model_cfg
        self.sampling_defaults = check_sampling_defaults(self.sampling_defaults, model_cfg.vocab_size, max_len,
                                                         f"{args.generation_config} generation_config.json")
        try:
            layout = make_layout(args.kv_layout, num_loops, len(family.once_planes(model_cfg, num_loops)))
        except ValueError as e:
            raise InvalidRequestError(str(e), param="kv_layout") from None
        # a config that asks for the impossible is refused before anything is allocated
        check_fits(footprint(model_cfg, dtype=dtype, kv_dtype=cfg.kv_dtype, device=device, max_model_len=max_len,
                             max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                             num_planes=layout.num_planes, weights=model is None), device)
        self.model = model.to(device=device, dtype=dtype).eval() if model is not None else _load_weights(args, model_path, dtype, device)
        backends = backends or select_backends(args.attention_backend, args.kernel_backend, device)
        self.model.use_ops(backends.layer_ops)
        self.tokenizer = (None if args.skip_tokenizer_init
                          else load_tokenizer(args.tokenizer or model_path, args.chat_template))
        num_blocks = num_kv_blocks(cfg, self.model, backends.attention, layout)
        self.kv = KVCacheManager(num_blocks, args.block_size, layout, args.enable_prefix_caching)
        head = _lookahead_head(args, model_cfg)
        self.exit_policy = make_exit_policy(args.exit_mode, head[1].threshold if head is not None else None)
        spec = args.speculative()
        if spec is not None:
            spec.check_model(model_cfg.total_ut_steps)
            if spec.scheme == "pipeline" and "num_speculative_tokens" in args.speculative_config:
                # vLLM's habit names K; the default scheme has no rounds to spend it on
                logger.info("speculative_config: scheme 'pipeline' (the default) keeps up to %d tokens in flight and "
                            "does not use num_speculative_tokens=%d; \"scheme\": \"draft_verify\" drafts that "
                            "many a round", spec.lanes(model_cfg.total_ut_steps), spec.num_speculative_tokens)
        # (a family without speculation, Huginn, has no total_ut_steps: spec is None for it)
        speculation = make_speculation(spec, model_cfg.total_ut_steps if spec is not None else 0, self.exit_policy.per_token,
                                       args.max_num_seqs)
        block_bytes = kv_bytes_per_block(model_cfg, args.block_size, cfg.kv_dtype)
        preemption = Preemption(int(args.swap_space * 2**30 // block_bytes)) if args.enable_preemption else None
        self.scheduler = Scheduler(self.kv, self.exit_policy, make_queue(args.scheduling_policy), args.max_num_seqs,
                                   cfg.max_num_batched_tokens, num_loops,
                                   allocation=make_allocation(args.kv_allocation), preemption=preemption,
                                   watermark_blocks=int(args.kv_watermark * num_blocks),
                                   after_prefill=RequestStatus.HANDOFF if prefill_only else RequestStatus.DECODE,
                                   speculation=speculation)
        kv_scales = kv_scales_for(self.model, cfg.kv_dtype, self.tokenizer, max_len, num_loops)
        if kv_scales is not None:
            logger.info("KV cache: %s with per-layer, per-KV-head scales from %s", args.kv_cache_dtype, kv_scales.source)
        self.runner = ModelRunner(self.model, layout, backends.attention, num_blocks, args.block_size, args.max_num_seqs,
                                  max_len, Sampler(args.logprobs_mode), device, dtype, slot_ops=backends.slot_ops,
                                  no_refill=args.scheduling_mode == "no_refill",
                                  per_token_exits=self.exit_policy.per_token, kv_dtype=cfg.kv_dtype,
                                  kv_scales=kv_scales, speculative=spec, lookahead=head,
                                  exit_trace=_exit_trace(args, model_cfg))
        if self.runner.spec is not None:  # drafts' trained adapter, beside the served weights (docs/speculation.md)
            weights_dir = model_path if model is None and args.load_format != "dummy" else None
            found = resolve_adapter(spec.draft_adapter, weights_dir, model_cfg.hidden_size, model_cfg.total_ut_steps,
                                    spec.draft_loops)
            if found is not None:
                self.runner.spec.head.install(*found)
        if device.type == "cuda" and not args.enforce_eager and backends.attention.graph_steps != "none":
            self.runner.capture_graphs(min(max_len, args.max_seq_len_to_capture), cfg.max_num_batched_tokens)
        if device.type == "cuda":  # sampling runs eagerly, graphs or not: its kernels compile now, not in a request
            self.runner.sampler.warm(model_cfg.vocab_size, device)
        self.outputs = OutputProcessor(self.tokenizer)
        # constrained requests' grammar matchers (xgrammar is imported on the first one)
        self.structured = StructuredOutputs(self.tokenizer, model_cfg.vocab_size, unsupported=(
            "on a prefill worker (prefill/decode disaggregation)" if prefill_only else None))
        self._builder = OutputBuilder()  # step()'s outputs from step_deltas()'s deltas
        self.inputs = InputProcessor(cfg, model_cfg, self.tokenizer, self.exit_policy, self.kv,
                                     frozenset(model_cfg.eos_token_ids), self.outputs.chat_end_ids)
        self.control = EngineControl(self.scheduler, self.kv, self.runner, self.model, self.outputs, model_cfg, device,
                                     on_finished=self._finish_output)
        self.stats = EngineStats()
        self._stat_logger = None if args.disable_log_stats else StatLogger(args.log_stats_interval)
        self._overlap = args.async_scheduling
        self._pending: tuple[SchedulerOutput, StepHandle] | None = None  # launched, not yet read
        self.dead_reason: str | None = None  # a device fault stopped the engine
        # prefill/decode disaggregation: requests leaving a prefill worker, arriving at a decode worker
        self.handoff = HandoffPort(self.scheduler, self.kv, self.runner.pages, self.inputs, self.outputs,
                                   self.control, cfg.num_loops, self._check_alive)

    # --- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    *, chat_stop: bool = False) -> None:
        """Validates and queues a request; raises ``InvalidRequestError`` and changes nothing on bad input.

        While generation is paused the request is held and starts at ``resume_generation()``.
        """
        self._check_alive()
        if not self.control.is_paused:
            self.control.check_may_generate()
        if self.outputs.has(request_id):
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        self.structured.check_supported(params)
        req = self.inputs.process(request_id, prompt, params, chat_stop)
        self.structured.add(req.params.structured_outputs, req.children)  # one grammar matcher per child
        self.outputs.add(request_id, req.prompt, req.prompt_token_ids, req.params,
                         [c.request_id for c in req.children], self.control.weight_version)
        for child in req.children:
            if not self.control.hold(child):
                self.scheduler.add_request(child)
        self.stats.prompt_tokens += len(req.prompt_token_ids) * len(req.children)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Aborts requests (unknown ids are ignored); their KV is freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for child in self.outputs.children(rid):
                self._finish(child, "abort")

    def _finish(self, child_id: str, reason: str, stop_reason: int | str | None = None) -> bool:
        """Finishes a request; returns whether its output ended as asked (not by a failure)."""
        req = self._release(child_id, reason, stop_reason)
        return req is not None and self._finish_output(req)

    def _finish_output(self, req: Request) -> bool:
        try:
            self.outputs.on_finished(req)
            return True
        except Exception as e:  # e.g. the detokenizer failing on its last characters: it fails alone
            self._fail(req.request_id, e)
            return False

    def _release(self, child_id: str, reason: str, stop_reason: int | str | None = None) -> Request | None:
        """Takes a request out of the scheduler (its KV, slot and snapshot freed; the runner drops its
        state with the next step's ``finished_request_ids``) or out of a pause's held list."""
        self.structured.drop(child_id)
        req = self.scheduler.finish_request(child_id, reason, stop_reason)
        if req is not None and self.runner.trace is not None:  # its recorded rows past its last token go
            self.runner.trace.finish(child_id, req.num_output_tokens)
        return req or self.control.drop_held(child_id, reason)

    def has_unfinished_requests(self) -> bool:
        # NOTE: a launched step not yet read matters only for requests still in the scheduler: the
        # results of finished ones are dropped when it is read (by the next step, whenever that is).
        # Outputs not yet returned (an abort's) come from the next step too.
        return self.scheduler.has_unfinished() or bool(self.control.held) or self.outputs.has_unreported()

    def has_runnable_requests(self) -> bool:
        """Whether ``step()`` can advance a request: some are in the scheduler and no ``"keep"``
        pause freezes them (requests held by a pause wait for ``resume_generation()``)."""
        return self.scheduler.has_unfinished() and not self.control.frozen

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests) + len(self.control.held)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one loop for every scheduled row; returns the outputs of requests that progressed, as
        each request's ``output_kind`` asks (cumulative by default). Use this or :meth:`step_deltas`."""
        deltas = self._step()
        # NOTE: adopted requests first: their outputs build on what their prefill worker reported
        return self._builder.build(self.outputs.take_adopted() + deltas)

    def step_deltas(self) -> list[OutputDelta]:
        """One step, as :meth:`step`; returns what each request that progressed added (the engine
        loop sends these to its clients, which build the outputs their consumers ask for)."""
        deltas = self._step()
        self.outputs.take_adopted()  # a prefill worker reported those: its client has them
        return deltas

    def _step(self) -> list[OutputDelta]:
        self._check_alive()
        t0, generated = time.perf_counter(), self.stats.generated_tokens
        if self.control.step_blocked():  # paused with mode "keep", or no usable weights / KV
            return self._collect()
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.preempted_request_ids and any(
                r.status != RequestStatus.HANDOFF for r in self.scheduler.running):  # (those wait for handoff.take)
            self._fail_blocked()
            sched = self.scheduler.schedule()
        for new in sched.new_requests:
            self.outputs.on_scheduled(new.request_id)
        for rid in sched.preempted_request_ids:
            self.outputs.on_preempted(rid)
        if self.structured:
            self.structured.prune()
        # Constrained rows' logits are masked; a step that may sample a constrained request's token, when
        # the next step may sample its next one, is read at once: that token's mask needs this step's token.
        constrained = self.structured.in_step(sched)
        read_now = constrained and self.structured.read_at_once(sched, self.exit_policy.per_token)
        sched, handle = self._launch(sched, constrained)
        previous = self._pending
        self._pending = (sched, handle) if handle is not None and sched.rows else None
        if (not self._overlap or read_now) and self._pending is not None:
            if previous is not None:
                self._read(*previous)
            previous, self._pending = self._pending, None
        if previous is not None:
            self._read(*previous)
        elapsed = time.perf_counter() - t0
        self.stats.count_step(sched, elapsed)
        self.scheduler.speculation.observe_step(sched.rows, elapsed, self.stats.generated_tokens - generated)
        if self._stat_logger is not None:
            self._stat_logger.maybe_log(self)
        deltas = self._collect()
        if self.runner.trace is not None and not self.scheduler.has_unfinished():
            self.runner.trace.flush()  # idle: what was recorded goes to disk
        return deltas

    def _collect(self) -> list[OutputDelta]:
        return self.outputs.collect(on_error=self._fail_output)

    def _launch(self, sched: SchedulerOutput, constrained: bool = False) -> tuple[SchedulerOutput, StepHandle | None]:
        """Launches a step; returns what ran and its handle. Requests the runner refuses before it
        changed anything fail alone and the rest of the step is launched again; any other failure
        fails the whole step's requests (their state may be half-applied). ``constrained``: the step
        has rows of constrained requests, whose logits the grammar masks before sampling."""
        mask = self.structured.token_mask if constrained else None
        try:
            try:
                return sched, self.runner.launch(sched, mask)
            except RowFailure as e:
                for rid in e.request_ids:
                    self._fail(rid, e)
                sched = sched.without(set(e.request_ids))
                return sched, self.runner.launch(sched, mask)
        except Exception as e:  # the engine goes on
            self._fail_step(sched, e)
            return sched, None

    def _read(self, sched: SchedulerOutput, handle: StepHandle) -> None:
        try:
            result = handle.get()
            touched = self.scheduler.update(sched, result)
        except Exception as e:  # not one request's: the step's requests fail
            self._fail_step(sched, e)
            return
        self._count_rounds(sched, result)
        self._apply_results(sched, result, touched)

    def _count_rounds(self, sched: SchedulerOutput, result: RunnerOutput) -> None:
        """Speculative rounds that ended in this step: drafts proposed and accepted (the committed run
        is the accepted drafts plus the correction or bonus)."""
        if self.scheduler.speculation.config is None:
            return
        for i, (judged, accepted) in result.spec_verdicts.items():  # pipelining lanes: each draft its own round
            if self.scheduler.owner(sched.rows[i]) is not None:
                for n in range(judged):
                    self.stats.count_round(1, int(n < accepted))
        for i, row in enumerate(sched.rows):
            if row.spec is not None and row.spec.last and result.sampled[i] is not None \
                    and self.scheduler.owner(row) is not None:
                self.stats.count_round(row.spec.queries - 1, len(result.more.get(i, ())))

    def _apply_results(self, sched: SchedulerOutput, result: RunnerOutput, touched: list[Request]) -> None:
        """Books a step's results request by request: a failure fails only the request it happened in."""
        if result.failed or result.prompt_logprobs:
            live = {r.request_id for r in sched.rows if self.scheduler.owner(r) is not None}
            for rid, error in result.failed.items():  # rows whose results could not be read
                if rid in live:
                    self._fail(rid, error)
            for rid, entries in result.prompt_logprobs.items():
                if rid in live and rid not in result.failed:
                    try:
                        self.outputs.add_prompt_logprobs(rid, entries)
                    except Exception as e:
                        self._fail(rid, e)
        for req in touched:
            if req.status == RequestStatus.FINISHED:
                continue  # failed above
            try:
                self._book_token(req)
                # a speculative round's accepted run, token by token: nothing is booked past a stop
                while req.status != RequestStatus.FINISHED and self.scheduler.take_unbooked(req):
                    self._book_token(req)
            except Exception as e:  # e.g. a tokenizer or a stop check failing on this request
                self._fail(req.request_id, e)

    def _book_token(self, req: Request) -> None:
        self.stats.count_token(req.output[-1].exit_depth, len(req.prompt_token_ids) if len(req.output) == 1 else 0)
        grammar_done = self.structured.accept(req) if self.structured else False
        stop = self.scheduler.check_stop(req) or (("stop", None) if grammar_done else None)
        text_stop = self.outputs.on_token(req, self.control.weight_version, check_stop=stop is None)
        stop = stop or text_stop
        if stop is not None and self._finish(req.request_id, *stop):
            self.stats.finished_requests += 1

    # --- failures -----------------------------------------------------------------------
    def _fail_blocked(self) -> None:
        """Nothing can progress (KV and swap space exhausted): fail one request, clearly."""
        victim = self.scheduler.blocked_victim()
        logger.error("KV cache and swap space exhausted: aborting request %s", victim.request_id)
        self._finish(victim.request_id, "abort", "kv cache and swap space exhausted")

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> None:
        """A step failed: a device fault stops the engine; anything else fails the step's requests
        (their KV and slots freed) and the engine serves the others."""
        if is_device_fault(error):
            self.dead_reason = f"device fault: {type(error).__name__}"
            logger.exception("device fault: the engine stops")
            raise EngineDeadError(f"the engine stopped after a device fault ({type(error).__name__}); restart it") from error
        ids = {r.request_id for r in sched.rows} | {n.request_id for n in sched.new_requests}
        ids |= {r.request_id for r in sched.resumed_requests}
        logger.error("step failed (%d rows, %d new, %d resumed): failing requests %s",
                     len(sched.rows), len(sched.new_requests), len(sched.resumed_requests), sorted(ids),
                     exc_info=error)
        for rid in sorted(ids):
            self._fail(rid, error, log=False)

    def _fail(self, child_id: str, error: Exception, log: bool = True) -> None:
        """Fails one request: its KV and slot freed, finish reason ``abort``, and an error id (in
        ``error_id`` and the stop reason) that finds the traceback in the log -- never the exception's
        text, which may carry internals. A request that already finished is left as it is."""
        error_id = new_error_id()
        message = _failure_message(error_id)
        try:
            self._release(child_id, "abort", message)
        finally:  # even if freeing failed, its caller must not wait forever
            if self.outputs.on_failed(child_id, message, error_id):
                logger.error("request %s failed (error id %s)", child_id, error_id, exc_info=error if log else None)
                self.stats.failed_requests += 1

    def _fail_output(self, request_id: str, error: Exception) -> tuple[str, str]:
        """Building a request's output failed: every choice of it fails, under one error id."""
        error_id = new_error_id()
        logger.error("the output of request %s failed (error id %s)", request_id, error_id, exc_info=error)
        message = _failure_message(error_id)
        for child_id in self.outputs.children(request_id):
            self._release(child_id, "abort", message)
        self.stats.failed_requests += 1
        return message, error_id

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine stopped ({self.dead_reason}); restart it")

    # --- RL: weight updates, pause / resume, sleep (engine/verbs.py, engine/control.py) --
    @property
    def weight_version(self) -> Any:
        return self.control.weight_version

    @property
    def weights(self):
        return self.control.weights

    @property
    def draft_adapter(self) -> AdapterInfo | None:
        """The trained draft adapter speculation drafts through (``None``: the plain coda, or no speculation)."""
        return None if self.runner.spec is None else self.runner.spec.head.info

    def control_call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """Runs a control verb of ``engine/verbs.py`` on this engine (``engine.sleep(2)`` is
        ``engine.control_call("sleep", 2)``); an unknown verb raises ``InvalidRequestError``."""
        spec = VERBS.lookup(verb)
        if spec.loop:
            raise InvalidRequestError(f"{verb} is served by the engine loop: call it on AsyncLLM", param="verb")
        args = spec.bind(args, kwargs)
        served = getattr(self.control, spec.name)  # a state verb is a property there
        return served if spec.state else served(*args)

def _failure_message(error_id: str) -> str:
    return f"internal error (error id {error_id}); see the server log"
