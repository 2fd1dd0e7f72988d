"""The ``loopline`` command as a user runs it: output, logprobs, errors, --version, --config."""
from __future__ import annotations

import json

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
