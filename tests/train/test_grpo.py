"""GRPO (loopline.train.grpo): train/rollout consistency, exact resume, rewards, the ``train grpo`` command."""
from __future__ import annotations

import json

import pytest
import torch

from loopline.entrypoints.cli import main
from loopline.train.grpo import GRPO, GRPOConfig, contains, make_reward, python_closes, python_parses

TIMING = ("publish_downtime_s", "rollout_s", "train_s", "elapsed_s")


def config(tiny, **kw) -> GRPOConfig:
    # contains:e: a random tiny model earns it in some samples and not others, so updates are non-zero
    base = dict(model=str(tiny.path), prompts_per_iteration=2, group_size=4, max_tokens=6, iterations=3, lr=1e-3,
                reward="contains:e", kv_cache_memory_gb=1 / 64)
    return GRPOConfig(**{**base, **kw})


def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING}


@pytest.mark.parametrize("exits", [{}, {"exit_threshold": 0.6}, {"exit_threshold": 0.6, "kv_layout": "shared"}],
                         ids=["fixed_depth", "adaptive", "adaptive_shared"])
def test_trainer_and_rollout_logprobs_agree_within_1e_5(tiny_gqa, exits):
    records = []
    run = GRPO(config(tiny_gqa, iterations=2, **exits), log=records.append)
    run.train()
    assert [r["weight_version"] for r in records] == [1, 2] and run.llm.get_weight_version() == 2
    for r in records:
        assert r["mismatch_max"] <= 1e-5 and r["mismatch_mean"] <= r["mismatch_max"]
        assert r["completion_tokens"] == sum(r["exit_depths"].values())
        assert r["publish_downtime_s"] >= 0
    assert any(r["groups_with_signal"] and r["grad_norm"] > 0 for r in records)  # a real update was published
    depths = {d for r in records for d in r["exit_depths"]}
    assert (len(depths) > 1) if exits else depths == {"4"}, depths  # adaptive: replayed at varied depths
    # the second iteration's rollout ran on the first update: the served weights are the trainer's
    served = dict(run.llm.llm_engine.model.state_dict())
    assert all(torch.equal(served[k], v) for k, v in run.model.state_dict().items())


def test_resume_after_iteration_k_repeats_iteration_k_plus_1(tiny_gqa, tmp_path):
    whole: list[dict] = []
    a = GRPO(config(tiny_gqa), log=whole.append)
    a.train(until=1)
    ev = a.evaluate()  # greedy, on the served weights: it must not change the run
    assert ev["iteration"] == 1 and ev["weight_version"] == 1 and 0 <= ev["greedy_reward"] <= 1
    a.train()

    first: list[dict] = []
    b = GRPO(config(tiny_gqa), log=first.append)
    b.train(until=2)
    b.save(tmp_path)
    del b
    rest: list[dict] = []
    c = GRPO.resume(tmp_path, log=rest.append)
    assert (c.iteration, c.weight_version, c.llm.get_weight_version()) == (2, 2, 2)
    c.train()
    assert [untimed(r) for r in first + rest] == [untimed(r) for r in whole]
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), c.model.state_dict().values()))
    sa, sc = a.optimizer.state_dict()["state"], c.optimizer.state_dict()["state"]
    assert sa.keys() == sc.keys() and all(torch.equal(sa[k]["exp_avg"], sc[k]["exp_avg"]) for k in sa)
    assert any(r["groups_with_signal"] for r in whole), "the test must exercise a real update"


def test_rewards():
    assert python_parses("x = foo(1, ", "2)\nrest") == 1.0
    assert python_parses("x = foo(1, ", "2") == 0.0 and python_parses("print(", "\n)") == 0.0
    assert python_closes("x = foo(1, ", "2)") == 1.0
    assert python_closes("x = foo(1, ", "2) +") == 0.5  # closed, but not valid Python
    assert python_closes("x = foo(1, ", "')'") == 0.0  # a bracket inside a string closes nothing
    assert python_closes("x = foo(1, ", "a]") == 0.0
    assert contains("return")("", "a return b") == 1.0 and make_reward("contains:zz")("", "z") == 0.0
    for bad in ("contains", "nope", "python_parses:x"):
        with pytest.raises(ValueError):
            make_reward(bad)
    with pytest.raises(ValueError):
        GRPOConfig(group_size=1)


def test_train_grpo_command_stops_resumes_and_exports(tiny_gqa, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "grpo", "--model", str(tiny_gqa.path), "--out", str(out), "--iterations", "2", "--threads", "1",
            "--set", "prompts_per_iteration=2", "--set", "group_size=2", "--set", "max_tokens=4",
            "--set", "kv_cache_memory_gb=0.015625"]
    assert main([*args, "--stop-after", "1", "--eval"]) == 0
    assert not (out / "model").exists()
    assert main([*args, "--resume"]) == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {"resumed_at_iteration": 1, "weight_version": 1} in printed
    assert [(x["iteration"], x["weight_version"]) for x in printed if "greedy_reward" in x] == [(0, 0), (1, 1)]
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in log] == [1, 2] and log[-1]["weight_version"] == 2
    assert printed[-1]["exported"] == str(out / "model")

    from loopline import LLM, SamplingParams

    llm = LLM(str(out / "model"), dtype="float32", device="cpu", kv_cache_memory_gb=1 / 64, disable_log_stats=True)
    assert llm.generate(["x = ("], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
