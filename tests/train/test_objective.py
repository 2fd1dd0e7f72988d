"""The training objective: per-loop outputs against the independent reference, the exit distribution, the stage losses."""
from __future__ import annotations

import pytest
import torch

from loopline.models.tiny import random_state_dict, tiny_config
from loopline.models.ouro import OuroForCausalLM
from loopline.train.objective import (continue_targets, exit_log_probs, loop_outputs, per_loop_token_loss,
                                      stage_one_loss, stage_two_loss)

from reference import reference_forward


def _model(seed: int = 0) -> tuple[OuroForCausalLM, dict]:
    config = tiny_config()
    sd = random_state_dict(config, seed)
    model = OuroForCausalLM(config)
    model.load_state_dict(sd)
    cfg = {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
           "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
           "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
           "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps, "total_ut_steps": config.total_ut_steps}
    return model, (sd, cfg)


def test_loop_outputs_match_the_independent_reference_at_every_loop():
    model, (sd, cfg) = _model()
    ids = torch.randint(0, 500, (2, 11), generator=torch.Generator().manual_seed(1))
    out = loop_outputs(model, ids)
    assert out.hidden.shape == (4, 2, 11, 64) and out.gate_logits.shape == (4, 2, 11)
    for b in range(2):
        ref = reference_forward(sd, cfg, ids[b], 4)
        torch.testing.assert_close(out.hidden[:, b], ref["hidden"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.gate_logits[:, b], ref["gate_logits"], rtol=1e-5, atol=1e-5)
    # the last loop is what forward_dense (and so the engine's full-depth path) projects
    dense = model.forward_dense(ids)
    torch.testing.assert_close(model.lm_head(out.hidden[-1]).float(), dense.logits[-1])


def test_gate_logits_stay_fp32_under_bf16_autocast():
    """The trainer runs the forward under bf16 autocast; the exit gate's product is taken in fp32 there too."""
    model, _ = _model()
    ids = torch.randint(0, 500, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loop_outputs(model, ids)
    assert out.gate_logits.dtype == torch.float32
    gate = model.model.early_exit_gate
    want = torch.stack([torch.nn.functional.linear(h, gate.weight, gate.bias).squeeze(-1) for h in out.hidden])
    torch.testing.assert_close(out.gate_logits, want, rtol=1e-6, atol=1e-6)


def test_exit_distribution_is_the_design_formula_and_sums_to_one():
    g = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0)) * 3
    lam = torch.sigmoid(g)
    p = exit_log_probs(g).exp()
    expected = torch.stack([lam[0], lam[1] * (1 - lam[0]), lam[2] * (1 - lam[0]) * (1 - lam[1]),
                            (1 - lam[0]) * (1 - lam[1]) * (1 - lam[2])])
    torch.testing.assert_close(p, expected)
    torch.testing.assert_close(p.sum(0), torch.ones(3, 5))
    # its CDF is the engine's F_r = 1 - prod_{i<=r}(1 - lambda_i) for r < R
    torch.testing.assert_close(p.cumsum(0)[:-1], 1 - torch.cumprod(1 - lam, 0)[:-1])


def test_continue_targets_follow_the_loss_improvement():
    losses = torch.tensor([[3.0], [2.0], [1.999], [2.5]])  # big gain, tiny gain, a loss
    w = continue_targets(losses, k=50.0, gamma=0.005)
    assert w[0, 0] > 0.99  # loop 2 improves by 1.0: continue
    assert 0.4 < w[1, 0] < 0.5  # an improvement below gamma: lean towards exiting
    torch.testing.assert_close(w[2, 0], torch.sigmoid(torch.tensor(-50 * 0.005)))  # no improvement


def test_stage_one_is_expected_loss_minus_entropy():
    model, _ = _model()
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(2))
    tgt = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(3))
    out = stage_one_loss(model, ids, tgt, beta=0.1)
    lo = loop_outputs(model, ids)
    token_loss = per_loop_token_loss(model, lo.hidden, tgt)
    p = exit_log_probs(lo.gate_logits).exp()
    expected = (p * token_loss).sum(0).mean()
    entropy = -(p * p.log()).sum(0).mean()
    torch.testing.assert_close(out.loss, expected - 0.1 * entropy)
    out.loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
    assert model.model.early_exit_gate.weight.grad.abs().sum() > 0


def test_final_loop_weight_adds_the_last_loops_loss():
    model, _ = _model()
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(2))
    tgt = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(3))
    plain = stage_one_loss(model, ids, tgt, beta=0.1)
    weighted = stage_one_loss(model, ids, tgt, beta=0.1, final_loop_weight=0.5)
    last = per_loop_token_loss(model, loop_outputs(model, ids).hidden, tgt)[-1].mean()
    torch.testing.assert_close(weighted.loss, plain.loss + 0.5 * last)
    torch.testing.assert_close(weighted.expected_loss, plain.expected_loss)  # the logged metrics stay Ouro's
    # the gate's gradient is the expected loss's alone: the added term does not depend on the exit distribution
    gate = model.model.early_exit_gate.weight
    (g_plain,) = torch.autograd.grad(plain.loss, gate)
    (g_weighted,) = torch.autograd.grad(weighted.loss, gate)
    torch.testing.assert_close(g_weighted, g_plain)
    with pytest.raises(ValueError, match="final_loop_weight=-1.0"):
        stage_one_loss(model, ids, tgt, beta=0.1, final_loop_weight=-1.0)


def test_stage_two_trains_only_the_gate():
    model, _ = _model()
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(2))
    out = stage_two_loss(model, ids, ids.roll(-1, 1))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["model.early_exit_gate.weight"].abs().sum() > 0 and grads["model.early_exit_gate.bias"].abs() > 0
    assert all(g is None for n, g in grads.items() if "early_exit_gate" not in n)
