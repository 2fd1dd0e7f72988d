"""The trainer on CPU: both stages lower their losses, resume is exact, the held-out split stays out."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from loopline.train.corpus import CorpusSpec, split
from loopline.train.trainer import TokenWindows, TrainConfig, Trainer

from train.conftest import SMOKE


def test_both_stages_lower_their_losses(smoke_data):
    trainer = Trainer(SMOKE, smoke_data)
    start = trainer.evaluate()
    trainer.train(until=SMOKE.stage1_steps)
    after_one = trainer.evaluate()
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "early_exit_gate" not in n}
    trainer.train()
    end = trainer.evaluate()
    assert trainer.step == SMOKE.total_steps
    # stage 1: the LM learns (held-out, every loop) and stays far from its untrained ~uniform loss
    assert all(b < a - 0.5 for a, b in zip(start["loop_losses"], after_one["loop_losses"])), (start, after_one)
    assert after_one["expected_loss"] < start["uniform_loss"] - 0.5
    # stage 2: the gate's loss falls; nothing but the gate moved
    assert end["gate_loss"] < after_one["gate_loss"] - 1e-3, (after_one, end)
    assert end["loop_losses"] == after_one["loop_losses"]
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)


def test_the_untrained_gate_starts_deep_first(smoke_data):
    trainer = Trainer(dataclasses.replace(SMOKE, gate_init_exit=0.2), smoke_data)
    gate = trainer.model.model.early_exit_gate
    assert torch.all(gate.weight == 0) and torch.allclose(torch.sigmoid(gate.bias), torch.tensor(0.2))


def test_a_frozen_gate_keeps_its_init_while_the_lm_trains(smoke_data):
    config = dataclasses.replace(SMOKE, stage1_steps=6, stage2_steps=0, gate_freeze_steps=3)
    trainer = Trainer(config, smoke_data)
    gate = trainer.model.model.early_exit_gate
    init = [p.detach().clone() for p in gate.parameters()]
    lm_head = trainer.model.lm_head.weight.detach().clone()
    trainer.train(until=3)
    assert all(torch.equal(p, q) for p, q in zip(gate.parameters(), init))
    assert not torch.equal(trainer.model.lm_head.weight, lm_head)
    trainer.train()  # after the freeze the gate trains with the rest
    assert not all(torch.equal(p, q) for p, q in zip(gate.parameters(), init))
    with pytest.raises(ValueError, match="gate_freeze_steps"):
        dataclasses.replace(SMOKE, gate_freeze_steps=SMOKE.stage1_steps + 1)


# in stage 1, at the switch to stage 2, in stage 2 (~3.5 s each: the switch in the default run)
@pytest.mark.parametrize("cut", [pytest.param(4, marks=pytest.mark.slow), 10, pytest.param(13, marks=pytest.mark.slow)])
def test_resume_continues_exactly(smoke_data, tmp_path, cut):
    config = dataclasses.replace(SMOKE, stage1_steps=10, stage2_steps=6)
    straight = Trainer(config, smoke_data)
    straight.train()
    first = Trainer(config, smoke_data)
    first.train(until=cut)
    first.save(tmp_path)
    del first
    resumed = Trainer.resume(tmp_path, smoke_data)
    assert resumed.step == cut
    resumed.train()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if not torch.equal(a[k], b[k])]
    # the optimizer too (its moments), so a further resume would also continue exactly
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


def test_resume_changes_nothing_when_not_resumed(smoke_data, tmp_path):
    """Guards the test above: a run that diverges (another seed) is detected."""
    a = Trainer(dataclasses.replace(SMOKE, stage1_steps=3, stage2_steps=0), smoke_data)
    b = Trainer(dataclasses.replace(SMOKE, stage1_steps=3, stage2_steps=0, seed=1), smoke_data)
    a.train(), b.train()
    assert not torch.equal(a.model.lm_head.weight, b.model.lm_head.weight)


def test_heldout_split_is_disjoint_and_deterministic(smoke_data):
    train, heldout = split(SMOKE.corpus)
    assert train and heldout
    assert not {d.path for d in train} & {d.path for d in heldout}
    assert not {d.text for d in train} & {d.text for d in heldout}
    again = split(SMOKE.corpus)
    assert [d.path for d in again[0]] == [d.path for d in train] and [d.path for d in again[1]] == [d.path for d in heldout]
    # the training stream is exactly the training documents: no held-out token sequence got in
    n_train = sum(len(smoke_data.tokenizer.encode(d.text).ids) + 1 for d in train)
    assert smoke_data.train.numel() == n_train
    # a file's split depends only on its path: a bigger corpus keeps every small-corpus assignment
    big_train, big_heldout = split(dataclasses.replace(SMOKE.corpus, max_bytes=200_000))
    assert {d.path for d in heldout} <= {d.path for d in big_heldout}
    assert {d.path for d in train} <= {d.path for d in big_train}


def test_batches_are_a_function_of_seed_and_step():
    stream = torch.arange(1000)
    w = TokenWindows(stream, 9, seed=3)
    x1, y1 = w.batch(5, 4)
    x2, y2 = TokenWindows(stream, 9, seed=3).batch(5, 4)
    assert torch.equal(x1, x2) and torch.equal(y1[:, :-1], x1[:, 1:])
    assert not torch.equal(TokenWindows(stream, 9, seed=4).batch(5, 4)[0], x1)
    # one epoch visits every window once
    seen = torch.cat([w.batch(s, 1)[0][:, 0] for s in range(len(w))])
    assert sorted(seen.tolist()) == [i * 9 for i in range(len(w))]


def test_an_empty_heldout_split_fails_before_training():
    from loopline.train.trainer import build_data

    config = dataclasses.replace(SMOKE, corpus=dataclasses.replace(SMOKE.corpus, heldout_per_mille=1))
    assert split(config.corpus)[1] == []  # 1 per mille of the smoke corpus's few files: none held out
    with pytest.raises(ValueError, match=r"held-out split has 0 files.*corpus.heldout_per_mille=1"):
        build_data(config)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="TrainConfig.seq_len"):
        TrainConfig(seq_len=1)
    with pytest.raises(ValueError, match="CorpusSpec.heldout_per_mille"):
        CorpusSpec(heldout_per_mille=0)
    with pytest.raises(ValueError, match="unknown field"):
        TrainConfig.from_dict({"learning_rate": 1})


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_a_compiled_loss_trains_like_the_eager_one(smoke_data, backend):
    """``compile`` wraps both stages' loss functions in torch.compile; the steps' numbers and weights match
    eager. ``eager`` checks the plumbing (dynamo's trace only, seconds); ``aot_eager`` also traces the
    backward (~15 s on 2 cores: slow)."""
    config = dataclasses.replace(SMOKE, stage1_steps=1, stage2_steps=1)
    eager, compiled = Trainer(config, smoke_data), Trainer(dataclasses.replace(config, compile=backend), smoke_data)
    for _ in range(config.total_steps):  # both stages: stage 2 freezes all but the gate
        a, b = eager.train_step().as_dict(), compiled.train_step().as_dict()
        assert a["stage"] == b["stage"]
        for key in ("loss", "gate_loss", "mean_depth"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert list(eager.model.state_dict()) == list(compiled.model.state_dict())
    for (name, p), q in zip(eager.model.state_dict().items(), compiled.model.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="compile"):
        dataclasses.replace(SMOKE, compile="tensorrt")


def test_step_metrics_read_only_when_asked(smoke_data):
    """A step hands its numbers back as device tensors; ``as_dict`` reads them (the only host sync of a step)."""
    trainer = Trainer(dataclasses.replace(SMOKE, stage1_steps=1, stage2_steps=1), smoke_data)
    first = trainer.train_step()
    assert isinstance(first.tensors["loss"], torch.Tensor) and first.stage == 1
    values = first.as_dict()
    assert set(values) >= {"stage", "lr", "loss", "expected_loss", "entropy", "mean_depth", "grad_norm", "loop_losses"}
    assert len(values["loop_losses"]) == SMOKE.model.total_ut_steps and isinstance(values["loss"], float)
    assert "gate_loss" in trainer.train_step().as_dict()


def test_device_batches_are_the_windows_batches(smoke_data):
    trainer = Trainer(dataclasses.replace(SMOKE, stage1_steps=3, stage2_steps=1), smoke_data)
    for step in range(3):
        ids, targets = trainer.device_batch(step)
        want_ids, want_targets = trainer.windows.batch(step, SMOKE.batch_size)
        assert torch.equal(ids, want_ids) and torch.equal(targets, want_targets)
        assert torch.equal(ids[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_batch_copies_queued_behind_busy_work_arrive_intact(smoke_data):
    """Each batch's pinned staging tensor is released as soon as the call returns; if the allocator handed
    it out again before the queued copy ran, a later batch would overwrite an earlier one in flight."""
    trainer = Trainer(dataclasses.replace(SMOKE, stage1_steps=40, stage2_steps=1), smoke_data, device="cuda")
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # tens of milliseconds of queued work: every copy below waits behind it
        x = x @ x / 2048
    batches = [trainer.device_batch(step) for step in range(40)]
    torch.cuda.synchronize()
    for step, (ids, targets) in enumerate(batches):
        want_ids, want_targets = trainer.windows.batch(step, SMOKE.batch_size)
        assert torch.equal(ids.cpu(), want_ids) and torch.equal(targets.cpu(), want_targets), step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_training_step_never_waits_for_the_device(smoke_data):
    """The demo model's step is mostly kernel launches; a sync per step (a pageable batch copy, reading a
    metric) made the GPU idle while the host launched the next one."""
    trainer = Trainer(dataclasses.replace(SMOKE, stage1_steps=4, stage2_steps=1), smoke_data, device="cuda")
    trainer.train_step()  # first-use work (cuBLAS handles, allocator) may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step()
        trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
