import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopline.models.loader import (
    CheckpointError,
    chat_end_token_ids,
    load_config,
    load_model,
    load_tokenizer,
    load_weights,
)
from loopline.models.ouro import OuroForCausalLM
from loopline.models.tiny import make_tiny_checkpoint, random_state_dict


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(pristine, tmp_path / "ckpt")


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))


def edit_weights(path, fn):
    weights = load_file(path / "model.safetensors")
    fn(weights)
    save_file(weights, path / "model.safetensors")


def reference_model(path, seed=0):
    config = load_config(path)
    model = OuroForCausalLM(config)
    model.load_state_dict(random_state_dict(config, seed))
    return model.eval()


# --- round trips ------------------------------------------------------------------------


def test_round_trip_state_dict_and_forward(pristine):
    model = load_model(pristine)
    ref = reference_model(pristine)
    assert not model.training
    got, want = model.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in got.values())
    assert all(t.data_ptr() % 64 == 0 for t in got.values())  # own, aligned storage, not views of the file
    ids = torch.randint(0, 500, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model.forward_dense(ids), ref.forward_dense(ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.gate_logits, b.gate_logits)
    assert torch.isfinite(a.logits).all()


def test_sharded_loads_identically(pristine, tmp_path):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", seed=0, shards=4)
    a, b = load_weights(pristine), load_weights(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[5, 9, 200, 31]])
    with torch.no_grad():
        assert torch.equal(load_model(pristine).forward_dense(ids).logits, load_model(sharded).forward_dense(ids).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
def test_dtype_argument(pristine, dtype):
    model = load_model(pristine, dtype=dtype)
    want = torch.bfloat16 if dtype == "bfloat16" else dtype
    assert all(p.dtype == want for p in model.parameters())
    ref = random_state_dict(load_config(pristine), 0)
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"].to(want))
    with torch.no_grad():
        out = model.forward_dense(torch.tensor([[3, 4, 5]]))
    assert torch.isfinite(out.logits).all()


def test_dtype_none_uses_config_torch_dtype(tmp_path):
    path = make_tiny_checkpoint(tmp_path, torch_dtype="bfloat16")
    assert load_file(path / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in load_model(path).parameters())
    assert all(p.dtype == torch.float32 for p in load_model(path, dtype=torch.float32).parameters())
    with pytest.raises(ValueError, match="float64"):
        load_model(path, dtype=torch.float64)


def test_config_fields_eos_merge_and_extra(ckpt):
    edit_config(ckpt, eos_token_id=[2, 0], head_dim=..., num_key_value_heads=..., max_window_layers=2,
                sliding_window=4096)  # sliding_window is metadata while use_sliding_window is false
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    config = load_config(ckpt)
    assert config.eos_token_ids == (2, 0, 5)
    assert config.head_dim == 64 // 4 and config.num_key_value_heads == 4  # defaults
    assert config.extra["max_window_layers"] == 2 and config.extra["tie_word_embeddings"] is False
    (ckpt / "generation_config.json").unlink()
    assert load_config(ckpt).eos_token_ids == (2, 0)


def test_transformers5_style_keys(ckpt):
    edit_config(ckpt, rope_theta=..., torch_dtype=..., dtype="bfloat16", rope_scaling=...,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    config = load_config(ckpt)
    assert config.rope_theta == 5000.0 and config.torch_dtype == "bfloat16"


def test_ignores_persisted_rotary_buffer(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(ckpt)


def test_tied_config_with_lm_head_is_accepted(ckpt):
    edit_config(ckpt, tie_word_embeddings=True)
    model = load_model(ckpt)
    assert torch.equal(model.lm_head.weight, random_state_dict(load_config(ckpt), 0)["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # the file's lm_head wins


# --- config errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"model_type": "qwen2"}, r"model_type='qwen2'.*\"ouro\""),
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=True"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling=.*yarn"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'.*silu"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_size": ...}, "missing required field.*hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0.*positive integer"),
        ({"intermediate_size": -5}, "intermediate_size=-5"),
        ({"vocab_size": "512"}, "vocab_size='512'"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        ({"head_dim": ..., "num_attention_heads": 3, "num_key_value_heads": 3}, "hidden_size=64 is not divisible"),
        ({"torch_dtype": "float64"}, "torch_dtype='float64'"),
        ({"eos_token_id": 9999}, "eos_token_id=9999"),
        ({"early_exit_threshold": 1.5}, r"early_exit_threshold=1.5.*\[0, 1\]"),
    ],
)
def test_bad_config_raises(ckpt, changes, pattern):
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_config(ckpt)
    assert "config.json" in str(info.value)
    with pytest.raises(CheckpointError):
        load_model(ckpt)


def test_missing_directory_and_files(tmp_path, ckpt):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nope")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        load_model(ckpt)


def test_invalid_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: invalid JSON"):
        load_config(ckpt)
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        load_config(ckpt)


def test_bad_generation_config(ckpt):
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id='two'"):
        load_config(ckpt)


# --- weight errors ------------------------------------------------------------------------


def test_missing_tensor(ckpt):
    edit_weights(ckpt, lambda w: (w.pop("model.layers.1.mlp.up_proj.weight"), w.pop("model.norm.weight")))
    with pytest.raises(CheckpointError, match="missing.*model.layers.1.mlp.up_proj.weight, model.norm.weight"):
        load_model(ckpt)


def test_missing_tensors_are_summarised(ckpt):
    edit_weights(ckpt, lambda w: [w.pop(k) for k in list(w) if k.startswith("model.layers.1.")])
    with pytest.raises(CheckpointError, match=r"\(11 in all\)"):
        load_model(ckpt)


def test_unexpected_tensor(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}))
    with pytest.raises(CheckpointError, match="unexpected.*model.layers.2.mlp.up_proj.weight"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(CheckpointError, match=r"wrong shape.*k_proj.weight \(64, 64\) \(expected \(32, 64\)\)"):
        load_model(ckpt)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_tensor(ckpt, bad):
    def poison(w):
        w["model.layers.0.mlp.down_proj.weight"][3, 4] = bad
    edit_weights(ckpt, poison)
    with pytest.raises(CheckpointError, match="non-finite.*model.layers.0.mlp.down_proj.weight"):
        load_model(ckpt)


def test_overflow_when_casting_is_non_finite(ckpt):
    edit_weights(ckpt, lambda w: w["model.norm.weight"].__setitem__(0, 1e6))
    load_model(ckpt)  # fine in float32
    with pytest.raises(CheckpointError, match="non-finite.*as float16.*model.norm.weight"):
        load_model(ckpt, dtype=torch.float16)


def test_integer_tensor(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match="not floating point.*model.norm.weight"):
        load_model(ckpt)


@pytest.mark.parametrize("keep", [0, 3, 100, -4])
def test_truncated_file(ckpt, keep):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt or truncated"):
        load_weights(ckpt)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no weights.*pytorch_model.bin.*only safetensors"):
        load_model(ckpt)


def test_tied_config_without_lm_head(ckpt):
    edit_config(ckpt, tie_word_embeddings=True)
    edit_weights(ckpt, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="tie_word_embeddings=true.*lm_head.weight"):
        load_model(ckpt)


# --- sharded errors ---------------------------------------------------------------------------


@pytest.fixture
def sharded(tmp_path):
    return make_tiny_checkpoint(tmp_path / "sharded", seed=0, shards=3)


def test_missing_shard(sharded):
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard.*model-00002-of-00003.safetensors"):
        load_model(sharded)


def test_tensor_in_wrong_shard(sharded):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00003.safetensors: .*absent: lm_head.weight"):
        load_weights(sharded)


def test_truncated_shard(sharded):
    shard = sharded / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors: corrupt or truncated"):
        load_model(sharded)


def test_bad_index(sharded):
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map is missing"):
        load_weights(sharded)


# --- tokenizer ----------------------------------------------------------------------------------


def test_load_tokenizer_from_dir_and_file(pristine):
    tok = load_tokenizer(pristine)
    assert chat_end_token_ids(tok) == [2]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False).startswith("<|im_start|>user\n")
    bare = load_tokenizer(pristine / "tokenizer.json")
    assert bare.encode("hello world") == tok.encode("hello world")


def test_load_tokenizer_missing_files(ckpt, tmp_path):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_tokenizer(ckpt)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")


@pytest.mark.parametrize("content", ["garbage", '{"bad": 1}'])
def test_load_tokenizer_corrupt_file(ckpt, content):
    (ckpt / "tokenizer.json").write_text(content)
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot load the tokenizer"):
        load_tokenizer(ckpt)


def test_chat_end_token_ids_without_im_end():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    assert chat_end_token_ids(tok) == []


def test_hub_id_and_missing_path_say_local_directories_only(tmp_path):
    from loopline.errors import LooplineError

    with pytest.raises(CheckpointError, match="loads local checkpoint directories only") as info:
        load_config("ByteDance/Ouro-1.4B")
    msg = str(info.value)
    assert "hf download ByteDance/Ouro-1.4B --local-dir ./Ouro-1.4B" in msg and "\n" not in msg
    assert isinstance(info.value, LooplineError)  # the CLI prints it as one line
    with pytest.raises(CheckpointError, match="does not exist .*local checkpoint directories only"):
        load_config(tmp_path / "missing")
