"""Checkpoint files that are too big, malformed in type, or nested without end are refused with a
CheckpointError naming the file and the field, before they cost memory or time (issue #43)."""
from __future__ import annotations

import json
import logging
import shutil
import time

import pytest

from loopline import LLM
from loopline.models.loader import (MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, CheckpointError, load_config, load_model,
                                    load_tokenizer)
from loopline.models.tiny import default_checkpoint, make_tiny_checkpoint


@pytest.fixture
def demo(tmp_path):
    d = tmp_path / "demo"
    shutil.copytree(default_checkpoint(), d)
    return d


def _edit(path, **changes):
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_an_oversized_config_is_refused_before_it_is_read(demo):
    with open(demo / "config.json", "r+b") as f:
        f.truncate(1_500_000_000)  # sparse: no disk used, but a whole read would take 1.5 GB (and 3 as str)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"config.json: 1,500,000,000 bytes.*{MAX_JSON_BYTES:,}"):
        load_config(demo)
    assert time.perf_counter() - t0 < 1.0


def test_json_nested_without_end_is_refused(demo):
    (demo / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="config.json: invalid JSON"):
        load_config(demo)


@pytest.mark.parametrize("field,value", [("torch_dtype", ["float32"]), ("layer_types", 5),
                                         ("layer_types", [1, 2]), ("torch_dtype", {"a": 1})])
def test_config_fields_of_the_wrong_type_are_named(demo, field, value):
    _edit(demo / "config.json", **{field: value})
    with pytest.raises(CheckpointError, match=rf"config.json: {field}="):
        load_config(demo)


@pytest.mark.parametrize("field,value", [("torch_dtype", ["float32"]), ("layer_types", 5)])
def test_the_cli_names_the_file_and_field_of_a_config_of_the_wrong_type(demo, field, value, capsys):
    from loopline.entrypoints.cli import main

    _edit(demo / "config.json", **{field: value})
    assert main(["generate", "--model", str(demo), "--max-tokens", "1", "hi"]) != 0
    err = capsys.readouterr().err
    assert f"config.json: {field}=" in err and "internal error" not in err, err


@pytest.mark.parametrize("shard", [["a.safetensors"], 3, None, ""])
def test_index_shard_names_of_the_wrong_type_are_named(tmp_path, shard):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=1, shards=2)
    index = ckpt / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name = next(iter(raw["weight_map"]))
    raw["weight_map"][name] = shard
    index.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=rf"weight_map\['{name}'\]"):
        load_model(ckpt)


def test_generation_config_top_k_above_the_vocabulary_is_refused_at_start(demo):
    _edit(demo / "generation_config.json", top_k=100_000)
    with pytest.raises(CheckpointError, match=r"generation_config.json: top_k=100000 is above the model's vocabulary"):
        LLM(model=str(demo))


def test_generation_config_max_new_tokens_beyond_the_context_is_dropped(demo, caplog):
    _edit(demo / "generation_config.json", max_new_tokens=10**6)
    with caplog.at_level(logging.WARNING, logger="loopline"):
        llm = LLM(model=str(demo), max_model_len=128)
    assert "max_new_tokens=1000000" in caplog.text
    assert "max_tokens" not in llm.llm_engine.sampling_defaults
    out = llm.generate(["def f(x):"], use_tqdm=False)[0]  # the model's defaults (no SamplingParams)
    assert 0 < len(out.outputs[0].token_ids) <= 128 - len(out.prompt_token_ids)  # not a CapacityError


@pytest.mark.parametrize("name,limit", [("tokenizer.json", MAX_TOKENIZER_BYTES),
                                        ("tokenizer_config.json", MAX_JSON_BYTES),
                                        ("special_tokens_map.json", MAX_JSON_BYTES),
                                        ("chat_template.jinja", MAX_JSON_BYTES)])
def test_an_oversized_tokenizer_file_is_refused_before_it_is_parsed(demo, name, limit):
    import os

    with open(demo / name, "ab") as f:  # sparse: gigabytes on paper, nothing on disk
        os.truncate(f.fileno(), limit + 1)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"{name}: {limit + 1:,} bytes; a tokenizer's {name} may hold at most"):
        load_tokenizer(demo)
    assert time.monotonic() - t0 < 1
    if name == "tokenizer.json":  # also given as the file itself
        with pytest.raises(CheckpointError, match="may hold at most"):
            load_tokenizer(demo / name)
