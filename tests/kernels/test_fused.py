"""Fused Triton layer ops vs the reference ops (CPU under TRITON_INTERPRET=1, GPU when present)."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, DTYPES, close

from loopline.kernels.fused import TritonOps
from loopline.models.ops import TorchOps
from loopline.models.ops import rotary_cos_sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_residual(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(DEVICE, dtype)
    b = torch.randn(5, 48, generator=g).to(DEVICE, dtype) * 3
    w1 = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    w2 = (1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype)
    ref, fused = TorchOps(), TritonOps()
    close(fused.rms_norm(x, w1, 1e-6), ref.rms_norm(x, w1, 1e-6), dtype)
    (xr, yr), (xf, yf) = ref.add_rms_norm(x, b, w1, w2, 1e-6), fused.add_rms_norm(x, b, w1, w2, 1e-6)
    close(xf, xr, dtype)
    close(yf, yr, dtype)
    with pytest.raises(AssertionError):  # the test can fail: a wrong weight is caught
        close(fused.add_rms_norm(x, b, w2, w2, 1e-6)[1], yr, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 4, 16, generator=g).to(DEVICE, dtype)
    k = torch.randn(6, 2, 16, generator=g).to(DEVICE, dtype)
    cos, sin = rotary_cos_sin(torch.arange(3, 9, device=DEVICE), 16, 10000.0, dtype)
    (qr, kr), (qf, kf) = TorchOps.rotary(q, k, cos, sin), TritonOps().rotary(q, k, cos, sin)
    close(qf, qr, dtype)
    close(kf, kr, dtype)
    # q and k as strided views of one packed q/k/v projection, as the fused ops produce them
    qkv = torch.randn(6, 4 * 16 + 2 * 2 * 16, generator=g).to(DEVICE, dtype)
    qs, ks, _ = qkv.split([64, 32, 32], dim=-1)
    qs, ks = qs.view(6, 4, 16), ks.view(6, 2, 16)
    assert not qs.is_contiguous()
    (qr, kr), (qf, kf) = TorchOps.rotary(qs, ks, cos, sin), TritonOps().rotary(qs, ks, cos, sin)
    close(qf, qr, dtype)
    close(kf, kr, dtype)
    with pytest.raises(AssertionError):  # the test can fail: cos and sin swapped are caught
        close(TritonOps().rotary(qs, ks, sin, cos)[0], qr, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 1500, generator=g).to(DEVICE, dtype)
    b = torch.randn(3, 1500, generator=g).to(DEVICE, dtype)
    close(TritonOps().silu_mul(a, b), TorchOps.silu_mul(a, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_branch", [True, False])
def test_norm_exit_gate(dtype, bias, with_branch):
    g = torch.Generator().manual_seed(3)
    gate = torch.nn.Linear(48, 1, bias=bias).to(DEVICE, dtype)
    x = torch.randn(7, 96, generator=g).to(DEVICE, dtype)[:, :48]  # 7 rows with a row stride; 48: masked columns
    branch = torch.randn(7, 48, generator=g).to(DEVICE, dtype) if with_branch else None
    wb, wn = ((1 + 0.1 * torch.randn(48, generator=g)).to(DEVICE, dtype) for _ in range(2))
    h, logits = TritonOps().norm_exit_gate(gate, x, branch, wb if with_branch else None, wn, 1e-6)
    ref_h, ref_logits = TorchOps().norm_exit_gate(gate, x, branch, wb if with_branch else None, wn, 1e-6)
    assert logits.dtype == torch.float32 and logits.shape == (7,) and h.dtype == dtype
    close(h, ref_h, dtype)
    close(logits, ref_logits, torch.float32 if dtype == torch.float32 else dtype)
    empty = TritonOps().norm_exit_gate(gate, x[:0], None if branch is None else branch[:0], wb, wn, 1e-6)
    assert empty[0].shape == (0, 48) and empty[1].shape == (0,)
    with pytest.raises(AssertionError):  # the test can fail: another row's logits are caught
        close(logits, ref_logits.roll(1, 0), torch.float32)


def test_autograd_falls_back_to_reference():
    x = torch.randn(2, 8, device=DEVICE, requires_grad=True)
    w = torch.ones(8, device=DEVICE)
    TritonOps().rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None


def _tiny_model():
    from loopline.models.ouro import OuroConfig, OuroForCausalLM

    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, total_ut_steps=2, torch_dtype="float32")
    return OuroForCausalLM(cfg).to(DEVICE).eval()


def _loop(model, ops):
    from loopline.models.ouro import DenseCausalAttention

    ids = torch.arange(1, 7, device=DEVICE)
    with torch.inference_mode():
        h, g = model.loop(model.embed(ids), torch.arange(6, device=DEVICE), DenseCausalAttention(1, 6), ops)
    return h, g


def test_cos_sin_table_equals_the_reference():
    model = _tiny_model()
    ops = TritonOps()
    c = model.config
    positions = torch.tensor([0, 5, 4095, c.max_position_embeddings - 1, 5], device=DEVICE)
    want = rotary_cos_sin(positions, c.head_dim, c.rope_theta, torch.float32)
    model.use_ops(ops)
    got = ops.cos_sin(positions, c.head_dim, c.rope_theta, torch.float32)
    assert ops.has_rope_table  # the table is what answered
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # the same function computed the table: identical values
    half = ops.cos_sin(positions, c.head_dim, c.rope_theta, torch.float16)  # not the table's dtype: computed
    assert half[0].dtype == torch.float16 and torch.equal(half[0], want[0].half())
    model.use_ops(TorchOps())
    assert not ops.has_rope_table  # released with the packed weights


def test_packed_projections_keep_names_values_and_in_place_updates():
    model = _tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref_h, ref_g = _loop(model, TorchOps())
    ops = TritonOps()
    model.use_ops(ops)
    attn = model.model.layers[0].self_attn
    packed, sizes = ops.packed_weights(attn)
    assert sizes == [32, 16, 16]
    assert attn.k_proj.weight.data_ptr() == packed[32:].data_ptr()  # a view, not a copy
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    h, g = _loop(model, ops)
    close(h, ref_h, torch.float32)
    close(g, ref_g, torch.float32)
    with torch.no_grad():  # an in-place weight update reaches the packed GEMM
        attn.v_proj.weight.mul_(2.0)
        model.model.layers[1].mlp.up_proj.weight.add_(0.01)
    h2, _ = _loop(model, ops)
    ref2, _ = _loop(model, TorchOps())
    close(h2, ref2, torch.float32)
    with pytest.raises(AssertionError):
        close(h2, h, torch.float32)
    model.use_ops(TorchOps())  # release: back to separate projections, same values
    close(_loop(model, model.ops)[0], ref2, torch.float32)


@pytest.mark.slow  # ~70 s in the Triton interpreter; each fused kernel has its own test above in the default run
def test_engine_with_fused_ops_survives_sleep_and_weight_updates(tiny_gqa, tiny_factory):
    from loopline import SamplingParams
    from loopline.config import EngineArgs
    from loopline.engine import LLMEngine

    def generate(engine):
        engine.add_request(f"r{engine.stats.steps}", [5, 9, 23, 7, 11], SamplingParams(max_tokens=4, temperature=0.0,
                                                                                         ignore_eos=True))
        while engine.has_unfinished_requests():
            outs = engine.step()
        return outs[-1].outputs[0].token_ids

    kw = dict(model=str(tiny_gqa.path), dtype="float32", device=DEVICE, skip_tokenizer_init=True, num_kv_blocks=64,
              enforce_eager=True)
    reference = generate(LLMEngine(EngineArgs(kernel_backend="torch", **kw)))
    engine = LLMEngine(EngineArgs(kernel_backend="triton", **kw))
    assert engine.model.ops.name == "triton" and generate(engine) == reference
    attn = engine.model.model.layers[0].self_attn
    engine.sleep(level=2)
    assert engine.model.ops.num_packed == 0  # released: nothing pins device memory
    engine.wake_up()
    packed, _ = engine.model.ops.packed_weights(attn)  # rebuilt from the restored weights
    assert attn.q_proj.weight.data_ptr() == packed.data_ptr()
    assert generate(engine) == reference
    other = tiny_factory(3)
    engine.start_weight_update(1)
    engine.update_weights(other.state_dict.items())
    engine.finish_weight_update()
    kw["model"] = str(other.path)
    assert generate(engine) == generate(LLMEngine(EngineArgs(kernel_backend="torch", **kw))) != reference
