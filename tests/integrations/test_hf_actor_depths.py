"""Depth-aware log-probabilities in a trainer (#47): OuroActorForCausalLM recomputes each generated
token at the exit depth the rollout recorded and gives the rollout's logprobs (loopline.LLM,
``logprobs=0``) within fp32 tolerance -- fixed depth and adaptive exits, both KV layouts, in the
packed layout (verl's ``use_remove_padding=True``) and the padded one. The last test feeds the
per-sample inputs through verl's own merge (``extract_multi_modal_inputs``) and logprob function,
as verl's FSDP engine does (skipped without verl)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from loopline import SamplingParams

if TYPE_CHECKING:
    from loopline.train.hf_actor import OuroActorForCausalLM


def _hf_actor():
    """loopline.train.hf_actor, imported by the tests that use it: it loads transformers' model classes (seconds),
    which every test worker would otherwise pay when it collects this module."""
    from loopline.train import hf_actor

    return hf_actor


def rollout_depth_inputs(*args, **kwargs):
    return _hf_actor().rollout_depth_inputs(*args, **kwargs)

TOL = 1e-4
PROMPT_LENS = (4, 11, 7)


def _rollouts(tiny, layout: str, threshold: float | None, temperature: float = 1.0, **engine):
    llm = tiny.llm(kv_layout=layout, max_model_len=128, **engine)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, tiny.cfg["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=8, temperature=temperature, seed=50 + i, logprobs=0, ignore_eos=True,
                             exit_threshold=threshold) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0]) for o in outs]


def _actor(tiny) -> OuroActorForCausalLM:
    return _hf_actor().OuroActorForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32)


def _packed(samples, layout):
    """verl's remove-padding layout: one row of prompt + response per sample, positions restarting at 0."""
    ids = torch.cat([torch.tensor(p + c.token_ids) for p, c in samples])[None]
    positions = torch.cat([torch.arange(len(p) + len(c.token_ids)) for p, c in samples])[None]
    extra = [rollout_depth_inputs(len(p), c.exit_depths, layout) for p, c in samples]
    return ids, positions, {k: torch.cat([e[k] for e in extra]) for k in extra[0]}


def _response_logprobs(logits: torch.Tensor, ids: torch.Tensor, samples, starts) -> list[torch.Tensor]:
    """Each generated token's logprob: the logits at the position before it."""
    logp = logits.log_softmax(-1)
    out = []
    for (p, c), s in zip(samples, starts):
        pos = torch.arange(s + len(p) - 1, s + len(p) - 1 + len(c.token_ids))
        out.append(logp[pos, ids[pos + 1]])
    return out


def _starts(samples) -> list[int]:
    lengths = [len(p) + len(c.token_ids) for p, c in samples]
    return [sum(lengths[:i]) for i in range(len(lengths))]


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("threshold", [None, 0.6], ids=["fixed_depth", "adaptive"])
def test_packed_recompute_equals_the_rollout(tiny_gqa, layout, threshold):
    samples = _rollouts(tiny_gqa, layout, threshold)
    depths = {d for _, c in samples for d in c.exit_depths}
    if threshold is None:
        assert depths == {tiny_gqa.cfg["total_ut_steps"]}
    else:
        assert len(depths) > 1, "the adaptive case must exercise varied exit depths"
    ids, positions, extra = _packed(samples, layout)
    logits = _actor(tiny_gqa)(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits[0]
    for (_, c), lp in zip(samples, _response_logprobs(logits, ids[0], samples, _starts(samples))):
        assert (lp - torch.tensor(c.token_logprobs)).abs().max().item() < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_recompute_on_the_gpu_equals_the_rollout(tiny_gqa):
    """As verl's FSDP actor calls it: the model and every input on the GPU (depths included)."""
    samples = _rollouts(tiny_gqa, "last_exited", 0.6)
    ids, positions, extra = _packed(samples, "last_exited")
    actor = _actor(tiny_gqa).cuda()
    logits = actor(input_ids=ids.cuda(), position_ids=positions.cuda(), use_cache=False,
                   **{k: v.cuda() for k, v in extra.items()}).logits[0].cpu()
    for (_, c), lp in zip(samples, _response_logprobs(logits, ids[0], samples, _starts(samples))):
        assert (lp - torch.tensor(c.token_logprobs)).abs().max().item() < 1e-3  # (TF32 products on the GPU)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_padded_recompute_equals_the_rollout(tiny_gqa, layout):
    """verl's ``use_remove_padding=False``: right-padded rows, a mask, depths one per real token."""
    samples = _rollouts(tiny_gqa, layout, 0.6)
    width = max(len(p) + len(c.token_ids) for p, c in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(samples):
        ids[b, :len(p) + len(c.token_ids)] = torch.tensor(p + c.token_ids)
        mask[b, :len(p) + len(c.token_ids)] = 1
    _, _, extra = _packed(samples, layout)
    logits = _actor(tiny_gqa)(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                              use_cache=False, **extra).logits
    for b, (p, c) in enumerate(samples):
        lp = _response_logprobs(logits[b], ids[b], [(p, c)], [0])[0]
        assert (lp - torch.tensor(c.token_logprobs)).abs().max().item() < TOL


def test_depths_change_the_logprobs_and_carry_gradients(tiny_gqa):
    """Without the depths (the stock full-depth recompute) adaptive rollouts do not match; with them the
    loss reaches the shared weights."""
    samples = _rollouts(tiny_gqa, "last_exited", 0.6)
    ids, positions, extra = _packed(samples, "last_exited")
    actor = _actor(tiny_gqa)
    full = actor(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    worst = max((lp - torch.tensor(c.token_logprobs)).abs().max().item()
                for (_, c), lp in zip(samples, _response_logprobs(full, ids[0], samples, _starts(samples))))
    assert worst > 1e-2
    logits = actor(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits[0]
    sum(lp.sum() for lp in _response_logprobs(logits, ids[0], samples, _starts(samples))).backward()
    assert actor.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_bad_depth_inputs_name_the_field(tiny_gqa):
    actor = _actor(tiny_gqa)
    ids = torch.arange(1, 9)[None]
    with pytest.raises(ValueError, match="exit_depths has 5 entries"):
        actor(input_ids=ids, exit_depths=torch.ones(5, dtype=torch.long), use_cache=False)
    with pytest.raises(ValueError, match="one run of positions"):
        actor(input_ids=ids, exit_depths=torch.tensor([[0, 2, 0, 2, 2, 2, 2, 0]]), use_cache=False)
    with pytest.raises(ValueError, match=r"must be in 1\.\.4"):
        actor(input_ids=ids, exit_depths=torch.tensor([[0, 0, 0, 9, 2, 2, 2, 0]]), use_cache=False)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        rollout_depth_inputs(3, [1, 2], "paged")
    with pytest.raises(ValueError, match="kv_layout: one code"):
        actor(input_ids=ids, exit_depths=torch.tensor([[0, 0, 0, 4, 2, 2, 2, 0]]), kv_layout=torch.tensor([0, 1]),
              use_cache=False)


def test_through_verls_input_merge_and_logprob_function(tiny_gqa):
    pytest.importorskip("verl")
    from verl.utils.model import extract_multi_modal_inputs
    from verl.utils.torch_functional import logprobs_from_logits

    # verl's rollout default: logprobs of the distribution sampled from, log_softmax(logits / T)
    samples = _rollouts(tiny_gqa, "shared", 0.6, temperature=0.8, logprobs_mode="processed_logprobs")
    ids, positions, _ = _packed(samples, "shared")
    per_sample = [rollout_depth_inputs(len(p), c.exit_depths, "shared") for p, c in samples]
    # FSDPEngineWithLMHead.prepare_model_inputs: model_inputs.update(extract_multi_modal_inputs(...))
    inputs = {"input_ids": ids, "attention_mask": None, "position_ids": positions, **extract_multi_modal_inputs(per_sample)}
    logits = _actor(tiny_gqa)(**inputs, use_cache=False).logits[0] / 0.8
    logp = logprobs_from_logits(logits=logits, labels=torch.roll(ids[0], -1))  # prepare_model_outputs
    for (p, c), s in zip(samples, _starts(samples)):
        lp = logp[s + len(p) - 1:s + len(p) - 1 + len(c.token_ids)]
        assert (lp - torch.tensor(c.token_logprobs)).abs().max().item() < TOL


def test_agent_loop_samples_carry_their_depths():
    """The trainer plug-in's per-sample inputs (what LooplineAgentLoopManager's workers add)."""
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    from loopline.integrations.verl_trainer import depth_inputs

    def output(mask, depths):
        return AgentLoopOutput(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], response_mask=mask, num_turns=2,
                               metrics={}, extra_fields={} if depths is None else {"exit_depths": depths})

    d = depth_inputs(output([1, 1, 1], [2, 3, 1]), "shared")
    assert d["exit_depths"].tolist() == [0, 0, 2, 3, 1, 0] and d["kv_layout"].tolist() == [1]
    assert depth_inputs(output([1, 1, 1], [2, 3, 1, 4]), "last_exited")["exit_depths"].tolist() == [0, 0, 2, 3, 1, 0]
    assert depth_inputs(output([1, 1, 1], None), "last_exited") == {}
    assert depth_inputs(output([1, 0, 1], [2, 3, 1]), "last_exited") == {}  # a tool token: full depth
