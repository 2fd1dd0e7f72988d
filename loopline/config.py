"""Engine arguments and the validated, frozen configs built from them.

``EngineArgs`` is the single definition of every engine option: ``LLM(**kwargs)``
takes its fields, and the CLI derives its ``--flags`` from the same fields
(``add_cli_args``), so the two never drift.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin, get_type_hints

from loopline.core.exit_trace import ExitTraceConfig
from loopline.errors import InvalidRequestError
from loopline.spec.config import SpeculativeConfig
from loopline.vllm_flags import canonical_dtype, check_engine_options, json_object, option_help

if TYPE_CHECKING:
    import torch

# NOTE: torch (and the modules that import it) is imported inside the functions that use it: the CLI
# builds its parsers from EngineArgs, and `loopline serve --help` must answer without loading torch
# (tests/entrypoints/test_cli_fast.py).

KVLayoutName = Literal["last_exited", "shared"]
SchedulingMode = Literal["refill", "no_refill"]
SchedulingPolicy = Literal["fcfs", "priority"]
ExitMode = Literal["threshold", "fixed", "trace", "lookahead"]
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
AttentionBackendName = Literal["auto", "torch", "triton", "flashinfer"]
KernelBackendName = Literal["auto", "torch", "triton"]
DType = Literal["auto", "float32", "bfloat16", "float16", "half", "float"]  # half, float: vLLM's aliases
KVCacheDType = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3"]  # loopline.kv.quant.KV_CACHE_DTYPES
KVAllocationName = Literal["full", "incremental"]
DistributedBackendName = Literal["mp", "ray"]
KVTransportName = Literal["auto", "gloo", "nccl", "cuda_ipc", "nixl"]

_DTYPES = ("float32", "bfloat16", "float16")  # the torch dtypes of the same names
# NOTE: on an H200 at concurrency 128, 8,192 tokens was ~5% faster than 2,048 (docs/benchmarks); on the CPU
# a step's cost grows with its tokens and there is no launch overhead to amortize.
DEFAULT_TOKEN_BUDGET = {"cuda": 8192, "cpu": 2048}


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Every engine option (vLLM names where vLLM has one)."""

    model: str | None = _opt(None, "checkpoint directory (Hugging Face layout); default: the bundled demo model")
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model directory)")
    skip_tokenizer_init: bool = _opt(False, "do not load a tokenizer; prompts must be token ids")
    dtype: DType = _opt("auto", "weight and activation dtype ('auto': the checkpoint's, float32 on CPU for bf16 checkpoints is not forced)")
    device: str = _opt("auto", "'auto' (cuda when available), 'cpu', 'cuda' or 'cuda:N'")
    seed: int = _opt(0, "engine seed: seeds drawn for requests with seed=None come from it")
    kv_layout: KVLayoutName = _opt("last_exited", "depth-aware KV layout (docs/design.md, KV layouts)")
    block_size: int = _opt(16, "tokens per KV page")
    kv_cache_dtype: KVCacheDType = _opt("auto", "stored KV dtype: 'auto' (the model's), 'bfloat16', 'float16', or "
                                                "'fp8' / 'fp8_e4m3' (FP8 E4M3 with per-layer, per-KV-head scales from "
                                                "the checkpoint or a calibration pass at start: twice the tokens per GiB)")
    num_kv_blocks: int | None = _opt(None, "KV pages in the pool (all planes together); default: sized from memory")
    kv_cache_memory_gb: float | None = _opt(None, "KV pool size in GiB (default on CPU: what max_num_seqs requests of max_model_len tokens need, "
                                                     "at most 1 GiB; on CUDA: from gpu_memory_utilization)")
    gpu_memory_utilization: float = _opt(0.9, "fraction of GPU memory the engine may use (weights + activations + KV)")
    max_num_seqs: int = _opt(256, "max requests running at once (decode slots; vLLM's default)")
    max_num_batched_tokens: int | None = _opt(None, "token budget of one step (decode rows + prefill chunk tokens); default: "
                                                    f"{DEFAULT_TOKEN_BUDGET['cuda']} on CUDA (fastest measured), {DEFAULT_TOKEN_BUDGET['cpu']} on CPU")
    max_model_len: int | None = _opt(None, "max prompt + output tokens per request (default: the model's max_position_embeddings)")
    scheduling_mode: SchedulingMode = _opt("refill", "'refill': an exited slot starts its next token at once; 'no_refill': cohort baseline")
    scheduling_policy: SchedulingPolicy = _opt("fcfs", "admission order: first come first served, or by SamplingParams.priority")
    enable_prefix_caching: bool = _opt(False, "reuse KV of full prompt pages shared with earlier requests (last_exited only)")
    kv_allocation: KVAllocationName = _opt("full", "'full': reserve prompt + max_tokens at admission; 'incremental': grow with the sequence")
    enable_preemption: bool = _opt(False, "snapshot a victim's KV and state to CPU memory when KV runs out or a higher-priority request waits")
    swap_space: float = _opt(4.0, "CPU memory (GiB) for preemption snapshots; when full, requests wait instead")
    kv_watermark: float = _opt(0.0, "fraction of KV blocks kept free when admitting new requests (headroom for running ones)")
    max_num_loops: int | None = _opt(None, "most loops a request may run (its max_loops bound; sizes the KV planes): "
                                           "default the checkpoint's depth (Ouro: total_ut_steps, which is its only "
                                           "allowed value; Huginn: mean_recurrence, any integer >= 1)")
    exit_mode: ExitMode = _opt("threshold", "requests' default exit policy (SamplingParams.exit_mode picks one per request): "
                                            "'threshold': the exit rule; 'fixed': always max_loops; 'trace': replay "
                                            "SamplingParams.exit_depths; 'lookahead': the head beside the weights fixes "
                                            "each exit two loops ahead (docs/lookahead.md)")
    logprobs_mode: LogprobsMode = _opt("raw_logprobs", "logprobs of the raw model logits or of the processed sampling distribution")
    max_logprobs: int = _opt(20, "largest logprobs / prompt_logprobs a request may ask for")
    attention_backend: AttentionBackendName = _opt("auto", "paged attention backend ('auto': triton on CUDA, torch on CPU; "
                                                           "'flashinfer': FlashInfer's FA2 kernels on CUDA, the "
                                                           "loopline[flashinfer] extra, bf16/fp16 KV; runs eagerly)")
    kernel_backend: KernelBackendName = _opt("auto", "layer math (norms, rotary, SwiGLU, packed q/k/v and gate/up GEMMs, split-K down_proj for <= 64 rows, a GEMV for one row): 'auto' (fused triton kernels on CUDA), 'torch' (reference), 'triton'")
    enforce_eager: bool = _opt(False, "disable CUDA graphs")
    max_seq_len_to_capture: int = _opt(8192, "longest context served by CUDA graphs; longer decode steps run eagerly")
    async_scheduling: bool = _opt(True, "overlap: launch step n+1 before reading step n's results (exact: exits are "
                                        "decided on the device); --no-async-scheduling reads every step at once, "
                                        "on the same execution path (for A/B measurements)")
    disable_log_stats: bool = _opt(False, "turn off the engine statistics line logged every log_stats_interval seconds "
                                          "(logged at INFO: loopline serve shows it)")
    log_stats_interval: float = _opt(10.0, "seconds between engine statistics log lines")
    generation_config: str = _opt("auto", "where request sampling defaults come from (vLLM's option): 'auto' reads "
                                          "the model's generation_config.json (temperature, top_p, top_k, min_p, "
                                          "repetition_penalty, max_new_tokens as max_tokens); 'vllm' uses "
                                          "SamplingParams' own defaults; else a folder holding a generation_config.json")
    # --- scale-out (docs/serving.md "Scale-out"; AsyncLLM and loopline serve) --------------
    data_parallel_size: int = _opt(1, "engine replicas behind one front end, one per device (replica i on cuda:i; "
                                      "CPU processes on CPU); requests are routed by load with prefix affinity")
    distributed_executor_backend: DistributedBackendName = _opt(
        "mp", "how replicas and prefill/decode workers run: 'mp' (engine processes on this host) or 'ray' (Ray "
              "actors in a placement group, one bundle per replica or worker; needs loopline[ray])")
    # --- prefill/decode disaggregation (loopline.distributed.pd) ---
    prefill_workers: int = _opt(0, "prefill workers (with --decode-workers; processes, or Ray actors with "
                                   "--distributed-executor-backend ray): prompts run there, "
                                   "decoding on the decode workers; 0: one engine does both")
    decode_workers: int = _opt(0, "decode workers (with --prefill-workers)")
    kv_transport: KVTransportName = _opt("auto", "how KV pages move from prefill to decode workers ('auto': gloo on "
                                                 "the CPU, cuda_ipc when the workers share one GPU, else nccl; cuda_ipc "
                                                 "is refused with the ray backend; nixl "
                                                 "needs the nixl package)")
    kv_transfer_timeout: float = _opt(60.0, "seconds a KV transfer may take before its request fails")
    # --- loop self-speculation (docs/speculation.md) ---
    speculative_config: dict[str, Any] | None = _opt(
        None, "loop self-speculation (vLLM's option), a JSON object: {\"method\": \"loop\", "
              "\"draft_loops\": d (1..loops-1), \"scheme\": \"pipeline\" (default: the next token enters at loop 1 "
              "once its predecessor has run d loops) or \"draft_verify\" (\"num_speculative_tokens\": K (1..16) "
              "drafts from loops 1..d, verified at the deeper loops) or \"auto\"}; outputs equal plain decoding's "
              "(kv_layout last_exited); "
              "not for structured outputs or lookahead exits; \"adaptive\" (default true) and "
              "\"disable_by_batch_size\" (default 32) turn it off where it does not pay",
        type=json_object)
    # --- exit traces (docs/lookahead.md, 'Engine traces') ---
    exit_trace: dict[str, Any] | None = _opt(
        None, "record every executed loop's exit features while serving, a JSON object: {\"dir\": PATH, "
              "\"proj_dim\": 32, \"proj_seed\": 0, \"labels\": false, \"prompts\": true, \"shard_rows\": 65536}; "
              "safetensors shards and meta.json in dir (off when unset: nothing runs)",
        type=json_object)
    # --- vLLM launch options: loopline/vllm_flags.py says what each means here (the help) and checks it ---
    trust_remote_code: bool = _opt(False, option_help("trust_remote_code"))
    tensor_parallel_size: int = _opt(1, option_help("tensor_parallel_size"))
    pipeline_parallel_size: int = _opt(1, option_help("pipeline_parallel_size"))
    enable_chunked_prefill: bool | None = _opt(None, option_help("enable_chunked_prefill"))
    quantization: str | None = _opt(None, option_help("quantization"))
    revision: str | None = _opt(None, option_help("revision"))
    download_dir: str | None = _opt(None, option_help("download_dir"))
    load_format: str = _opt("auto", option_help("load_format"))
    override_generation_config: dict[str, Any] | None = _opt(None, option_help("override_generation_config"),
                                                             type=json_object)
    chat_template: str | None = _opt(None, option_help("chat_template"))
    enable_sleep_mode: bool = _opt(False, option_help("enable_sleep_mode"))

    # --- CLI ---------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("engine")
        add_dataclass_args(group, cls)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    # --- validation --------------------------------------------------------------------
    def validate(self) -> None:
        from loopline.attention import not_provided_reason
        from loopline.kv.quant import resolve_kv_cache_dtype

        def positive(name: str, value: int | float | None) -> None:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise InvalidRequestError(f"{name} must be > 0, got {value!r}", param=name)

        for name in ("block_size", "max_num_seqs", "max_seq_len_to_capture", "log_stats_interval", "max_num_batched_tokens", "num_kv_blocks", "max_model_len", "kv_cache_memory_gb", "max_num_loops"):
            positive(name, getattr(self, name))
        reason = not_provided_reason(self.attention_backend)
        if reason is not None:
            raise InvalidRequestError(reason, param="attention_backend")
        for name, lit in (("kv_layout", KVLayoutName), ("scheduling_mode", SchedulingMode), ("scheduling_policy", SchedulingPolicy),
                          ("exit_mode", ExitMode), ("kv_allocation", KVAllocationName),
                          ("distributed_executor_backend", DistributedBackendName), ("logprobs_mode", LogprobsMode), ("attention_backend", AttentionBackendName), ("kernel_backend", KernelBackendName), ("dtype", DType)):
            allowed = get_args(lit)
            if getattr(self, name) not in allowed:
                raise InvalidRequestError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}", param=name)
        if self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two, got {self.block_size}", param="block_size")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidRequestError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so every decode row fits a step and prefill always progresses", param="max_num_batched_tokens")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise InvalidRequestError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}", param="kv_watermark")
        if self.swap_space < 0:
            raise InvalidRequestError(f"swap_space must be >= 0 GiB, got {self.swap_space}", param="swap_space")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}", param="gpu_memory_utilization")
        self._validate_disaggregation()
        if self.speculative() is not None and self.kv_layout == "shared":  # (speculative() raises on bad values)
            logging.getLogger("loopline").warning(
                "speculative_config with kv_layout='shared': outputs are not plain shared decoding's (a draft reads "
                "the round's earlier positions at their draft depth; docs/speculation.md); use kv_layout='last_exited' "
                "for outputs equal to plain decoding")
        if ExitTraceConfig.from_value(self.exit_trace) is not None and self.speculative_config is not None:
            raise InvalidRequestError("exit_trace records plain decode rows; it cannot be combined with "
                                      "speculative_config (speculating rows are not recorded)", param="exit_trace")
        check_engine_options(self)  # the vLLM launch options (loopline/vllm_flags.py)
        resolve_kv_cache_dtype(self.kv_cache_dtype, None)  # raises, naming the allowed values
        if self.enable_prefix_caching and self.kv_layout == "shared":
            logging.getLogger("loopline").warning(
                "enable_prefix_caching has no effect with kv_layout='shared' (a prompt's depth-major prefill needs its "
                "prefix's KV at every loop, which the one shared plane does not keep); use kv_layout='last_exited'")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise InvalidRequestError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                                      f"generation_config.json, got {self.generation_config!r}", param="generation_config")
        if not self.device == "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidRequestError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}", param="device")
        self._validate_scale_out()
        if self.prefill_workers and self.data_parallel_size > 1:
            raise InvalidRequestError(
                "prefill_workers/decode_workers run one disaggregated engine: data_parallel_size must be 1 with "
                f"them, got {self.data_parallel_size}", param="prefill_workers")
        if self.prefill_workers and self.distributed_executor_backend == "ray" and self.kv_transport == "cuda_ipc":
            raise InvalidRequestError(
                "kv_transport 'cuda_ipc' needs every worker on one GPU, but with distributed_executor_backend 'ray' "
                "each worker has a GPU of its own (possibly on another host): use 'nccl' or 'auto'",
                param="kv_transport")

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed and checked (``None``: speculation off); the model's loop count
        bounds ``draft_loops`` when the engine starts."""
        if self.speculative_config is None:
            return None
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec.pipelines and self.kv_layout != "last_exited":
            if "scheme" not in self.speculative_config:
                # the default scheme may pipeline, which the shared plane cannot: its user gets the scheme it can run
                return dataclasses.replace(spec, scheme="draft_verify")
            # NOTE: on the one shared plane a lane would read its predecessor's K/V at the predecessor's current
            # loop, where plain shared decoding reads every earlier token's final K/V (docs/speculation.md)
            raise InvalidRequestError(f"speculative_config.scheme={spec.scheme!r} needs kv_layout='last_exited', got "
                                      f"kv_layout={self.kv_layout!r}: on the shared plane tokens in flight would read "
                                      "their predecessors' unfinished K/V", param="kv_layout")
        return spec

    def _validate_scale_out(self) -> None:
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise InvalidRequestError(f"data_parallel_size must be an integer >= 1, got {dp!r}", param="data_parallel_size")
        if dp == 1:
            return
        if self.device.startswith("cuda:"):
            raise InvalidRequestError(f"device must be 'auto', 'cuda' or 'cpu' with data_parallel_size {dp} (replica i "
                                      f"runs on cuda:i), got {self.device!r}", param="device")
        import torch

        if self.distributed_executor_backend == "mp" and self.device != "cpu" and torch.cuda.is_available():
            visible = torch.cuda.device_count()
            if dp > visible:
                raise InvalidRequestError(f"data_parallel_size must be in [1, {visible}] (one replica per visible CUDA "
                                          f"device), got {dp}", param="data_parallel_size")

    def _validate_disaggregation(self) -> None:
        for name in ("prefill_workers", "decode_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
                raise InvalidRequestError(f"{name} must be an integer in [0, 64], got {value!r}", param=name)
        if (self.prefill_workers == 0) != (self.decode_workers == 0):
            raise InvalidRequestError(
                "prefill_workers and decode_workers go together: both >= 1 (disaggregated) or both 0, got "
                f"{self.prefill_workers} and {self.decode_workers}",
                param="prefill_workers" if self.prefill_workers == 0 else "decode_workers")
        if self.kv_transport not in get_args(KVTransportName):
            raise InvalidRequestError(f"kv_transport must be one of {list(get_args(KVTransportName))}, "
                                      f"got {self.kv_transport!r}", param="kv_transport")
        if isinstance(self.kv_transfer_timeout, bool) or not isinstance(self.kv_transfer_timeout, (int, float)) \
                or not 0 < self.kv_transfer_timeout <= 3600:
            raise InvalidRequestError(f"kv_transfer_timeout must be in (0, 3600] seconds, got {self.kv_transfer_timeout!r}",
                                      param="kv_transfer_timeout")


@dataclass(frozen=True)
class EngineConfig:
    """Validated engine options with the device, dtype and lengths resolved."""

    args: EngineArgs
    model_path: str | None  # None: an in-memory model passed to the engine
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    num_loops: int  # loops a request may run: max_num_loops resolved (Ouro: total_ut_steps)
    max_num_batched_tokens: int = 0  # resolved: the args' value, or the device's default budget
    kv_dtype: torch.dtype | None = None  # resolved: the KV pool's stored dtype (kv_cache_dtype)

    def __post_init__(self) -> None:
        from loopline.kv.quant import resolve_kv_cache_dtype

        object.__setattr__(self, "kv_dtype", resolve_kv_cache_dtype(self.args.kv_cache_dtype, self.dtype))
        budget = self.args.max_num_batched_tokens
        if budget is None:
            default = DEFAULT_TOKEN_BUDGET["cuda" if self.device.type == "cuda" else "cpu"]
            budget = max(default, self.args.max_num_seqs)
        object.__setattr__(self, "max_num_batched_tokens", budget)

    def __getattr__(self, name: str) -> Any:  # read-through to the (frozen by convention) args
        return getattr(object.__getattribute__(self, "args"), name)


def resolve_device(device: str) -> torch.device:
    """The engine's device; a CUDA device always carries its index (threads that launch work on it,
    like the server's engine thread, must select it by index)."""
    import torch

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidRequestError(f"device {device!r} requested but CUDA is not available", param="device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype != "auto":
        return getattr(torch, canonical_dtype(dtype))
    resolved = getattr(torch, checkpoint_dtype) if checkpoint_dtype in _DTYPES else torch.float32
    if device.type == "cpu" and resolved == torch.float16:
        return torch.float32  # fp16 matmuls on CPU are slow and poorly supported
    return resolved


def add_dataclass_args(parser: Any, cls: type, skip: tuple[str, ...] = (), rename: dict[str, str] | None = None) -> None:
    """Adds ``--field-name`` flags for every field of a dataclass, typed from its hints.

    ``rename`` maps a field to another flag/dest name where two dataclasses
    share a field name (the engine ``--seed`` vs a request's ``--sampling-seed``).
    """
    hints = get_type_hints(cls)
    rename = rename or {}
    for f in fields(cls):
        if f.name in skip or f.name == "extra" or not f.metadata.get("cli", True):
            continue
        dest = rename.get(f.name, f.name)
        flag = "--" + dest.replace("_", "-")
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "")
        base, optional = _unwrap_optional(hint)
        if "type" in f.metadata:  # the field's own parser (a JSON object flag)
            parser.add_argument(flag, dest=dest, type=f.metadata["type"], default=default, help=help_text)
        elif base is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif get_origin(base) is Literal:
            parser.add_argument(flag, dest=dest, choices=list(get_args(base)), default=default, help=help_text)
        elif get_origin(base) is list or base is list:
            item = (get_args(base) or (str,))[0]
            parser.add_argument(flag, dest=dest, type=item, nargs="+", default=default, help=help_text)
        elif get_origin(base) is None and base in (int, float, str):
            parser.add_argument(flag, dest=dest, type=base, default=default, help=help_text)
        else:  # unions like str | list[str]: take strings, repeatable
            parser.add_argument(flag, dest=dest, type=str, action="append", default=None, help=help_text)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    args = get_args(hint)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
        return hint, True
    return hint, False
