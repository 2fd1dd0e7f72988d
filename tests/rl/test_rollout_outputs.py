"""What a trainer reads from a rollout: aligned logprobs, effective parameters, seeds, stops, versions."""
from __future__ import annotations

import pytest

from loopline import SamplingParams


def test_logprobs_zero_gives_the_sampled_token_aligned_one_to_one(tiny_gqa, engine_for, run, ids):
    engine = engine_for(tiny_gqa)
    params = SamplingParams(n=2, max_tokens=7, temperature=1.0, logprobs=0, ignore_eos=True, exit_threshold=0.6)
    out = run(engine, {"a": (ids(6), params)})["a"]
    for c in out.outputs:
        assert len(c.token_ids) == len(c.logprobs) == len(c.token_logprobs) == len(c.exit_depths) == 7
        for tid, step, flat in zip(c.token_ids, c.logprobs, c.token_logprobs):
            assert list(step) == [tid]  # logprobs=0: exactly the sampled token
            assert step[tid].logprob == flat <= 0.0 and step[tid].rank >= 1
        assert c.cumulative_logprob == pytest.approx(sum(c.token_logprobs), abs=1e-5)
        assert all(isinstance(x, float) for x in c.token_logprobs)
    no_logprobs = run(engine, {"b": (ids(6), params.clone(logprobs=None))})["b"].outputs[0]
    assert no_logprobs.logprobs is None and no_logprobs.token_logprobs is None


def test_outputs_carry_the_effective_sampling_parameters(tiny_gqa, engine_for, run, ids):
    engine = engine_for(tiny_gqa)
    r = tiny_gqa.cfg["total_ut_steps"]
    out = run(engine, {"a": (ids(5), SamplingParams(max_tokens=4, n=3, min_loops=2, ignore_eos=True))})["a"]
    eff = out.sampling_params
    assert eff.seed is not None and eff.max_loops == r and eff.min_loops == 2
    assert eff.exit_threshold == tiny_gqa.cfg["early_exit_threshold"] and eff.max_tokens == 4
    assert eff.logprobs_mode == "raw_logprobs"  # None: the engine's
    assert [c.seed for c in out.outputs] == [eff.seed, eff.seed + 1, eff.seed + 2]  # one stream per child
    assert all(min(c.exit_depths) >= 2 for c in out.outputs)
    # The reported seed reproduces the sample.
    again = run(engine, {"b": (ids(5), eff.clone(n=1, seed=out.outputs[1].seed))})["b"]
    assert again.outputs[0].token_ids == out.outputs[1].token_ids


def test_unseeded_group_does_not_collapse(tiny_gqa, engine_for, run, ids):
    """A GRPO group: the same prompt many times with seed=None (verl sends one request per sample)."""
    engine = engine_for(tiny_gqa)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=0)
    done = run(engine, {f"g{i}": (ids(6), params) for i in range(6)})
    samples = {tuple(o.outputs[0].token_ids) for o in done.values()}
    seeds = {o.outputs[0].seed for o in done.values()}
    assert len(samples) == 6 and len(seeds) == 6


def test_stop_token_ids_end_the_completion_with_the_token(tiny_gqa, engine_for, run, ids):
    engine = engine_for(tiny_gqa)
    free = run(engine, {"a": (ids(6), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))})["a"]
    stop_at = free.outputs[0].token_ids[4]
    first = free.outputs[0].token_ids.index(stop_at)
    out = run(engine, {"b": (ids(6), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0,
                                                    stop_token_ids=[stop_at]))})["b"].outputs[0]
    assert out.token_ids == free.outputs[0].token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert len(out.token_logprobs) == len(out.exit_depths) == first + 1


def test_every_output_carries_its_weight_version(tiny_gqa, engine_for, ids):
    engine = engine_for(tiny_gqa)
    engine.add_request("a", {"prompt_token_ids": ids(5)}, SamplingParams(max_tokens=5, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert seen and all(o.weight_version == 0 for o in seen)
    assert seen[-1].finished and seen[-1].outputs[0].weight_versions == [0] * 5


def test_per_request_logprobs_mode_matches_an_engine_in_that_mode(tiny_gqa, engine_for, run, ids):
    """vime sends logprobs_mode="processed" per request; a batch may mix modes."""
    params = SamplingParams(max_tokens=6, temperature=0.7, top_k=20, ignore_eos=True, logprobs=2, seed=3)
    reqs = {f"r{i}": (ids(5 + i, seed=i), params.clone(seed=i)) for i in range(4)}

    def logprobs(done):
        return {rid: (o.outputs[0].token_ids, o.outputs[0].token_logprobs, o.outputs[0].logprobs) for rid, o in done.items()}

    raw = logprobs(run(engine_for(tiny_gqa), reqs))
    processed = logprobs(run(engine_for(tiny_gqa, logprobs_mode="processed_logprobs"), reqs))
    assert raw != processed
    engine = engine_for(tiny_gqa)  # default raw_logprobs
    everyone = {rid: (p, sp.clone(logprobs_mode="processed")) for rid, (p, sp) in reqs.items()}
    assert logprobs(run(engine, everyone)) == processed
    assert run(engine, {"x": (ids(5), params.clone(logprobs_mode="processed"))})["x"].sampling_params.logprobs_mode \
        == "processed_logprobs"
    mixed = {rid: (p, sp.clone(logprobs_mode=["raw_logprobs", "processed", None, "processed_logprobs"][i]))
             for i, (rid, (p, sp)) in enumerate(reqs.items())}
    got = logprobs(run(engine, mixed))
    assert got == {"r0": raw["r0"], "r1": processed["r1"], "r2": raw["r2"], "r3": processed["r3"]}
    with pytest.raises(Exception, match="logprobs_mode") as info:
        SamplingParams(logprobs_mode="final")
    assert info.value.param == "logprobs_mode"
