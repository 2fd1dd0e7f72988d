"""``loopline`` answers help, usage errors and a missing model directory without importing torch
(issue #45: these took ~2 s and ~650 MB when every parser pulled in torch through EngineArgs)."""
from __future__ import annotations

import subprocess
import sys

import pytest

# Runs the CLI in a fresh interpreter and reports, after it returns, whether torch was imported.
_PROBE = """
import sys
from loopline.entrypoints.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(f"rc={rc} torch={'torch' in sys.modules}", file=sys.stderr)
"""


def _probe(*argv: str) -> tuple[int, str, str]:
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    *err, last = r.stderr.rstrip("\n").split("\n")
    return r.returncode, r.stdout, "\n".join(err) + "\n" + last


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "train"])
def test_help_needs_no_torch(command):
    rc, out, err = _probe(command, "--help")
    assert rc == 0 and err.endswith("rc=0 torch=False"), err
    assert out.startswith(f"usage: loopline {command}")
    assert ("--cpu-threads N" in out) == (command != "train")  # train has its own --threads


@pytest.mark.parametrize("argv, message", [
    (["generate", "--bogus"], "error: loopline: unrecognized arguments: --bogus"),
    (["serve", "--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    (["generate", "hi", "--model", "/nonexistent/ouro"], "error: --model /nonexistent/ouro: no such directory"),
    (["serve", "--model", "/nonexistent/ouro"], "error: --model /nonexistent/ouro: no such directory"),
    (["serve", "ByteDance/Ouro-1.4B"], "hf download ByteDance/Ouro-1.4B --local-dir ./Ouro-1.4B"),
    (["generate", "--tokenizer", __file__], f"error: --tokenizer {__file__}: not a directory"),
    (["serve", "--cpu-threads", "0"], "argument --cpu-threads: expected an integer >= 1, got 0"),
])
def test_usage_errors_and_missing_model_need_no_torch(argv, message):
    rc, out, err = _probe(*argv)
    assert out == "" and message in err, err
    assert err.endswith("rc=2 torch=False"), err


def test_model_default_fields_match_the_loader():
    from loopline.entrypoints.cli_args import MODEL_DEFAULT_FIELDS
    from loopline.models.loader import SAMPLING_DEFAULT_KEYS

    assert sorted(MODEL_DEFAULT_FIELDS) == sorted(SAMPLING_DEFAULT_KEYS.values())
