"""The transformers-compatible Ouro class: HF names, a (loop, layer) cache, generate() == loopline greedy."""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from loopline import SamplingParams
from loopline.models.hf_compat import OuroHFConfig, OuroHFForCausalLM
from loopline.models.ouro import OuroForCausalLM


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@pytest.mark.parametrize("fixture", ["tiny_gqa", "tiny_mha"])
def test_greedy_generate_equals_loopline_fixed_depth(fixture, request):
    tiny = request.getfixturevalue(fixture)
    prompts = [[5, 17, 99, 230, 41, 8, 77, 310, 12], [64, 3, 250]]  # different lengths: the second is left padded
    new = 10
    hf = OuroHFForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos (generate() would fill a None eos from here)
    ids, mask = left_padded(prompts)
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = hf.generate(ids, attention_mask=mask, generation_config=config)
    hf_tokens = out[:, ids.shape[1]:].tolist()

    llm = tiny.llm(exit_mode="fixed")
    res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    assert hf_tokens == [r.outputs[0].token_ids for r in res]


def test_parameter_names_are_the_checkpoint_names(tiny_gqa):
    hf = OuroHFForCausalLM.from_pretrained(str(tiny_gqa.path), dtype=torch.float32)
    state = hf.state_dict()
    assert set(state) == set(tiny_gqa.state_dict)
    for name, tensor in tiny_gqa.state_dict.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    assert hf.config.model_type == "ouro" and hf.config.total_ut_steps == tiny_gqa.cfg["total_ut_steps"]


def test_from_ouro_shares_weights_and_matches_dense_forward(tiny_gqa):
    from loopline.models.loader import load_model

    core: OuroForCausalLM = load_model(tiny_gqa.path, torch.float32)
    hf = OuroHFForCausalLM.from_ouro(core)
    assert hf.model.embed_tokens.weight.data_ptr() == core.model.embed_tokens.weight.data_ptr()
    assert hf.ouro is core and not any(n.startswith("_core") for n, _ in hf.named_parameters())

    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = hf(ids, use_cache=False).logits
        dense = core.forward_dense(ids).logits[-1]  # last loop
        torch.testing.assert_close(full, dense, rtol=1e-5, atol=1e-5)
        # Incremental decoding through the (loop, layer) cache gives the same logits.
        first = hf(ids[:, :6], use_cache=True)
        cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
        assert len(cache.layers) == core.config.num_hidden_layers * core.config.total_ut_steps
        second = hf(ids[:, 6:], **{"cache" if hasattr(first, "cache") else "past_key_values": cache})
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, rtol=1e-5, atol=1e-5)


def test_left_padding_does_not_change_logits(tiny_gqa):
    hf = OuroHFForCausalLM.from_pretrained(str(tiny_gqa.path), dtype=torch.float32)
    short = [64, 3, 250, 7]
    ids, mask = left_padded([[5] * 7, short])
    with torch.no_grad():
        padded = hf(ids, attention_mask=mask, use_cache=False).logits[1, -len(short):]
        alone = hf(torch.tensor([short]), use_cache=False).logits[0]
    assert torch.isfinite(hf(ids, attention_mask=mask, use_cache=False).logits).all()
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_labels_give_a_differentiable_loss(tiny_gqa):
    hf = OuroHFForCausalLM.from_pretrained(str(tiny_gqa.path), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(1))
    loss = hf(ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss) and hf.model.layers[0].mlp.up_proj.weight.grad is not None


def test_config_round_trip_and_validation(tiny_mha):
    from loopline.models.loader import load_config

    cfg = load_config(tiny_mha.path)
    back = OuroHFConfig.from_ouro_config(cfg).to_ouro_config()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "total_ut_steps",
                  "early_exit_threshold", "max_position_embeddings", "bos_token_id"):
        assert getattr(back, field) == getattr(cfg, field), field
    assert OuroHFConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5}).rope_theta == 5e5
    assert OuroHFConfig().tie_word_embeddings is False
    with pytest.raises(ValueError, match="rope"):
        OuroHFConfig(rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="sliding"):
        OuroHFConfig(use_sliding_window=True)


def test_float64_gradients_equal_finite_differences(tiny_mha, tmp_path):
    """The training class's autograd gradients are the derivative of its loss (central differences in
    float64), for weights the loops share (each is one parameter, its gradient summed over loops)."""
    import json
    import shutil

    # The directory as the real Ouro one is laid out: an auto_map and remote code that must never run.
    ckpt = tmp_path / "ouro"
    shutil.copytree(tiny_mha.path, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    for name in ("configuration_ouro.py", "modeling_ouro.py"):
        (ckpt / name).write_text("raise RuntimeError('remote code was executed')\n")
    hf = OuroHFForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64)
    params = dict(hf.named_parameters())
    assert set(params) == set(tiny_mha.state_dict) and len(list(hf.parameters())) == len(tiny_mha.state_dict)

    ids = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :2] = 0  # a left-padded row

    def loss() -> torch.Tensor:
        return hf(ids, attention_mask=attention_mask, labels=ids, use_cache=False).loss

    loss().backward()
    g = torch.Generator().manual_seed(3)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight",
             "lm_head.weight"]
    eps = 1e-6
    for name in names:
        p = params[name]
        assert p.dtype == torch.float64 and p.grad is not None
        for _ in range(3):
            idx = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in p.shape)
            if name == "model.embed_tokens.weight":
                idx = (int(ids[0, 1]),) + idx[1:]  # a row the batch uses
            with torch.no_grad():
                p[idx] += eps
                up = loss().item()
                p[idx] -= 2 * eps
                down = loss().item()
                p[idx] += eps
            fd = (up - down) / (2 * eps)
            assert abs(fd - p.grad[idx].item()) <= 1e-6 + 1e-5 * abs(fd), (name, idx, fd, p.grad[idx].item())
    # The gate has no effect on the full-depth loss: its gradient is exactly zero.
    assert params["model.early_exit_gate.weight"].grad is None or not params["model.early_exit_gate.weight"].grad.any()
