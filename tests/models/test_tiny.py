import json

import pytest
import torch
from safetensors.torch import load_file

from loopline.models.loader import load_config, load_model, load_tokenizer
from loopline.models.ouro import OuroForCausalLM
from loopline.models.tiny import (
    CHAT_TEMPLATE,
    make_tiny_checkpoint,
    random_checkpoint_config,
    random_state_dict,
    tiny_config,
)


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_seed_gives_identical_bytes(tmp_path):
    a = _files(make_tiny_checkpoint(tmp_path / "a", seed=3))
    b = _files(make_tiny_checkpoint(tmp_path / "b", seed=3))
    assert set(a) == {
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    }
    assert a == b


def test_different_seed_gives_different_weights(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=0)
    b = make_tiny_checkpoint(tmp_path / "b", seed=1)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(not torch.equal(wa[k], wb[k]) for k in wa)
    # Only the weights depend on the seed.
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()


def test_sharded_is_deterministic_and_replaces_single_file(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=0)  # single file first: must be removed
    make_tiny_checkpoint(a, seed=0, shards=3)
    b = make_tiny_checkpoint(tmp_path / "b", seed=0, shards=3)
    assert _files(a) == _files(b)
    assert not (a / "model.safetensors").exists()
    index = json.loads((a / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for shard in shards:
        names = load_file(a / shard).keys()
        assert names == {n for n, s in index["weight_map"].items() if s == shard}


def test_config_json_has_hf_fields_and_overrides(tmp_path):
    path = make_tiny_checkpoint(tmp_path, num_key_value_heads=4, total_ut_steps=3, num_hidden_layers=1, vocab_size=600)
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "ouro" and raw["architectures"] == ["OuroForCausalLM"]
    assert raw["num_key_value_heads"] == 4 and raw["total_ut_steps"] == 3
    assert raw["num_hidden_layers"] == 1 and raw["vocab_size"] == 600
    assert raw["tie_word_embeddings"] is False and raw["use_sliding_window"] is False
    assert raw["sliding_window"] is None and raw["rope_scaling"] is None
    assert raw["hidden_act"] == "silu" and raw["torch_dtype"] == "float32"
    assert raw["eos_token_id"] == 0 and raw["bos_token_id"] == 0 and raw["head_dim"] == 16
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    assert load_config(path) == tiny_config(num_key_value_heads=4, total_ut_steps=3, num_hidden_layers=1,
                                            vocab_size=600, eos_token_ids=(0, 2))


def test_bad_overrides_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="num_hidden_layer"):
        make_tiny_checkpoint(tmp_path, num_hidden_layer=1)
    with pytest.raises(ValueError, match="vocab_size=100"):
        make_tiny_checkpoint(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="shards=0"):
        make_tiny_checkpoint(tmp_path, shards=0)


def test_weight_init_scales():
    w = random_state_dict(tiny_config(hidden_size=256, head_dim=64), seed=0)
    assert abs(w["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 0.002
    norm = w["model.layers.1.post_attention_layernorm_2.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.03 and abs(norm.std().item() - 0.1) < 0.03
    assert abs(w["model.early_exit_gate.weight"].std().item() - 2 / 16) < 0.03


def test_tiny_model_exits_at_varied_depths(tmp_path):
    model = load_model(make_tiny_checkpoint(tmp_path))
    ids = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lambdas = model.forward_dense(ids, compute_logits=False).exit_lambdas  # [R, B, T]
    cdf = 1 - torch.cumprod(1 - lambdas, dim=0)
    depth = ((cdf >= 0.9).float().cumsum(0) == 0).sum(0).clamp(max=lambdas.shape[0] - 1) + 1
    assert len(depth.unique()) >= 3, depth


def test_tokenizer_round_trip_and_special_ids(tmp_path):
    tok = load_tokenizer(make_tiny_checkpoint(tmp_path))
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert 450 <= len(tok) <= 512
    for text in ["The river town woke slowly.", "def add(a, b):\n    return a + b\n", "héllo ✓ 日本 1024", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    common = tok.encode("the capital of France", add_special_tokens=False)
    assert len(common) < len("the capital of France") / 2  # merges were learned
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 1
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0


def test_chat_template_renders_chatml(tmp_path):
    tok = load_tokenizer(make_tiny_checkpoint(tmp_path))
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages[1:], tokenize=False) == "<|im_start|>user\nHi!<|im_end|>\n"


@pytest.mark.parametrize("name, layers", [("ouro-1.4b", 24), ("Ouro-2.6B-Thinking", 48)])
def test_random_checkpoint_config_has_real_shapes(name, layers):
    config = random_checkpoint_config(name)
    assert config.num_hidden_layers == layers
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 2048, 5632)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 16, 128)
    assert (config.rope_theta, config.total_ut_steps, config.early_exit_threshold) == (1e6, 4, 1.0)
    assert config.max_position_embeddings == 65536 and config.eos_token_ids == (0,)
    with torch.device("meta"):
        params = sum(p.numel() for p in OuroForCausalLM(config).parameters())
    assert params == {24: 1_434_652_673, 48: 2_667_974_657}[layers]  # reference/ouro.md §5


def test_random_checkpoint_config_rejects_unknown_name():
    with pytest.raises(ValueError, match="ouro-1.4b, ouro-2.6b"):
        random_checkpoint_config("ouro-7b")
