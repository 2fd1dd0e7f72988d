"""Every CLI error names the flag, key or file it is about, and bad values fail before a model loads (issue #43)."""
from __future__ import annotations

import json

import pytest

from loopline.entrypoints.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--port", "70000"], "argument --port: expected a port in [0, 65535], got 70000"),
    (["bench", "serve", "--timeout", "-1", "--base-url", "http://127.0.0.1:1"], "argument --timeout: expected a number > 0"),
    (["train", "pretrain", "--out", "OUT", "--threads", "-1"], "argument --threads: expected an integer >= 1, got -1"),
    (["train", "curve", "--seq-len", "0"], "argument --seq-len: expected an integer >= 1, got 0"),
])
def test_bad_flag_values_are_usage_errors_naming_the_flag(argv, needle, capsys, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_prompt_file_that_is_not_text_is_named(tmp_path, capsys):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"\xff\xfe not utf-8")
    assert main(["generate", "--prompt-file", str(bad)]) != 0
    err = capsys.readouterr().err
    assert f"--prompt-file {bad}: not UTF-8 text" in err and "internal error" not in err
    assert main(["generate", "--prompt-file", str(tmp_path / "missing.txt")]) != 0
    assert "--prompt-file" in capsys.readouterr().err


@pytest.mark.parametrize("sets,needle", [
    (["model.num_attention_heads=0"], "TrainConfig.model.num_attention_heads=0; allowed: >= 1"),
    (["model.num_hidden_layers=abc"], "TrainConfig.model.num_hidden_layers='abc'; allowed: an integer"),
    (["model.hidden_size=1000000000"], "parameters"),
    (["model=3"], "TrainConfig.model must be an object"),
    (["lr=true"], "TrainConfig.lr=True; allowed: a number"),
    (["seed=1.5"], "TrainConfig.seed=1.5; allowed: an integer"),
    (["betas=[1]"], "TrainConfig.betas"),
    (["nonsense=3"], "unknown field(s) ['nonsense']"),
])
def test_train_set_values_of_the_wrong_type_or_size_are_named(sets, needle, tmp_path, capsys):
    argv = ["train", "pretrain", "--out", str(tmp_path / "out")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert needle in err and "internal error" not in err
    assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.parametrize("content,needle", [(b"\xff\xfe", "not UTF-8 text"), (b"{bad", "invalid JSON"),
                                            (b"[1, 2]", "expected a JSON object"),
                                            (json.dumps({"model": {"head_dim": 3}}).encode(), "head_dim=3")])
def test_train_config_file_errors_are_named(content, needle, tmp_path, capsys):
    f = tmp_path / "cfg.json"
    f.write_bytes(content)
    assert main(["train", "pretrain", "--out", str(tmp_path / "out"), "--config-file", str(f)]) != 0
    err = capsys.readouterr().err
    assert needle in err and "internal error" not in err


@pytest.mark.parametrize("content,needle", [
    (b"a: &a [x, x, x]\nb: &b [*a, *a, *a]\nc: &c [*b, *b, *b]\nmax-tokens: *c\n", "aliases"),
    (b"max-tokens: [[1, 2]]\n", "nested list"),
    (b"x" * (2 << 20), "more than"),
    (b"max-tokens: \xff\n", "not UTF-8"),
])
def test_yaml_config_files_are_bounded(content, needle, tmp_path, capsys):
    f = tmp_path / "flags.yaml"
    f.write_bytes(content)
    assert main(["generate", "--config", str(f)]) != 0
    err = capsys.readouterr().err
    assert needle in err and "internal error" not in err


def test_list_flags_leave_the_prompt_alone(tiny_gqa, capsys):
    from loopline.entrypoints.cli import unswallow

    flags = {"--stop-token-ids", "--exit-depths"}
    assert unswallow(["generate", "--stop-token-ids", "5", "6", "hi there", "--max-tokens", "3"], flags) == \
        ["generate", "hi there", "--stop-token-ids", "5", "6", "--max-tokens", "3"]
    assert unswallow(["generate", "a", "--exit-depths", "2", "--", "-b"], flags) == \
        ["generate", "a", "--exit-depths", "2", "--", "-b"]
    rc = main(["generate", "--model", str(tiny_gqa.path), "--device", "cpu", "--dtype", "float32", "--json",
               "--stop-token-ids", "1", "2", "The cat", "--max-tokens", "2", "--exit-depths", "2", "3", "The dog",
               "--exit-mode", "trace"])
    assert rc == 0
    prompts = [json.loads(line)["prompt"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert prompts == ["The cat", "The dog"]


def test_bench_serve_fails_up_front_without_a_server(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "no server answers at http://127.0.0.1:9" in err and "internal error" not in err


def test_prefix_caching_with_the_shared_layout_warns(caplog):
    import logging

    from loopline.config import EngineArgs

    with caplog.at_level(logging.WARNING, logger="loopline"):
        EngineArgs(kv_layout="shared", enable_prefix_caching=True).validate()
    assert "enable_prefix_caching has no effect with kv_layout='shared'" in caplog.text


@pytest.mark.parametrize("argv,needle", [(["--top-p", "1.5"], "top_p"), (["--temperature", "-0.5"], "temperature")])
def test_bench_sampling_flags_fail_before_any_load(argv, needle, capsys):
    """`bench serve` checks its requests' sampling before it looks for a server (the port answers nothing)."""
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "no server answers" not in err and "internal error" not in err
