"""vLLM's launch options and what each means in loopline: the one table ``loopline serve``, ``LLM(...)``
(through :class:`~loopline.config.EngineArgs`) and docs/configuration.md ("Coming from vLLM") consult.

Engine rows are :class:`EngineArgs` fields (so ``LLM(model, tensor_parallel_size=1)`` and
``loopline serve --tensor-parallel-size 1`` take the same path and get the same message); server rows
are ``loopline serve`` flags. A row's ``refuse`` names the option, the value and what is supported;
its ``note`` is logged once when the option is given with a value that changes nothing here.
Standard library only: the CLI builds its parsers from this module before torch loads.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from loopline.errors import InvalidRequestError

#: ``--dtype`` names vLLM accepts besides the torch names, and the dtype each one means.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
#: ``--load-format`` values: ``auto`` / ``safetensors`` read the checkpoint's safetensors; ``dummy``
#: builds the model of its config.json with random weights (for benchmarks and smoke tests).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_NO_QUANTIZATION = (None, "none", "None")
_LOCAL_ONLY = ("loopline loads local checkpoint directories only and never downloads "
               "(fetch a checkpoint first, e.g. with `hf download <repo> --local-dir <dir>`)")


@dataclass(frozen=True)
class VllmOption:
    """One vLLM option: where it lives here and what it means."""

    name: str  # the field / flag dest (``tensor_parallel_size`` is ``--tensor-parallel-size``)
    scope: Literal["engine", "server"]  # an EngineArgs field (LLM and every command) or a `loopline serve` flag
    meaning: str  # what it does in loopline (docs/configuration.md shows it)
    refuse: Callable[[Any], str | None] | None = None  # the refusal for a value, None when accepted
    note: Callable[[Any], str | None] | None = None  # logged once for a value that changes nothing

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _only_one(name: str, what: str) -> Callable[[Any], str | None]:
    def refuse(value: Any) -> str | None:
        if value == 1 and not isinstance(value, bool):
            return None
        return (f"{name} must be 1, got {value!r}: loopline does not support {what} (one model copy per device; "
                f"for several GPUs run replicas with data_parallel_size)")
    return refuse


def _chunked_prefill(value: Any) -> str | None:
    if value is None or value is True:
        return None
    return (f"enable_chunked_prefill must be true (or unset), got {value!r}: loopline always splits prompts into "
            "chunks that share each step's max_num_batched_tokens with the decode rows")


def _quantization(value: Any) -> str | None:
    if value in _NO_QUANTIZATION:
        return None
    return (f"quantization {value!r} is not supported: loopline serves unquantized checkpoints (allowed: none); "
            "for a smaller KV cache use kv_cache_dtype fp8")


def _load_format(value: Any) -> str | None:
    if value in LOAD_FORMATS:
        return None
    return f"load_format must be one of {list(LOAD_FORMATS)}, got {value!r} (loopline reads safetensors only)"


def _override_generation_config(value: Any) -> str | None:
    if value is None or isinstance(value, dict):
        return None
    return f"override_generation_config must be a JSON object such as '{{\"temperature\": 0.5}}', got {value!r}"


def _trust_remote_code(value: Any) -> str | None:
    if value:
        return ("trust_remote_code: loopline never runs code shipped with a checkpoint (it implements each model "
                "family itself), so this option changes nothing")
    return None


def _local_only(name: str) -> Callable[[Any], str | None]:
    def note(value: Any) -> str | None:
        return None if value is None else f"{name} {value!r} has no effect: {_LOCAL_ONLY}"
    return note


OPTIONS: tuple[VllmOption, ...] = (
    # --- engine (EngineArgs fields: LLM(...) keywords and flags of every command) ---
    VllmOption("dtype", "engine", "weights and activations: auto, float32, bfloat16, float16; vLLM's aliases half "
                                  "(float16) and float (float32) are accepted"),
    VllmOption("kv_cache_dtype", "engine", "stored KV dtype: auto, bfloat16, float16, fp8 / fp8_e4m3"),
    VllmOption("trust_remote_code", "engine", "accepted; changes nothing: loopline never runs code shipped with a "
                                              "checkpoint (said once in the log)", note=_trust_remote_code),
    VllmOption("tensor_parallel_size", "engine", "1 only (no tensor parallelism); several GPUs: data_parallel_size",
               refuse=_only_one("tensor_parallel_size", "tensor parallelism")),
    VllmOption("pipeline_parallel_size", "engine", "1 only (no pipeline parallelism)",
               refuse=_only_one("pipeline_parallel_size", "pipeline parallelism")),
    VllmOption("enable_chunked_prefill", "engine", "accepted (true): loopline always chunks prefill within "
                                                   "max_num_batched_tokens; false is refused", refuse=_chunked_prefill),
    VllmOption("quantization", "engine", "none only (unquantized checkpoints); others are refused",
               refuse=_quantization),
    VllmOption("revision", "engine", "accepted; changes nothing (local directories only, never downloads; "
                                     "said once in the log)", note=_local_only("revision")),
    VllmOption("download_dir", "engine", "accepted; changes nothing (local directories only, never downloads; "
                                         "said once in the log)", note=_local_only("download_dir")),
    VllmOption("load_format", "engine", "auto / safetensors: the checkpoint's weights; dummy: random weights of the "
                                        "checkpoint's config.json; others are refused", refuse=_load_format),
    VllmOption("override_generation_config", "engine", "a JSON object of generation_config.json keys (temperature, "
                                                       "top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
                                                       "merged over the request defaults, checked like them",
               refuse=_override_generation_config),
    VllmOption("chat_template", "engine", "a chat template file, or the template itself inline (vLLM's rule: a "
                                          "value that is no file but holds {, } or a newline is a template), "
                                          "replacing the checkpoint's for chat requests and LLM.chat",
               refuse=lambda value: chat_template_problem(value)),
    VllmOption("enable_sleep_mode", "engine", "loopline serve mounts POST /sleep, POST /wake_up and GET "
                                              "/is_sleeping (also without --enable-rl-api); LLM's sleep() / "
                                              "wake_up() work either way"),
    # --- server (loopline serve flags) ---
    VllmOption("response_role", "server", "the role chat responses carry after a generation prompt "
                                          "(default assistant)"),
    VllmOption("root_path", "server", "the path prefix of a proxy in front of the server (ASGI root_path)"),
    VllmOption("ssl_keyfile", "server", "serve HTTPS with this private key (with --ssl-certfile)"),
    VllmOption("ssl_certfile", "server", "serve HTTPS with this certificate (with --ssl-keyfile)"),
    VllmOption("ssl_ca_certs", "server", "with --ssl-keyfile/--ssl-certfile: clients must present a certificate "
                                         "these CAs signed"),
    VllmOption("uds", "server", "listen on this unix domain socket instead of --host/--port"),
    VllmOption("disable_uvicorn_access_log", "server", "accepted: uvicorn's access log is always off (loopline "
                                                       "logs one line per request itself)"),
    VllmOption("disable_log_requests", "server", "turn off loopline's one line per request (method, path, status, "
                                                 "time, token counts; never prompt text)"),
    VllmOption("enable_log_requests", "server", "keep the one line per request on (loopline's default; vLLM's is "
                                                "off); refused with --disable-log-requests"),
    VllmOption("max_log_len", "server", "cut each request line's details (request id, token counts, user) to "
                                        "this many characters (default: no cut)"),
)

_ENGINE = {o.name: o for o in OPTIONS if o.scope == "engine"}


def engine_option_names() -> tuple[str, ...]:
    """The engine rows' names (each is an EngineArgs field)."""
    return tuple(_ENGINE)


def check_engine_options(args: Any) -> None:
    """Refuses an EngineArgs value a row does not support (``InvalidRequestError`` naming the field)."""
    for option in _ENGINE.values():
        message = option.refuse(getattr(args, option.name)) if option.refuse else None
        if message is not None:
            raise InvalidRequestError(message, param=option.name)


def engine_option_notes(args: Any) -> list[str]:
    """What to log once for the options given that change nothing here."""
    notes = (option.note(getattr(args, option.name)) for option in _ENGINE.values() if option.note)
    return [n for n in notes if n]


def log_engine_option_notes(args: Any, logger: logging.Logger | None = None) -> None:
    for note in engine_option_notes(args):
        (logger or logging.getLogger("loopline")).info(note)


def read_chat_template(value: str) -> str:
    """``--chat-template``'s template: the file ``value`` names, else ``value`` itself when it looks like a
    template (holds ``{``, ``}`` or a newline, as vLLM decides), else an error naming the option."""
    try:
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, ValueError) as e:
        if any(c in value for c in "{}\n"):
            return value
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidRequestError(f"chat_template {value!r}: cannot read it ({reason}); give a template file or the "
                                  "template itself", param="chat_template") from None


def chat_template_problem(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        return f"chat_template must be a template file or the template text, got {value!r:.80}"
    try:
        read_chat_template(value)
    except InvalidRequestError as e:
        return str(e)
    return None


def option_help(name: str) -> str:
    """A row's meaning: the help of its flag (and of its EngineArgs field)."""
    (option,) = [o for o in OPTIONS if o.name == name]
    return option.meaning


def json_object(text: str) -> dict[str, Any]:
    """An argparse ``type`` for ``--override-generation-config``: a JSON object (argparse names the flag)."""
    import argparse

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"temperature\": 0.5}}', got {text!r}")
    return value


def canonical_dtype(dtype: str) -> str:
    """``half`` -> ``float16``, ``float`` -> ``float32``; other names unchanged."""
    return DTYPE_ALIASES.get(dtype, dtype)


def markdown_table() -> str:
    """docs/configuration.md's "Coming from vLLM" table (a test keeps the page equal to it)."""
    rows = ["| vLLM option | where | in loopline |", "|---|---|---|"]
    for o in OPTIONS:
        where = "`LLM(...)` and every command" if o.scope == "engine" else "`loopline serve`"
        rows.append(f"| `{o.flag}` (`{o.name}`) | {where} | {o.meaning} |")
    return "\n".join(rows)
