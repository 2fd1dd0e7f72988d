"""Malformed update checkpoints (issue #43): each is refused with an error naming the file and the
field, the old weights keep serving, and the update reads tensors one at a time."""
from __future__ import annotations

import json

import pytest
import torch
from reads_testing import count_live_reads

from loopline.models.loader import CheckpointError
from loopline.models.tiny import make_tiny_checkpoint

INDEX = "model.safetensors.index.json"


def _edit_json(path, **changes) -> None:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _set_first_shard(ckpt, value) -> str:
    raw = json.loads((ckpt / INDEX).read_text())
    name = sorted(raw["weight_map"])[0]
    raw["weight_map"][name] = value
    (ckpt / INDEX).write_text(json.dumps(raw))
    return name


def _nested(ckpt) -> None:
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)


def _gen_config_outside(ckpt) -> None:
    outside = ckpt.parent / "elsewhere.json"
    outside.write_text("{}")
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    (ckpt / "generation_config.json").symlink_to(outside)


CASES = {
    "torch_dtype_list": (lambda c: _edit_json(c / "config.json", torch_dtype=["float32"]), r"config.json: torch_dtype="),
    "layer_types_number": (lambda c: _edit_json(c / "config.json", layer_types=5), r"config.json: layer_types="),
    "weight_map_list": (lambda c: _set_first_shard(c, ["a.safetensors"]), rf"{INDEX}: weight_map\['.*'\] is \["),
    "weight_map_number": (lambda c: _set_first_shard(c, 3), rf"{INDEX}: weight_map\['.*'\] is 3"),
    "weight_map_null": (lambda c: _set_first_shard(c, None), rf"{INDEX}: weight_map\['.*'\] is None"),
    "nested_100k": (_nested, r"config.json: invalid JSON \(nested too deeply\)"),
    "generation_config_symlink_out": (_gen_config_outside, r"generation_config.json names a file outside"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_update_checkpoint_is_named_and_changes_nothing(tiny_gqa, engine_for, tmp_path, case):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, shards=2)
    spoil, message = CASES[case]
    spoil(ckpt)
    engine = engine_for(tiny_gqa)
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    with pytest.raises(CheckpointError, match=message):
        engine.update_weights_from_disk(str(ckpt), 1)
    assert not engine.weights.broken and not engine.weights.in_progress and engine.get_weight_version() == 0
    assert all(torch.equal(p, params[n]) for n, p in engine.model.named_parameters())


def test_disk_update_holds_one_tensor_at_a_time(tiny_gqa, engine_for, tmp_path, monkeypatch):
    """Each tensor read from the checkpoint is dropped before the next is read (a shard-at-a-time
    read held a whole shard: every earlier tensor of it was still alive)."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, shards=1)
    engine = engine_for(tiny_gqa)
    seen = count_live_reads(monkeypatch)
    assert engine.update_weights_from_disk(str(ckpt), 1) == 1
    n = len(engine.weights.names)
    assert seen.reads == 2 * n  # a dry run, then the copy: each tensor read twice, one by one
    assert seen.most <= 1, f"{seen.most} earlier tensors still held when the next was read"
