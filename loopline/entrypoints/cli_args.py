"""What every ``loopline`` subcommand's parser shares: the help formatter, the common options and
the sampling flags (from :class:`SamplingParams`, so the CLI and the Python API share one definition).
Imported by ``cli.py`` and each subcommand's module; it imports none of them."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

SAMPLING_RENAMES = {"seed": "sampling_seed"}  # --seed is the engine's
# The SamplingParams fields a model's generation_config.json may default: the values of
# loopline.models.loader.SAMPLING_DEFAULT_KEYS (a literal: the loader imports torch; a test keeps them equal).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")

# Help of each sampling flag (the SamplingParams fields; docs/configuration.md says the same).
SAMPLING_HELP = {
    "n": "completions per prompt (completion i uses seed + i)",
    "max_tokens": "tokens to generate at most",
    "temperature": "sampling temperature; 0 is greedy",
    "top_p": "nucleus sampling: keep the most likely tokens whose probabilities sum to top_p",
    "top_k": "keep the k most likely tokens (0 or -1: off)",
    "min_p": "drop tokens whose probability is below min_p times the top token's",
    "seed": "request seed (unset: drawn from the engine's --seed and printed with --json)",
    "stop": "stop at this string (repeat the flag for several)",
    "stop_token_ids": "also stop at these token ids",
    "ignore_eos": "do not stop at end-of-sequence",
    "logprobs": "print each generated token's logprob and rank with the top K (K <= --max-logprobs)",
    "prompt_logprobs": "print each prompt token's logprob and rank with the top K (the first token has none)",
    "presence_penalty": "subtract this from the logits of tokens already generated, in [-2, 2]",
    "frequency_penalty": "subtract this times the count of each generated token from its logit, in [-2, 2]",
    "repetition_penalty": "divide positive (multiply negative) logits of tokens already seen (> 0; 1: off)",
    "skip_special_tokens": "leave special tokens out of the text",
    "include_stop_str_in_output": "keep the matched stop string at the end of the text",
    "detokenize": "decode tokens to text",
    "priority": "admission priority with --scheduling-policy priority (lower runs first)",
    "min_loops": "a generated token runs at least this many loops",
    "max_loops": "a generated token runs at most this many loops (unset: the checkpoint's total_ut_steps)",
    "exit_threshold": "exit after the loop where the cumulative exit probability reaches this "
                      "(unset: the checkpoint's early_exit_threshold; 1.0 = fixed depth)",
    "exit_depths": "per-token exit depths replayed with --exit-mode trace (the last value repeats)",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only where there is a default to tell and the help does not name one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # NOTE: identity, not ==: a default of 0 equals False but is worth telling.
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if unset or "default:" in text or "(default" in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


def add_sampling_args(parser: Any) -> None:
    from loopline.config import add_dataclass_args
    from loopline.sampling_params import SamplingParams

    group = parser.add_argument_group("sampling")
    add_dataclass_args(group, SamplingParams, rename=SAMPLING_RENAMES)
    names = {SAMPLING_RENAMES.get(k, k): k for k in SAMPLING_HELP}
    for action in group._group_actions:
        action.help = SAMPLING_HELP[names[action.dest]]
        if names[action.dest] in MODEL_DEFAULT_FIELDS:  # unset: the model's default (sampling_from_ns)
            fallback = "" if action.default is None else f", else {action.default}"
            action.help += f" (default: the model's generation_config.json{fallback})"
            action.default = None


def sampling_from_ns(ns: argparse.Namespace, defaults: dict[str, Any] | None = None) -> Any:
    """The request's SamplingParams from the flags; ``defaults`` (the model's generation_config
    defaults) fill the fields whose flags were not given."""
    from loopline.sampling_params import SamplingParams

    kwargs = {}
    for f in dataclasses.fields(SamplingParams):
        dest = SAMPLING_RENAMES.get(f.name, f.name)
        # (fields marked cli=False have no flag of their own: a namesake, e.g. the engine's --exit-mode, is not theirs)
        if f.name != "extra" and f.metadata.get("cli", True) and hasattr(ns, dest):
            value = getattr(ns, dest)
            if value is None and f.name in MODEL_DEFAULT_FIELDS:
                value = (defaults or {}).get(f.name, f.default)
            kwargs[f.name] = value
    return SamplingParams(**kwargs)


def common_parser(config: bool = True) -> argparse.ArgumentParser:
    """Options every subcommand takes: ``--debug``, and ``--config FILE.yaml`` (listed for ``--help``;
    :func:`expand_config` replaces it before parsing)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("command")
    if config:
        g.add_argument("--config", metavar="FILE.yaml", help="read flags from a YAML file (keys: flag names; "
                                                            "flags on the command line win)")
    g.add_argument("--debug", action="store_true", help="print the traceback of an error (env LOOPLINE_DEBUG=1)")
    return p


def _number_type(kind: type, lo: float | None, hi: float | None, what: str):
    """An argparse ``type`` that parses ``kind`` and checks ``lo <= value <= hi``; argparse names the flag."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    parse.__name__ = what  # argparse's own messages print a type's name
    return parse


positive_int = _number_type(int, 1, None, "an integer >= 1")
port_number = _number_type(int, 0, 65535, "a port in [0, 65535]")
positive_float = _number_type(float, 1e-9, None, "a number > 0")


def read_text_file(path: str, flag: str) -> str:
    """A text file a flag names, as UTF-8; any failure says which flag and file, not an internal error."""
    from loopline.errors import InvalidRequestError

    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"{flag} {path}: not UTF-8 text (byte {e.start}: {e.reason})", param=flag) from None
    except OSError as e:
        raise InvalidRequestError(f"{flag} {path}: {e.strerror or e}", param=flag) from None


def check_model_dir(path: str | None, flag: str = "--model") -> None:
    """Refuses a model path that is not a directory before anything heavy loads (the loader says the
    same, but only after torch and the engine have been imported: seconds for a typo)."""
    from loopline.errors import InvalidRequestError

    if path is None or os.path.isdir(path):
        return
    if os.path.exists(path):
        raise InvalidRequestError(f"{flag} {path}: not a directory (a checkpoint is a directory)", param=flag)
    hub = "/" in path and not os.path.isabs(path) and path.count("/") == 1 and not path.startswith(".")
    fetch = (f"`hf download {path} --local-dir ./{path.split('/')[1]}`" if hub
             else "`hf download <repo> --local-dir <dir>`")
    raise InvalidRequestError(f"{flag} {path}: no such directory (loopline loads local checkpoint directories "
                              f"only and never downloads: fetch the weights first, e.g. with {fetch})", param=flag)


# --- CPU threads -----------------------------------------------------------------------------------------
CPU_THREADS_HELP = ("torch CPU threads (intra-op) of this process and its engine processes; default: "
                    "OMP_NUM_THREADS when it is set, else one less than the CPUs this process may use (at least 1): "
                    "a thread team as large as the machine stalls whenever another process takes a core "
                    "(docs/configuration.md, 'CPU threads')")


def add_cpu_threads_arg(parser: Any) -> None:
    """``--cpu-threads N`` (generate, serve and the offline bench)."""
    parser.add_argument("--cpu-threads", type=positive_int, default=None, metavar="N", help=CPU_THREADS_HELP)


def default_cpu_threads(physical_cores: int, usable_cpus: int | None = None) -> int:
    """The thread count without a flag or OMP_NUM_THREADS: one less than the CPUs this process may run on,
    at most ``physical_cores`` (torch's own default), at least 1.

    NOTE: torch's default (every physical core) collapsed on a busy 2-core machine (docs/benchmarks/
    cpu-2026-12-04-threads.md): each op waits for its slowest thread, and a thread without a core stalls
    them all; the spare core also runs the process's Python side (scheduler, tokenizer, HTTP)."""
    if usable_cpus is None:
        usable_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(physical_cores, usable_cpus - 1))


def apply_cpu_threads(requested: int | None) -> int:
    """Sets torch's thread count by precedence: ``--cpu-threads``, else ``OMP_NUM_THREADS`` (torch has
    read it already), else :func:`default_cpu_threads`. Returns the count in use. Engine processes
    started later inherit it (``MPClient`` passes ``torch.get_num_threads()``)."""
    import torch  # only a command that runs an engine gets here

    if requested is None and os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()
    threads = requested or default_cpu_threads(torch.get_num_threads())
    torch.set_num_threads(threads)
    return threads
