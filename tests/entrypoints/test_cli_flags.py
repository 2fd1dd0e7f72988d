"""Usage details of the ``loopline`` command from issue #45: list flags leave the prompts alone (in
order), conflicting loop bounds are named, ``--debug`` keeps exit status 2, and a layout that cannot
cache prefixes says so. None of these load a model."""
from __future__ import annotations

import logging

import pytest

from loopline.entrypoints.cli import _int_list_flags, build_parser, main, unswallow


def _parse(*argv: str):
    parser = build_parser(only=argv[0], lazy=True)
    return parser.parse_args(unswallow(list(argv), _int_list_flags(parser)))


@pytest.mark.parametrize("argv, prompts, stop_ids, depths", [
    (["--stop-token-ids", "5", "6", "a prompt"], ["a prompt"], [5, 6], None),
    (["--exit-mode", "trace", "--exit-depths", "1", "2", "hello", "--max-tokens", "3"], ["hello"], None, [1, 2]),
    (["first", "--stop-token-ids", "5", "second"], ["first", "second"], [5], None),  # order kept
    (["--stop-token-ids", "5", "a", "--exit-depths", "3", "b"], ["a", "b"], [5], [3]),
    (["--stop-token-ids", "5", "--", "7"], ["7"], [5], None),  # after --, a number is a prompt
])
def test_int_list_flags_do_not_swallow_prompts(argv, prompts, stop_ids, depths):
    ns = _parse("generate", *argv)
    assert (ns.prompts, ns.stop_token_ids, ns.exit_depths) == (prompts, stop_ids, depths)


def test_min_loops_above_max_loops_names_the_conflict(capsys):
    assert main(["generate", "--min-loops", "3", "--max-loops", "2"]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err == "error: max_loops (2) must be >= min_loops (3)\n"


def test_debug_prints_the_traceback_and_still_exits_2(capsys, monkeypatch):
    assert main(["generate", "--min-loops", "3", "--max-loops", "2", "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "InvalidRequestError" in err
    assert err.endswith("\nerror: max_loops (2) must be >= min_loops (3)\n")
    monkeypatch.setenv("LOOPLINE_DEBUG", "1")
    assert main(["generate", "--prompt-file", "/nonexistent/prompts.txt"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("/nonexistent/prompts.txt: No such file or directory\n")


def test_shared_layout_with_prefix_caching_warns(caplog):
    from loopline.config import EngineArgs

    with caplog.at_level(logging.WARNING, logger="loopline"):
        EngineArgs(kv_layout="shared", enable_prefix_caching=True).validate()
    assert "enable_prefix_caching has no effect with kv_layout='shared'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loopline"):
        EngineArgs(kv_layout="last_exited", enable_prefix_caching=True).validate()
    assert caplog.text == ""
