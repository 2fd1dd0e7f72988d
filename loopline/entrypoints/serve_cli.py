"""``loopline serve``: the OpenAI-compatible HTTP server (engine flags from :class:`EngineArgs`)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from loopline.entrypoints.cli_args import (HelpFormatter, add_cpu_threads_arg, apply_cpu_threads, check_model_dir,
                                           common_parser, port_number)
from loopline.errors import LooplineError
from loopline.vllm_flags import check_engine_options, option_help

HELP = "serve an OpenAI-compatible HTTP API (default model: the bundled demo model)"

# NOTE: literals, not imports: building the parser must not import the server (FastAPI, uvicorn).
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
# the names in loopline.entrypoints.openai.tool_parsers.TOOL_PARSERS (a test keeps them equal)
TOOL_CALL_PARSERS = ("hermes",)


def _str_list(value: str) -> list[str]:
    """A list flag: a JSON list (vLLM's form, '["https://a.example"]') or comma-separated names."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {value!r} ({e})") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return items
    return [part.strip() for part in text.split(",") if part.strip()]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from loopline.config import EngineArgs

    p = sub.add_parser("serve", help=HELP, formatter_class=HelpFormatter, parents=[common_parser()])
    p.add_argument("model_tag", nargs="?", default=None, help="checkpoint directory (same as --model)")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a request's own chat_template (vLLM's flag; templates are programs: off by default)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="tool_choice 'auto' (and tools without tool_choice): tool calls are parsed out of the "
                             "model's text with --tool-call-parser (vLLM's flag)")
    server.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="how tool calls are written in the model's text (hermes: <tool_call>{json}</tool_call>); "
                             "needed by --enable-auto-tool-choice")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in 'model' (default: the model path); the first is reported")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (env LOOPLINE_API_KEY) on every route except "
                             "/health, /metrics and /version: /v1/completions, /v1/chat/completions, /v1/models, "
                             "/tokenize, /detokenize and, with --enable-rl-api, /generate and every RL control route "
                             "(pause/resume, abort, weight updates, prefix cache, sleep/wake_up)")
    server.add_argument("--enable-rl-api", action="store_true",
                        help="mount /generate and the RL control routes (pause, resume, abort, update weights from "
                             "disk, sleep, wake_up, reset the prefix cache); a non-loopback --host then needs --api-key")
    server.add_argument("--allowed-hosts", type=_str_list, default=[],
                        help="Host header names to answer besides the loopback names (JSON list or comma-separated; "
                             "'*': any); bound to a loopback address only the loopback names are answered by default, "
                             "on another address any Host unless this is given")
    server.add_argument("--allowed-origins", type=_str_list, default=[],
                        help="origins allowed to make cross-origin (CORS) requests (JSON list or comma-separated; "
                             "'*': any); none by default, so browsers on other sites are refused")
    server.add_argument("--allowed-methods", type=_str_list, default=["*"],
                        help="methods allowed in CORS requests from --allowed-origins")
    server.add_argument("--allowed-headers", type=_str_list, default=["*"],
                        help="headers allowed in CORS requests from --allowed-origins")
    server.add_argument("--allow-credentials", action="store_true",
                        help="allow credentials (cookies, Authorization) in CORS requests from --allowed-origins")
    server.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get HTTP 413")
    server.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                        help="the most prompts one /v1/completions or /generate request may carry (more: HTTP 400)")
    server.add_argument("--max-concurrent-requests", type=int, default=256,
                        help="generation requests in flight before new ones get HTTP 429")
    server.add_argument("--shutdown-timeout", type=float, default=30,
                        help="seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted "
                             "(streams then end with finish_reason 'abort' and [DONE])")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="in logprobs, name every token 'token_id:<id>' instead of by its text "
                             "(tokens that are not valid UTF-8 on their own stay identifiable)")
    server.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's own log level")
    add_cpu_threads_arg(server)
    _add_vllm_server_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_serve)
    return p


def _add_vllm_server_args(p: argparse.ArgumentParser) -> None:
    """vLLM's server flags (their help comes from loopline/vllm_flags.py, the table the docs show)."""
    g = p.add_argument_group("vLLM server flags")
    h = option_help
    g.add_argument("--response-role", default="assistant", help=h("response_role"))
    g.add_argument("--root-path", default=None, help=h("root_path"))
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help=h("ssl_keyfile"))
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help=h("ssl_certfile"))
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE", help=h("ssl_ca_certs"))
    g.add_argument("--uds", default=None, metavar="PATH", help=h("uds"))
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help=h("disable_uvicorn_access_log"))
    g.add_argument("--disable-log-requests", action="store_true", help=h("disable_log_requests"))
    g.add_argument("--enable-log-requests", action="store_true", help=h("enable_log_requests"))
    g.add_argument("--max-log-len", type=int, default=None, metavar="N", help=h("max_log_len"))


def _run_serve(ns: argparse.Namespace) -> int:
    from loopline.config import EngineArgs

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise LooplineError("give the model either positionally or with --model, not both")
        ns.model = ns.model_tag
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise LooplineError("--enable-auto-tool-choice needs --tool-call-parser (e.g. --tool-call-parser hermes)")
    check_model_dir(ns.model, "--model")
    check_model_dir(ns.tokenizer, "--tokenizer")
    check_engine_options(EngineArgs.from_cli_args(ns))  # vLLM options loopline cannot honour, before torch loads
    apply_cpu_threads(ns.cpu_threads)  # torch and the server load from here, after the flags are checked
    from loopline.entrypoints.openai.api_server import run_server

    return run_server(ns)
