"""``loopline train draft`` (#41): the draft adapter's distillation on the frozen model: KL falls on the
fitting windows, calibration windows of the training split pick each depth's stopping epoch (the plain
coda when nothing carries over), the run is reproducible, and the saved adapter is the engine's format
with the base weights' hash."""
from __future__ import annotations

import json

import pytest
import torch

from loopline.entrypoints.cli import main
from loopline.models.loader import load_model
from loopline.models.tiny import default_checkpoint
from loopline.spec.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    base_weights_sha256,
    load_adapter,
)
from loopline.train.draft import collect_states, evaluate, train_adapter
from loopline.train.lookahead import split_stream

# each corpus read once in this module (tests/train/conftest.py::memoized_corpus)
pytestmark = pytest.mark.usefixtures("memoized_corpus")

TINY_RUN = ["--seq-len", "32", "--train-windows", "4", "--calib-windows", "2", "--heldout-windows", "2",
            "--epochs", "2", "--rank", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def model():
    return load_model(default_checkpoint(), dtype=torch.float32).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def train_stream():
    """The bundled model's training split, read once (``split_stream`` scans the corpus: seconds a call)."""
    return split_stream(default_checkpoint(), "train", 12 * 64)


@pytest.fixture(scope="module")
def states(model, train_stream):
    stream = train_stream
    return collect_states(model, stream[:8 * 64], 64, 8), collect_states(model, stream[8 * 64:], 64, 4)


def test_states_are_the_dense_forward(model, states, train_stream):
    fit, _ = states
    assert fit.shape == (8 * 64, 4, 256)
    stream = train_stream  # (its first 64 tokens: split_stream(..., "train", 64)'s, the same documents in order)
    dense = model.forward_dense(torch.tensor([stream[:64]])).hidden_states[:, 0]  # [R, T, H]
    torch.testing.assert_close(fit[:64], dense.permute(1, 0, 2), atol=1e-5, rtol=1e-5)


def test_fitting_lowers_kl_and_is_seeded(model, states):
    fit, _ = states
    a, curve = train_adapter(fit, model.lm_head, [1, 2], rank=8, epochs=3, lr=3e-3)
    before, after = evaluate(fit, model.lm_head, a, [1, 2])["plain"], evaluate(fit, model.lm_head, a, [1, 2])["adapter"]
    assert after["1"]["kl"] < before["1"]["kl"] - 0.005 and after["2"]["kl"] < before["2"]["kl"]
    again, _ = train_adapter(fit, model.lm_head, [1, 2], rank=8, epochs=3, lr=3e-3)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), again.tensors().values()))
    assert [p["epoch"] for p in curve] == [0, 1, 2, 3]


def test_calibration_keeps_the_plain_coda_when_fitting_hurts(model, states):
    fit, calib = states
    a, curve = train_adapter(fit, model.lm_head, [1], calib=calib, rank=8, epochs=2, lr=1.0)  # diverges
    assert curve[-1]["calib_kl_d1"] > curve[0]["calib_kl_d1"]
    t = a.tensors()
    assert torch.equal(t["d1.scale"], torch.ones(256)) and torch.equal(t["d1.up"], torch.zeros(256, 8))
    plain = evaluate(calib, model.lm_head, a, [1])
    assert plain["adapter"]["1"] == plain["plain"]["1"]


def _cli_run(tmp_path, name: str):
    out, report = tmp_path / name, tmp_path / f"{name}.json"
    assert main(["train", "draft", "--out", str(out), "--report", str(report), "--depths", "1,3", *TINY_RUN]) == 0
    return out, json.loads(report.read_text())


def test_cli_trains_saves_and_reports(tmp_path, capsys):
    assert main(["train", "draft"]) == 2
    assert "--out is required" in capsys.readouterr().err
    assert main(["train", "draft", "--out", str(tmp_path / "x"), "--depths", "0,4"]) == 2
    assert "depths=[0, 4]; allowed: draft depths in 1..3" in capsys.readouterr().err
    a, ra = _cli_run(tmp_path, "a")
    assert ra["heldout"]["positions"] == 64
    assert set(ra["heldout"]["plain"]) == set(ra["heldout"]["adapter"]) == {"1", "3"}
    cfg = json.loads((a / ADAPTER_CONFIG).read_text())
    assert cfg["format"] == "loopline-draft-adapter/1" and cfg["depths"] == [1, 3]
    assert cfg["base_weights_sha256"] == base_weights_sha256(default_checkpoint())
    adapter, _ = load_adapter(a, 256, 4, base_sha256=base_weights_sha256(default_checkpoint()))
    assert adapter.depths == [1, 3] and adapter.rank == 4


@pytest.mark.slow  # two more CLI runs (~9 s each on 2 cores); default run: test_fitting_lowers_kl_and_is_seeded
# fits twice with one seed and gets the same adapter, test_cli_trains_saves_and_reports runs the command once
def test_cli_runs_are_reproducible(tmp_path):
    (a, ra), (b, rb) = _cli_run(tmp_path, "a"), _cli_run(tmp_path, "b")
    assert (a / ADAPTER_FILE).read_bytes() == (b / ADAPTER_FILE).read_bytes()  # one seed, one adapter
    assert ra["heldout"] == rb["heldout"] and ra["heldout"]["positions"] == 64
