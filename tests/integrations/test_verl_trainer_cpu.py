"""verl 0.9.1's trainer end to end on the CPU (#47): ``python -m verl.trainer.main_ppo`` with the recipe's
config (tools/verl_grpo_demo.yaml: GRPO on the bundled demo model, FSDP2 actor, loopline rollouts with
adaptive exits, the exit depths carried to the actor) for 2 iterations, saving after each.

* verl's own rollout-vs-actor logprob mismatch must be at fp32 noise: the actor recomputes every token at
  its exit depth;
* a run resumed from the save at iteration 1 must reproduce iteration 2 (tools/verl_grpo_resume_check.py:
  equal rewards and lengths, logprob metrics within fp32 noise): the rollouts are seeded per sample
  (loopline/integrations/rollout_seed.py), weights, optimizer and data order come from the checkpoint;
* the checkpoint of iteration 2, exported (loopline.integrations.verl_checkpoint), is served by
  ``loopline serve`` and answers a completion as the offline engine does (tools/verl_serve_check.py).

Slow (about 5 minutes on two shared cores: two main_ppo runs of ~130 s, mostly Ray and model start-up)
and skipped without verl's trainer requirements (``.[verl-train]``). The CPU needs loopline's verl platform
(``VERL_PLATFORM=loopline_cpu``, loopline/integrations/verl_cpu.py) and a logical GPU for verl's placement
groups (``ray_kwargs.ray_init.num_gpus=1``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "loopline/models/demo_ouro"


@dataclass
class Run:
    path: Path
    metrics: list[dict]
    log: Path
    elapsed: float


def main_ppo(path: Path, data: Path, *overrides: str) -> Run:
    """One ``main_ppo`` run of the recipe in ``path`` (its metrics: verl's file logger, one record per iteration)."""
    path.mkdir(parents=True, exist_ok=True)
    log = path / "metrics.jsonl"
    env = {**os.environ, "VERL_PLATFORM": "loopline_cpu", "OMP_NUM_THREADS": "1", "VERL_FILE_LOGGER_PATH": str(log)}
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={ROOT / 'tools'}", "--config-name=verl_grpo_demo",
         f"actor_rollout_ref.model.path={MODEL}", f"reward.custom_reward_function.path={ROOT / 'tools/verl_grpo_reward.py'}",
         f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
         "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16", "trainer.logger=[console,file]",
         f"trainer.default_local_dir={path / 'ckpt'}", *overrides],
        cwd=path, env=env, capture_output=True, text=True, timeout=1500, check=False)
    elapsed = time.monotonic() - start
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return Run(path, [r.get("data", r) for r in records], log, elapsed)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    out = tmp_path_factory.mktemp("verl_data")
    subprocess.run([sys.executable, str(ROOT / "tools/verl_grpo_data.py"), "--out", str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def continued(tmp_path_factory, data) -> Run:
    """Two iterations, a checkpoint after each (global_step_1, global_step_2)."""
    run = main_ppo(tmp_path_factory.mktemp("continued"), data, "trainer.save_freq=1")
    print(f"main_ppo, 2 iterations on the CPU: {run.elapsed:.0f} s")
    return run


def test_main_ppo_two_iterations_on_the_cpu(continued):
    assert len(continued.metrics) == 2, continued.metrics
    for d in continued.metrics:
        assert 0.0 <= d["critic/score/mean"] <= 1.0
        assert d["training/rollout_probs_diff_mean"] < 1e-4, d["training/rollout_probs_diff_mean"]
        assert d["training/rollout_probs_diff_max"] < 1e-3, d["training/rollout_probs_diff_max"]
    assert (continued.path / "ckpt/global_step_1/actor/model_world_size_1_rank_0.pt").is_file()
    assert (continued.path / "ckpt/latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_a_resumed_run_reproduces_the_next_iteration(continued, data, tmp_path):
    resumed = main_ppo(tmp_path / "resumed", data, "trainer.resume_mode=resume_path",
                       f"trainer.resume_from_path={continued.path / 'ckpt/global_step_1'}")
    print(f"main_ppo, resumed for iteration 2 on the CPU: {resumed.elapsed:.0f} s")
    assert [d["training/global_step"] for d in resumed.metrics] == [2]
    check = subprocess.run([sys.executable, str(ROOT / "tools/verl_grpo_resume_check.py"), str(continued.log),
                            str(resumed.log), "--step", "2", "--out", str(tmp_path / "check.json")],
                           capture_output=True, text=True, check=False)
    print(check.stdout)
    assert check.returncode == 0, check.stdout + check.stderr
    a, b = continued.metrics[1], resumed.metrics[0]
    assert b["critic/score/mean"] == a["critic/score/mean"]
    assert b["rollout_corr/rollout_log_ppl"] == pytest.approx(a["rollout_corr/rollout_log_ppl"], rel=1e-4)


def test_the_trained_checkpoint_is_served(continued, tmp_path):
    import torch
    from safetensors.torch import load_file

    export = tmp_path / "export"
    subprocess.run([sys.executable, "-m", "loopline.integrations.verl_checkpoint",
                    str(continued.path / "ckpt/global_step_2"), str(export), "--base", str(MODEL)], check=True)
    trained, base = load_file(str(export / "model.safetensors")), load_file(str(MODEL / "model.safetensors"))
    assert sorted(trained) == sorted(base)
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # two updates changed the weights
    serve = subprocess.run([sys.executable, str(ROOT / "tools/verl_serve_check.py"), str(export), "--out",
                            str(tmp_path / "serve.json"), "--device", "cpu", "--dtype", "float32"],
                           capture_output=True, text=True, timeout=600, check=False)
    assert serve.returncode == 0, serve.stdout + serve.stderr
    record = json.loads((tmp_path / "serve.json").read_text())
    assert record["equal"] and record["text"] and len(record["served_tokens"]) == 12
    print(serve.stdout.strip())
