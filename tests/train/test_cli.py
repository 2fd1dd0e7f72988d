"""``loopline train pretrain``: a smoke run end to end, resume through the CLI, errors that name the field."""
from __future__ import annotations

import hashlib
import json

import pytest

from loopline.entrypoints.cli import main
from loopline.train.presets import build_config

# each corpus read once in this module (tests/train/conftest.py::memoized_corpus)
pytestmark = pytest.mark.usefixtures("memoized_corpus")


def test_pretrain_smoke_exports_a_loadable_model_and_resumes(tmp_path, capsys):
    out, ckpt = tmp_path / "demo", tmp_path / "state"
    args = ["train", "pretrain", "--preset", "smoke", "--set", "stage1_steps=4", "--set", "stage2_steps=2",
            "--out", str(out), "--checkpoint-dir", str(ckpt), "--log-every", "1", "--threads", "1"]
    assert main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    final = lines[-1]
    assert final["exported"] == str(out) and 0 < final["chosen_threshold"] <= 1
    assert json.loads((out / "config.json").read_text())["early_exit_threshold"] == final["chosen_threshold"]
    assert not (out / "train_state.pt").exists() and (ckpt / "train_state.pt").is_file()
    # the run is complete: a resume trains nothing more and exports the same weights
    before = (out / "model.safetensors").read_bytes()
    assert main([*args, "--resume"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0]) == {"resumed_at_step": 6}
    assert (out / "model.safetensors").read_bytes() == before

    from loopline import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory_gb=1 / 64, disable_log_stats=True)
    comp = llm.generate(["def f("], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(comp.exit_depths) == len(comp.token_ids) >= 1


@pytest.mark.slow  # two training runs (~8 s on 2 cores); default run: the command in
# test_pretrain_smoke_exports_a_loadable_model_and_resumes, test_export.py the held-out evaluation
def test_eval_every_reports_heldout_losses_and_leaves_the_run_alone(tmp_path, capsys):
    base = ["train", "pretrain", "--preset", "smoke", "--set", "stage1_steps=4", "--set", "stage2_steps=2",
            "--log-every", "0", "--threads", "1"]
    assert main([*base, "--out", str(tmp_path / "a"), "--eval-every", "3"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    held = [x for x in lines if "heldout_loop_losses" in x]
    assert [x["step"] for x in held] == [3] and len(held[0]["heldout_loop_losses"]) == 4
    assert main([*base, "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_overrides_and_their_errors(tmp_path, capsys):
    config = build_config("smoke", None, ["model.hidden_size=96", "lr=0.002", "betas=[0.9, 0.99]"])
    assert config.model.hidden_size == 96 and config.lr == 0.002 and config.betas == (0.9, 0.99)
    with pytest.raises(ValueError, match="TrainConfig.lr"):
        build_config("smoke", None, ["lr=-1"])
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        build_config("smoke", None, ["lr"])
    assert main(["train", "pretrain", "--preset", "smoke", "--set", "stage1_step=3", "--out", str(tmp_path)]) == 2
    assert "unknown field(s) ['stage1_step']" in capsys.readouterr().err


def test_curve_names_the_model_by_content_and_checks_max_windows(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["train", "pretrain", "--preset", "smoke", "--set", "stage1_steps=2", "--set", "stage2_steps=1",
                 "--out", str(out), "--log-every", "0", "--threads", "1"]) == 0
    capsys.readouterr()
    curve_file = tmp_path / "curve.json"
    assert main(["train", "curve", "--model", str(out), "--device", "cpu", "--max-windows", "1", "--seq-len", "16",
                 "--thresholds", "0.5,1.0", "--out", str(curve_file)]) == 0
    curve = json.loads(curve_file.read_text())
    assert curve["model"] == json.loads((out / "config.json").read_text())["_name_or_path"]
    assert curve["weights_sha256"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert [p["tokens"] for p in curve["engine"]] == [16, 16] and curve["depths_equal"]
    capsys.readouterr()
    assert main(["train", "curve", "--model", str(out), "--max-windows", "-1"]) == 2
    assert "--max-windows -1; allowed: >= 0" in capsys.readouterr().err


def test_a_bad_setting_is_a_user_error_on_one_line(tmp_path, capsys):
    """Training settings are the user's input: the CLI names the field and the allowed range, and does not
    call it an internal error."""
    assert main(["train", "pretrain", "--preset", "smoke", "--out", str(tmp_path / "x"), "--set", "lr=-1"]) == 2
    assert capsys.readouterr().err == "error: TrainConfig.lr=-1; allowed: > 0\n"
    assert main(["train", "pretrain", "--preset", "smoke", "--out", str(tmp_path / "x"),
                 "--set", "corpus.heldout_per_mille=1"]) == 2  # no held-out file in the smoke corpus
    err = capsys.readouterr().err
    assert err.startswith("error: the held-out split has 0 files") and "internal error" not in err
