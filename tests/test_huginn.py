"""Huginn-0125 (``huginn_raven``) behind the family seam, held to the independent oracle in tests/huginn_reference.py.

Covers config.json parsing and loading (no remote code), the fixed-iteration forward (logits to fp32
tolerance), the seeded latent initial state, the convergence exit and the KV semantics of early-exited
tokens through the plain path (models/plain.py), and Ouro through the same plain path against its own oracle.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from huginn_reference import reference_generate as huginn_generate  # tests/ is on pythonpath (pyproject.toml)
from huginn_reference import reference_logits
from reference import reference_generate as ouro_generate
from safetensors.torch import load_file, save_file

from loopline.models import huginn
from loopline.models.family import ConvergenceExit, GateExit, family_of
from loopline.models.huginn import HuginnConfig, HuginnForCausalLM, config_from_dict, config_to_dict
from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint, tiny_huginn_config
from loopline.models.loader import CheckpointError, load_config, load_looped_config, load_looped_model, load_tokenizer
from loopline.models.ouro import DenseCausalAttention
from loopline.models.plain import plain_generate

# The config.json of tomg-group-umd/huginn-0125 (fields the model reads; upstream also lists auto_map etc.).
HUGINN_0125 = {
    "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven", "block_size": 4096, "vocab_size": 65536,
    "padding_multiple": 4096, "padded_vocab_size": 65536, "tie_embeddings": True, "num_attention_heads": 55,
    "num_key_value_heads": 55, "n_embd": 5280, "intermediate_size": 17920, "bias": False, "n_layers": 8,
    "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2, "mean_recurrence": 32,
    "mean_backprop_depth": 8, "effective_expected_depth": 132, "injection_type": "linear", "state_init": "like-init",
    "block_class_name": "SandwichBlock", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-6, "qk_bias": True, "rope_base": 50000,
    "init_strategy": "takase", "init_values": {"std": 0.008703882797784892, "out_proj": 0.0005356869554443541,
                                               "embedding": 0.008703882797784892, "embed_scale": 72.6636084983398},
    "sampling_scheme": "poisson-lognormal-filling", "test_time_noise": 0, "test_time_noise_type": "fixed",
    "torch_dtype": "bfloat16", "bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"), seed=0)
    return path, json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def model(tiny):
    return load_looped_model(tiny[0])


def init_states(model: HuginnForCausalLM, n: int, seed: int = 0) -> torch.Tensor:
    """The latent initial states of positions 0..n-1 of a request with ``seed``: the oracle's input."""
    pos = torch.arange(n)
    return model.initial_state(torch.zeros(n, model.config.hidden_size), pos, torch.full((n,), seed))


# --- config.json -------------------------------------------------------------------------------------------


def test_huginn_0125_config_parses_to_the_defaults():
    config = config_from_dict(HUGINN_0125, "config.json")
    assert config == HuginnConfig()
    assert (config.head_dim, config.num_loops) == (96, 32)
    assert 3.5e9 < huginn.parameter_count(config) < 3.6e9
    assert config.extra["effective_expected_depth"] == 132


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_is_the_model(tied):
    config = tiny_huginn_config(tie_embeddings=tied, bias=not tied, qk_bias=tied)
    params = sum(p.numel() for p in HuginnForCausalLM(config).parameters())
    head = config.padded_vocab_size * config.hidden_size if tied else 0  # one tensor when tied
    assert huginn.parameter_count(config) == params - head


def test_config_round_trips():
    config = tiny_huginn_config(num_key_value_heads=2, qk_bias=False, bias=True, tie_embeddings=False)
    assert config_from_dict(config_to_dict(config), "x") == config


@pytest.mark.parametrize("change, field", [
    ({"injection_type": "add"}, "injection_type"),
    ({"state_init": "zero"}, "state_init"),
    ({"test_time_noise": 0.1}, "test_time_noise"),
    ({"n_layers": 9}, "n_layers"),
    ({"n_embd": 5281}, "n_embd"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),  # qk_bias needs one key bias per query head
    ({"mean_recurrence": 0}, "mean_recurrence"),
    ({"padded_vocab_size": 100}, "padded_vocab_size"),
    ({"init_values": {"std": -1.0}}, "init_values.std"),
    ({"eos_token_id": 70000}, "eos_token_id"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
])
def test_bad_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=rf"{field}=.*allowed"):
        config_from_dict({**HUGINN_0125, **change}, "config.json")


def test_loader_dispatches_on_model_type(tiny, tmp_path):
    assert load_looped_config(tiny[0]).model_type == "huginn_raven"
    assert family_of(load_looped_config(tiny[0])).model_type == "huginn_raven"
    with pytest.raises(CheckpointError, match='model_type.*"ouro".*huginn_raven directory loads through load_looped_config'):
        load_config(tiny[0])  # the Ouro-only loader says what it takes and which loader reads Huginn
    bad = shutil.copytree(tiny[0], tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({**tiny[1], "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type='llama'.*allowed: 'ouro', 'huginn_raven'"):
        load_looped_config(bad)
    (bad / "config.json").write_text(json.dumps({**tiny[1], "injection_type": "add"}))
    with pytest.raises(CheckpointError, match="config.json: injection_type='add'"):
        load_looped_model(bad)


def test_weights_load_under_upstream_names(tiny, model, tmp_path):
    path, _, sd = tiny
    assert "lm_head.weight" not in sd  # tied: upstream stores the embedding only
    assert torch.equal(model.lm_head.weight, sd["transformer.wte.weight"])
    assert torch.equal(model.transformer.core_block[3].attn.qk_bias, sd["transformer.core_block.3.attn.qk_bias"])
    bad = shutil.copytree(path, tmp_path / "bad")
    # a persisted RoPE table is recomputed, not read
    save_file({**sd, "freqs_cis": torch.zeros(3)}, str(bad / "model.safetensors"))
    load_looped_model(bad)
    save_file({**sd, "lm_head.weight": sd["transformer.wte.weight"] + 1}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_looped_model(bad)
    save_file({k: v for k, v in sd.items() if k != "transformer.adapter.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing.*transformer.adapter.weight"):
        load_looped_model(bad)


def test_sharded_checkpoint_and_tokenizer_load(tiny, model, tmp_path):
    """Shards listed in model.safetensors.index.json load like one file; the tokenizer is a local file."""
    path, _, sd = tiny
    sharded = shutil.copytree(path, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: sd[n] for n in part}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}}))
    again = load_looped_model(sharded)
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    tokenizer = load_tokenizer(path)
    assert tokenizer.decode(tokenizer.encode("The river town")) == "The river town"


# --- forward vs the oracle ---------------------------------------------------------------------------------


@torch.no_grad()
def fixed_logits(model: HuginnForCausalLM, ids: list[int], steps: int, init: torch.Tensor) -> torch.Tensor:
    t = len(ids)
    x, pos = torch.tensor(ids), torch.arange(t)
    e = model.prelude(x, pos, DenseCausalAttention(1, t))
    s = init[:t]
    for _ in range(steps):
        s, signal = model.core(s, e, pos, DenseCausalAttention(1, t))
        assert signal is None
    return model.coda(s, pos, DenseCausalAttention(1, t))


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_fixed_iterations_match_oracle(tiny, model, steps):
    _, cfg, sd = tiny
    ids = [5, 9, 100, 3, 44, 7, 311]
    init = init_states(model, len(ids))
    ours, ref = fixed_logits(model, ids, steps, init), reference_logits(sd, cfg, ids, steps, init)
    assert ours.dtype == torch.float32 and ours.shape == (len(ids), 512)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [
    dict(hidden_size=440, num_attention_heads=55, num_key_value_heads=55),  # Huginn-0125's 55 heads (of 8 here)
    dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, qk_bias=False, bias=True, tie_embeddings=False),
])
def test_other_shapes_match_oracle(tmp_path, shape):
    path = make_tiny_huginn_checkpoint(tmp_path, seed=2, intermediate_size=48, n_layers_in_prelude=1,
                                       n_layers_in_recurrent_block=2, n_layers_in_coda=1, **shape)
    cfg, sd = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    model = load_looped_model(path)
    ids = [7, 300, 2, 41, 9]
    init = init_states(model, len(ids), seed=5)
    torch.testing.assert_close(fixed_logits(model, ids, 3, init), reference_logits(sd, cfg, ids, 3, init),
                               rtol=1e-4, atol=1e-4)


def test_oracle_sees_each_part(tiny, model):
    """The comparison can fail: changing any one part of the math moves the logits well past the tolerance."""
    _, cfg, sd = tiny
    ids = [5, 9, 100, 3]
    init = init_states(model, len(ids))
    ref = reference_logits(sd, cfg, ids, 3, init)
    variants = {
        "qk_bias": {**sd, "transformer.core_block.0.attn.qk_bias": torch.zeros_like(sd["transformer.core_block.0.attn.qk_bias"])},
        "adapter": {**sd, "transformer.adapter.weight": sd["transformer.adapter.weight"].roll(1, 1)},
        "coda": {**sd, "transformer.coda.1.norm_4.weight": torch.ones(64)},
    }
    for name, other in variants.items():
        assert (reference_logits(other, cfg, ids, 3, init) - ref).abs().max() > 1e-2, name
    assert (reference_logits(sd, cfg, ids, 3, init_states(model, 4, seed=1)) - ref).abs().max() > 1e-2
    assert (reference_logits(sd, {**cfg, "init_values": {"embed_scale": 1.0}}, ids, 3, init) - ref).abs().max() > 1e-2


# --- the latent initial state ------------------------------------------------------------------------------


def test_initial_state_is_seeded_per_position_and_batch_invariant(model):
    c = model.config
    pos = torch.tensor([0, 1, 2, 3, 1000])
    a = model.initial_state(torch.zeros(5, c.hidden_size), pos, torch.tensor([0, 0, 0, 7, 7]))
    # the same (seed, position) gives the same state in any batch and any row
    b = model.initial_state(torch.zeros(2, c.hidden_size), pos[[4, 0]], torch.tensor([7, 0]))
    assert torch.equal(a[[4, 0]], b)
    assert not torch.equal(a[3], init_states(model, 4)[3])  # the seed matters
    assert not torch.equal(a[0], a[1])  # so does the position
    # upstream's distribution: N(0, std^2) truncated to +-3 std, times embed_scale
    z = huginn.truncated_normal_hash(torch.arange(64), torch.arange(64), 4096)
    assert z.abs().max() <= 3.0
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 0.9866) < 0.01  # std of the truncated normal
    scale = c.init_std * c.embed_scale
    torch.testing.assert_close(a, huginn.truncated_normal_hash(torch.tensor([0, 0, 0, 7, 7]), pos, c.hidden_size) * scale)


# --- exit criteria -----------------------------------------------------------------------------------------


def test_convergence_exit_is_kl_of_successive_distributions():
    crit = ConvergenceExit()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 50, generator=g), torch.randn(3, 50, generator=g)
    carry = crit.initial_carry(3, 50, torch.device("cpu"))
    done, carry = crit.decide(1, carry, a, 1, 8, 1.0)
    assert not done.any()  # threshold 1.0: fixed depth
    kl = F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), reduction="none", log_target=True).sum(-1)
    mid = float(kl.sort().values[1])
    done, _ = crit.decide(2, carry, b, 1, 8, mid + 1e-6)
    assert done.tolist() == (kl < mid + 1e-6).tolist() and done.sum() == 2
    assert not crit.decide(2, carry, b, 3, 8, mid + 1e-6)[0].any()  # below min_loops
    assert crit.decide(8, carry, b, 3, 8, 1.0)[0].all()  # max_loops


def test_gate_exit_is_the_engine_rule():
    from loopline.worker.exit_rule import exit_decision

    g = torch.Generator().manual_seed(1)
    crit = GateExit()
    carry = crit.initial_carry(16, 0, torch.device("cpu"))
    survival = torch.ones(16)
    for loop in range(1, 5):
        logit = torch.randn(16, generator=g)
        done, carry = crit.decide(loop, carry, logit, 2, 4, 0.6)
        ref_done, survival = exit_decision(loop, survival, logit, 2, 4, 0.6)
        assert torch.equal(done, ref_done) and torch.equal(carry, survival)


# --- generation through the plain path vs the oracles -------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(max_loops=4),  # fixed depth
    dict(max_loops=10, min_loops=2, exit_threshold=0.05),  # convergence exits at varied iterations
    dict(max_loops=9, exit_threshold=0.2, seed=3),
])
def test_generation_matches_oracle(tiny, model, kwargs):
    _, cfg, sd = tiny
    prompt = [5, 9, 100, 3, 44, 7]
    out = plain_generate(model, prompt, 8, **kwargs)
    tokens, depths, logprobs = huginn_generate(
        sd, cfg, prompt, 8, max_steps=kwargs["max_loops"], min_steps=kwargs.get("min_loops", 1),
        threshold=kwargs.get("exit_threshold", 1.0), init_states=init_states(model, 14, kwargs.get("seed", 0)))
    assert out.tokens == tokens
    assert out.exit_loops == depths
    assert out.logprobs == pytest.approx(logprobs, abs=1e-4)
    if "exit_threshold" in kwargs:  # the test exercises early exits and the KV they leave
        assert min(depths[1:]) < kwargs["max_loops"] and len(set(depths)) > 2
    assert depths[0] == kwargs["max_loops"]  # the prompt runs the full depth


def test_exited_tokens_kv_is_their_latest_iteration(tiny, model):
    """The oracle tells the KV semantics apart: a query at iteration d must read an exited token's
    iteration-min(d, e) K/V. Reading instead a deeper iteration of that token's recomputed state (as if it
    had not exited) changes the outputs, so test_generation_matches_oracle would fail on it."""
    import huginn_reference as ref

    _, cfg, sd = tiny
    prompt = [5, 9, 100, 3, 44, 7]
    init = init_states(model, 14)
    kw = dict(max_steps=10, min_steps=2, threshold=0.05, init_states=init)
    right = huginn_generate(sd, cfg, prompt, 8, **kw)
    original = ref.HuginnReference.iterate
    try:
        ref.HuginnReference.iterate = lambda self, s, e, r, exits, kv: original(self, s, e, r, [None] * len(exits), kv)
        wrong = huginn_generate(sd, cfg, prompt, 8, **kw)
    finally:
        ref.HuginnReference.iterate = original
    assert right[2] != pytest.approx(wrong[2], abs=1e-4)


def test_bad_request_bounds_are_refused(model):
    with pytest.raises(ValueError, match="min_loops=5; allowed: 1..max_loops"):
        plain_generate(model, [1, 2], 2, max_loops=4, min_loops=5)
    with pytest.raises(ValueError, match=r"exit_threshold=0.0; allowed: \(0, 1\]"):
        plain_generate(model, [1, 2], 2, exit_threshold=0.0)
    with pytest.raises(ValueError, match="prompt_ids"):
        plain_generate(model, [], 2)
    with pytest.raises(ValueError, match="max_tokens=0; allowed: an integer >= 1"):
        plain_generate(model, [1, 2], 0)
    with pytest.raises(ValueError, match="max_loops=0; allowed: an integer >= 1"):
        plain_generate(model, [1, 2], 2, max_loops=0)


def test_generation_stops_after_eos(model):
    full = plain_generate(model, [5, 9, 100, 3], 6, max_loops=4)
    stop = full.tokens[2]
    out = plain_generate(model, [5, 9, 100, 3], 6, max_loops=4, eos_ids=[stop])
    assert out.tokens == full.tokens[: full.tokens.index(stop) + 1]


@pytest.mark.parametrize("kwargs", [dict(), dict(max_loops=3, exit_threshold=0.5)])
def test_ouro_through_the_same_plain_path_matches_its_oracle(tiny_gqa, kwargs):
    """The seam is family-agnostic: the same plain path runs Ouro, equal to tests/reference.py."""
    ouro = load_looped_model(tiny_gqa.path)
    prompt = [3, 17, 250, 8, 41]
    out = plain_generate(ouro, prompt, 8, **kwargs)
    tokens, depths, logprobs = ouro_generate(tiny_gqa.state_dict, tiny_gqa.cfg, prompt, 8, **kwargs)
    assert (out.tokens, out.exit_loops) == (tokens, depths)
    assert out.logprobs == pytest.approx(logprobs, abs=1e-4)
    if kwargs:
        assert len(set(depths)) > 1


def test_bf16_close_to_fp32(tiny):
    path = tiny[0]
    fp32, bf16 = load_looped_model(path, dtype="float32"), load_looped_model(path, dtype="bfloat16")
    ids = [5, 9, 100, 3]
    init = init_states(fp32, 4)
    a = fixed_logits(fp32, ids, 3, init)
    b = fixed_logits(bf16, ids, 3, init.bfloat16())
    assert b.dtype == torch.float32
    assert (a - b).abs().max() / a.abs().max() < 0.1


def test_interleaved_rope_is_rotate_half_on_permuted_channels():
    """The route docs/model-families.md names for the fused attention: Huginn's interleaved RoPE equals the
    engine's rotate-half RoPE after permuting q/k channels (2i -> i, 2i+1 -> D/2 + i), at the same angles."""
    from loopline.models.ops import TORCH_OPS, rotary_cos_sin

    d, pos = 16, torch.tensor([0, 1, 7, 300])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 3, d, generator=g), torch.randn(4, 1, d, generator=g)
    rq, rk = huginn.interleaved_rope(pos, d, 10000.0)(q, k)
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    cos, sin = rotary_cos_sin(pos, d, 10000.0, torch.float32)
    hq, hk = TORCH_OPS.rotary(q[..., perm], k[..., perm], cos, sin)
    torch.testing.assert_close(hq, rq[..., perm])
    torch.testing.assert_close(hk, rk[..., perm])
    torch.testing.assert_close(hq @ hk.transpose(-1, -2), rq @ rk.transpose(-1, -2))
