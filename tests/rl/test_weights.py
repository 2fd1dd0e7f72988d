"""Full-weight updates: validate everything first, copy in place, commit atomically, fail closed."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopline import SamplingParams
from loopline.errors import EngineStateError, WeightUpdateError
from loopline.models.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0, exit_threshold=0.6)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def new_weights(tiny_factory):
    """Another tiny checkpoint with the same architecture: the 'trained' weights."""
    return tiny_factory(3)


def requests(ids):
    return {"g": (ids(7, seed=1), GREEDY), "s": (ids(12, seed=2), SEEDED)}


def results(done):
    return {rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths, o.outputs[0].token_logprobs)
            for rid, o in done.items()}


def publish(engine, state_dict, version, shards=3):
    names = sorted(state_dict)
    engine.start_weight_update(version)
    for i in range(shards):
        engine.update_weights((n, state_dict[n]) for n in names[i::shards])
    return engine.finish_weight_update()


def test_update_equals_a_fresh_engine_with_the_new_weights(tiny_gqa, new_weights, engine_for, run, ids):
    engine = engine_for(tiny_gqa)
    before = results(run(engine, requests(ids)))
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    assert engine.get_weight_version() == 0
    assert publish(engine, new_weights.state_dict, 1) == 1
    assert engine.get_weight_version() == 1 and engine.scheduler.cache_salt == 1
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs, "copied in place"
    done = run(engine, requests(ids))
    fresh = results(run(engine_for(new_weights), requests(ids)))
    assert results(done) == fresh != before
    assert all(o.weight_version == 1 and o.outputs[0].weight_versions == [1] * 6 for o in done.values())


def test_prefix_cache_is_invalidated(tiny_gqa, new_weights, engine_for, run, ids):
    engine = engine_for(tiny_gqa, enable_prefix_caching=True)
    prompt = ids(13, seed=4)
    run(engine, {"a": (prompt, GREEDY)})
    assert engine.kv.prefix_cache.num_pages > 0
    publish(engine, new_weights.state_dict, 5)
    assert engine.kv.prefix_cache.num_pages == 0
    after = run(engine, {"b": (prompt, GREEDY)})["b"].outputs[0].token_ids
    fresh = run(engine_for(new_weights), {"b": (prompt, GREEDY)})["b"].outputs[0].token_ids
    assert after == fresh


def test_update_from_disk_sharded_and_same_version_noop(tiny_gqa, new_weights, engine_for, run, ids, tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, shards=3)
    engine = engine_for(tiny_gqa)
    assert engine.update_weights_from_disk(str(ckpt), 2) == 2
    assert results(run(engine, requests(ids))) == results(run(engine_for(new_weights), requests(ids)))
    # Re-publishing the committed version with the same weights changes nothing ...
    engine.kv.reset_prefix_cache()
    assert engine.update_weights_from_disk(str(ckpt), 2) == 2 and engine.get_weight_version() == 2
    # ... with other weights it is refused, and the current weights keep serving.
    with pytest.raises(WeightUpdateError, match="already committed with different weights"):
        engine.update_weights_from_disk(str(tiny_gqa.path), 2)
    assert results(run(engine, requests(ids))) == results(run(engine_for(new_weights), requests(ids)))
    with pytest.raises(WeightUpdateError, match="versions must increase"):
        engine.update_weights_from_disk(str(ckpt), 1)


@pytest.mark.parametrize("bad, pattern", [
    (lambda sd: {**sd, "model.layers.9.mlp.up_proj.weight": torch.zeros(3)}, "unknown parameter"),
    (lambda sd: {**sd, "lm_head.weight": sd["lm_head.weight"][:, :5]}, "shape"),
    (lambda sd: {**sd, "model.norm.weight": sd["model.norm.weight"].to(torch.int32)}, "not floating point"),
    (lambda sd: {**sd, "model.norm.weight": sd["model.norm.weight"].clone().fill_(float("nan"))}, "non-finite"),
    (lambda sd: {**sd, "model.norm.weight": sd["model.norm.weight"].double() * 1e300}, "non-finite"),
    (lambda sd: [("model.norm.weight", sd["model.norm.weight"])] * 2, "sent twice"),
    (lambda sd: [("model.norm.weight", [1.0] * 64)], "torch.Tensor"),
    (lambda sd: {**sd, "model.norm.weight": torch.empty(sd["model.norm.weight"].shape, device="meta")},
     "model.norm.weight: a meta tensor"),
    (lambda sd: {**sd, "lm_head.weight": sd["lm_head.weight"].to_sparse()}, "lm_head.weight: a torch.sparse_coo"),
])
def test_rejected_update_leaves_the_old_weights_serving(tiny_gqa, new_weights, engine_for, run, ids, bad, pattern):
    engine = engine_for(tiny_gqa)
    before = results(run(engine, requests(ids)))
    engine.start_weight_update(1)
    with pytest.raises(WeightUpdateError, match=pattern):
        engine.update_weights(bad(new_weights.state_dict))
    assert engine.get_weight_version() == 0 and not engine.weights.in_progress and not engine.weights.broken
    done = run(engine, requests(ids))
    assert results(done) == before and all(o.weight_version == 0 for o in done.values())


def test_bad_versions(tiny_gqa, new_weights, engine_for):
    engine = engine_for(tiny_gqa)
    for version in (-1, 1.5, "2", True, None):
        with pytest.raises(WeightUpdateError, match="version"):
            engine.start_weight_update(version)
    publish(engine, new_weights.state_dict, 3)
    with pytest.raises(WeightUpdateError, match="versions must increase"):
        engine.start_weight_update(2)
    engine.start_weight_update(4)
    with pytest.raises(EngineStateError, match="in progress"):
        engine.start_weight_update(5)
    engine.abort_weight_update()
    assert engine.get_weight_version() == 3 and not engine.weights.broken


def _assert_refuses_to_generate(engine, ids):
    with pytest.raises(EngineStateError, match="partially updated"):
        engine.add_request("x", {"prompt_token_ids": ids(4)}, GREEDY)
    engine.pause_generation("keep")
    with pytest.raises(EngineStateError, match="partially updated"):
        engine.resume_generation()


@pytest.mark.parametrize("failure", ["second_call_rejected", "finish_incomplete", "copy_raises"])
def test_half_failed_update_blocks_generation_until_fixed(tiny_gqa, new_weights, engine_for, run, ids, failure,
                                                          monkeypatch):
    engine = engine_for(tiny_gqa)
    sd = new_weights.state_dict
    names = sorted(sd)
    engine.start_weight_update(1)
    if failure == "second_call_rejected":
        engine.update_weights((n, sd[n]) for n in names[:5])
        with pytest.raises(WeightUpdateError, match="unknown parameter"):
            engine.update_weights([("nope", torch.zeros(1))])
    elif failure == "finish_incomplete":
        engine.update_weights((n, sd[n]) for n in names[:-1])
        with pytest.raises(WeightUpdateError, match=f"incomplete: 1 parameter.*{names[-1]}"):
            engine.finish_weight_update()
    else:
        real_copy, calls = torch.Tensor.copy_, []

        def flaky_copy(self, src, *a, **kw):
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("device lost")
            return real_copy(self, src, *a, **kw)

        monkeypatch.setattr(torch.Tensor, "copy_", flaky_copy)
        with pytest.raises(EngineStateError, match="partially updated"):
            engine.update_weights(sd.items())
        monkeypatch.undo()
    assert engine.weights.broken and engine.get_weight_version() == 0
    _assert_refuses_to_generate(engine, ids)
    engine.pause_generation("abort")
    # A complete update repairs the engine (even re-publishing the committed version).
    publish(engine, tiny_gqa.state_dict, 0)
    engine.resume_generation()
    assert results(run(engine, requests(ids))) == results(run(engine_for(tiny_gqa), requests(ids)))
    publish(engine, sd, 1)
    assert results(run(engine, requests(ids))) == results(run(engine_for(new_weights), requests(ids)))


def test_updates_need_an_idle_or_paused_engine(tiny_gqa, new_weights, engine_for, run, ids):
    engine = engine_for(tiny_gqa)
    engine.add_request("a", {"prompt_token_ids": ids(5)}, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    with pytest.raises(EngineStateError, match="idle or paused"):
        engine.start_weight_update(1)
    engine.pause_generation("wait")
    with pytest.raises(EngineStateError, match="idle or paused"):
        engine.start_weight_update(1)
    run(engine)
    assert engine.is_drained
    publish(engine, new_weights.state_dict, 1)
    engine.resume_generation()
    # While an update is open, nothing may be generated.
    engine.start_weight_update(2)
    with pytest.raises(EngineStateError, match="in progress"):
        engine.add_request("b", {"prompt_token_ids": ids(5)}, GREEDY)
    engine.abort_weight_update()
    assert run(engine, {"b": (ids(5), GREEDY)})["b"].weight_version == 1


def test_aborted_outputs_carry_the_version_they_were_generated_with(tiny_gqa, new_weights, engine_for, run, ids):
    engine = engine_for(tiny_gqa)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids(4 + i, seed=i)}, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(12):
        assert all(o.weight_version == 0 for o in engine.step())
    engine.pause_generation("abort")
    publish(engine, new_weights.state_dict, 7)
    outs = engine.step()  # the aborted requests' final outputs come after the update committed
    assert len(outs) == 3 and all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert all(o.weight_version == 0 and set(o.outputs[0].weight_versions) <= {0} for o in outs)
    engine.resume_generation()
    assert run(engine, {"n": (ids(4), GREEDY)})["n"].weight_version == 7


def test_llm_methods_delegate(tiny_gqa, new_weights, tmp_path):
    llm = tiny_gqa.llm(skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    llm.start_weight_update(1)
    llm.update_weights(load_file(str(new_weights.path / "model.safetensors")).items())
    assert llm.finish_weight_update() == 1 == llm.get_weight_version()
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].weight_version == 1
    save_file(tiny_gqa.state_dict, str(tmp_path / "model.safetensors"))
    assert llm.update_weights_from_disk(str(tmp_path), 2) == 2
    llm.reset_prefix_cache()
    llm.pause_generation("keep")
    assert llm.is_paused()
    with pytest.raises(EngineStateError, match="paused"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    llm.resume_generation()
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.weight_version == 2


def test_disk_update_validates_every_shard_before_copying(tiny_gqa, engine_for, run, ids, tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, shards=3)
    last = ckpt / "model-00003-of-00003.safetensors"
    tensors = load_file(str(last))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone().fill_(float("inf"))
    save_file(tensors, str(last))
    engine = engine_for(tiny_gqa)
    before = results(run(engine, requests(ids)))
    with pytest.raises(WeightUpdateError, match=f"non-finite.*{name}"):
        engine.update_weights_from_disk(str(ckpt), 1)
    assert not engine.weights.broken and engine.get_weight_version() == 0
    assert results(run(engine, requests(ids))) == before
    other = make_tiny_checkpoint(tmp_path / "other", seed=3, total_ut_steps=3)
    with pytest.raises(WeightUpdateError, match="total_ut_steps=3"):
        engine.update_weights_from_disk(str(other), 1)
    assert results(run(engine, requests(ids))) == before and engine.get_weight_version() == 0


def _drop_tensor(ckpt, shard: str) -> str:
    """Removes one tensor from a shard file and from the index: a complete-looking, incomplete checkpoint."""
    import json

    tensors = load_file(str(ckpt / shard))
    name = sorted(tensors)[-1]
    del tensors[name]
    save_file(tensors, str(ckpt / shard))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return name


def test_disk_update_missing_a_tensor_is_refused_before_any_copy(tiny_gqa, engine_for, run, ids, tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, shards=3)
    missing = _drop_tensor(ckpt, "model-00003-of-00003.safetensors")
    engine = engine_for(tiny_gqa)
    before = results(run(engine, requests(ids)))
    params_before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    with pytest.raises(WeightUpdateError, match=f"incomplete: 1 parameter.*{missing}") as info:
        engine.update_weights_from_disk(str(ckpt), 1)
    assert info.value.param == missing
    assert not engine.weights.broken and not engine.weights.in_progress and engine.get_weight_version() == 0
    assert all(torch.equal(p, params_before[n]) for n, p in engine.model.named_parameters()), "nothing copied"
    assert results(run(engine, requests(ids))) == before  # still serving the old weights


def test_check_complete_names_what_is_missing(tiny_gqa, engine_for):
    engine = engine_for(tiny_gqa)
    names = set(engine.weights.names)
    engine.weights.check_complete(names)
    with pytest.raises(WeightUpdateError, match="2 parameter"):
        engine.weights.check_complete(names - set(sorted(names)[:2]))


def _index_pointing_at(ckpt, target: str) -> None:
    import json

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = target
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink_out", "index_symlink_out", "single_symlink_out",
                                    "generation_config_symlink_out"])
def test_disk_update_refuses_files_outside_the_checkpoint(tiny_gqa, engine_for, run, ids, tmp_path, escape):
    from loopline.models.loader import CheckpointError

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, shards=3)
    outside = make_tiny_checkpoint(tmp_path / "outside", seed=3, shards=3)  # a loadable shard, elsewhere
    shard = "model-00001-of-00003.safetensors"
    if escape == "dotdot":
        _index_pointing_at(ckpt, f"../outside/{shard}")
    elif escape == "absolute":
        _index_pointing_at(ckpt, str(outside / shard))
    elif escape == "symlink_out":
        (ckpt / shard).unlink()
        (ckpt / shard).symlink_to(outside / shard)
    elif escape == "generation_config_symlink_out":
        (outside / "generation_config.json").write_text('{"temperature": 0.5}')
        (ckpt / "generation_config.json").unlink(missing_ok=True)
        (ckpt / "generation_config.json").symlink_to(outside / "generation_config.json")
    elif escape == "index_symlink_out":
        (ckpt / "model.safetensors.index.json").unlink()
        (ckpt / "model.safetensors.index.json").symlink_to(outside / "model.safetensors.index.json")
    else:
        single = make_tiny_checkpoint(tmp_path / "single", seed=3)
        for f in ckpt.glob("model*"):
            f.unlink()
        (ckpt / "model.safetensors").symlink_to(single / "model.safetensors")
    engine = engine_for(tiny_gqa)
    before = results(run(engine, requests(ids)))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        engine.update_weights_from_disk(str(ckpt), 1)
    assert not engine.weights.broken and engine.get_weight_version() == 0
    assert results(run(engine, requests(ids))) == before


def test_symlinks_inside_the_checkpoint_are_fine(tiny_gqa, engine_for, tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, shards=3)
    shard = "model-00002-of-00003.safetensors"
    (ckpt / "blobs").mkdir()
    (ckpt / shard).rename(ckpt / "blobs" / shard)
    (ckpt / shard).symlink_to(ckpt / "blobs" / shard)  # the Hugging Face cache layout
    assert engine_for(tiny_gqa).update_weights_from_disk(str(ckpt), 1) == 1
