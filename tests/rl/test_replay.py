"""Train/inference consistency: the dense, differentiable replay reproduces the engine's logprobs.

The replay (loopline.rl.replay) recomputes each generated token's logprob from
(prompt, output ids, exit depths, layout) on a trainer-side copy of the model.
It must equal the engine's logprobs to fp32 tolerance at fixed depth and with
adaptive exits, in both KV layouts, and carry gradients to the weights.
"""
from __future__ import annotations

import random

import pytest
import torch

from loopline import SamplingParams
from loopline.errors import InvalidRequestError
from loopline.models.loader import load_model
from loopline.rl import replay_logprobs, replay_logprobs_batch
from reference import reference_forward

TOL = 1e-5


def trainer_model(tiny):
    model = load_model(tiny.path, torch.float32)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def rollout(engine, run, ids, lengths, params):
    reqs = {f"r{i}": (ids(n, seed=10 + i), params.clone(seed=100 + i)) for i, n in enumerate(lengths)}
    done = run(engine, reqs)
    return [done[f"r{i}"] for i in range(len(lengths))]


def replay_all(model, outs, layout, temperature=1.0):
    comps = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
    return comps, replay_logprobs_batch(model, [p for p, _ in comps], [c.token_ids for _, c in comps],
                                        [c.exit_depths for _, c in comps], layout=layout, temperature=temperature)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("threshold", [None, 0.6], ids=["fixed_depth", "adaptive"])
def test_engine_logprobs_equal_replay(tiny_gqa, engine_for, run, ids, layout, threshold, async_scheduling):
    engine = engine_for(tiny_gqa, kv_layout=layout, max_num_seqs=4, max_num_batched_tokens=16,
                        async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=9, temperature=1.0, logprobs=0, ignore_eos=True, exit_threshold=threshold)
    outs = rollout(engine, run, ids, [4, 11, 7, 16], params)
    depths = [d for o in outs for d in o.outputs[0].exit_depths]
    if threshold is None:
        assert set(depths) == {tiny_gqa.cfg["total_ut_steps"]}
    else:
        assert len(set(depths)) > 1, "the adaptive case must exercise varied exit depths"
    comps, replayed = replay_all(trainer_model(tiny_gqa), outs, layout)
    for (_, comp), lp in zip(comps, replayed):
        engine_lp = torch.tensor(comp.token_logprobs)
        assert lp.shape == engine_lp.shape
        assert (lp.detach() - engine_lp).abs().max().item() < TOL


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_processed_logprobs_equal_replay_at_temperature(tiny_gqa, engine_for, run, ids, layout):
    engine = engine_for(tiny_gqa, kv_layout=layout, logprobs_mode="processed_logprobs")
    params = SamplingParams(max_tokens=6, temperature=0.7, logprobs=0, ignore_eos=True, exit_threshold=0.7, n=2)
    outs = rollout(engine, run, ids, [5, 9], params)
    comps, replayed = replay_all(trainer_model(tiny_gqa), outs, layout, temperature=[0.7] * 4)
    for (_, comp), lp in zip(comps, replayed):
        assert (lp.detach() - torch.tensor(comp.token_logprobs)).abs().max().item() < TOL
    # ... and raw logprobs are the temperature-1 values, which differ.
    _, raw = replay_all(trainer_model(tiny_gqa), outs, layout, temperature=1.0)
    assert not torch.allclose(raw[0], replayed[0])


def test_gradients_flow_to_the_weights(tiny_gqa, engine_for, run, ids):
    engine = engine_for(tiny_gqa)
    out = rollout(engine, run, ids, [6], SamplingParams(max_tokens=5, logprobs=0, ignore_eos=True, exit_threshold=0.6))[0]
    model = trainer_model(tiny_gqa)
    for layout in ("last_exited", "shared"):
        model.zero_grad()
        c = out.outputs[0]
        lp = replay_logprobs(model, out.prompt_token_ids, c.token_ids, c.exit_depths, layout=layout)
        assert lp.requires_grad
        lp.sum().backward()
        for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
                     "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
            grad = model.get_parameter(name).grad
            assert grad is not None and grad.abs().sum() > 0, name
        # Given the exit depths, a token's logprob does not depend on the exit gate.
        gate = model.get_parameter("model.early_exit_gate.weight").grad
        assert gate is None or gate.abs().sum() == 0


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_replay_matches_the_independent_reference(tiny_mha, layout):
    """Arbitrary depths (any value per token), batched with unequal lengths, against tests/reference.py."""
    tiny = tiny_mha
    r = tiny.cfg["total_ut_steps"]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 2, 9)]
    outputs = [[rng.randrange(3, 500) for _ in range(n)] for n in (7, 1, 4)]
    depths = [[rng.randint(1, r) for _ in o] for o in outputs]
    model = load_model(tiny.path, torch.float32)
    replayed = replay_logprobs_batch(model, prompts, outputs, depths, layout=layout)
    for prompt, out, ds, lp in zip(prompts, outputs, depths, replayed):
        seq = prompt + out[:-1]
        ref = reference_forward(tiny.state_dict, tiny.cfg, torch.tensor(seq), r, [r] * len(prompt) + ds[1:], layout,
                                prompt_len=len(prompt))
        want = torch.stack([torch.log_softmax(ref["logits"][e - 1, len(prompt) - 1 + k], -1)[out[k]]
                            for k, e in enumerate(ds)])
        assert (lp.detach() - want).abs().max().item() < TOL


def test_bad_replay_input(tiny_gqa):
    model = load_model(tiny_gqa.path, torch.float32)
    with pytest.raises(InvalidRequestError, match="exit_depths"):
        replay_logprobs(model, [5, 6], [7, 8], [4])
    with pytest.raises(InvalidRequestError, match=r"integers in \[1, 4\]"):
        replay_logprobs(model, [5, 6], [7, 8], [4, 5])
    with pytest.raises(InvalidRequestError, match="layout"):
        replay_logprobs(model, [5, 6], [7], [4], layout="paged")
    with pytest.raises(InvalidRequestError, match="token ids"):
        replay_logprobs(model, [5, 6], [], [])
