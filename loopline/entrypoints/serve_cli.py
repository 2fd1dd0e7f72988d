"""``loopline serve``: the OpenAI-compatible HTTP server (engine flags from :class:`EngineArgs`)."""
from __future__ import annotations

import argparse
from typing import Any

from loopline.errors import LooplineError

HELP = "serve an OpenAI-compatible HTTP API (default model: the bundled tiny checkpoint)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from loopline.config import EngineArgs
    from loopline.entrypoints.cli import HelpFormatter, common_parser

    p = sub.add_parser("serve", help=HELP, formatter_class=HelpFormatter, parents=[common_parser()])
    p.add_argument("model_tag", nargs="?", default=None, help="checkpoint directory (same as --model)")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in 'model' (default: the model path); the first is reported")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize (env LOOPLINE_API_KEY)")
    server.add_argument("--max-concurrent-requests", type=int, default=256,
                        help="generation requests in flight before new ones get HTTP 429")
    server.add_argument("--shutdown-timeout", type=int, default=30,
                        help="seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="in logprobs, name every token 'token_id:<id>' instead of by its text "
                             "(tokens that are not valid UTF-8 on their own stay identifiable)")
    server.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's own log level")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_serve)
    return p


def _run_serve(ns: argparse.Namespace) -> int:
    from loopline.entrypoints.openai.api_server import run_server

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise LooplineError("give the model either positionally or with --model, not both")
        ns.model = ns.model_tag
    return run_server(ns)
