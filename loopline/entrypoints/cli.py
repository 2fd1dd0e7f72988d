"""The ``loopline`` command: ``generate``, ``serve``, ``bench``, ``train``.

Engine flags come from :class:`EngineArgs` and sampling flags from
:class:`SamplingParams` (``--max-tokens``, ``--exit-threshold``, ...), so the
CLI and the Python API share one definition.

Parsing imports neither torch nor the engine (:mod:`loopline.config` is
torch-free at import), so ``--help``, a usage error or a missing model
directory answers in a fraction of a second; only a command that runs loads
them. Every error is one line on stderr and exit status 2; ``--debug`` (or
``LOOPLINE_DEBUG=1``) prints the traceback before that line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Any

import loopline
from loopline.entrypoints import bench_cli, serve_cli, train_cli  # stdlib only at import: torch loads when a command runs
from loopline.entrypoints.cli_args import (
    HelpFormatter,
    add_cpu_threads_arg,
    add_sampling_args,
    apply_cpu_threads,
    check_model_dir,
    common_parser,
    read_text_file,
    sampling_from_ns,
)
from loopline.errors import LooplineError

class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with a one-line error (no usage dump), exit status 2 as argparse's."""

    command: str | None = None  # the subcommand being parsed: an unknown flag's hint names its --help

    def error(self, message: str) -> Any:
        where = f"{self.prog} {self.command}" if self.command else self.prog
        self.exit(2, f"error: {self.prog}: {message} (see {where} --help)\n")


def _add_generate(sub: Any) -> None:
    from loopline.config import EngineArgs

    p = sub.add_parser("generate", help=GENERATE_HELP, formatter_class=HelpFormatter, parents=[common_parser()])
    p.add_argument("prompts", nargs="*", help=f"prompts (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--prompt-file", help="file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    p.add_argument("--stats", action="store_true",
                   help="print steps, rows per step, mean exit depth, tokens/s and CPU threads (in text mode with a "
                        "line on what each means)")
    add_cpu_threads_arg(p)
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(ns: argparse.Namespace) -> int:
    from loopline.config import EngineArgs

    prompts = list(ns.prompts)
    if ns.prompt_file:
        prompts += [line for line in read_text_file(ns.prompt_file, "--prompt-file").splitlines() if line.strip()]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    sampling_from_ns(ns)  # bad flag values fail before a model loads
    args = EngineArgs.from_cli_args(ns)
    check_model_dir(args.model, "--model")
    check_model_dir(args.tokenizer, "--tokenizer")
    if args.model is None:
        print(DEMO_NOTICE, file=sys.stderr)
    threads = apply_cpu_threads(ns.cpu_threads)  # torch and the engine load from here, after the flags are checked
    from loopline.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(args))
    params = sampling_from_ns(ns, llm.llm_engine.sampling_defaults)
    print(loop_settings_line(ns, args, llm.llm_engine.model_config), file=sys.stderr)
    t0 = time.perf_counter()
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outs):
        prompt_lps = logprob_rows(out.prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs)
        for comp in out.outputs:
            lps = logprob_rows(comp.token_ids, comp.logprobs, params.logprobs)
            if ns.json:
                record = {"prompt": prompt, "index": comp.index, "text": comp.text, "token_ids": comp.token_ids,
                          "exit_depths": comp.exit_depths, "finish_reason": comp.finish_reason,
                          "cumulative_logprob": comp.cumulative_logprob, "seed": comp.seed}
                if lps is not None:
                    record["logprobs"] = lps
                if prompt_lps is not None:
                    record["prompt_logprobs"] = prompt_lps
                print(json.dumps(record))
            else:
                print(completion_text(prompt, comp, numbered=len(out.outputs) > 1))
                if prompt_lps is not None and comp.index == 0:
                    print("prompt logprobs (id, token, logprob, rank | top: id, token, logprob):\n" + format_logprob_rows(prompt_lps))
                if lps is not None:
                    print("logprobs (id, token, logprob, rank | top: id, token, logprob):\n" + format_logprob_rows(lps))
                print()
    if ns.stats:
        st = llm.llm_engine.stats
        stats = {"steps": st.steps, "rows_per_step": round(st.rows_per_step, 2),
                 "mean_exit_depth": round(st.mean_exit_depth, 3), "generated_tokens": st.generated_tokens,
                 "elapsed_s": round(elapsed, 3), "output_tokens_per_s": round(st.generated_tokens / elapsed, 1),
                 "cpu_threads": threads}
        if ns.json:
            print(json.dumps({"stats": stats}))
        else:
            print("stats: " + ", ".join(f"{k}={v}" for k, v in stats.items()))
            print("\n".join(f"  {k:<20} {STATS_LEGEND[k]}" for k in stats))
    return 0


def completion_text(prompt: str, comp: Any, numbered: bool = False) -> str:
    """A completion as a reader wants it: the prompt, the text as generated (not a repr), then one line
    with its length, finish reason and per-token exit depths."""
    depths = " ".join(map(str, comp.exit_depths))
    return (f"prompt: {prompt}\n" + (f"completion {comp.index}:" if numbered else "completion:") + f"\n{comp.text}\n"
            f"[{len(comp.token_ids)} tokens, finish: {comp.finish_reason}; exit depth per token: {depths} "
            f"(mean {comp.mean_exit_depth:.2f})]")


def loop_settings_line(ns: argparse.Namespace, args: Any, model_config: Any) -> str:
    """The loop budget and exit rule every prompt runs with, and where each value came from."""
    from loopline.models.family import family_of  # (torch loads when a command runs)

    family = family_of(model_config)
    where = "the bundled demo model's config.json" if args.model is None else f"{args.model}/config.json"
    budget = (f"{ns.max_loops} (--max-loops)" if ns.max_loops is not None
              else f"{model_config.num_loops} ({family.depth_field} in {where})")
    line = f"loops per token: at most {budget}, at least {ns.min_loops}"
    if args.exit_mode == "fixed":
        return line + "; --exit-mode fixed: every token runs the most loops"
    if args.exit_mode == "trace":
        return line + "; --exit-mode trace: exit depths replayed from --exit-depths"
    if args.exit_mode == "lookahead":
        return line + ("; --exit-mode lookahead: the head beside the weights (lookahead.json) fixes each exit two "
                       "loops ahead, at its calibrated threshold")
    default = family.default_threshold(model_config)
    threshold = (f"{ns.exit_threshold} (--exit-threshold)" if ns.exit_threshold is not None
                 else f"{default} ({family.threshold_field} in {where})" if family.threshold_field
                 else f"{default} ({model_config.model_type}'s default)")
    return line + "; " + family.exit_criterion.rule.format(threshold) + "; 1.0 means fixed depth"


# One line each for `loopline generate --stats` (docs/user-guide.md says the same).
STATS_LEGEND = {
    "steps": "engine steps: each runs one loop of the shared layer stack for every row in the batch",
    "rows_per_step": "mean rows per step (a row: one request's token or prompt chunk at one of its loops)",
    "mean_exit_depth": "mean loops a generated token ran before it exited",
    "generated_tokens": "tokens generated, every completion together",
    "elapsed_s": "seconds the generation took (prefill and decode; loading the model not included)",
    "output_tokens_per_s": "generated_tokens / elapsed_s",
    "cpu_threads": "torch CPU threads (--cpu-threads; docs/configuration.md)",
}


def logprob_rows(token_ids: list[int], entries: list | None, k: int | None) -> list[dict | None] | None:
    """One JSON-ready row per token: its id, text, logprob and rank, and the top ``k`` ranked
    (``None`` where a position has no logprob: the first prompt token)."""
    if entries is None or k is None:
        return None
    rows: list[dict | None] = []
    for tid, entry in zip(token_ids, entries):
        if not entry:
            rows.append(None)
            continue
        lp = entry[tid]
        ranked = sorted((v.rank, t, v) for t, v in entry.items() if v.rank is not None and v.rank <= k)
        rows.append({"token_id": tid, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank,
                     "top": [{"token_id": t, "token": v.decoded_token, "logprob": v.logprob, "rank": r}
                             for r, t, v in ranked]})
    return rows


def format_logprob_rows(rows: list[dict | None]) -> str:
    """The text-mode table of :func:`logprob_rows`: one line per token, its top entries after ``|``."""
    lines = []
    for row in rows:
        if row is None:
            lines.append("  (first prompt token: no logprob)")
            continue
        top = ", ".join(f"{t['token_id']} {t['token']!r} {t['logprob']:.3f}" for t in row["top"])
        rank = "-" if row["rank"] is None else row["rank"]
        lines.append(f"  {row['token_id']:>6} {row['token']!r:<12} {row['logprob']:8.3f} {rank:>6}"
                     + (f" | {top}" if top else ""))
    return "\n".join(lines)


GENERATE_HELP = "generate text offline (default model: the bundled demo model)"
DEFAULT_PROMPT = "def fibonacci(n):"  # the demo model knows Python source code, and little else
DEMO_NOTICE = ("note: no --model given, so this is loopline's bundled demo model (5.5M parameters, trained on the "
               "Python source of the standard library and twelve packages; see "
               "loopline/models/demo_ouro/MODEL_CARD.md). Real Ouro weights load from "
               "a local directory: loopline generate --model /path/to/Ouro-1.4B")

# name -> (help, builder of the full sub-parser)
COMMANDS = {
    "generate": (GENERATE_HELP, _add_generate),
    "serve": (serve_cli.HELP, serve_cli.add_parser),
    "bench": (bench_cli.HELP, bench_cli.add_parser),
    "train": (train_cli.HELP, train_cli.add_parser),
}


def build_parser(only: str | None = None, lazy: bool = False) -> argparse.ArgumentParser:
    """The ``loopline`` parser. With ``lazy``, only subcommand ``only`` (if any) is built, the others are
    just listed: ``loopline --help`` and ``--version`` then need no torch."""
    parser = ArgumentParser(prog="loopline", description="Inference and serving for looped language models (Ouro).",
                                     epilog="Options of a command: loopline COMMAND --help. Any command takes "
                                            "--config FILE.yaml (its flags as keys; command-line flags win) and --debug.")
    parser.command = only
    parser.add_argument("--version", action="version", version=loopline.__version__)
    sub = parser.add_subparsers(dest="command", metavar="{generate,serve,bench,train}")
    sub.required = True
    for name, (help_text, build) in COMMANDS.items():
        if not lazy or name == only:
            build(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def expand_config(argv: list[str]) -> list[str]:
    """Replaces ``--config FILE.yaml`` with the flags the file holds, right after the subcommand, so
    flags given on the command line (later in ``argv``) win, as with vLLM's ``--config``.

    Keys are flag names without dashes (``max-num-seqs`` or ``max_num_seqs``); ``true`` / ``false``
    give ``--flag`` / ``--no-flag``, lists give several values. ``loopline bench --config NAME``
    (random weights of a model's shapes) is left alone unless NAME is a ``.yaml`` / ``.yml`` file.
    """
    command = next((j for j, a in enumerate(argv) if a in COMMANDS), None)
    for i, arg in enumerate(argv):
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None
        if path is None or (command is not None and argv[command] == "bench" and not path.endswith((".yaml", ".yml"))):
            continue
        if command is None or i < command:
            raise LooplineError("--config FILE.yaml goes after the command, e.g. loopline serve --config FILE.yaml")
        rest = argv[:i] + argv[i + (1 if "=" in arg else 2):]
        return rest[:command + 1] + _config_flags(path) + rest[command + 1:]
    return argv


_MAX_CONFIG_BYTES = 1 << 20


def _config_flags(path: str) -> list[str]:
    try:
        import yaml
    except ImportError:
        raise LooplineError("--config FILE.yaml needs PyYAML: pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(_MAX_CONFIG_BYTES + 1)
        if len(text) > _MAX_CONFIG_BYTES:
            raise LooplineError(f"--config {path}: more than {_MAX_CONFIG_BYTES:,} characters; a flags file is small")
        # A flags file needs no anchors or aliases; refusing them bounds the work (no "billion laughs").
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise LooplineError(f"--config {path}: YAML aliases (*name) are not allowed in a flags file")
        data = yaml.safe_load(text)
    except UnicodeDecodeError as e:
        raise LooplineError(f"--config {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise LooplineError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise LooplineError(f"--config {path}: invalid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise LooplineError(f"--config {path}: expected a mapping of flag names to values, found {type(data).__name__}")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if key == "config":
            raise LooplineError(f"--config {path}: a config file cannot name another one")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif value is None:
            continue
        elif isinstance(value, list):
            if any(isinstance(v, (list, dict)) for v in value):
                raise LooplineError(f"--config {path}: {key}: expected a list of values, got a nested list or mapping")
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            raise LooplineError(f"--config {path}: {key}: expected a value or a list, got a mapping")
        else:
            flags += [flag, str(value)]
    return flags


def _debug(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("LOOPLINE_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(argv)
        command = next((a for a in argv if a in COMMANDS), None)
        parser = build_parser(only=command, lazy=True)
        ns = parser.parse_args(unswallow(argv, _int_list_flags(parser)))
        return ns.func(ns)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 -- the one place that turns any error into a clean CLI line
        if _debug(argv):
            traceback.print_exc()  # then the same line and status as without --debug
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2


def _int_list_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Flags of every (sub)command in ``parser`` that take one or more integers (``--stop-token-ids 5 6``)."""
    flags: set[str] = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:  # NOTE: argparse has no public walk over actions and subparsers
            if isinstance(action, argparse._SubParsersAction):
                stack += list(action.choices.values())
            elif action.nargs == "+" and action.type is int:
                flags.update(action.option_strings)
    return flags


def unswallow(argv: list[str], int_list_flags: set[str]) -> list[str]:
    """Moves words that follow a list-of-integers flag's integers to the subcommand's positionals (after
    those given before the first flag), so that ``generate --stop-token-ids 5 6 "a prompt"`` reads the prompt as a prompt
    (argparse's ``nargs='+'`` would take it as a third id and fail)."""
    out: list[str] = []
    moved: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            out += argv[i:]
            break
        if word not in int_list_flags:
            out.append(word)
            i += 1
            continue
        j = i + 1
        while j < len(argv) and _is_int(argv[j]):
            j += 1
        k = j
        while k < len(argv) and not argv[k].startswith("-"):
            k += 1  # the words after the ids, up to the next flag: positionals
        moved += argv[j:k]
        out += argv[i:j]
        i = k
    if not moved:
        return out
    at = next((n for n, w in enumerate(out) if not w.startswith("-")), -1) + 1
    while at < len(out) and not out[at].startswith("-"):
        at += 1  # positionals given before the first flag stay first: prompts keep their order
    return out[:at] + moved + out[at:]


def _is_int(word: str) -> bool:
    try:
        int(word)
        return True
    except ValueError:
        return False


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (LooplineError, OSError)):
        return text
    return f"{type(e).__name__}: {text} (an internal error: rerun with --debug or LOOPLINE_DEBUG=1 for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
