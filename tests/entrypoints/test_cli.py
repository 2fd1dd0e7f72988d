"""The ``loopline`` command as a user runs it: output, logprobs, errors, --version, --config."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loopline.entrypoints.cli import main


def _generate(tiny, capsys, *extra: str) -> str:
    rc = main(["generate", "The cat sat", "--model", str(tiny.path), "--device", "cpu", "--dtype", "float32",
               "--max-tokens", "3", "--sampling-seed", "1", *extra])
    assert rc == 0
    return capsys.readouterr().out


def test_generate_json_prints_logprobs_and_prompt_logprobs(tiny_gqa, capsys):
    rec = json.loads(_generate(tiny_gqa, capsys, "--logprobs", "2", "--prompt-logprobs", "1", "--json"))
    assert len(rec["logprobs"]) == 3
    for tid, row in zip(rec["token_ids"], rec["logprobs"]):
        assert row["token_id"] == tid and row["logprob"] <= 0 and row["rank"] >= 1
        assert [t["rank"] for t in row["top"]] == [1, 2]
        assert row["top"][0]["logprob"] >= row["top"][1]["logprob"]
    assert sum(r["logprob"] for r in rec["logprobs"]) == pytest.approx(rec["cumulative_logprob"], abs=1e-4)
    prompt = rec["prompt_logprobs"]
    assert len(prompt) == 5 and prompt[0] is None
    assert [r["token"] for r in prompt[1:]] == [" c", "at", " s", "at"] and all(len(r["top"]) == 1 for r in prompt[1:])


def test_generate_text_prints_logprob_tables(tiny_gqa, capsys):
    out = _generate(tiny_gqa, capsys, "--logprobs", "1", "--prompt-logprobs", "0")
    assert "prompt logprobs (id, token, logprob, rank" in out and "logprobs (id, token, logprob, rank" in out
    assert "(first prompt token: no logprob)" in out
    assert "' c'" in out  # a prompt token's text


def test_generate_without_logprobs_prints_none(tiny_gqa, capsys):
    out = _generate(tiny_gqa, capsys, "--json")
    assert "logprobs" not in json.loads(out)


def test_generate_prints_the_text_the_loop_settings_and_a_stats_legend(tiny_gqa, capsys):
    from loopline.entrypoints.cli import STATS_LEGEND

    rec = json.loads(_generate(tiny_gqa, capsys, "--json", "--temperature", "0"))
    out = _generate(tiny_gqa, capsys, "--temperature", "0", "--stats")
    depths = " ".join(map(str, rec["exit_depths"]))
    # the text as generated, not its repr, between the prompt and a line about the completion
    assert out.startswith(f"prompt: The cat sat\ncompletion:\n{rec['text']}\n[3 tokens, finish: length; "
                          f"exit depth per token: {depths} (mean ")
    stats_line, *legend = out.split("stats: ", 1)[1].strip().split("\n")
    keys = [item.split("=")[0] for item in stats_line.split(", ")]
    assert keys == list(STATS_LEGEND) and [line.split()[0] for line in legend] == keys
    # where the loop budget and threshold came from: the checkpoint, then the flags
    cfg = json.loads((tiny_gqa.path / "config.json").read_text())
    assert main(["generate", "x", "--model", str(tiny_gqa.path), "--device", "cpu", "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert f"at most {cfg['total_ut_steps']} (total_ut_steps in {tiny_gqa.path}/config.json), at least 1" in err
    assert f"reaches {float(cfg.get('early_exit_threshold', 1.0))} (early_exit_threshold in {tiny_gqa.path}/config.json)" in err
    assert main(["generate", "x", "--model", str(tiny_gqa.path), "--device", "cpu", "--max-tokens", "1",
                 "--max-loops", "2", "--exit-threshold", "0.4"]) == 0
    err = capsys.readouterr().err
    assert "at most 2 (--max-loops)" in err and "reaches 0.4 (--exit-threshold)" in err


# --- conventions: --version, lazy imports, one-line errors, --config -------------------------------
def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loopline.entrypoints.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_version_and_help_do_not_import_torch():
    import loopline

    code = ("import sys, contextlib, io\nfrom loopline.entrypoints.cli import main\n"
            "for argv in (['--version'], ['--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        try: main(argv)\n"
            "        except SystemExit as e: assert e.code == 0\n"
            "    print(out.getvalue().splitlines()[0])\n"
            "print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr
    assert lines[0] == loopline.__version__ and lines[1].startswith("usage: loopline") and lines[2] == "False"


def test_python_dash_m_loopline_is_the_command():
    import loopline

    r = subprocess.run([sys.executable, "-m", "loopline", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == loopline.__version__, r.stderr


def test_errors_are_one_line_with_exit_2_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    from loopline.errors import InvalidRequestError

    # one real process: the exit status and streams as a shell sees them
    r = _run("generate", "x", "--model", "ByteDance/Ouro-1.4B")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: --model ByteDance/Ouro-1.4B: no such directory")
    assert "hf download ByteDance/Ouro-1.4B" in r.stderr
    # the rest in process (each process start costs seconds): --debug and LOOPLINE_DEBUG add the traceback
    capsys.readouterr()
    assert main(["generate", "x", "--model", str(tmp_path / "missing"), "--debug"]) == 2
    assert f"{InvalidRequestError.__name__}: --model {tmp_path / 'missing'}" in capsys.readouterr().err
    monkeypatch.setenv("LOOPLINE_DEBUG", "1")
    assert main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.delenv("LOOPLINE_DEBUG")
    assert main(["generate", "--prompt-file", str(tmp_path / "none.txt")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "none.txt" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--bogus"], "unrecognized arguments: --bogus"),
    (["generate", "--kv-layout", "nope"], "argument --kv-layout: invalid choice: 'nope'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "serve", "--timeout", "-1"], "argument --timeout: expected a number > 0"),
])
def test_usage_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_bad_option_values_exit_2_naming_the_field(capsys):
    assert main(["generate", "x", "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: max_tokens must be") and err.count("\n") == 1


def test_config_yaml_gives_flags_and_the_command_line_wins(tmp_path, tiny_gqa, capsys):
    from loopline.entrypoints.cli import build_parser, expand_config

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9001\nmax_num_seqs: 3\nkv-layout: shared\nenable-prefix-caching: true\n"
                   "served-model-name: [a, b]\nreturn_tokens_as_token_ids: true\n")
    argv = expand_config(["serve", "--config", str(cfg), "--port", "9002"])
    ns = build_parser().parse_args(argv)
    assert (ns.port, ns.max_num_seqs, ns.kv_layout, ns.enable_prefix_caching) == (9002, 3, "shared", True)
    assert ns.served_model_name == ["a", "b"] and ns.return_tokens_as_token_ids
    # generate end to end, with a value the command line overrides
    gen = tmp_path / "gen.yaml"
    gen.write_text(f"model: {tiny_gqa.path}\ndevice: cpu\ndtype: float32\nmax-tokens: 7\njson: true\n")
    assert main(["generate", "hi", f"--config={gen}", "--max-tokens", "2", "--sampling-seed", "0"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2


@pytest.mark.parametrize("text, message", [
    ("- a\n- b\n", "expected a mapping"),
    ("port: [\n", "invalid YAML"),
    ("no-such-flag: 1\n", "unrecognized arguments: --no-such-flag"),
])
def test_bad_config_files(tmp_path, capsys, text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    try:
        rc = main(["serve", "--config", str(cfg)])
    except SystemExit as e:  # argparse's own error (usage + message)
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err


def test_bench_config_keeps_model_shape_names():
    from loopline.entrypoints.cli import expand_config

    assert expand_config(["bench", "--config", "ouro-1.4b"]) == ["bench", "--config", "ouro-1.4b"]


def test_sampling_flags_have_help_and_no_default_none():
    from loopline.entrypoints.cli import build_parser

    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    help_text = gen.format_help()
    assert "(default: None)" not in help_text and "(default: False)" not in help_text
    sampling = next(g for g in gen._action_groups if g.title == "sampling")
    assert all(a.help for a in sampling._group_actions)
    flat = " ".join(help_text.split())
    assert "--temperature TEMPERATURE" in help_text and "(default: the model's generation_config.json, else 1.0)" in flat
    assert "come from it (default: 0)" in flat and "vLLM's default) (default: 256)" in flat  # 0 is a default too
    assert "the model's max_position_embeddings) (default" not in flat  # a help that names its default keeps it


def test_user_guide_shows_the_stats_legend_as_printed():
    from pathlib import Path

    from loopline.entrypoints.cli import STATS_LEGEND

    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text()
    assert [k for k, v in STATS_LEGEND.items() if f"\n  {k:<20} {v}\n" not in guide] == []
