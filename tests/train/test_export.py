"""An exported run loads through loopline.LLM's normal path; the engine matches the dense oracle on its weights."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from loopline import LLM, SamplingParams
from loopline.models.loader import load_config, load_tokenizer
from loopline.train.trainer import Trainer

from reference import reference_generate
from train.conftest import SMOKE



@pytest.fixture(scope="module")
def trained(smoke_data):
    trainer = Trainer(dataclasses.replace(SMOKE, stage1_steps=20, stage2_steps=10), smoke_data)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def threshold(trained, smoke_data) -> float:
    """The median held-out F_2: a few steps of training leave the gate nearly constant, and at this
    threshold tokens still exit at depth 2 or 3, so the engine's early exits are exercised."""
    with torch.no_grad():
        gates = trained.model.forward_dense(smoke_data.heldout[:256][None], compute_logits=False).gate_logits[:, 0]
    cdf = 1 - torch.cumprod(1 - torch.sigmoid(gates), 0)
    return round(float(cdf[1].median()), 6)


@pytest.fixture(scope="module")
def exported(trained, threshold, tmp_path_factory):
    return trained.export(tmp_path_factory.mktemp("demo"), early_exit_threshold=threshold, metrics=trained.evaluate())


def test_export_is_an_ouro_checkpoint(exported, threshold, trained):
    raw = json.loads((exported / "config.json").read_text())
    assert raw["model_type"] == "ouro" and raw["architectures"] == ["OuroForCausalLM"]
    assert raw["early_exit_threshold"] == threshold and raw["total_ut_steps"] == 4
    config = load_config(exported)
    assert config.early_exit_threshold == threshold and set(config.eos_token_ids) == {0, 2}
    weights = load_file(str(exported / "model.safetensors"))
    names = set(weights)
    trained_sd = trained.model.state_dict()
    assert names == set(trained_sd) and all(torch.equal(weights[k], trained_sd[k]) for k in names)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.early_exit_gate.bias",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.0.input_layernorm_2.weight"} <= names
    tok = load_tokenizer(exported)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    info = json.loads((exported / "training_info.json").read_text())
    assert info["corpus"]["license"].startswith("PSF") and len(info["metrics"]["loop_losses"]) == 4
    card = (exported / "MODEL_CARD.md").read_text()
    assert "PSF-2.0" in card and info["corpus"]["sha256"] in card and f"{info['parameters']:,} parameters" in card
    assert f"| loss | {info['metrics']['loop_losses'][0]:.4f} |" in card and f": {threshold}" in card


# the shared layout (~6 s) is slow: tests/core/test_engine_reference.py checks it against the oracle
@pytest.mark.parametrize("layout", ["last_exited", pytest.param("shared", marks=pytest.mark.slow)])
def test_engine_matches_the_dense_oracle_on_the_exported_weights(exported, threshold, layout):
    llm = LLM(str(exported), dtype="float32", device="cpu", kv_layout=layout, kv_cache_memory_gb=1 / 64,
              disable_log_stats=True)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)  # exit_threshold: the checkpoint's
    sd = load_file(str(exported / "model.safetensors"))
    cfg = json.loads((exported / "config.json").read_text())
    all_depths = []
    for prompt in ["def __init__(self", "import os\n", "    return x + 1", "class Error(Exception):"]:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        comp = out.outputs[0]
        tokens, depths, logprobs = reference_generate(sd, cfg, out.prompt_token_ids, 16, exit_threshold=threshold,
                                                      layout=layout)
        assert comp.token_ids == tokens
        assert comp.exit_depths == depths
        engine_lps = [entry[t].logprob for entry, t in zip(comp.logprobs, comp.token_ids)]
        torch.testing.assert_close(torch.tensor(engine_lps), torch.tensor(logprobs), rtol=0, atol=1e-4)
        all_depths += depths
    # the threshold makes the trained gate exit at more than one depth: the comparison covers early exits
    assert len(set(all_depths)) > 1, all_depths
