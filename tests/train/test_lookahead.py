"""Lookahead exits (#44): traces equal the dense model, the policy replays the stock gate with an oracle,
the head learns something and round-trips, and ``loopline train lookahead`` runs end to end."""
from __future__ import annotations

import json
import math

import pytest
import torch

from loopline.entrypoints.cli import main
from loopline.models.tiny import default_checkpoint
from loopline.train import lookahead as la

# each corpus read once in this module (tests/train/conftest.py::memoized_corpus)
pytestmark = pytest.mark.usefixtures("memoized_corpus")

SPEC = la.TraceSpec(proj_dim=8, seq_len=48)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Traces of the bundled model: 6 held-out windows (3 shards), 32 training windows and 8 calibration windows."""
    model = default_checkpoint()
    root = tmp_path_factory.mktemp("traces")
    held = la.split_stream(model, "heldout", 6 * SPEC.seq_len + 1)
    train = la.split_stream(model, "train", 40 * SPEC.seq_len + 1)
    meta = la.collect_traces(model, held, root / "held", spec=SPEC, max_windows=6, batch=2, split="heldout")
    la.collect_traces(model, train, root / "train", spec=SPEC, max_windows=32, batch=16, split="train")
    la.collect_traces(model, train[32 * SPEC.seq_len:], root / "calib", spec=SPEC, max_windows=8, split="calib")
    return {"meta": meta, "held_stream": held, "root": root, **{k: la.load_traces(root / k)[1] for k in ("held", "train", "calib")}}


def test_traces_equal_the_dense_forward(traces):
    from loopline.models.loader import load_model
    from loopline.train.objective import per_loop_token_loss

    meta, tr = traces["meta"], traces["held"]
    assert meta["format"] == la.TRACE_FORMAT and len(meta["shards"]) == 3 and meta["loops"] == 4
    assert tr["positions"].shape == (6 * SPEC.seq_len,) and tr["hidden_proj"].shape == (6 * SPEC.seq_len, 4, 8)
    model = load_model(default_checkpoint(), dtype=torch.float32, device="cpu").eval()
    stream = torch.tensor(traces["held_stream"][: 6 * SPEC.seq_len + 1])
    ids, targets = stream[:-1].view(6, SPEC.seq_len), stream[1:].view(6, SPEC.seq_len)
    with torch.no_grad():
        out = model.forward_dense(ids, compute_logits=True)
        loss = per_loop_token_loss(model, out.hidden_states, targets)  # [R, B, T]
    assert torch.allclose(tr["gate_logits"], out.gate_logits.flatten(1).T, atol=1e-4)
    assert torch.allclose(tr["loop_loss"], loss.flatten(1).T, atol=1e-4)
    assert torch.equal(tr["targets"].long(), targets.flatten())
    assert torch.equal(tr["positions"].long(), torch.arange(SPEC.seq_len).repeat(6))
    same = (tr["greedy"].long() == out.logits.argmax(-1).flatten(1).T).float().mean()
    assert same > 0.999  # argmax ties under float noise only
    proj = la.projection(model.config.hidden_size, SPEC)
    assert torch.allclose(tr["hidden_proj"][:, 2], out.hidden_states[2].reshape(-1, 256) @ proj, atol=1e-4)


def test_features_at_loop_zero_and_later(traces):
    tr = traces["held"]
    f0, f2 = la.features(tr, 0, 4, SPEC.max_position), la.features(tr, 2, 4, SPEC.max_position)
    assert f0.shape == f2.shape == (tr["positions"].shape[0], 2 + 2 * 8 + 1 + 4)
    assert f0[:, :2].abs().max() == 0 and f0[:, 2 + 8:2 + 16].abs().max() == 0  # no gate and no change yet
    cdf = 1 - (1 - torch.sigmoid(tr["gate_logits"][:, 0])) * (1 - torch.sigmoid(tr["gate_logits"][:, 1]))
    assert torch.allclose(f2[:, 1], cdf, atol=1e-6)
    assert torch.allclose(f2[:, 2 + 8:2 + 16], tr["hidden_proj"][:, 1] - tr["hidden_proj"][:, 0])
    assert torch.equal(f2[:, -4:].argmax(1), torch.full((f2.shape[0],), 2))


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.6, 0.8, 1.0])
def test_an_oracle_replaying_the_stock_gate_gives_its_depths(traces, threshold):
    """Decided two loops ahead by an oracle that knows the stock gate's choice, the policy's depths and points
    equal the stock gate's with min_loops=2 (the least depth a decision two loops ahead can fix)."""
    tr = traces["held"]
    stock = la.stock_depths(tr, threshold, min_loops=2)
    oracle = torch.stack([(stock == n + la.DISTANCE).float() for n in la.decision_loops(4)], 1)
    mine = la.lookahead_depths(oracle, 0.5, 4)
    assert torch.equal(mine, stock)
    assert la.policy_point(tr, mine) == la.policy_point(tr, stock)


def test_policy_depths_and_points_by_hand():
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.95], [0.1, 0.2], [0.7, 0.7]])
    assert la.lookahead_depths(probs, 0.8, 4).tolist() == [2, 3, 4, 4]
    assert la.lookahead_depths(probs, 0.6, 4).tolist() == [2, 3, 4, 2]
    tr = {"loop_loss": torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2), "greedy": torch.tensor([[5, 6, 7, 7], [1, 1, 1, 1]])}
    p = la.policy_point(tr, torch.tensor([2, 3]))
    assert p["mean_depth"] == 2.5 and math.isclose(p["loss"], 2.5)
    assert p["early_exits"] == 2 and p["wrong_exits"] == 1 and p["wrong_exit_rate"] == 0.5


def test_head_beats_the_base_rate_on_unseen_windows_and_round_trips(traces, tmp_path):
    head, config = la.train_head(traces["train"], traces["calib"], 4, SPEC, hidden=16, epochs=30, batch=256)
    m = config.metrics
    y = la.agree(traces["train"])[:, la.DISTANCE:la.DISTANCE + 2].float()
    p, q = y.mean().item(), m["calib_positive_rate"]
    base = -(q * math.log(p) + (1 - q) * math.log(1 - p))  # the training base rate as a constant prediction
    assert m["calib_bce"] < base - 0.01, (m["calib_bce"], base)
    assert config.threshold in [q["threshold"] for q in m["calib_curve"]]
    assert la.load_head(tmp_path) is None
    la.save_head(head, config, tmp_path)
    loaded, cfg = la.load_head(tmp_path)
    assert cfg == config
    x = la.features(traces["held"], 1, 4, SPEC.max_position)
    assert torch.equal(loaded(x), head(x))
    (tmp_path / la.HEAD_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=la.HEAD_FILE):
        la.load_head(tmp_path)


def test_bad_trace_dirs_and_splits_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="meta.json"):
        la.load_traces(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(la.InvalidRequestError, match="format 'other'"):
        la.load_traces(tmp_path)
    with pytest.raises(la.InvalidRequestError, match="split 'test'; allowed"):
        la.split_stream(default_checkpoint(), "test", 10)


def test_cli_refuses_missing_paths(tmp_path, capsys):
    assert main(["train", "lookahead", "--traces-dir", str(tmp_path / "t")]) == 2
    assert "--out is required" in capsys.readouterr().err
    assert main(["train", "lookahead", "--model", str(tmp_path / "none"), "--traces-dir", str(tmp_path / "t")]) == 2
    assert "--model" in capsys.readouterr().err


@pytest.mark.slow  # a whole run (~9 s on 2 cores); default run: each step it takes (collect_traces, train_head,
# save_head and the policy points) is tested above
def test_cli_trains_saves_and_reports(tmp_path, capsys):
    out, report = tmp_path / "head", tmp_path / "report.json"
    args = ["train", "lookahead", "--out", str(out), "--traces-dir", str(tmp_path / "t"), "--report", str(report),
            "--seq-len", "32", "--train-windows", "4", "--calib-windows", "2", "--heldout-windows", "2",
            "--epochs", "2", "--threads", "1"]
    assert main(args) == 0
    result = json.loads(report.read_text())
    assert result["heldout_positions"] == 64 and result["threshold"] == json.loads((out / la.HEAD_CONFIG).read_text())["threshold"]
    held = result["heldout"]
    assert held["stock"][-1]["threshold"] == 1.0 and held["stock"][-1]["mean_depth"] == 4.0
    assert all(2 <= p["mean_depth"] <= 4 for p in held["lookahead"])
    assert all(3 <= p["mean_depth"] <= 4 for p in held["stock_delayed"])  # the gate never fires before loop 1
    assert la.load_head(out) is not None


def test_pareto_tool_tables_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import lookahead_pareto

    def point(q, depth, loss):
        return {"threshold": q, "mean_depth": depth, "loss": loss, "tokens": 10, "early_exits": 4, "wrong_exits": 1,
                "wrong_exit_rate": 0.25}

    held = {"stock": [point(0.5, 2.5, 2.2), point(1.0, 4.0, 2.1)], "stock_min2": [point(0.5, 2.6, 2.19)],
            "stock_delayed": [point(0.5, 3.6, 2.15)],
            "lookahead": [point(0.9, 3.0, 2.15)], "lookahead_chosen": point(0.9, 3.0, 2.15)}
    text = lookahead_pareto.table(held["stock"])
    assert text.splitlines()[2] == "| 0.5 | 2.500 | 2.2000 | 4 | 1 (0.250) |"
    png = lookahead_pareto.draw({"heldout": held, "heldout_positions": 10}, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("threshold", [0.5, 0.6, 0.7])
def test_plain_path_with_an_oracle_equals_the_stock_gate_token_for_token(traces, threshold):
    """Decisions two loops ahead replaying the stock gate's exits (min_loops 2) give its tokens, depths and
    log-probabilities on the plain path, KV of exited tokens included."""
    from loopline.models.loader import load_model
    from loopline.models.plain import plain_generate

    model = load_model(default_checkpoint(), dtype=torch.float32, device="cpu").eval()
    prompt = traces["held_stream"][:12]
    stock = plain_generate(model, prompt, 16, min_loops=2, exit_threshold=threshold)
    assert len(set(stock.exit_loops)) > 1  # the test needs tokens that exit at different loops
    calls = []

    def oracle(index, n, row):
        calls.append((index, n, row["hidden_proj"].shape[1]))
        return stock.exit_loops[index] == n + la.DISTANCE

    mine = la.lookahead_generate(model, prompt, 16, oracle)
    assert mine.tokens == stock.tokens and mine.exit_loops == stock.exit_loops
    assert mine.logprobs == pytest.approx(stock.logprobs, abs=1e-5)
    assert all(n == loops_seen for _, n, loops_seen in calls)  # a decision after loop n sees loops 1..n only


def test_plain_path_with_a_trained_head(traces):
    from loopline.models.loader import load_model

    head, config = la.train_head(traces["train"], traces["calib"], 4, SPEC, hidden=16, epochs=5, batch=256)
    model = load_model(default_checkpoint(), dtype=torch.float32, device="cpu").eval()
    out = la.lookahead_generate(model, [5, 6, 7, 8], 8, la.head_decider(head, config, threshold=0.0), spec=SPEC)
    assert out.exit_loops == [2] * 8  # threshold 0: every token exits at the first loop it can fix
    out = la.lookahead_generate(model, [5, 6, 7, 8], 8, la.head_decider(head, config, threshold=1.1), spec=SPEC)
    assert out.exit_loops == [4] * 8
