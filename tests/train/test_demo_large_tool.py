"""tools/train_demo_large_gpu.sh in its reduced CPU form: trains demo-large on a tiny budget (packages included),
then measures the curve through the engine, writes the card, scores nats/byte against the demo model and
returns a summary and the export."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.train.presets import DEMO_LARGE_PACKAGES

from train.conftest import installed

ROOT = Path(__file__).resolve().parents[2]


# the preset's packages that this environment has (CI's fresh venv may lack triton, say; torch and numpy it has)
PRESENT = json.dumps([p for p in DEMO_LARGE_PACKAGES if installed(p)])
TINY = ["--set", f"corpus.packages={PRESENT}", "--set", "corpus.max_bytes=1500000", "--set", "corpus.heldout_per_mille=100", "--set", "stage1_steps=2",
        "--set", "stage2_steps=2", "--set", "batch_size=2", "--set", "seq_len=64", "--set", "warmup_steps=1",
        "--set", "stage2_warmup_steps=1", "--set", "eval_batches=1"]


@pytest.mark.slow  # ~20-40 s of a 2-core CI run; the corpus logic it drives is tested fast in test_corpus_packages.py
def test_the_reduced_cpu_form_trains_measures_and_returns_the_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "STATE_ROOT": str(tmp_path / "state"),
           "EVAL_WINDOWS": "2", "EVAL_SEQ_LEN": "64", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(ROOT / "tools" / "train_demo_large_gpu.sh"), str(out), "300", "cpu-check",
                          "--device", "cpu", "--threads", "1", *TINY],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    summary = json.loads((out / "cpu-check.summary.json").read_text())
    assert summary["step"] == 4 and len(summary["heldout_loop_losses"]) == 4
    assert summary["sources"][0][0] == "cpython-stdlib" and {"torch", "numpy"} <= {s[0] for s in summary["sources"]}
    assert [p[0] for p in summary["engine_curve"]][-1] == 1.0 and summary["engine_vs_dense_max_abs_loss_diff"] < 1e-3
    per_byte = summary["stdlib_heldout_nats_per_byte"]
    assert len(per_byte) == 2 and all(len(v) == 4 and all(0 < x < 10 for x in v) for v in per_byte.values())
    model = tmp_path / "state" / "cpu-check"
    card = (model / "MODEL_CARD.md").read_text()
    assert "| torch |" in card and "measured through the engine" in card
    assert sorted(p.name for p in out.glob("cpu-check.tar.*"))[0] == "cpu-check.tar.aa"
    # called again, the finished run is not retrained: the same summary comes back
    again = subprocess.run(["bash", str(ROOT / "tools" / "train_demo_large_gpu.sh"), str(out), "300", "cpu-check",
                            "--device", "cpu", "--threads", "1", *TINY],
                           capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert again.returncode == 0 and '"step": 0, "stage"' not in again.stdout
    assert json.loads((out / "cpu-check.summary.json").read_text())["heldout_loop_losses"] == summary["heldout_loop_losses"]


@pytest.mark.slow  # the script's process (~4-5 s on 2 cores); default run: test_corpus_packages.py covers the
# demo-large preset's corpus
def test_a_follow_up_call_on_a_fresh_machine_starts_nothing(tmp_path):
    """REQUIRE_RESUME=1 is for the second call of a run split over two: without the first call's state (the
    machine went cold in between) it must stop, not spend the call training from step 0."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "STATE_ROOT": str(tmp_path / "state"),
           "REQUIRE_RESUME": "1"}
    run = subprocess.run(["bash", str(ROOT / "tools" / "train_demo_large_gpu.sh"), str(out), "300", "cold",
                          "--device", "cpu", *TINY], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    assert "NO STATE" in run.stdout and '"step"' not in run.stdout
    assert not (tmp_path / "state" / "cold").exists() and not list(out.glob("cold.tar.*"))
