"""loopline.compat.vllm_rlt: every name, keyword and return type vime's NativeEngine uses (no vime needed).

The interface is shared/reference/training-adapters.md, Part A. Engines run on the tiny checkpoint in fp32.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import random
import sys

import pytest
import torch

from loopline.compat import vllm_rlt as V
from loopline.errors import EngineStateError
from loopline.models.loader import load_model
from loopline.rl import replay_logprobs

TOL = 1e-5


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def make_llm(tiny, **kw) -> V.LLM:
    kw.setdefault("cache_config", V.CacheConfig(num_blocks=256, block_size=4))
    kw.setdefault("scheduler_config", V.SchedulerConfig(max_num_seqs=4))
    return V.LLM(str(tiny.path), device="cuda", dtype=torch.float32, attention_backend="triton", **kw)


@pytest.fixture(scope="module")
def llm(tiny_gqa):
    out = make_llm(tiny_gqa)
    yield out
    out.close()


@pytest.fixture(scope="module")
def trained(tiny_factory):
    """Another tiny checkpoint of the same architecture: the trainer's new weights."""
    return tiny_factory(3)


def rollout_params(seed: int, **kw) -> V.SamplingParams:
    """What vime sends: one seed per sample, top_p=1, top_k=-1, logprobs=0, processed, fixed depth."""
    kw.setdefault("max_loops", 4)
    kw.setdefault("min_loops", kw["max_loops"])
    return V.SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0, top_k=-1, seed=seed, logprobs=0,
                            logprobs_mode="processed", ignore_eos=True, **kw)


def tokens(outs) -> list:
    return [(o.token_ids, o.exit_depths) for o in outs]


# --- configuration and sampling parameters ----------------------------------------------------------
def test_config_dataclasses_have_defaults_for_every_field():
    for cls, field, value in ((V.CacheConfig, "num_blocks", 7), (V.ExecutionConfig, "cuda_graphs", True),
                              (V.SchedulerConfig, "max_num_seqs", 3)):
        assert dataclasses.is_dataclass(cls)
        cls()  # every field has a default
        assert getattr(cls(**{field: value}), field) == value
    assert V.ExecutionConfig().cuda_graphs is False


def test_sampling_params_fields_defaults_and_frozen():
    expected = dict(max_tokens=16, temperature=0.0, top_p=1.0, top_k=-1, seed=0, latent_seed=None, logprobs=None,
                    logprobs_mode="raw", stop_token_ids=(), min_loops=2, max_loops=None, exit_threshold=1.0,
                    ignore_eos=False, priority=0)
    sp = V.SamplingParams()
    assert {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)} == expected
    assert list(expected) == [f.name for f in dataclasses.fields(sp)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.seed = 3
    sp2 = dataclasses.replace(sp, seed=None, temperature=0.7, stop_token_ids=[2])
    assert (sp2.seed, sp2.temperature, sp2.latent_seed, sp2.stop_token_ids) == (None, 0.7, None, (2,))
    assert V.SamplingParams(seed=2**63 - 1, logprobs=0, logprobs_mode="processed").seed == 2**63 - 1


@pytest.mark.parametrize("bad", [dict(logprobs=1), dict(logprobs=True), dict(logprobs_mode="raw_logprobs"),
                                 dict(logprobs_mode="x"), dict(seed=-1), dict(seed=2**63), dict(seed=1.5),
                                 dict(latent_seed=3), dict(max_tokens=0), dict(top_k=0), dict(top_p=0.0),
                                 dict(temperature=-1.0), dict(min_loops=3, max_loops=2), dict(exit_threshold=1.5)])
def test_sampling_params_validation_raises_value_error(bad):
    with pytest.raises(ValueError):
        V.SamplingParams(**bad)


# --- LLM construction ---------------------------------------------------------------------------------
def test_cuda_request_falls_back_to_cpu_with_a_warning(tiny_gqa, caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as inside a GPU-less Ray actor
    with caplog.at_level(logging.WARNING, logger="loopline"):
        llm = V.LLM(tiny_gqa.path, cache_config=V.CacheConfig(num_blocks=32))  # PathLike, bf16 default
    assert "CPU" in caplog.text
    assert llm.engine.config.device.type == "cpu" and llm.engine.config.dtype == torch.bfloat16
    assert llm.engine.config.attention_backend == "torch"
    llm.close()
    with pytest.raises(EngineStateError):
        llm.generate([[5, 6]], [V.SamplingParams()])


def test_accepts_a_module_and_dtype_strings(tiny_gqa, llm):
    module = load_model(tiny_gqa.path, torch.float32)
    other = V.LLM(module, device="cpu", dtype="float32", attention_backend="torch",
                  cache_config=V.CacheConfig(num_blocks=64, block_size=4))
    sp = V.SamplingParams(max_tokens=5, ignore_eos=True)
    assert tokens(other.generate([ids(5, 1)], [sp])) == tokens(llm.generate([ids(5, 1)], [sp]))
    assert isinstance(llm.engine.model, torch.nn.Module)
    assert "model.layers.0.self_attn.q_proj.weight" in dict(llm.engine.model.named_parameters())
    with pytest.raises(ValueError):
        V.LLM(module, device="cpu", dtype="int8")


# --- generate -----------------------------------------------------------------------------------------
def test_generate_returns_one_finished_output_per_prompt_in_order(llm):
    prompts = [ids(n, s) for s, n in enumerate([3, 9, 5, 12, 4, 7])]  # more prompts than max_num_seqs
    params = [rollout_params(100 + i) for i in range(len(prompts))]
    params[2] = dataclasses.replace(params[2], logprobs=None, max_tokens=3)
    version = llm.get_weight_version()
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts) and len({o.request_id for o in outs}) == len(outs)
    for o, p, sp in zip(outs, prompts, params):
        assert isinstance(o, V.RequestOutput) and dataclasses.is_dataclass(o)
        assert o.prompt_token_ids == p and o.finished is True and o.text == ""
        assert isinstance(o.request_id, str) and o.weight_version == version == 0
        assert len(o.token_ids) == sp.max_tokens and o.finish_reason == "length"
        assert o.exit_depths == [4] * len(o.token_ids)
        assert o.sampling_params.seed == sp.seed and isinstance(o.sampling_params, V.SamplingParams)
        if sp.logprobs is None:
            assert o.log_probs is None
        else:
            assert len(o.log_probs) == len(o.token_ids) and all(isinstance(x, float) for x in o.log_probs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        outs[0].token_ids = []


def test_same_seed_same_tokens_whatever_the_batch_or_engine(tiny_gqa, llm):
    target, sp = ids(8, 42), rollout_params(7)
    alone = llm.generate([target], [sp])[0]
    crowd = llm.generate([ids(5, 1), target, ids(11, 2)], [rollout_params(1), sp, rollout_params(2)])[1]
    other_engine = make_llm(tiny_gqa, scheduler_config=V.SchedulerConfig(max_num_seqs=2)).generate([target], [sp])[0]
    for o in (crowd, other_engine):
        assert (o.token_ids, o.exit_depths) == (alone.token_ids, alone.exit_depths)
        assert max(abs(a - b) for a, b in zip(o.log_probs, alone.log_probs)) < TOL


def test_seed_none_samples_differently(llm):
    sp = dataclasses.replace(rollout_params(0), seed=None, max_tokens=8)
    outs = llm.generate([ids(6, 3)] * 4, [sp] * 4)
    seeds = {o.sampling_params.seed for o in outs}
    assert len(seeds) == 4 and None not in seeds
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stops_at_eos_or_a_stop_token_included(llm):
    greedy = V.SamplingParams(max_tokens=6)
    first = llm.generate([ids(7, 5)], [greedy])[0].token_ids[0]
    out = llm.generate([ids(7, 5)], [dataclasses.replace(greedy, stop_token_ids=(first,))])[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    eos = llm.engine.model_config.eos_token_ids[0]
    out = llm.generate([ids(7, 5)], [dataclasses.replace(greedy, stop_token_ids=[eos], ignore_eos=True)])[0]
    assert out.finish_reason in ("stop", "length") and out.token_ids


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_depth", "adaptive"])
def test_logprob_semantics_equal_a_dense_teacher_forced_forward(tiny_gqa, llm, adaptive):
    model = load_model(tiny_gqa.path, torch.float32)
    loops = dict(min_loops=1, max_loops=4, exit_threshold=0.6) if adaptive else {}
    prompts = [ids(n, 20 + n) for n in (4, 10, 6)]
    for temperature in (0.0, 0.7):
        sps = [dataclasses.replace(rollout_params(50 + i, **loops), temperature=temperature, max_tokens=8)
               for i in range(len(prompts))]
        processed = llm.generate(prompts, sps)
        raw = llm.generate(prompts, [dataclasses.replace(sp, logprobs_mode="raw") for sp in sps])
        assert tokens(processed) == tokens(raw), "the mode never changes the sampled tokens"
        depths = {d for o in processed for d in o.exit_depths}
        assert (len(depths) > 1) if adaptive else depths == {4}
        for p, r in zip(processed, raw):
            for out, t in ((p, temperature), (r, 1.0)):  # processed: T (greedy: 1); raw: 1
                ref = replay_logprobs(model, out.prompt_token_ids, out.token_ids, out.exit_depths, temperature=t)
                assert (ref - torch.tensor(out.log_probs)).abs().max().item() < TOL


def test_loop_fields(llm):
    prompt = ids(6, 9)
    at_min = llm.generate([prompt], [V.SamplingParams(max_tokens=5, min_loops=2, exit_threshold=0.0)])[0]
    assert at_min.exit_depths == [2] * 5  # threshold 0: every token exits at min_loops
    assert at_min.sampling_params.exit_threshold == 0.0 and at_min.sampling_params.max_loops == 2
    default = llm.generate([prompt], None)[0]  # the defaults: greedy, seed 0, fixed depth (the model's 4 loops)
    assert default.exit_depths == [4] * len(default.token_ids) and default.sampling_params.max_loops == 4
    assert default.token_ids == llm.generate([prompt], V.SamplingParams())[0].token_ids
    capped = llm.generate([prompt], [V.SamplingParams(max_tokens=3, min_loops=9)])[0]  # above the depth: capped
    assert capped.exit_depths == [4] * 3
    with pytest.raises(ValueError):
        llm.generate([prompt], [V.SamplingParams(max_loops=5)])  # deeper than the model
    with pytest.raises(ValueError):
        llm.generate([prompt, prompt], [V.SamplingParams()])  # one params per prompt


def test_truncation_and_priority_reach_the_engine(llm):
    prompt = ids(6, 11)
    sp = V.SamplingParams(max_tokens=6, temperature=1.0, top_k=3, top_p=0.9, seed=4, logprobs=0,
                          logprobs_mode="processed", priority=3, ignore_eos=True)
    out = llm.generate([prompt], [sp])[0]
    assert out.sampling_params.priority == 3 and out.sampling_params.top_k == 3
    # processed logprobs are renormalised over the 3 kept tokens (untruncated: about -6.2 on this near-uniform model)
    assert min(out.log_probs) > -3.0
    assert max(out.log_probs) <= 0 and len(out.token_ids) == 6


def test_a_small_kv_pool_makes_requests_wait_not_fail(tiny_gqa):
    small = make_llm(tiny_gqa, cache_config=V.CacheConfig(num_blocks=40, block_size=4))  # 16 pages a request (4 planes): 2 at a time
    prompts = [ids(10, s) for s in range(6)]
    outs = small.generate(prompts, [rollout_params(s) for s in range(6)])
    assert [len(o.token_ids) for o in outs] == [6] * 6


# --- control ------------------------------------------------------------------------------------------
def test_pause_is_idempotent_and_generate_refuses_while_paused(llm):
    llm.pause_generation()
    llm.pause_generation()
    with pytest.raises(EngineStateError, match="paused"):
        llm.generate([[5, 6, 7]], [V.SamplingParams()])
    llm.resume_generation()
    llm.reset_prefix_cache()
    assert llm.generate([[5, 6, 7]], [V.SamplingParams(max_tokens=2)])[0].token_ids


# --- weights ------------------------------------------------------------------------------------------
def shards(state: dict, n: int = 3) -> list[list]:
    names = sorted(state)
    return [[(k, state[k].clone()) for k in names[i::n]] for i in range(n)]


def publish(llm, state, version):
    llm.pause_generation()
    llm.start_weight_update(version)
    for shard in shards(state):
        llm.update_weights(iter(shard))  # an iterable, consumed once
    assert llm.finish_weight_update() == version
    llm.resume_generation()


PROBE = [(ids(6, 70), rollout_params(70)), (ids(11, 71), rollout_params(71, max_loops=3))]


def probe(llm):
    return [(o.token_ids, o.log_probs) for o in llm.generate([p for p, _ in PROBE], [sp for _, sp in PROBE])]


def test_full_update_serves_the_new_weights(tiny_gqa, trained):
    llm = make_llm(tiny_gqa)
    assert llm.get_weight_version() == 0
    with pytest.raises(ValueError, match="version"):
        llm.start_weight_update(0)  # not strictly newer
    publish(llm, trained.state_dict, 3)
    assert llm.get_weight_version() == 3
    assert probe(llm) == probe(make_llm(trained))
    assert all(o.weight_version == 3 for o in llm.generate([[5, 6]], [V.SamplingParams(max_tokens=2)]))
    for version in (3, 2):
        with pytest.raises(ValueError, match="version"):
            llm.start_weight_update(version)


def _bad_shard(state: dict, kind: str) -> list:
    name = "model.layers.0.mlp.down_proj.weight"
    t = state[name].clone()
    return {"unknown": [("model.not_a_layer.weight", t)],
            "duplicate": [(name, t), (name, t)],
            "shape": [(name, t[:, :-1])],
            "dtype": [(name, t.to(torch.int32))],
            "nonfinite": [(name, t.index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(math.nan)))],
            }[kind]


@pytest.mark.parametrize("kind", ["unknown", "duplicate", "shape", "dtype", "nonfinite"])
def test_a_rejected_shard_changes_nothing_and_the_old_weights_keep_serving(tiny_gqa, trained, kind):
    llm = make_llm(tiny_gqa)
    before = probe(llm)
    llm.pause_generation()
    llm.start_weight_update(1)
    good = [(n, t) for n, t in sorted(trained.state_dict.items()) if n != "model.layers.0.mlp.down_proj.weight"][:4]
    with pytest.raises(ValueError) as err:
        llm.update_weights(good + _bad_shard(trained.state_dict, kind))  # valid entries first: still nothing copied
    assert "model." in str(err.value)  # names the tensor
    assert llm.get_weight_version() == 0
    llm.resume_generation()
    assert probe(llm) == before
    publish(llm, trained.state_dict, 1)  # recovery: a newer version is accepted
    assert probe(llm) == probe(make_llm(trained))


@pytest.mark.parametrize("failure", ["incomplete", "later_shard_rejected"])
def test_a_failure_after_copies_refuses_to_serve_a_mixture_until_a_newer_complete_update(tiny_gqa, trained, failure):
    llm = make_llm(tiny_gqa)
    llm.pause_generation()
    llm.start_weight_update(1)
    first, second, third = shards(trained.state_dict)
    llm.update_weights(first)
    with pytest.raises(ValueError):
        if failure == "incomplete":
            llm.update_weights(second)
            llm.finish_weight_update()  # `third` never arrived
        else:
            llm.update_weights(_bad_shard(trained.state_dict, "shape"))
    assert llm.get_weight_version() == 0
    with pytest.raises(EngineStateError):
        llm.resume_generation()
    with pytest.raises(EngineStateError):
        llm.generate([[5, 6]], [V.SamplingParams()])
    with pytest.raises(ValueError):
        llm.start_weight_update(0)
    publish(llm, trained.state_dict, 2)
    assert llm.get_weight_version() == 2 and probe(llm) == probe(make_llm(trained))


# --- how vime finds the module ------------------------------------------------------------------------
def test_both_import_routes_give_vime_the_names(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm_rlt", raising=False)
    monkeypatch.setitem(sys.modules, "vllm_rlt", V)  # route 1: the alias
    from vllm_rlt import LLM, CacheConfig, ExecutionConfig, SamplingParams, SchedulerConfig  # vime's import
    assert (LLM, CacheConfig, ExecutionConfig, SamplingParams, SchedulerConfig) == (
        V.LLM, V.CacheConfig, V.ExecutionConfig, V.SamplingParams, V.SchedulerConfig)
    monkeypatch.delitem(sys.modules, "vllm_rlt")  # route 2: the one-line shim on the path (docs/rl.md)
    (tmp_path / "vllm_rlt.py").write_text(
        "import sys, loopline.compat.vllm_rlt; sys.modules[__name__] = loopline.compat.vllm_rlt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    shim = importlib.import_module("vllm_rlt")
    assert shim is V and shim.RequestOutput is V.RequestOutput
