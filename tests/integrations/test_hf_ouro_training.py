"""Training Ouro through its Hugging Face class (what verl's FSDP actor and reference load): the
gradients equal those of the independent dense reference, packed sequences attend within their
own sequence, and FSDP (verl's own wrapping, one process on the CPU) keeps one parameter per shared
weight with the same gradients. The FSDP test needs verl (skipped without it)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from reference import reference_forward

from loopline.models.hf_compat import OuroHFForCausalLM


def _reference_loss_and_grads(tiny, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Mean next-token NLL of the last loop's logits on the reference, with autograd (its forward is
    written under no_grad; ``__wrapped__`` is the undecorated function)."""
    weights = {k: v.clone().requires_grad_(True) for k, v in tiny.state_dict.items()}
    with torch.enable_grad():
        out = reference_forward.__wrapped__(weights, tiny.cfg, ids, tiny.cfg["total_ut_steps"])
        logp = out["logits"][-1].log_softmax(-1)
        loss = -logp[torch.arange(len(ids) - 1), ids[1:]].mean()
        loss.backward()
    return loss.detach(), {k: w.grad for k, w in weights.items()}


@pytest.mark.parametrize("seed, overrides", [(0, {}), (1, {"num_key_value_heads": 4, "total_ut_steps": 3})])
def test_gradients_equal_the_dense_reference(tiny_factory, seed, overrides):
    tiny = tiny_factory(seed, **overrides)
    model = OuroHFForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32)
    ids = torch.randint(0, tiny.cfg["vocab_size"], (11,), generator=torch.Generator().manual_seed(seed))
    ref_loss, ref_grads = _reference_loss_and_grads(tiny, ids)
    loss = model(input_ids=ids[None], labels=ids[None], use_cache=False).loss
    loss.backward()
    assert torch.allclose(loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(tiny.state_dict)  # one parameter per shared weight, the checkpoint's names
    for name, p in model.named_parameters():
        ref = ref_grads[name]
        if ref is None:  # the exit gate: the last loop's logits do not read it
            assert p.grad is None, name
            continue
        scale = ref.abs().max().clamp(min=1e-8)
        assert (p.grad - ref).abs().max() / scale < 1e-4, name


def test_packed_sequences_attend_within_their_own(tiny_factory):
    """verl's "remove padding" layout: [1, total] ids, positions restarting at 0, no attention mask."""
    tiny = tiny_factory(0)
    model = OuroHFForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, tiny.cfg["vocab_size"], (n,), generator=g) for n in (5, 9, 1)]
    with torch.no_grad():
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        packed = model(input_ids=torch.cat(seqs)[None], position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None],
                       use_cache=False).logits[0]
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)


_FSDP_SCRIPT = textwrap.dedent("""
    import copy, os, sys
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
    device = sys.argv[3]  # "cpu", or "cuda": parameters offloaded to the host, as verl's reference model
    dist.init_process_group("gloo" if device == "cpu" else "nccl")
    import loopline.integrations.verl  # noqa: F401  (registers Ouro with AutoModelForCausalLM, as verl's plug-in)
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM
    from verl.utils.fsdp_utils import apply_fsdp2
    from torch.distributed.fsdp import CPUOffloadPolicy
    from loopline.train.hf_actor import OuroActorForCausalLM, rollout_depth_inputs
    path = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, config=AutoConfig.from_pretrained(path))
    assert type(model) is OuroActorForCausalLM, type(model)
    plain = copy.deepcopy(model).to(device)
    # verl's FSDP2 wrapping (engine strategy fsdp2), as FSDPEngine._build_fsdp_module calls it
    kwargs = {"mesh": init_device_mesh(device, (1,)), "reshard_after_forward": True}
    if device == "cuda":
        torch.cuda.set_device(0)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    apply_fsdp2(model, kwargs, {})
    units = sorted(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP"))
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in plain.named_parameters()] and len(names) == len(set(names)), names
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    # the depth-aware forward inside the wrapped model (prompt 4, 5 generated tokens at mixed depths)
    r = model.config.total_ut_steps
    extra = rollout_depth_inputs(4, [r, 1, r, max(r - 1, 1), r])
    extra = {k: v.to(device) for k, v in extra.items()}
    with torch.no_grad():
        depth_worst = float((model(input_ids=ids[:1], use_cache=False, **extra).logits
                             - plain(input_ids=ids[:1], use_cache=False, **extra).logits).abs().max())
    worst = 0.0
    for _ in range(2):  # twice: gradients accumulate over micro-batches as over loops
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
            continue
        worst = max(worst, float((p.grad.full_tensor().to(q.grad.device) - q.grad).abs().max() / q.grad.abs().max()))
    print("UNITS", units, "PARAMS", len(names), "WORST", worst, "DEPTHS", depth_worst)
    dist.destroy_process_group()
""")


def _fsdp_run(tiny, tmp_path, device: str) -> tuple[str, int, float, float]:
    script = tmp_path / "fsdp.py"
    script.write_text(_FSDP_SCRIPT)
    port = str(29500 + os.getpid() % 1000)
    run = subprocess.run([sys.executable, str(script), str(tiny.path), port, device], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(l for l in run.stdout.splitlines() if l.startswith("UNITS"))
    units, rest = line.split(" PARAMS ")
    params, rest = rest.split(" WORST ")
    worst, depths = rest.split(" DEPTHS ")
    return units, int(params), float(worst), float(depths)


def test_fsdp2_wrapping_keeps_one_parameter_per_shared_weight(tiny_factory, tmp_path):
    pytest.importorskip("verl")
    tiny = tiny_factory(0)
    units, params, worst, depths = _fsdp_run(tiny, tmp_path, "cpu")
    # units: embed_tokens and lm_head (verl wraps them by name), the layer stack, the root
    assert "FSDPOuroLayerStack" in units and "FSDPOuroActorForCausalLM" in units, units
    assert params == len(tiny.state_dict)
    assert worst < 1e-5
    assert depths < 1e-5  # the depth-aware forward, wrapped, equals the unwrapped model's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fsdp2_offloaded_reference_on_the_gpu(tiny_factory, tmp_path):
    """verl's reference worker: FSDP2 with parameters offloaded to the host between calls. torch 2.11 refused
    the layer stack as a ModuleList, and the depth-aware replay ran on the offloaded parameters' device."""
    pytest.importorskip("verl")
    tiny = tiny_factory(0)
    units, params, worst, depths = _fsdp_run(tiny, tmp_path, "cuda")
    assert "FSDPOuroLayerStack" in units and "FSDPOuroActorForCausalLM" in units, units
    assert params == len(tiny.state_dict)
    assert worst < 1e-3 and depths < 1e-3  # (TF32 products on the GPU)
