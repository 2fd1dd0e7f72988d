"""verl 0.9.1's trainer end to end on the CPU (#47): ``python -m verl.trainer.main_ppo`` with the recipe's
config (tools/verl_grpo_demo.yaml: GRPO on the bundled demo model, FSDP2 actor, loopline rollouts with
adaptive exits, the exit depths carried to the actor) for 2 iterations. verl's own rollout-vs-actor
logprob mismatch must be at fp32 noise: the actor recomputes every token at its exit depth.

Slow (a few minutes on two cores) and skipped without verl's trainer requirements (``.[verl-train]``).
The CPU needs loopline's verl platform (``VERL_PLATFORM=loopline_cpu``, loopline/integrations/verl_cpu.py)
and a logical GPU for verl's placement groups (``ray_kwargs.ray_init.num_gpus=1``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_main_ppo_two_iterations_on_the_cpu(tmp_path):
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    subprocess.run([sys.executable, str(ROOT / "tools/verl_grpo_data.py"), "--out", str(tmp_path / "data")], check=True)
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "VERL_PLATFORM": "loopline_cpu", "OMP_NUM_THREADS": "1",
           "VERL_FILE_LOGGER_PATH": str(metrics)}
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={ROOT / 'tools'}", "--config-name=verl_grpo_demo",
         f"actor_rollout_ref.model.path={ROOT / 'loopline/models/demo_ouro'}",
         f"reward.custom_reward_function.path={ROOT / 'tools/verl_grpo_reward.py'}",
         f"data.train_files={tmp_path / 'data/train.parquet'}", f"data.val_files={tmp_path / 'data/val.parquet'}",
         "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16", "trainer.logger=[console,file]",
         f"trainer.default_local_dir={tmp_path / 'ckpt'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    elapsed = time.monotonic() - start
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    data = [s.get("data", s) for s in steps]
    assert len(data) == 2, data
    for d in data:
        assert 0.0 <= d["critic/score/mean"] <= 1.0
        assert d["training/rollout_probs_diff_mean"] < 1e-4, d["training/rollout_probs_diff_mean"]
        assert d["training/rollout_probs_diff_max"] < 1e-3, d["training/rollout_probs_diff_max"]
    print(f"main_ppo, 2 iterations on the CPU: {elapsed:.0f} s")
