"""verl's actor checkpoint -> a directory loopline loads (loopline/integrations/verl_checkpoint.py).

The checkpoint is written the way verl's FSDP2 checkpoint manager writes it (per-rank pickles of
DTensor shards under the Hugging Face names, ``fsdp_config.json``, ``huggingface/config.json`` naming
verl's actor class and its autocast dtype), from a tiny checkpoint's weights split over two ranks; the
export must hold exactly those weights and generate what the original generates. No verl needed."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from loopline.integrations.verl_checkpoint import export_hf, load_actor_state, main
from loopline.models.loader import CheckpointError, load_weights


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def write_verl_actor(src, actor, mesh, world: int = 2):
    """verl's ``global_step_N/actor`` layout for the weights of checkpoint ``src``, sharded over ``world`` ranks."""
    from torch.distributed.tensor import DTensor, Shard

    weights = load_weights(src)
    actor.mkdir(parents=True)
    for rank in range(world):
        shards = {}
        for name, full in weights.items():
            pieces = full.chunk(world, dim=0)  # FSDP2 shards dim 0 in torch.chunk's pieces, empty past the end
            piece = pieces[rank].clone() if rank < len(pieces) else full[:0].clone()
            shards[name] = DTensor.from_local(piece, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                              stride=full.stride())
        torch.save(shards, actor / f"model_world_size_{world}_rank_{rank}.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    hf = actor / "huggingface"
    hf.mkdir()
    config = json.loads((src / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["OuroActorForCausalLM"],
                                                "dtype": "bfloat16", "attn_implementation": "sdpa"}))
    shutil.copyfile(src / "tokenizer.json", hf / "tokenizer.json")
    return weights


def test_export_rebuilds_the_weights_and_generates_as_the_original(tiny_gqa, tmp_path, mesh):
    from loopline import LLM, SamplingParams

    step = tmp_path / "global_step_3"
    weights = write_verl_actor(tiny_gqa.path, step / "actor", mesh)
    state = load_actor_state(step)  # global_step_N works as well as its actor/
    assert list(state) == list(weights)
    for name, full in weights.items():
        assert torch.equal(state[name], full), name
    out = export_hf(step / "actor", tmp_path / "export", base_model=tiny_gqa.path)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["OuroForCausalLM"] and config["torch_dtype"] == "float32"
    assert "dtype" not in config
    assert (out / "generation_config.json").read_bytes() == (tiny_gqa.path / "generation_config.json").read_bytes()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = [{"prompt_token_ids": [3, 9, 4, 17, 5]}]
    got = LLM(str(out), device="cpu", dtype="float32").generate(prompt, params, use_tqdm=False)[0].outputs[0]
    want = tiny_gqa.llm(device="cpu", dtype="float32").generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert list(got.token_ids) == list(want.token_ids)
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-6)


def test_cli_casts_and_bad_checkpoints_name_the_file(tiny_gqa, tmp_path, mesh, capsys):
    actor = tmp_path / "actor"
    write_verl_actor(tiny_gqa.path, actor, mesh, world=1)
    main([str(actor), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    assert "exported" in capsys.readouterr().out
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not (tmp_path / "bf16" / "generation_config.json").exists()  # no --base, none in huggingface/
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a verl actor checkpoint"):
        export_hf(tmp_path / "empty", tmp_path / "x")
    (actor / "model_world_size_1_rank_0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard file\(s\) \['model_world_size_1_rank_0.pt'\]"):
        load_actor_state(actor)
    (actor / "fsdp_config.json").write_text(json.dumps({"world_size": 0}))
    with pytest.raises(CheckpointError, match="world_size=0"):
        load_actor_state(actor)
    with pytest.raises(CheckpointError, match="base_model"):
        export_hf(actor, tmp_path / "y", base_model=tmp_path / "nowhere")
