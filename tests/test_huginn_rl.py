"""The RL rollout / weight-update contract for Huginn (``huginn_raven``, issue #46): rollouts carry logprobs
aligned 1:1 with tokens, the convergence exit's per-token iteration counts and the effective loop fields;
``loopline.rl.replay_logprobs`` recomputes them at those depths (with autograd) from the rollout's
``max_loops`` and ``latent_seed``; weight updates from tensors (upstream names, the tied head left out)
and from disk equal a fresh engine on the new weights and invalidate the prefix cache."""
from __future__ import annotations

import pytest
import torch
from engine_testing import run_arrivals  # tests/ is on pythonpath (pyproject.toml)
from safetensors.torch import load_file

from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.errors import InvalidRequestError, WeightUpdateError
from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopline.models.loader import load_looped_model
from loopline.rl import replay_logprobs, replay_logprobs_batch
from loopline.sampling_params import SamplingParams

PROMPTS = {"g": [5, 9, 100, 3, 44], "s": list(range(7, 26)), "f": [300, 2, 41, 41, 8, 90, 17], "t": [11] * 9}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The served checkpoint and the 'trained' one (same shapes, other weights)."""
    root = tmp_path_factory.mktemp("huginn_rl")
    return make_tiny_huginn_checkpoint(root / "a", seed=0), make_tiny_huginn_checkpoint(root / "b", seed=3)


def engine(path, **kw) -> LLMEngine:
    kw = {"skip_tokenizer_init": True, "device": "cpu", "dtype": "float32", "max_num_seqs": 3, "block_size": 4,
          "max_num_loops": 8, **kw}
    return LLMEngine(EngineArgs(model=str(path), **kw))


drain = run_arrivals  # every request at once, run to completion


def rollouts(temperature: float = 1.0) -> dict:
    """Greedy and sampled, fixed iterations and the convergence exit, several max_loops and latent seeds."""
    base = SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True, min_loops=2, exit_threshold=0.05)
    return {"g": (PROMPTS["g"], base.clone(temperature=0.0)),
            "s": (PROMPTS["s"], base.clone(temperature=temperature, seed=4, latent_seed=3, max_loops=8, exit_threshold=0.1)),
            "f": (PROMPTS["f"], base.clone(temperature=temperature, seed=9, latent_seed=77, max_loops=5, exit_threshold=1.0)),
            "t": (PROMPTS["t"], base.clone(temperature=temperature, seed=2, latent_seed=12345, max_loops=8,
                                              exit_threshold=0.2))}


def replay(model, done: dict, **kw) -> dict:
    """Each completion's logprobs recomputed from what the rollout reports (its effective loop fields)."""
    rids = sorted(done)
    eff = [done[r].sampling_params for r in rids]
    lps = replay_logprobs_batch(model, [done[r].prompt_token_ids for r in rids],
                                [done[r].outputs[0].token_ids for r in rids],
                                [done[r].outputs[0].exit_depths for r in rids],
                                max_loops=[p.max_loops for p in eff], latent_seed=[p.latent_seed for p in eff], **kw)
    return dict(zip(rids, lps))


def test_rollouts_align_and_replay_at_their_depths(ckpts):
    path, _ = ckpts
    done = drain(engine(path), rollouts())
    depths = set()
    for rid, (prompt, params) in rollouts().items():
        out, c = done[rid], done[rid].outputs[0]
        eff = out.sampling_params
        assert (eff.max_loops, eff.latent_seed) == (params.max_loops or 6, params.latent_seed)  # 6: mean_recurrence
        assert len(c.token_ids) == len(c.logprobs) == len(c.token_logprobs) == len(c.exit_depths) == 8
        assert all(list(step) == [t] for t, step in zip(c.token_ids, c.logprobs))  # logprobs=0: the sampled one
        assert c.exit_depths[0] == eff.max_loops and all(2 <= d <= eff.max_loops for d in c.exit_depths)
        assert out.weight_version == 0
        depths.update(c.exit_depths[1:])
    assert len(depths) >= 3  # the convergence exit fired at varied iterations
    model = load_looped_model(path, torch.float32)
    replayed = replay(model, done)
    for rid, lp in replayed.items():
        assert lp.detach() == pytest.approx(torch.tensor(done[rid].outputs[0].token_logprobs), abs=1e-5), rid
    # differentiable: the core block, the adapter and the prelude get gradients
    sum(lp.sum() for lp in replayed.values()).backward()
    for name in ("transformer.core_block.0.attn.Wqkv.weight", "transformer.adapter.weight",
                 "transformer.prelude.0.mlp.fc.weight", "transformer.coda.1.mlp.proj.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name
    # the replay depends on what the rollout reports: another latent seed or other depths give other values
    with torch.no_grad():
        rid, c = "t", done["t"].outputs[0]
        other_seed = replay_logprobs(model, done[rid].prompt_token_ids, c.token_ids, c.exit_depths, max_loops=8, latent_seed=1)
        shallower = replay_logprobs(model, done[rid].prompt_token_ids, c.token_ids,
                                    c.exit_depths[:1] + [2] * (len(c.exit_depths) - 1), max_loops=8,
                                    latent_seed=12345)
    assert (other_seed - replayed[rid].detach()).abs().max() > 1e-3
    assert (shallower - replayed[rid].detach()).abs().max() > 1e-3


def test_processed_logprobs_replay_at_the_temperature(ckpts):
    path, _ = ckpts
    done = drain(engine(path, logprobs_mode="processed_logprobs"), rollouts(temperature=0.7))
    model = load_looped_model(path, torch.float32)
    temps = [done[r].sampling_params.temperature for r in sorted(done)]
    with torch.no_grad():
        replayed = replay(model, done, temperature=temps)
    for rid, lp in replayed.items():
        assert lp == pytest.approx(torch.tensor(done[rid].outputs[0].token_logprobs), abs=1e-5), rid


def test_replay_refuses_what_huginn_rollouts_cannot_be(ckpts):
    model = load_looped_model(ckpts[0], torch.float32)
    with pytest.raises(InvalidRequestError, match=r"for huginn_raven models .* last_exited only") as e:
        replay_logprobs(model, [5, 6], [7, 8], [6, 6], layout="shared")
    assert e.value.param == "layout"
    with pytest.raises(InvalidRequestError, match=r"exit_depths\[0\]\[0\] must be 6: .* max_loops") as e:
        replay_logprobs(model, [5, 6], [7, 8], [4, 4])  # the rollout ran 4 iterations: pass max_loops=4
    assert e.value.param == "exit_depths"
    assert replay_logprobs(model, [5, 6], [7, 8], [4, 4], max_loops=4).shape == (2,)
    with pytest.raises(InvalidRequestError, match=r"integers in \[1, 4\]"):
        replay_logprobs(model, [5, 6], [7, 8], [4, 5], max_loops=4)
    with pytest.raises(InvalidRequestError, match="latent_seed") as e:
        replay_logprobs(model, [5, 6], [7, 8], [6, 6], latent_seed=-1)
    assert e.value.param == "latent_seed"
    with pytest.raises(InvalidRequestError, match="max_loops") as e:
        replay_logprobs_batch(model, [[5]], [[7]], [[6]], max_loops=[6, 6])
    assert e.value.param == "max_loops"


def results(done: dict) -> dict:
    return {rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths, o.outputs[0].token_logprobs)
            for rid, o in done.items()}


def test_update_from_tensors_with_huginn_names(ckpts):
    """A trainer's tensors under upstream names (the tied lm_head left out, as checkpoints do; a persisted
    freqs_cis skipped): the engine then equals a fresh one on the new weights, and the prefix cache
    holds nothing of the old ones."""
    old, new = ckpts
    eng = engine(old, enable_prefix_caching=True)
    before = results(drain(eng, rollouts()))
    assert eng.kv.prefix_cache.num_pages > 0
    ptrs = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    state = load_file(str(new / "model.safetensors"))
    assert "lm_head.weight" not in state
    names = sorted(state)
    eng.start_weight_update(1)
    for part in (names[::2], names[1::2]):
        eng.update_weights([(n, state[n]) for n in part])
    eng.update_weights([("freqs_cis", torch.zeros(4, 8))])
    assert eng.finish_weight_update() == 1
    assert eng.kv.prefix_cache.num_pages == 0 and eng.scheduler.cache_salt == 1
    assert {n: p.data_ptr() for n, p in eng.model.named_parameters()} == ptrs  # copied in place
    assert torch.equal(eng.model.lm_head.weight, eng.model.transformer.wte.weight)
    after = drain(eng, rollouts())
    assert results(after) == results(drain(engine(new), rollouts())) != before
    assert all(o.weight_version == 1 for o in after.values())
    # the tied head sent apart from the embedding is refused (the loader refuses such a checkpoint): in one call,
    # nothing of it is copied and the weights keep serving; in a later call than the head's, the update fails
    # with the head already copied, and the engine refuses to generate until a complete update lands
    wte, apart = state["transformer.wte.weight"], state["transformer.wte.weight"] + 1
    weights = eng.control.weights
    eng.start_weight_update(2)
    with pytest.raises(WeightUpdateError, match="lm_head.weight differs from transformer.wte.weight"):
        eng.update_weights([("transformer.wte.weight", wte), ("lm_head.weight", apart)])
    assert not weights.broken and not weights.in_progress
    eng.start_weight_update(2)
    eng.update_weights([("lm_head.weight", apart)])
    with pytest.raises(WeightUpdateError, match="lm_head.weight differs from transformer.wte.weight"):
        eng.update_weights([("transformer.wte.weight", wte)])
    assert weights.broken
    eng.start_weight_update(2)  # equal tensors, the head sent too: accepted, and the engine serves again
    eng.update_weights([(n, state[n]) for n in names] + [("lm_head.weight", wte.clone())])
    assert eng.finish_weight_update() == 2 and not weights.broken
    assert results(drain(eng, rollouts())) == results(after)
    # an incomplete set (a core weight missing) is refused at finish and names it
    eng.start_weight_update(3)
    eng.update_weights([(n, state[n]) for n in names if n != "transformer.core_block.3.mlp.fc.weight"])
    with pytest.raises(WeightUpdateError, match="transformer.core_block.3.mlp.fc.weight"):
        eng.finish_weight_update()


def test_update_from_disk_refuses_a_tied_head_stored_apart(ckpts, tmp_path):
    """A tied checkpoint storing lm_head.weight unequal to the embedding (the loader refuses it) is refused
    by the dry run, before any tensor is copied: the old weights keep serving, nothing is broken."""
    import shutil

    from safetensors.torch import save_file

    old, new = ckpts
    bad = tmp_path / "apart"
    shutil.copytree(new, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1
    save_file(state, str(bad / "model.safetensors"))
    eng = engine(old)
    with pytest.raises(WeightUpdateError, match="lm_head.weight differs from transformer.wte.weight"):
        eng.update_weights_from_disk(str(bad), 1)
    assert not eng.control.weights.broken and not eng.control.weights.in_progress
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()  # stored equal: accepted
    save_file(state, str(bad / "model.safetensors"))
    assert eng.update_weights_from_disk(str(bad), 1) == 1


@pytest.mark.slow  # ~6.5 s on 2 cores; default run: test_update_from_tensors_with_huginn_names updates a Huginn
# engine's weights in place, tests/rl updates from disk
def test_update_from_disk(ckpts, tmp_path):
    old, new = ckpts
    eng = engine(old, enable_prefix_caching=True)
    drain(eng, rollouts())
    assert eng.update_weights_from_disk(str(new), 1) == 1
    assert eng.kv.prefix_cache.num_pages == 0
    assert results(drain(eng, rollouts())) == results(drain(engine(new), rollouts()))
    # another architecture is refused naming the field, and the current weights keep serving
    other = make_tiny_huginn_checkpoint(tmp_path / "deeper", seed=3, mean_recurrence=7)
    with pytest.raises(WeightUpdateError, match=r"mean_recurrence=7 \(serving 6\)"):
        eng.update_weights_from_disk(str(other), 2)


def test_rollout_server_generates_what_the_replay_recomputes(ckpts):
    """The trainer-facing server (verl plug-in core) on a Huginn checkpoint: its loop defaults reach the
    engine, and each rollout's logprobs equal the replay at its exit iterations."""
    import asyncio

    from loopline.entrypoints.rollout_server import RolloutServer, engine_options

    path, _ = ckpts
    o = engine_options(str(path), dtype="float32", logprobs_mode="raw_logprobs", prompt_length=16, response_length=8,
                       max_model_len=None, max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.5,
                       enforce_eager=True, enable_prefix_caching=True, seed=3,
                       extra={"device": "cpu", "num_kv_blocks": 256, "block_size": 4, "max_num_loops": 8,
                              "max_loops": 8, "min_loops": 2, "exit_threshold": 0.2})

    async def main():
        server = RolloutServer(o.build(), o.limits, o.loop_defaults)
        try:
            return await asyncio.gather(*[server.generate(PROMPTS["s"], {"temperature": 1.0, "logprobs": True}, "r")
                                          for _ in range(3)])
        finally:
            server.llm.shutdown()

    results = asyncio.run(main())
    assert len({tuple(r.token_ids) for r in results}) > 1 and len({d for r in results for d in r.exit_depths}) > 1
    model = load_looped_model(path, torch.float32)
    with torch.no_grad():
        for r in results:
            assert 1 <= len(r.token_ids) == len(r.log_probs) == len(r.exit_depths) <= 8 and r.exit_depths[0] == 8
            lp = replay_logprobs(model, PROMPTS["s"], r.token_ids, r.exit_depths, max_loops=8)
            assert lp == pytest.approx(torch.tensor(r.log_probs), abs=1e-5)
